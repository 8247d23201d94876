"""The parent's side of worker processes: start them, turn their shared-memory slots into chunks.

:class:`ProcFetchers` offers the feed the same interface as ``feeder.fetchers.ThreadFetchers``
(``states``, ``start``, ``set_batch_size``, ``signal_stop``, ``threads``, ``describe``), so the
feed has one way of fetching; only here is it known that ``fetch_fun`` runs elsewhere.

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

Stop (``signal_stop``) asks politely (flag and message; the child's control thread ends the
process within ``STOP_GRACE_S`` even when ``fetch_fun`` hangs), then a *reaper* thread sends
SIGTERM and SIGKILL to what is left, against the coordinator's one join budget, and joins
every process so none is left as a zombie; ``close()`` then releases the processes, control
pages, lifelines and descriptors at once, not when the garbage collector gets to them.

Starting a process (``start``): ``fetch_fun`` and ``worker_init_fun`` travel with cloudpickle
(``feeder.processes.sending``); each child gets the read end of its own *lifeline* pipe, whose write end
only this (main) process holds, so the kernel kills the child when this process dies (see
``feeder.processes.child.arm_lifeline``); and a Ctrl-C while they start gives one
``KeyboardInterrupt``, in the parent, once every process is started and known (``_ctrl_c_held``),
and no traceback from any child: with "spawn" and "fork" the starting thread blocks SIGINT
while a child is made (the child inherits the mask, ignores SIGINT, then unblocks it), and with
"spawn" and "forkserver" the child's name, which multiprocessing unpickles first of all, before
re-importing the main module, sets SIGINT to "ignore" as it is unpickled (``_ChildName``). The
forkserver itself is never started with SIGINT blocked: the user's other processes are its
children too.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import operator
import os
import pickle
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..chunkqueue import Chunk, ChunkQueue
from ..errors import Failure, FeederError, FetchError, InputValidationError, RemoteError
from ..fetchers import IN_FETCH, SLICE_S, WAITING_FOR_ROOM, WorkerState, put_chunk
from ..pacing import NoneReport
from ..trace import TraceHook
from ..tuning import Throttle
from ..validation import ChunkValidator
from .child import worker_main
from .mainguard import ADVICE, MAIN_REIMPORT_EXIT
from .remotetb import attach
from .sending import Sendable
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
    map_fd,
    memory_device,
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
# A FeedTimeout may come at most a tenth of a second after its timeout, stacks included: a
# consumer asks the children for their stacks STACK_LEAD_S before its deadline, and at the
# deadline a diagnosis waits at most STACK_WAIT_S in all: first for the control threads' answers,
# then, from those that did not answer (C code holding the GIL), for faulthandler's dump.
STACK_LEAD_S = 0.1
STACK_WAIT_S = 0.06
REPLY_WAIT_S = 0.03     # of STACK_WAIT_S, the most spent waiting for answers
DEFAULT_STOP_S = 5.0    # the reaper's budget when the caller gives no deadline
# Imported once in the forkserver, so each child starts in milliseconds (cloudpickle: for functions
# sent by value).
PRELOAD = ["feeder.processes.child", "cloudpickle"]


@dataclass(frozen=True)
class ProcessOptions:
    """How a registration runs its worker processes (validated by ``feeder.api``)."""

    context: BaseContext
    worker_init_fun: Optional[Callable[[int], Any]] = None
    seed: Optional[int] = None


def get_context(mp_context: Any) -> BaseContext:
    """The multiprocessing context for ``mp_context`` (None: "forkserver" where available, else "spawn")."""
    if isinstance(mp_context, BaseContext):
        return mp_context
    methods = multiprocessing.get_all_start_methods()
    if mp_context is None:
        mp_context = "forkserver" if "forkserver" in methods else "spawn"
    if not isinstance(mp_context, str):
        raise TypeError(f"mp_context must be a start method name or a multiprocessing context, "
                        f"got {type(mp_context).__name__}")
    if mp_context not in methods:
        raise ValueError(f"mp_context {mp_context!r} is not available here (start methods: {methods})")
    ctx = multiprocessing.get_context(mp_context)
    if mp_context == "forkserver":
        # Adds to the forkserver's preload list only; harmless for other users of it.
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _SigintIgnored:
    """Unpickled in a child: SIGINT ignored (see _ChildName)."""

    def __reduce__(self) -> Any:
        return signal.signal, (int(signal.SIGINT), signal.SIG_IGN)


class _SigintUnblocked:
    """Unpickled in a child: SIGINT unblocked (a Ctrl-C pending meanwhile is then discarded)."""

    def __reduce__(self) -> Any:
        return signal.pthread_sigmask, (signal.SIG_UNBLOCK, (int(signal.SIGINT),))


class _ChildName(str):
    """A worker process's name. "spawn" and "forkserver" children unpickle their name before
    anything else, before they re-import the main module (which may take long: imports): this one
    unpickles as the plain name after setting SIGINT to "ignore" and unblocking it, so a Ctrl-C
    meanwhile gives no traceback in every child. Only the standard library is needed for that
    (importing feeder, hence numpy, before the main module would change what it sets up)."""

    def __reduce__(self) -> Any:
        return operator.itemgetter(2), ((_SigintIgnored(), _SigintUnblocked(), str(self)),)


@contextlib.contextmanager
def _ctrl_c_held(block: bool) -> Iterator[None]:
    """A Ctrl-C held back for the duration, then delivered (none is lost): the processes are all
    started and known by then, so none is left half-started. From the main thread, SIGINT's
    handler records it meanwhile (blocking it here would not do: the kernel hands a process's
    SIGINT to any thread that does not block it, and Python raises it in the main thread). With
    ``block``, SIGINT is also blocked in this thread, so that a child forked meanwhile ("spawn",
    "fork") is born with it blocked (see the module docstring)."""
    got: List[Any] = []
    handler: Any = None
    if threading.current_thread() is threading.main_thread():
        try:
            handler = signal.signal(signal.SIGINT, lambda signum, frame: got.append((signum, frame)))
        except ValueError:  # not the main interpreter
            handler = None
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if block else None
    try:
        yield
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
            if got and callable(handler):
                handler(*got[0])  # Python's default raises KeyboardInterrupt here
            elif got and handler == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


def _exit_text(code: Optional[int]) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name} ({-code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _join(proc: Any, until: float) -> None:
    """Join a process until ``until`` (monotonic s); one already closed (close() after a stop whose
    budget ran out while the reaper still waited) has nothing left to join."""
    try:
        proc.join(max(0.0, until - time.monotonic()))
    except ValueError:
        pass


def _exitcode(proc: Any) -> Optional[int]:
    try:
        return proc.exitcode  # type: ignore[no-any-return]
    except ValueError:  # closed: it had ended (close() closes only processes that have)
        return 0


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


class ProcFetchers:
    """The fetchers of one feed as worker processes (see the module docstring)."""

    mode = "processes"

    def __init__(self, *, source: ChunkQueue, fetch_fun: Callable[[int, int], Any], validator: ChunkValidator,
                 worker_ids: Sequence[int], max_fetch_errors: int, stop: threading.Event, options: ProcessOptions,
                 throttle: Optional[Throttle] = None, pump: Optional[Callable[[Chunk], Optional[bool]]] = None,
                 register: Optional[Callable[[int, int], Optional[Callable[[], None]]]] = None,
                 trace: Optional[TraceHook] = None):
        self.source = source
        self._pump = pump  # Feed.pump_put: receivers take their chunks on into the feed's ready queue
        # A device feed's registration of each segment with the CUDA runtime, as it is mapped (what it
        # returns unregisters it, and runs before the segment is unmapped: feeder.processes.shm.map_fd)
        self._register = register
        self._trace = trace
        self.states = [WorkerState(w) for w in worker_ids]
        self._workers = [_Worker(s) for s in self.states]
        self._fetch_fun = fetch_fun
        self._validator = validator
        self._max_fetch_errors = max_fetch_errors
        self._stop = stop
        self._options = options
        self._throttle = throttle
        self._reaper: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._device: Optional[int] = None  # where children's segments must live (feeder.processes.shm.check_segment)
        self.nones = NoneReport(source.name)  # fetch_fun returning None, logged for all of them

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, batch_size: int, coalesce: bool) -> None:
        """Start one process and its receiver thread per worker id (``fetch_fun`` is pickled now,
        for each process, see the module docstring)."""
        ctx = self._options.context
        method = ctx.get_start_method()
        seed = self._options.seed if self._options.seed is not None else secrets.randbits(63)
        functions = Sendable((self._fetch_fun, self._options.worker_init_fun))
        self._device = memory_device()
        # PR_SET_PDEATHSIG fires when the *thread* that made the child ends: only safe from the
        # main thread, and useless under a forkserver (the child's parent); the lifeline covers all.
        death_ppid = os.getpid() if method != "forkserver" and threading.current_thread() is threading.main_thread() \
            else None
        if method == "spawn":
            # Starting a "spawn" child makes sure multiprocessing's resource tracker runs, and
            # starting that unblocks SIGINT in this thread: have it running before SIGINT is blocked.
            from multiprocessing import resource_tracker
            resource_tracker.ensure_running()
        with _ctrl_c_held(block=method in ("spawn", "fork")):
            for w in self._workers:
                self._start_one(w, ctx, functions, seed, batch_size, coalesce, death_ppid)

    def _start_one(self, w: _Worker, ctx: BaseContext, functions: Sendable, seed: int, batch_size: int,
                   coalesce: bool, death_ppid: Optional[int]) -> None:
        name, wid = self.source.name, w.state.worker_id
        w.batch_size = batch_size
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        w.chan = Channel(parent_conn)
        r, w.lifeline = os.pipe()
        read_end = Connection(r, writable=False)
        # A "fork" child inherits every descriptor: this lifeline's write end and its siblings' too.
        fork = ctx.get_start_method() == "fork"
        inherited = tuple(x.lifeline for x in self._workers if x.lifeline is not None) if fork else ()
        proc = ctx.Process(  # type: ignore[attr-defined]  # BaseContext's Process is set per context
            target=worker_main, name=_ChildName(f"feeder:{name}:proc-{wid}"), daemon=True,
            args=(child_conn, wid, functions, seed, self._validator, batch_size, coalesce,
                  (read_end, inherited, death_ppid)))
        w.state.set("starting")
        try:
            proc.start()
        except Exception as e:
            raise TypeError(f"source {name!r}, worker {wid}: could not start a worker process "
                            f"({type(e).__name__}: {e})") from e
        finally:
            # The child has its own copies; ours would keep the channel open when it dies.
            child_conn.close()
            read_end.close()
        w.process, w.pid = proc, proc.pid
        w.state.thread = threading.Thread(target=self._receive, args=(w,), name=f"feeder:{name}:recv-{wid}",
                                          daemon=True)
        w.state.thread.start()

    def set_batch_size(self, batch_size: int) -> None:
        """The next fetch_fun call of every process sees ``batch_size``."""
        for w in self._workers:
            w.batch_size = batch_size
            control = w.control
            if control is not None:
                control.fields[BATCH_SIZE] = batch_size

    def signal_stop(self, deadline: Optional[float] = None) -> None:
        """Ask every process to stop; a reaper thread makes sure they do before ``deadline``."""
        self._stop.set()
        for w in self._workers:
            self._tell_stop(w)
        if deadline is None:
            deadline = time.monotonic() + DEFAULT_STOP_S
        with self._lock:
            if self._reaper is None and any(w.process is not None for w in self._workers):
                self._reaper = threading.Thread(target=self._reap, args=(deadline,),
                                                name=f"feeder:{self.source.name}:reaper", daemon=True)
                self._reaper.start()

    def threads(self) -> List[threading.Thread]:
        out = [w.state.thread for w in self._workers if w.state.thread is not None]
        if self._reaper is not None:
            out.append(self._reaper)
        return out

    def _reap(self, deadline: float) -> None:
        """Polite stop, then SIGTERM, then SIGKILL, each given a share of the budget; join all."""
        procs = [w.process for w in self._workers if w.process is not None]
        now = time.monotonic()
        budget = max(0.1, deadline - now)
        for share, action in ((0.5, None), (0.75, "terminate"), (0.95, "kill")):
            until = now + share * budget
            for p in procs:
                _join(p, until)
            alive = [p for p in procs if _exitcode(p) is None]
            if not alive:
                break
            if action is not None:
                log.warning("source %r: worker process(es) %s did not stop in time; %s", self.source.name,
                            [p.pid for p in alive], "terminating" if action == "terminate" else "killing")
                for p in alive:
                    try:
                        getattr(p, action)()
                    except (OSError, ValueError):
                        pass
        for p in procs:  # joined: none is left a zombie (close() releases them once the receivers ended)
            _join(p, deadline)

    def close(self) -> None:
        """After stop, once the coordinator has joined the threads: release the processes, control
        pages, lifelines and descriptors now (a receiver still running keeps its worker's)."""
        self._pump = None  # a reference back to the feed: no cycle may keep it for the garbage collector
        for w in self._workers:
            thread = w.state.thread
            if thread is not None and thread.is_alive():
                continue
            proc = w.process
            if proc is not None and proc.exitcode is not None:
                w.exitcode = proc.exitcode
                try:
                    proc.close()
                    w.process = None
                except ValueError:  # still running after all
                    pass
            if w.control is not None:
                w.control.close()
                w.control = None
            if w.lifeline is not None:  # were the process alive still, this would end it
                os.close(w.lifeline)
                w.lifeline = None
            w.maps.clear()
            w.in_use.clear()
            w.stacks.close()
            if w.chan is not None:
                w.chan.close()

    # ---- the receiver thread ----------------------------------------------------------------
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
                                            f"worker process {w.pid} failed: {type(e).__name__}: {e}"), e))
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
                    w.control = ControlPage(map_fd(control_fd, CONTROL_BYTES, close=False))
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
                log.warning("source %r worker %d: fetch_fun returned a chunk with 0 rows; skipped",
                            source.name, state.worker_id)
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
                try:
                    w.maps[slot] = map_fd(fd, sizes[0], close=False, register=self._register)
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

    # ---- introspection --------------------------------------------------------------------
    def counters(self) -> Dict[str, float]:
        """The fetch_fun's ``feeder_counters`` as the worker processes last reported them, added up."""
        out: Dict[str, float] = {}
        for w in self._workers:
            for k, v in w.state.counters.items():
                out[k] = out.get(k, 0.0) + float(v)
        return out

    def _live(self) -> List[_Worker]:
        return [w for w in self._workers if w.process is not None and w.state.thread is not None
                and w.state.thread.is_alive() and w.chan is not None]

    def request_stacks(self) -> None:
        """Ask every live process for its stack now, so that a diagnosis due soon has it (a
        consumer calls this ``STACK_LEAD_S`` before its deadline). One request per process is in
        flight at a time, shared by every consumer that asks (feeder.processes.stacks)."""
        now = time.monotonic()
        for w in self._live():
            self._request_stack(w, now)

    @staticmethod
    def _request_stack(w: _Worker, now: float) -> int:
        chan = w.chan
        if chan is None:
            return w.stacks.sent
        return w.stacks.request(lambda msg: chan.send(msg, timeout=0.01), now)

    def describe(self, now: float, stack_after_s: float = 1.0, frames: int = 6) -> List[str]:
        """One line per process (plus its stack when in fetch_fun for ``stack_after_s`` s or more),
        by ``now + STACK_WAIT_S`` at the latest: a process that answers neither through its control
        thread nor through faulthandler is named as such. Safe for any number of consumers at once
        (feeder.processes.stacks)."""
        deadline = now + STACK_WAIT_S
        live = self._live()
        asked = {id(w): self._request_stack(w, now) for w in live}
        answered = {}
        for w in live:  # answers: at most REPLY_WAIT_S after the request (an early one is done by now)
            probe = w.stacks
            until = min(deadline - (STACK_WAIT_S - REPLY_WAIT_S), max(now, probe.asked_at + REPLY_WAIT_S))
            answered[id(w)] = asked[id(w)] > 0 and probe.wait(asked[id(w)], until)
        dumping = [w for w in live if not answered[id(w)] and time.monotonic() - w.child_since >= stack_after_s
                   and w.stacks.start_dump(time.monotonic())]
        dumps = {id(w): w.stacks.read_dump(deadline) for w in dumping}
        lines = []
        for w in self._workers:
            state = w.state
            alive = w in live
            what = w.child_state if alive and not state.state.startswith(("ended", "failed", "stopped")) \
                else state.state
            busy = time.monotonic() - (w.child_since if alive else state.since)
            text = f"worker {state.worker_id} {what} for {busy:.1f} s (call #{state.calls}, process pid {w.pid})"
            replied = answered.get(id(w), False)
            stack = w.stacks.text
            if alive and replied and what == IN_FETCH and busy >= stack_after_s and stack:
                lines_ = stack.rstrip("\n").splitlines()[-2 * frames:]
                text += "; stack (innermost last):\n" + "\n".join("    " + ln for ln in lines_)
            elif alive and not replied and busy >= stack_after_s:
                dump = dumps.get(id(w), "")
                if dump:  # faulthandler's format: most recent call first
                    shown = dump.strip().splitlines()[:2 * frames + 1]
                    text += ("; it did not answer (C code holding the GIL?); faulthandler's stack of its main "
                             "thread, most recent call first:\n" + "\n".join("    " + ln for ln in shown))
                else:
                    text += (f"; worker {state.worker_id}, pid {w.pid}, did not answer in time (busy in C code "
                             f"holding the GIL?)")
            lines.append(text)
        return lines

    def live_descriptions(self) -> List[str]:
        now = time.monotonic()
        alive = [w.process is not None and w.process.exitcode is None for w in self._workers]
        return [line for line, a in zip(self.describe(now, 0.0), alive) if a]
