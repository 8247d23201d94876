"""The parent's side of worker processes: start them, turn their shared-memory slots into chunks.

:class:`ProcFetchers` offers the feed the same interface as ``feeder.workers.ThreadFetchers``
(``states``, ``start``, ``set_batch_size``, ``signal_stop``, ``threads``, ``describe``), so the
feed has one way of fetching; only here is it known that ``fetch_fun`` runs elsewhere.

Per worker process, one *receiver* thread in the parent reads the child's messages (see
``feeder.procworker``): a chunk becomes numpy views onto the child's slot, checked against the
source's validator (children learn shapes independently, the source decides), put on the
source's queue like a fetcher thread's chunk, and the slot is handed back when the last view
is gone. The receiver is also where the child's failures become the source's failure:

* an exception in ``fetch_fun``: ``FetchError`` from the original (unpickled) exception, or from
  a :class:`feeder.RemoteError` when it cannot be rebuilt; the child's traceback is in the message;
* a process that ends without saying so (``os._exit``, a segfault, SIGKILL): ``FetchError``
  naming worker id, pid and exit code or signal; the channel reaches end-of-file at once, so
  this takes milliseconds, and ``is_alive`` is checked every ``SLICE_S`` as well.

Stop (``signal_stop``) asks politely (flag and message; the child's control thread ends the
process within ``STOP_GRACE_S`` even when ``fetch_fun`` hangs), then a *reaper* thread sends
SIGTERM and SIGKILL to what is left, against the coordinator's one join budget, and joins
every process so none is left as a zombie.
"""
from __future__ import annotations

import logging
import mmap
import multiprocessing
import os
import pickle
import secrets
import signal
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .chunks import ChunkValidator
from .errors import Failure, FeederError, FetchError, InputValidationError, RemoteError
from .procworker import worker_main
from .shm import ACKED, BATCH_SIZE, GO, MAX_SLOTS, STOP, Channel, ControlPage, arrays_from_slot, map_fd
from .source import Chunk, ChunkQueue
from .tuning import Throttle
from .workers import IN_FETCH, SLICE_S, WAITING_FOR_ROOM, WorkerState, put_chunk

log = logging.getLogger("feeder")

DEATH_JOIN_S = 1.0      # a child whose channel closed gets this long to report its exit status
# A consumer that keeps its batches (``list(feed)``) keeps their shared-memory slots, and a child
# has MAX_SLOTS of them: past this many held, chunks are copied out of their slot at once (the slot
# comes back) instead of being handed on as views, so hoarding costs a copy, never a deadlock.
HOARD_SLOTS = MAX_SLOTS // 2
STACK_WAIT_S = 0.5      # a diagnosis waits this long in all for the children's stacks
DEFAULT_STOP_S = 5.0    # the reaper's budget when the caller gives no deadline
PRELOAD = ["feeder.procworker"]  # imported once in the forkserver, so each child starts in milliseconds


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


class _NullWriter:
    def write(self, data: Any) -> int:
        return len(data)


def check_picklable(what: str, obj: Any, context: BaseContext) -> None:
    """TypeError naming ``what`` if ``obj`` cannot be pickled (as spawn and forkserver need). Array
    buffers are not copied (protocol 5, out of band), so a big source costs little to check."""
    if obj is None or context.get_start_method() == "fork":
        return
    try:
        pickle.Pickler(_NullWriter(), protocol=5, buffer_callback=lambda b: False).dump(obj)
    except Exception as e:
        raise TypeError(
            f"{what} {obj!r} cannot be pickled, and worker processes started with "
            f"{context.get_start_method()!r} need it pickled ({type(e).__name__}: {e}). Use a module-level "
            f"function or an instance of a module-level class (not a lambda, closure or bound method of an "
            f"object holding locks, files or sessions), or mp_context='fork'") from e


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
        self.process: Any = None  # multiprocessing.process.BaseProcess
        self.chan: Optional[Channel] = None
        self.control: Optional[ControlPage] = None
        self.maps: Dict[int, mmap.mmap] = {}
        self.pid: Optional[int] = None
        self.child_state = "starting"
        self.child_since = time.monotonic()
        self.done = False        # ended (StopIteration), failed, or told to stop: its exit is expected
        self.stack: Optional[str] = None
        self.stack_event = threading.Event()
        self.batch_size = 0
        self.go = True
        self.stacks_fd: Optional[int] = None  # the child's faulthandler file (see procworker)
        self.stacks_read = 0

    def fault_stacks(self, wait_s: float = 0.2) -> str:
        """Every thread's stack, written by faulthandler on SIGUSR1 (works while the child holds
        the GIL in C code); '' if it cannot be had."""
        fd, pid = self.stacks_fd, self.pid
        if fd is None or pid is None:
            return ""
        try:
            os.kill(pid, signal.SIGUSR1)
            deadline = time.monotonic() + wait_s
            size = self.stacks_read
            while time.monotonic() < deadline:
                time.sleep(0.01)
                new = os.fstat(fd).st_size
                if new > size and new == size + len(os.pread(fd, new - size, size)):
                    size = new
                    time.sleep(0.02)  # let it finish writing the other threads
                    break
            size = os.fstat(fd).st_size
            text = os.pread(fd, size - self.stacks_read, self.stacks_read).decode("utf-8", "replace")
            self.stacks_read = size
            return text
        except OSError:
            return ""

    def close_stacks(self) -> None:
        if self.stacks_fd is not None:
            try:
                os.close(self.stacks_fd)
            except OSError:
                pass
            self.stacks_fd = None


class ProcFetchers:
    """The fetchers of one feed as worker processes (see the module docstring)."""

    mode = "processes"

    def __init__(self, *, source: ChunkQueue, fetch_fun: Callable[[int, int], Any], validator: ChunkValidator,
                 worker_ids: Sequence[int], max_fetch_errors: int, stop: threading.Event, options: ProcessOptions,
                 throttle: Optional[Throttle] = None):
        self.source = source
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

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, batch_size: int, coalesce: bool) -> None:
        """Start one process and its receiver thread per worker id (pickles ``fetch_fun`` now)."""
        ctx = self._options.context
        seed = self._options.seed if self._options.seed is not None else secrets.randbits(63)
        name = self.source.name
        for w in self._workers:
            wid = w.state.worker_id
            w.batch_size = batch_size
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            w.chan = Channel(parent_conn)
            proc = ctx.Process(  # type: ignore[attr-defined]  # BaseContext's Process is set per context
                target=worker_main, name=f"feeder:{name}:proc-{wid}", daemon=True,
                args=(child_conn, wid, self._fetch_fun, self._options.worker_init_fun, seed, self._validator,
                      batch_size, coalesce))
            w.state.set("starting")
            try:
                proc.start()
            except Exception as e:
                child_conn.close()
                raise TypeError(f"source {name!r}, worker {wid}: could not start a worker process "
                                f"({type(e).__name__}: {e}); fetch_fun and worker_init_fun must be picklable") from e
            child_conn.close()  # the child has its own copy; ours would keep the channel open when it dies
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
            w.done = True
            if w.control is not None:
                w.control.fields[STOP] = 1
            if w.chan is not None:
                try:
                    w.chan.send(("stop",), timeout=0.1)
                except (OSError, ValueError):
                    pass  # already gone
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
                p.join(max(0.0, until - time.monotonic()))
            alive = [p for p in procs if p.exitcode is None]
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
        for p in procs:  # joined: none is left a zombie (Process.close() is left to GC: receivers may still ask)
            p.join(max(0.0, deadline - time.monotonic()))

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
            w.close_stacks()  # views a consumer still holds keep their own mapping alive

    def _receive_loop(self, w: _Worker) -> None:
        chan, state, source = w.chan, w.state, self.source
        assert chan is not None
        stop = self._stop
        while True:
            if self._throttle is not None and w.control is not None:
                go = state.worker_id in self._throttle.active
                if go != w.go:
                    w.go = go
                    w.control.fields[GO] = int(go)
                    (state.unpark if go else state.park)(time.monotonic())  # not running time
            try:
                if not chan.poll(SLICE_S):
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
                if not self._chunk(w, msg):
                    if stop.is_set() or source.failure is not None or source.closed:
                        self._drain_until_stopped(w)
                        return
            elif kind == "hello":
                w.pid = msg[1]
                control_fd, w.stacks_fd = chan.recv_fds(2)
                w.control = ControlPage(map_fd(control_fd, msg[2]))
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
            elif kind == "none":
                state.none_chunks += 0  # counted by the child; the figures came with the message
                log.warning("source %r worker %d: fetch_fun returned None; skipped", source.name, state.worker_id)
            elif kind == "empty":
                log.warning("source %r worker %d: fetch_fun returned a chunk with 0 rows; skipped",
                            source.name, state.worker_id)
            elif kind == "error":
                if self._error(w, msg):
                    self._drain_until_stopped(w)
                    return
            elif kind == "invalid":
                w.done = True
                state.set("failed")
                source.fail(Failure(InputValidationError(msg[1] + f" (in worker process pid {w.pid})")))
                self._drain_until_stopped(w)
                return
            elif kind == "end":
                w.done = True
                state.set("ended (StopIteration)")
                source.worker_ended(state.worker_id)
                if self._throttle is not None:
                    self._throttle.ended(state.worker_id)
            elif kind == "stack":
                w.stack = msg[1]
                w.stack_event.set()
            elif kind == "bye":
                w.done = True

    def _update(self, w: _Worker, stats: Tuple[Any, ...]) -> None:
        s = w.state
        (s.calls, s.chunks, rows, s.none_chunks, s.empty_chunks, s.fetch_errors, s.fetch_s, s.cpu_s, wall_s,
         child_state, age) = stats
        s.cpu_wall_s = max(0.0, wall_s - s.parked_s(time.monotonic()))  # the child's clock runs while parked
        s.rows = max(s.rows, rows)
        w.child_state = child_state
        w.child_since = time.monotonic() - age

    def _chunk(self, w: _Worker, msg: Tuple[Any, ...]) -> bool:
        """Turn a chunk message into a Chunk on the source; False if it could not be put (stop, failure)."""
        _, slot, layout, total, rows, slots, dropped, sizes, _stats = msg
        chan, state = w.chan, w.state
        assert chan is not None and w.control is not None
        for d in dropped:
            w.maps.pop(d, None)
        if sizes:
            w.maps[slot] = map_fd(chan.recv_fds(1)[0], sizes[0])
        arrays, base = arrays_from_slot(w.maps[slot] if slot is not None else None, layout, total)
        if base is not None:
            busy = w.control.busy
            if len(w.maps) >= HOARD_SLOTS and sum(busy[s] for s in w.maps) >= HOARD_SLOTS:
                arrays = tuple(a.copy() if a.base is not None else a for a in arrays)
                del base
                w.control.release(slot)
            else:
                weakref.finalize(base, w.control.release, slot)
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

    def _put(self, chunk: Chunk, state: WorkerState) -> bool:
        ok = put_chunk(self.source, chunk, state, self._stop)
        if state.state == WAITING_FOR_ROOM:
            state.set(IN_FETCH)  # the receiver waited, not the child: it is back in fetch_fun
        return ok

    def _error(self, w: _Worker, msg: Tuple[Any, ...]) -> bool:
        """An exception in the child; True if it fails the source."""
        _, data, type_name, text, tb, fatal, where, _stats = msg
        state, source = w.state, self.source
        cause: BaseException
        try:
            cause = pickle.loads(data) if data is not None else RemoteError(f"{type_name}: {text}\n{tb}")
        except Exception:
            cause = RemoteError(f"{type_name}: {text}\n{tb}")
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
        if where == "starting":  # it never reported after its hello, or never said hello
            where = ("in worker_init_fun or its first fetch_fun call (it had not reported yet)"
                     if w.control is not None else
                     "starting, before it could report (its error, if any, went to stderr)")
        self.source.fail(Failure(FetchError(
            f"source {self.source.name!r}, worker {state.worker_id}: worker process pid {w.pid} died "
            f"({_exit_text(code)}) while {where}")))

    def _drain_until_stopped(self, w: _Worker) -> None:
        """After a failure: keep reading (so the child never blocks on a full channel) until stop."""
        chan = w.chan
        assert chan is not None
        while not self._stop.is_set():
            try:
                if chan.poll(SLICE_S):
                    msg = chan.recv()
                    if msg[0] == "chunk" and msg[7]:
                        for fd in chan.recv_fds(1):
                            os.close(fd)
            except (EOFError, OSError):
                return

    # ---- introspection --------------------------------------------------------------------
    def describe(self, now: float, stack_after_s: float = 1.0, frames: int = 6) -> List[str]:
        """One line per process (plus its stack when in fetch_fun for ``stack_after_s`` s or more)."""
        live = [w for w in self._workers if w.process is not None and w.state.thread is not None
                and w.state.thread.is_alive() and w.chan is not None]
        for w in live:
            w.stack_event.clear()
            try:
                w.chan.send(("stack",), timeout=0.1)  # type: ignore[union-attr]
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + STACK_WAIT_S
        lines = []
        for w in self._workers:
            state = w.state
            alive = w in live
            if alive:
                w.stack_event.wait(max(0.0, deadline - time.monotonic()))
            what = w.child_state if alive and not state.state.startswith(("ended", "failed", "stopped")) \
                else state.state
            busy = time.monotonic() - (w.child_since if alive else state.since)
            text = f"worker {state.worker_id} {what} for {busy:.1f} s (call #{state.calls}, process pid {w.pid})"
            replied = w.stack_event.is_set()
            if alive and replied and what == IN_FETCH and busy >= stack_after_s and w.stack:
                lines_ = w.stack.rstrip("\n").splitlines()[-2 * frames:]
                text += "; stack (innermost last):\n" + "\n".join("    " + ln for ln in lines_)
            elif alive and not replied and busy >= stack_after_s:
                dump = w.fault_stacks()
                if dump:  # faulthandler's format: most recent call first, every thread
                    shown = dump.strip().splitlines()[:4 * frames]
                    text += ("; it did not answer (C code holding the GIL?); faulthandler's stacks, most recent "
                             "call first:\n" + "\n".join("    " + ln for ln in shown))
                else:
                    text += "; no stack: the process did not answer (busy in C code holding the GIL?)"
            lines.append(text)
        return lines

    def live_descriptions(self) -> List[str]:
        now = time.monotonic()
        alive = [w.process is not None and w.process.exitcode is None for w in self._workers]
        return [line for line, a in zip(self.describe(now, 0.0), alive) if a]
