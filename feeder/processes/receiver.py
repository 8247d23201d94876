"""The parent's receiver threads: a worker process's messages turned into chunks, and its failures
into the source's failure.

Per worker process, one *receiver* thread in the parent reads the child's messages (see
``feeder.processes.child``): a chunk becomes numpy views onto the child's slot, checked against the
source's validator (children learn shapes independently, the source decides), put on the
source's queue like a fetcher thread's chunk, and the slot is handed back when the last view
is gone. The receiver is also where the child's failures become the source's failure:

* an exception in ``fetch_fun``: ``FetchError`` from the original (unpickled) exception, or from
  a :class:`feeder.RemoteError` when it cannot be rebuilt, with the child's traceback rebuilt on it
  (``feeder.processes.remotetb``: it prints with the user's file, line and source text); the
  traceback's text is in the message too;
* a process that ends without saying so (``os._exit``, a segfault, SIGKILL): ``FetchError``
  naming worker id, pid and exit code or signal; the channel reaches end-of-file at once, so
  this takes milliseconds, and ``is_alive`` is checked every ``SLICE_S`` as well.

* a source that failed (this worker, another one, or a bad chunk): the receiver sets the
  child's STOP flag, so no process of a failed source calls ``fetch_fun`` again (the child
  waits for the parent's verdict after each exception, see ``feeder.processes.child``);
* a segment or layout the parent cannot trust (``feeder.processes.shm.SegmentError``: not sealed against
  shrinking, smaller than said, an offset outside it): ``FetchError`` naming the worker, never a
  crash of the parent.

:class:`Receivers` is a base class of ``feeder.processes.parent.ProcFetchers``: its methods are
the receiver threads' part of it, and read the fetchers' source, validator, stop event and
throttle as they are at the time.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from ..chunkqueue import Chunk, ChunkQueue
from ..errors import Failure, FeederError, FetchError, InputValidationError, RemoteError, exception_text
from ..fetchers import IN_FETCH, SLICE_S, WAITING_FOR_ROOM, WorkerState, put_chunk
from ..pacing import EmptyReport, NoneReport
from ..trace import TraceHook
from ..tuning import Throttle
from ..validation import ChunkValidator
from . import shm
from .mainguard import ADVICE, MAIN_REIMPORT_EXIT
from .remotetb import attach
from .shm import (
    ACKED,
    BATCH_SIZE,
    CONTROL_BYTES,
    GO,
    MAX_SLOTS,
    STOP,
    VERDICTS,
    Channel,
    ControlPage,
    SegmentError,
    arrays_from_slot,
    check_segment,
)
from .stacks import StackProbe

log = logging.getLogger("feeder")

DEATH_JOIN_S = 1.0      # a child whose channel closed gets this long to report its exit status
# A consumer that keeps its batches (``list(feed)``) keeps their shared-memory slots, and a child
# has MAX_SLOTS of them: past this many held, chunks are copied out of their slot at once (the slot
# comes back) instead of being handed on as views, so hoarding costs a copy, never a deadlock.
HOARD_SLOTS = MAX_SLOTS // 2


def _free_refs() -> int:
    """The reference count _reclaim reads for a base array held by nothing but its dict."""
    probe = {0: np.empty(1)}
    return max(sys.getrefcount(probe[slot]) for slot in probe)


_FREE_REFS = _free_refs()


def _exit_text(code: Optional[int]) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name} ({-code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Worker:
    """The parent's record of one worker process."""

    def __init__(self, state: WorkerState):
        self.state = state
        self.process: Any = None  # multiprocessing.process.BaseProcess (None again once closed)
        self.exitcode: Optional[int] = None  # kept when the process object is closed
        self.chan: Optional[Channel] = None
        self.control: Optional[ControlPage] = None
        self.maps: Dict[int, Any] = {}
        # Slots whose chunk views may still be held: slot -> the views' common base array. A slot
        # is free again once nothing but this dict refers to its base (see _reclaim): polled by
        # reference count, which costs a microsecond, where a weakref.finalize per chunk cost ten.
        self.in_use: Dict[int, Any] = {}
        self.pid: Optional[int] = None
        self.lifeline: Optional[int] = None  # write end of the child's lifeline pipe (see start)
        self.child_state = "starting"
        self.child_since = time.monotonic()
        self.done = False        # ended (StopIteration), failed, or told to stop: its exit is expected
        self.stacks = StackProbe()  # stack requests and faulthandler dumps (feeder.processes.stacks)
        self.batch_size = 0
        self.go = True


class Receivers:
    """The receiver threads of ``ProcFetchers``, one per worker process (see the module docstring)."""

    # What they read of the fetchers (set by ProcFetchers.__init__, ``_device`` at start, ``_pump``
    # dropped at close).
    source: ChunkQueue
    nones: NoneReport
    empties: EmptyReport
    _pump: Optional[Callable[[Chunk], Optional[bool]]]
    _register: Optional[Callable[[int, int], Optional[Callable[[], None]]]]
    _trace: Optional[TraceHook]
    _validator: ChunkValidator
    _max_fetch_errors: int
    _stop: threading.Event
    _throttle: Optional[Throttle]
    _device: Optional[int]

    def _receive(self, w: _Worker) -> None:
        state, source = w.state, self.source
        state.begin()
        if self._throttle is not None and state.worker_id not in self._throttle.active:
            state.park(state.started_at)  # parked from the start (see _receive_loop)
        try:
            self._receive_loop(w)
        except BaseException as e:  # a bug here must not leave the source waiting on a dead worker
            w.done = True
            state.set("failed")
            source.fail(Failure(FeederError(f"source {source.name!r}, worker {state.worker_id}: the receiver of "
                                            f"worker process {w.pid} failed: {type(e).__name__}: "
                                            f"{exception_text(e)}"), e))
            log.error("source %r worker %d: receiver thread failed", source.name, state.worker_id, exc_info=True)
        finally:
            if not state.state.startswith(("ended", "failed")):
                state.set("stopped")
            state.ended_at = time.monotonic()
            # Rows the process fetched that never reached the source (held for coalescing, in
            # flight at stop) enter the ledger as fetched and discarded, as with threads.
            source.discarded(state.rows - state.rows_put, fetched=True)
            if w.chan is not None:
                w.chan.close()
            w.maps.clear()
            w.in_use.clear()  # views a consumer still holds keep their own mapping alive
            w.stacks.close()

    def _receive_loop(self, w: _Worker) -> None:
        chan, state, source = w.chan, w.state, self.source
        assert chan is not None
        stop = self._stop
        while True:
            if source.failure is not None:  # failed here or elsewhere: no more fetch_fun calls
                self._drain(w)
                return
            if self._throttle is not None and w.control is not None:
                go = state.worker_id in self._throttle.active
                if go != w.go:
                    w.go = go
                    w.control.fields[GO] = int(go)
                    (state.unpark if go else state.park)(time.monotonic())  # not running time
            try:
                if not chan.poll(SLICE_S):
                    self._reclaim(w)
                    if stop.is_set() and (w.process is None or not w.process.is_alive()):
                        return
                    if w.process is not None and not w.process.is_alive() and not chan.poll(0):
                        self._ended_silently(w)
                        return
                    continue
                msg = chan.recv()
            except (EOFError, OSError):
                self._ended_silently(w)
                return
            kind = msg[0]
            if kind != "hello":
                self._update(w, msg[-1])
            if kind == "chunk":
                try:
                    ok = self._chunk(w, msg)
                except SegmentError as e:
                    self._refuse(w, e)
                    return
                if not ok:
                    if stop.is_set() or source.failure is not None or source.closed:
                        self._drain(w)
                        return
            elif kind == "hello":
                w.pid = msg[1]
                control_fd, stacks_fd = chan.recv_fds(2)
                w.stacks.attach(msg[1], msg[3], stacks_fd)
                try:
                    check_segment(control_fd, CONTROL_BYTES, self._device)
                    # shm.map_fd, looked up at each call: tests/conftest.py replaces it to record mappings
                    w.control = ControlPage(shm.map_fd(control_fd, CONTROL_BYTES, close=False))
                except (SegmentError, OSError) as e:
                    self._refuse(w, e, "its control page")
                    return
                finally:
                    os.close(control_fd)
                w.control.fields[BATCH_SIZE] = w.batch_size
                if self._throttle is not None:
                    w.go = state.worker_id in self._throttle.active
                    w.control.fields[GO] = int(w.go)
                    (state.unpark if w.go else state.park)(time.monotonic())
                if stop.is_set():
                    w.control.fields[STOP] = 1
            elif kind == "drop":
                for slot in msg[1]:
                    w.maps.pop(slot, None)
            elif kind == "none":  # counted by the child (the figures came with the message), which pauses
                self.nones.note(state.worker_id)
            elif kind == "empty":
                self.empties.note(state.worker_id)
            elif kind == "skip":  # feeder.sources.base.SKIP: an ordered source's turn without rows
                if source.ordered and not self._put(Chunk(state.worker_id, (), 0), state):
                    self._drain(w)
                    return
            elif kind == "error":
                failed = self._error(w, msg)
                if failed:
                    self._halt(w)  # before the verdict: the child reads STOP once it has one
                if w.control is not None:
                    w.control.fields[VERDICTS] += 1
                if failed:
                    self._drain(w)
                    return
            elif kind == "invalid":
                w.done = True
                state.set("failed")
                source.fail(Failure(InputValidationError(msg[1] + f" (in worker process pid {w.pid})")))
                self._drain(w)
                return
            elif kind == "end":
                w.done = True
                state.set("ended (StopIteration)")
                source.worker_ended(state.worker_id)
                if self._throttle is not None:
                    self._throttle.ended(state.worker_id)
            elif kind == "stack":
                w.stacks.answer(msg[1], msg[2])
            elif kind == "bye":
                w.done = True

    def _update(self, w: _Worker, stats: Tuple[Any, ...]) -> None:
        s = w.state
        fetch_before = s.fetch_s
        (s.calls, s.chunks, rows, s.none_chunks, s.empty_chunks, s.fetch_errors, s.fetch_s, s.cpu_s, wall_s,
         child_state, age, counters, keys) = stats
        tracer = self._trace.tracer if self._trace is not None else None
        if tracer is not None and s.fetch_s > fetch_before:
            # The child's time in fetch_fun since its last report, ending as the parent hears of it.
            now = time.monotonic()
            tracer.span("fetch", now - (s.fetch_s - fetch_before), now, track=f"feeder:{self.source.name}:proc-"
                        f"{s.worker_id} (pid {w.pid})")
        if counters is not None:
            s.counters = counters
        if keys is not None:  # rows its fetch_fun filtered: recorded as done (feeder.sources.transform)
            self.source.record_filtered(len(keys), keys)
        s.cpu_wall_s = max(0.0, wall_s - s.parked_s(time.monotonic()))  # the child's clock runs while parked
        s.rows = max(s.rows, rows)
        w.child_state = child_state
        w.child_since = time.monotonic() - age

    def _chunk(self, w: _Worker, msg: Tuple[Any, ...]) -> bool:
        """Turn a chunk message into a Chunk on the source; False if it could not be put (stop, failure)."""
        _, slot, layout, total, rows, slots, dropped, sizes, _stats = msg
        chan, state = w.chan, w.state
        if chan is None or w.control is None:
            raise SegmentError("a chunk before its hello")
        for d in dropped:
            w.maps.pop(d, None)
        if sizes:
            (fd,) = chan.recv_fds(1)
            try:
                if not isinstance(slot, int) or not 0 <= slot < MAX_SLOTS:
                    raise SegmentError(f"a segment for slot {slot!r}, which is not a slot")
                check_segment(fd, sizes[0], self._device)
                try:  # (shm.map_fd looked up at each call, as above)
                    w.maps[slot] = shm.map_fd(fd, sizes[0], close=False, register=self._register)
                except OSError as e:
                    raise SegmentError(f"a segment that could not be mapped ({e})") from None
            finally:
                os.close(fd)
        mm = None
        if slot is not None:
            mm = w.maps.get(slot)
            if mm is None:
                raise SegmentError(f"a chunk in slot {slot!r}, for which it sent no segment")
        arrays, base = arrays_from_slot(mm, layout, total)
        if w.in_use:
            self._reclaim(w)
        if base is not None:
            if len(w.in_use) >= HOARD_SLOTS:
                arrays = tuple(a.copy() if a.base is not None else a for a in arrays)
                del base
                w.control.release(slot)
            else:
                w.in_use[slot] = base
                del base
        wid = state.worker_id
        try:
            arrays, checked = self._validator.check(arrays, wid)
        except InputValidationError as e:
            w.done = True
            state.set("failed")
            self.source.fail(Failure(e))
            return False
        ok = self._put(Chunk(wid, arrays, rows, slots), state)
        del arrays
        if ok:
            w.control.fields[ACKED] += 1
        return ok

    @staticmethod
    def _reclaim(w: _Worker) -> None:
        """Hand back to the child the slots of which no view is left (nobody holds their chunks)."""
        control = w.control
        if control is None:
            return
        in_use = w.in_use
        free = [slot for slot in in_use if sys.getrefcount(in_use[slot]) <= _FREE_REFS]
        for slot in free:
            del in_use[slot]
            control.release(slot)

    def _put(self, chunk: Chunk, state: WorkerState) -> bool:
        ok = put_chunk(self.source, chunk, state, self._stop, self._pump)
        if state.state == WAITING_FOR_ROOM:
            state.set(IN_FETCH)  # the receiver waited, not the child: it is back in fetch_fun
        return ok

    def _error(self, w: _Worker, msg: Tuple[Any, ...]) -> bool:
        """An exception in the child; True if it fails the source."""
        _, data, type_name, text, tb, frames, fatal, where, _stats = msg
        state, source = w.state, self.source
        cause: BaseException
        try:
            cause = pickle.loads(data) if data is not None else RemoteError(f"{type_name}: {text}\n{tb}")
        except Exception:
            cause = RemoteError(f"{type_name}: {text}\n{tb}")
        # The cause prints with the worker's frames (file, line, source text), as a local one would;
        # the message keeps the text of the whole traceback (chained exceptions included), for
        # whoever logs only str(error).
        attach(cause, frames)
        short = type_name.rsplit(".", 1)[-1]
        if where == "fetch_fun" and isinstance(cause, InputValidationError):
            # A source found bad data (feeder.sources: a null in a column): the same error as in
            # threads, and as there never tolerated by max_fetch_errors.
            w.done = True
            state.set("failed")
            source.fail(Failure(InputValidationError(f"source {source.name!r}, worker {state.worker_id}: {cause} "
                                                     f"(in worker process pid {w.pid})"), cause))
            return True
        final = getattr(cause, "feeder_final", False)  # the source cannot serve again (feeder.sources.base)
        n = source.note_fetch_error() if not final else 0
        if where == "fetch_fun" and not fatal and not final and n <= self._max_fetch_errors:
            log.warning("source %r worker %d: fetch_fun raised (%d of %d tolerated) in worker process pid %s; "
                        "skipping that call. Its traceback:\n%s", source.name, state.worker_id, n,
                        self._max_fetch_errors, w.pid, tb, exc_info=cause)
            return False
        msg_text = f"source {source.name!r}, worker {state.worker_id}: {where} raised {short}: {text}"
        if where == "fetch_fun" and self._max_fetch_errors and not final:
            msg_text += f" (fetch error {n}, more than max_fetch_errors={self._max_fetch_errors})"
        msg_text += f"\nin worker process pid {w.pid}; its traceback:\n{tb.rstrip()}"
        w.done = True
        state.set("failed")
        source.fail(Failure(FetchError(msg_text), cause))
        return True

    def _refuse(self, w: _Worker, e: Exception, what: str = "") -> None:
        """The child sent something the parent cannot safely use (feeder.processes.shm.SegmentError): the source
        fails, naming the worker; the parent never maps or reads it."""
        state = w.state
        state.set("failed")
        self.source.fail(Failure(FetchError(
            f"source {self.source.name!r}, worker {state.worker_id}: worker process pid {w.pid} sent "
            f"{what + ': ' if what else ''}{e}; refused (the parent maps only memory files sealed against "
            f"shrinking and reads only within them, so that nothing the process does can crash it)"), e))
        self._drain(w)

    def _halt(self, w: _Worker) -> None:
        """Tell the child to stop calling fetch_fun and end (its source failed): the flag, which its
        loop reads between calls, and the message, for its control thread (which ends the process
        even when fetch_fun does not return; and there may be no control page to flag)."""
        if w.done and w.control is not None and w.control.fields[STOP]:
            return
        self._tell_stop(w)

    @staticmethod
    def _tell_stop(w: _Worker) -> None:
        """Mark the worker done and ask its child to stop: the flag on its control page and the
        message to its control thread (which ends the child even inside fetch_fun)."""
        w.done = True
        if w.control is not None:
            w.control.fields[STOP] = 1
        if w.chan is not None:
            try:
                w.chan.send(("stop",), timeout=0.1)
            except (OSError, ValueError):
                pass  # already gone

    def _ended_silently(self, w: _Worker) -> None:
        """The channel closed or the process is gone: fine after an end or a stop, else a failure."""
        proc = w.process
        if proc is not None:
            proc.join(DEATH_JOIN_S)
        if w.done or self._stop.is_set():
            return
        code = proc.exitcode if proc is not None else None
        state = w.state
        state.set("failed")
        where = w.child_state
        if where == "starting" and w.control is None and code == MAIN_REIMPORT_EXIT:
            where = "starting: its import of the main script called start() again; " + ADVICE
        elif where == "starting":  # it never reported after its hello, or never said hello
            where = ("in worker_init_fun or its first fetch_fun call (it had not reported yet)"
                     if w.control is not None else
                     "starting, before it could report (its error, if any, went to stderr)")
        self.source.fail(Failure(FetchError(
            f"source {self.source.name!r}, worker {state.worker_id}: worker process pid {w.pid} died "
            f"({_exit_text(code)}) while {where}")))

    def _drain(self, w: _Worker) -> None:
        """After a failure or at stop: the child is told to stop; keep reading until it has ended, so
        that it never blocks on a full channel, its channel stays open while it lives (a child
        still starting must be able to say hello) and its final figures reach the books. Chunks
        are not taken any more: their rows count as fetched and discarded (see _receive). Bounded:
        a child told to stop ends within STOP_GRACE_S by itself, or the reaper ends it within
        stop()'s budget."""
        self._halt(w)
        chan = w.chan
        assert chan is not None
        while True:
            try:
                if not chan.poll(SLICE_S):
                    if w.process is None or not w.process.is_alive():
                        return
                    continue
                msg = chan.recv()
                if msg[0] == "hello":  # it started after the failure: its control page is not needed
                    w.pid = msg[1]
                    for fd in chan.recv_fds(2):
                        os.close(fd)
                    continue
                self._update(w, msg[-1])
                if msg[0] == "chunk" and msg[7]:
                    for fd in chan.recv_fds(1):
                        os.close(fd)
                elif msg[0] == "error" and w.control is not None:
                    w.control.fields[VERDICTS] += 1  # it waits for one; STOP is set
            except (EOFError, OSError):
                return
            except Exception:  # garbage from a misbehaving child: it is stopped anyway
                return
