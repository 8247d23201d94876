"""The parent's side of worker processes: start them, turn their shared-memory slots into chunks.

:class:`ProcFetchers` offers the feed the same interface as ``feeder.fetchers.ThreadFetchers``
(``states``, ``start``, ``set_batch_size``, ``signal_stop``, ``threads``, ``describe``), so the
feed has one way of fetching; only here is it known that ``fetch_fun`` runs elsewhere.

The rest of the parent's side is in its own modules: starting the processes (and a Ctrl-C
meanwhile) in ``feeder.processes.starting``, the receiver threads that turn each process's
messages into chunks and failures in ``feeder.processes.receiver``.

Stop (``signal_stop``) asks politely (flag and message; the child's control thread ends the
process within ``STOP_GRACE_S`` even when ``fetch_fun`` hangs), then a *reaper* thread sends
SIGTERM and SIGKILL to what is left, against the coordinator's one join budget, and joins
every process so none is left as a zombie; ``close()`` then releases the processes, control
pages, lifelines and descriptors at once, not when the garbage collector gets to them.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..chunkqueue import Chunk, ChunkQueue
from ..fetchers import IN_FETCH, WorkerState
from ..pacing import EmptyReport, NoneReport
from ..trace import TraceHook
from ..tuning import Throttle
from ..validation import ChunkValidator
from .child import worker_main
from .receiver import Receivers, _Worker
from .sending import Sendable
from .shm import (
    BATCH_SIZE,
    Channel,
    # Not called here any more (the receivers call shm.map_fd): kept because tests/conftest.py
    # records the parent's mappings by replacing map_fd in shm and here, and checks both.
    map_fd,  # noqa: F401
    memory_device,
)
from .starting import ProcessOptions, _ChildName, _ctrl_c_held, phantom_main_file_hidden

log = logging.getLogger("feeder")

# A FeedTimeout may come at most a tenth of a second after its timeout, stacks included: a
# consumer asks the children for their stacks STACK_LEAD_S before its deadline, and at the
# deadline a diagnosis waits at most STACK_WAIT_S in all: first for the control threads' answers,
# then, from those that did not answer (C code holding the GIL), for faulthandler's dump.
STACK_LEAD_S = 0.1
STACK_WAIT_S = 0.06
REPLY_WAIT_S = 0.03     # of STACK_WAIT_S, the most spent waiting for answers
DEFAULT_STOP_S = 5.0    # the reaper's budget when the caller gives no deadline


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


class ProcFetchers(Receivers):
    """The fetchers of one feed as worker processes (see the module docstring); the receiver
    threads' methods are those of :class:`~feeder.processes.receiver.Receivers`."""

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
        self.empties = EmptyReport(source.name)  # ... and chunks of 0 rows

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, batch_size: int, coalesce: bool) -> None:
        """Start one process and its receiver thread per worker id (``fetch_fun`` is pickled now,
        for each process, see ``feeder.processes.starting``)."""
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
            # (coalesce: the most chunks one coalesced piece may stand for, the queue's bound; 0: off)
            args=(child_conn, wid, functions, seed, self._validator, batch_size,
                  max(1, self.source.maxsize) if coalesce else 0, (read_end, inherited, death_ppid)))
        w.state.set("starting")
        try:
            with phantom_main_file_hidden():
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
