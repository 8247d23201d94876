"""The loop that runs in a worker process: fetch, validate, coalesce, write into shared memory.

``worker_main`` is a module-level function with explicit arguments (after PyTorch's
``_worker_loop`` and torchdata's ``_populate_queue``), started by the parent's
``feeder.processes.parent`` with the start method the registration chose. In the child it:

* arms its *lifeline* (see :func:`arm_lifeline`): the kernel kills the process when the main
  process dies, whatever the process is doing, even inside C code that holds the GIL;
* ignores SIGINT (Ctrl-C in a terminal reaches the whole process group: the parent raises one
  ``KeyboardInterrupt`` and stops its workers; children must not print a traceback each; the
  parent starts them with SIGINT blocked or ignored, see ``feeder.processes.parent``), and enables
  ``faulthandler`` so a crash in C code leaves a stack on stderr;
* rebuilds ``fetch_fun`` and ``worker_init_fun`` from what was sent (``feeder.processes.sending``);
* seeds ``random`` and numpy's global generator from ``(seed, worker_id)``;
* runs ``worker_init_fun(worker_id)``, then calls ``fetch_fun`` until ``StopIteration``, a
  fatal error, or the parent's stop. After an exception in ``fetch_fun`` it waits for the
  parent's verdict (``VERDICTS`` on the control page) before calling again: only the parent
  counts ``max_fetch_errors``, and once the source has failed it sets ``STOP``, so a failed
  source's processes make no further call;
* validates each chunk with the source's validator (a copy of the parent's, with what it had
  learned when the process started), casts where ``cast=True``, and coalesces chunks smaller
  than a batch into whole batches (not for ordered sources nor ``dont_rebatch``): the copy into
  shared memory is then the only copy, and the parent hands the batch on without one;
* writes the arrays once into a free slot of its ring (``feeder.processes.shm``) and sends the parent
  their layout; it waits while ``MAX_INFLIGHT`` chunks (or ``MAX_INFLIGHT_BYTES``) are not yet queued by the parent
  (back-pressure: a full source stops the process) or while no slot is free.

A control thread in the child receives the parent's messages (stop, stack requests) and ends
the process when the parent is gone: the channel reaches end-of-file when the parent dies,
even by SIGKILL, and the parent pid changes when it is reparented. (It needs the GIL; the
lifeline does not.)
"""
from __future__ import annotations

import ctypes
import ctypes.util
import faulthandler
import math
import os
import pickle
import random
import select
import signal
import sys
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InputValidationError, exception_text
from ..pacing import AFTER_NONE, none_pause
from ..ragged import concat_shapes
from ..rebatcher import take_rows
from ..sources.base import SKIP
from ..validation import ChunkValidator
from .remotetb import Frame, frames_of
from .sending import Sendable
from .shm import (
    ACKED,
    ALIGN,
    BATCH_SIZE,
    CONTROL_BYTES,
    GO,
    MAX_INFLIGHT,
    MAX_INFLIGHT_BYTES,
    STOP,
    VERDICTS,
    Channel,
    ControlPage,
    Layout,
    SegmentRing,
    map_fd,
    new_fd,
)

COALESCE_HOLD_S = 0.02        # longest rows wait in the child for more rows to make a batch
COALESCE_SLOW_CALL_S = 0.002  # a call slower than this puts rows as they come
WAIT_S = 0.0001               # first sleep while waiting for a slot or for the parent to queue
WAIT_MAX_S = 0.001            # ... doubling up to this (a wake-up costs microseconds; oversleeping costs rows)
PARENT_CHECK_S = 0.2          # how often the control thread checks that the parent lives
STOP_GRACE_S = 0.2            # after a stop request, the main thread gets this long to return
FINAL_WORD_S = 0.05           # then the control thread waits at most this long to send the final figures
TRIM_EVERY = 32               # chunks between two looks for free segments to give back
STACKS_BYTES = 0              # the faulthandler file grows as it is written
CPU_SAMPLE_S = 0.05           # the child reads its CPU clock this often
STATS_S = 0.25                # a fetch that blocks still reports its figures this often
PAUSE_SLICE_S = 0.01          # a pause after fetch_fun returned None looks at stop this often


_FINAL = frozenset({"end", "bye", "error", "invalid", "stats", "stack"})


def seed_worker(seed: int, worker_id: int) -> None:
    """Seed ``random`` and numpy's global generator from (seed, worker_id): distinct per worker,
    reproducible for a given seed."""
    state = np.random.SeedSequence([seed & (2**63 - 1), worker_id]).generate_state(2)
    random.seed(int(state[0]) << 32 | int(state[1]))
    np.random.seed(int(state[0]))


class _Status:
    """What the main thread is doing, for the control thread's answers (single writer)."""

    def __init__(self) -> None:
        self.state = "starting"
        self.since = time.monotonic()
        self.calls = 0

    def set(self, state: str) -> None:
        self.state = state
        self.since = time.monotonic()


class _Child:
    def __init__(self, chan: Channel, control: ControlPage, worker_id: int):
        self.chan = chan
        self.control = control
        self.worker_id = worker_id
        self.ring = SegmentRing(control)
        self.status = _Status()
        self.stop = threading.Event()
        self.sent = 0
        self.unacked: Deque[int] = deque()  # the bytes of each chunk sent and not yet queued by the parent
        self.unacked_bytes = 0
        self.t0 = time.monotonic()
        self.cpu0 = time.thread_time()
        self.cpu_s = 0.0
        self.cpu_due = 0.0
        # figures sent with every message: calls, chunks, rows, none, empty, errors, fetch_s, cpu_s, wall_s,
        # and the fetch_fun's own (every CPU_SAMPLE_S and in the last messages, else None): its
        # feeder_counters() and the row keys it filtered since it last reported them
        self.calls = self.chunks = self.rows = self.none_chunks = self.empty_chunks = self.errors = 0
        self.counters_of: Optional[Callable[[Tuple[int, ...]], Any]] = None
        self.filtered_of: Optional[Callable[[Tuple[int, ...]], Any]] = None
        self.fetch_s = 0.0
        self.main_ident = threading.get_ident()
        # Rows held for coalescing. The main thread owns them except inside fetch_fun, where the
        # control thread may put them (a call that blocks must not hold rows back); the lock
        # decides who has them.
        self.lock = threading.Lock()
        self.pending: List[Tuple[Tuple[np.ndarray, ...], int]] = []
        self.pending_rows = 0
        self.held_since = 0.0
        self.axes: Tuple[int, ...] = ()
        self.padded: Tuple[bool, ...] = ()  # inputs whose rows may differ in shape (pad=): sent as values + rows

    def flush(self, wait: bool = True) -> bool:
        """Put the held rows as one chunk (caller holds ``lock``); False on stop, or when it would
        have to wait and ``wait`` is False (the rows are then kept)."""
        if not self.pending_rows:
            return True
        ok = self.put(self.pending, self.pending_rows, len(self.pending), self.axes, wait)
        if ok or wait:
            self.pending, self.pending_rows, self.held_since = [], 0, 0.0
        return ok

    def flush_if_stale(self) -> None:
        """From the control thread: put rows held past COALESCE_HOLD_S while fetch_fun runs."""
        if not self.held_since or time.monotonic() - self.held_since < COALESCE_HOLD_S \
                or self.status.state != "in fetch_fun":
            return
        if self.lock.acquire(blocking=False):
            try:
                if self.status.state == "in fetch_fun":
                    self.flush(wait=False)
            finally:
                self.lock.release()

    def stats(self, final: bool = False) -> Tuple[Any, ...]:
        now = time.monotonic()
        main = threading.get_ident() == self.main_ident
        counters = keys = None
        if now >= self.cpu_due and main:
            # the thread CPU clock is a system call: read it every CPU_SAMPLE_S, not per message;
            # the fetch_fun's counters likewise (the parent keeps the last ones it got)
            self.cpu_due = now + CPU_SAMPLE_S
            self.cpu_s = time.thread_time() - self.cpu0
            final = True
        if final and self.counters_of is not None:
            counters = self.counters_of((self.worker_id,))
        if final and self.filtered_of is not None and main:
            keys = self.filtered_of((self.worker_id,))  # taken by the main thread only, which filters
        return (self.calls, self.chunks, self.rows, self.none_chunks, self.empty_chunks, self.errors,
                self.fetch_s, self.cpu_s, now - self.t0, self.status.state, now - self.status.since, counters, keys)

    def send(self, *msg: Any, fds: Tuple[int, ...] = ()) -> None:
        # A worker's last messages, and one every CPU_SAMPLE_S, carry its fetch_fun's counters and
        # the keys it filtered: a filtered row is recorded before the worker's end, never lost
        # (one not yet reported when the process is stopped is simply read again on a resume).
        self.chan.send(msg + (self.stats(final=msg[0] in _FINAL),), fds)

    def stopped(self) -> bool:
        return self.stop.is_set() or bool(self.control.fields[STOP])

    # ---- the control thread ---------------------------------------------------------------
    def control_loop(self, ppid: int) -> None:
        # faulthandler's SIGUSR1 is for the main thread (the parent sends it there, see
        # feeder.processes.stacks); where the signal can only go to the process, not to this thread.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        owed = 0  # the stack request to answer (its number); retried until the answer is sent
        try:
            next_check = time.monotonic() + PARENT_CHECK_S
            while True:
                self.flush_if_stale()
                if self.chan.poll(COALESCE_HOLD_S):
                    msg = self.chan.recv()
                    if msg[0] == "stop":
                        self.stop.set()
                        break
                    if msg[0] == "stack":
                        owed = msg[1]
                if owed and self.chan.send(("stack", self.stack(), owed, self.stats()), timeout=0.5):
                    owed = 0
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + PARENT_CHECK_S
                    if os.getppid() != ppid:
                        break  # reparented: the parent is gone
        except (EOFError, OSError):
            pass  # the parent closed the channel or died
        self.stop.set()
        # Give the main thread a moment to return by itself (it checks between calls, and then
        # says goodbye with its final figures); one stuck in fetch_fun is not waited for.
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            time.sleep(0.01)
        self.last_word()
        os._exit(0)

    def last_word(self) -> None:
        """The final figures, for the parent's books (rows fetched and never sent are discarded
        there, see feeder.processes.parent), from the control thread as it ends the process. Taken
        under the lock, which the main thread holds except inside fetch_fun: a row it counts after
        them never leaves this process. Bounded, and silent if the parent is gone."""
        got = self.lock.acquire(timeout=FINAL_WORD_S)
        try:
            self.chan.send(("bye", self.stats()), timeout=FINAL_WORD_S)
        except (OSError, ValueError):
            pass
        finally:
            if got:
                self.lock.release()

    def stack(self, frames: int = 6) -> str:
        frame = sys._current_frames().get(self.main_ident)
        if frame is None:
            return ""
        lines = traceback.format_list(traceback.extract_stack(frame)[-frames:])
        return "".join(lines)

    # ---- waits ----------------------------------------------------------------------------
    def _wait(self, ready: Callable[[], bool], what: str, wait: bool = True) -> bool:
        """Sleep in growing slices until ``ready()``; False on stop (or at once if not ``wait``)."""
        if ready():
            return True
        if not wait:
            return False
        before = self.status.state
        self.status.set(what)
        pause = WAIT_S
        try:
            while not ready():
                if self.stopped():
                    return False
                time.sleep(pause)
                pause = min(WAIT_MAX_S, pause * 2)
            return True
        finally:
            self.status.set(before)

    def pause(self, seconds: float) -> bool:
        """After fetch_fun returned None: wait ``seconds`` (in slices, the lock let go: nothing is
        held, see ``flush``) before the next call; False on stop."""
        self.status.set(AFTER_NONE)
        deadline = time.monotonic() + seconds
        self.lock.release()
        try:
            while not self.stopped():
                left = deadline - time.monotonic()
                if left <= 0:
                    return True
                time.sleep(min(left, PAUSE_SLICE_S))
            return False
        finally:
            self.lock.acquire()

    def wait_go(self) -> bool:
        return self._wait(lambda: bool(self.control.fields[GO]), "parked (auto concurrency)")

    def verdict(self) -> bool:
        """After an exception in fetch_fun: wait until the parent has judged it. True to go on (it
        was tolerated); False when the source failed (the parent set STOP first) or stops."""
        fields = self.control.fields
        return self._wait(lambda: int(fields[VERDICTS]) >= self.errors or bool(fields[STOP]),
                          "waiting for the parent's verdict on an error") and not self.stopped()

    def _room(self) -> bool:
        """The parent has queued enough of what was sent for one more chunk to go (see MAX_INFLIGHT)."""
        unacked = self.unacked
        inflight = self.sent - int(self.control.fields[ACKED])
        while len(unacked) > inflight:  # the oldest were queued since
            self.unacked_bytes -= unacked.popleft()
        return inflight < MAX_INFLIGHT and (self.unacked_bytes < MAX_INFLIGHT_BYTES or not inflight)

    # ---- sending chunks -------------------------------------------------------------------
    def put(self, pieces: List[Tuple[Tuple[np.ndarray, ...], int]], rows: int, slots: int,
            axes: Tuple[int, ...], wait: bool = True) -> bool:
        """Write ``rows`` rows made of ``pieces`` into one slot and send its layout; False on stop
        (or, if not ``wait``, when no slot or no room is free right now)."""
        first = pieces[0][0]
        shapes: List[Tuple[int, ...]] = []
        row_shapes: List[Optional[np.ndarray]] = []
        for i, a in enumerate(first):
            if self.padded and self.padded[i]:
                # Rows that differ in shape: their values one after the other, then where each row
                # starts and its shape (feeder.ragged), all in the slot.
                cs = concat_shapes([p[0][i] for p in pieces])
                row_shapes.append(cs)
                shapes.append((int(cs.prod(axis=1).sum()) if cs.shape[1] else len(cs),))
                continue
            row_shapes.append(None)
            dims = list(a.shape)
            dims[axes[i]] = rows
            shapes.append(tuple(dims))
        # Strings of different widths widen, as in the parent's rebatcher.
        dtypes = [a.dtype if a.dtype.kind not in "US" else np.result_type(*(p[0][i].dtype for p in pieces))
                  for i, a in enumerate(first)]
        offsets: List[Optional[int]] = []
        rows_at: List[int] = []
        total = 0
        for s, d, rsh in zip(shapes, dtypes, row_shapes):
            if rsh is not None:
                offsets.append(total)
                total += -(-math.prod(s) * d.itemsize // ALIGN) * ALIGN
                rows_at.append(total)
                total += -(-rows * (1 + rsh.shape[1]) * 8 // ALIGN) * ALIGN
                continue
            rows_at.append(-1)
            if d.hasobject or not math.prod(s) * d.itemsize:
                offsets.append(None)  # pickled with the message (object arrays; rows without bytes)
                continue
            offsets.append(total)
            total += -(-math.prod(s) * d.itemsize // ALIGN) * ALIGN
        if not self._wait(self._room, "waiting for queue space", wait):
            return False
        slot = None
        fds: List[int] = []
        dropped: List[int] = []
        if total:
            got: List[Any] = []

            def take() -> bool:
                got[:] = self.ring.acquire(total)
                return got[0] is not None

            if not self._wait(take, "waiting for a free shared-memory slot", wait):
                return False
            slot, dropped, fds, _ = got
        layout: Layout = []
        for i, (shape, dtype, off) in enumerate(zip(shapes, dtypes, offsets)):
            parts = [p[0][i] for p in pieces]
            rs = row_shapes[i]
            if rs is not None:
                assert slot is not None and off is not None
                nd = rs.shape[1]
                where = self.ring.view(slot, rows_at[i], np.dtype(np.int64), (rows,))
                self.ring.view(slot, rows_at[i] + rows * 8, np.dtype(np.int64), rs.shape)[...] = rs
                _write_rows(self.ring.view(slot, off, dtype, shape), where, parts)
                del where
                layout.append(("ragged", off, dtype.str, shape[0], rows_at[i], rows, nd))
                continue
            if off is None:
                layout.append(("obj", parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axes[i])))
                continue
            assert slot is not None
            dst = self.ring.view(slot, off, dtype, shape)
            if len(parts) == 1:
                np.copyto(dst, parts[0], casting="unsafe" if dtype.kind in "US" else "same_kind")
            else:
                np.concatenate(parts, axis=axes[i], out=dst, casting="same_kind")
            del dst
            layout.append(("shm", off, dtype.str if dtype.names is None else dtype, shape))
        sizes = [self.ring.sizes[slot]] if fds and slot is not None else []
        try:
            self.send("chunk", slot, layout, total, rows, slots, dropped, sizes, fds=tuple(fds))
        finally:
            for fd in fds:
                os.close(fd)
        self.sent += 1
        self.unacked.append(total)
        self.unacked_bytes += total
        if not self.sent % TRIM_EVERY:
            trimmed = self.ring.trim()
            if trimmed:
                self.send("drop", trimmed)
        return True


def _write_rows(values: np.ndarray, starts: np.ndarray, parts: Sequence[Any]) -> None:
    """Write the rows of a padded input's pieces (Ragged or plain arrays) one after the other into
    ``values`` (each byte once), and where each row starts into ``starts``."""
    pos = row = 0
    for p in parts:
        if isinstance(p, np.ndarray):
            n, size = p.shape[0], math.prod(p.shape[1:])
            np.copyto(values[pos:pos + n * size].reshape(p.shape), p)
            starts[row:row + n] = np.arange(n, dtype=np.int64) * size + pos
            pos, row = pos + n * size, row + n
            continue
        n = len(p)
        sizes = p.sizes()
        starts[row:row + n] = np.concatenate([[0], np.cumsum(sizes)[:-1]]) + pos if n else sizes
        total = int(sizes.sum())
        if p.rows_list is not None:
            for r, s in zip(p.rows_list, starts[row:row + n].tolist()):
                values[s:s + r.size] = r.reshape(-1)
        else:
            assert p.values is not None and p.starts is not None
            if p.is_contiguous():
                first = int(p.starts[0]) if n else 0
                values[pos:pos + total] = p.values[first:first + total]
                pos, row = pos + total, row + n
                continue
            # rows here and there in their values: one gather of every element
            shift = np.repeat(p.starts - (starts[row:row + n] - pos), sizes)
            np.take(p.values, shift + np.arange(total), out=values[pos:pos + total])
        pos, row = pos + total, row + n


def _describe_exception(e: BaseException) -> Tuple[Optional[bytes], str, str, str, List[Frame]]:
    """(pickled exception or None, type name, str, traceback text, the frames of its traceback)
    of an exception. The parent rebuilds the traceback from the frames
    (``feeder.processes.remotetb``): pickling drops it."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        frames = frames_of(e)
    except Exception:
        frames = []
    try:
        pickled = pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(pickled)  # some exceptions pickle but cannot be rebuilt
        data: Optional[bytes] = pickled
    except Exception:
        data = None
    text = exception_text(e)
    return data, f"{type(e).__module__}.{type(e).__qualname__}", text, tb, frames


# glibc's malloc in a worker process: keep freed memory for reuse. A fetch function that makes a
# fresh multi-megabyte array per chunk otherwise gets it from the kernel anew each time (the
# freed one is unmapped or trimmed away) and faults every page in again: 746 page faults per
# batch of two 3 MB chunks, 2.7x slower, where a fetcher thread in the big parent saw 36.
# The worker process is feeder's, so it sets these; worker_init_fun runs after and may undo it.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_FREED_BYTES = 256 << 20   # freed memory at the top of the heap kept, not trimmed
MMAP_THRESHOLD_BYTES = 32 << 20  # allocations below this come from the heap (glibc's maximum)


def keep_freed_memory() -> bool:
    """Tune glibc's malloc in this process as above; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


PR_SET_PDEATHSIG = 1  # prctl(2)
F_SETSIG = 10         # fcntl(2), Linux: the signal sent for O_ASYNC events instead of SIGIO


def arm_lifeline(read_end: Connection, close_fds: Sequence[int], death_ppid: Optional[int]) -> None:
    """Make the kernel kill this process when the main process dies, whatever it is doing.

    ``read_end`` is this process's end of a pipe whose only write end the main process holds and
    never writes to. When the main process dies the kernel closes that end, the read end reaches
    end-of-file, and (``O_ASYNC`` with ``F_SETSIG``) the kernel sends this process SIGKILL: even
    inside C code holding the GIL, where no Python thread of this process can run, and whatever
    the chain of parents (a forkserver's children are the forkserver's, which outlives the main
    process). ``close_fds``: with "fork", the write ends this process inherited, which would
    otherwise keep the pipe open. ``death_ppid``: where the parent is the main process and the
    thread that started this one lives as long as it does, ``PR_SET_PDEATHSIG`` as well, checked
    against the expected parent pid right after (the parent may have died before it was set).
    Not every platform has these: there the control thread's checks remain.
    """
    for fd in close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    if not sys.platform.startswith("linux"):
        return
    if death_ppid is not None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
        if os.getppid() != death_ppid:
            os._exit(1)
    import fcntl

    r = read_end.fileno()
    fcntl.fcntl(r, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(r, getattr(fcntl, "F_SETSIG", F_SETSIG), int(signal.SIGKILL))
    fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | os.O_ASYNC)
    poller = select.poll()  # not select(): a "fork" child's descriptor numbers may pass FD_SETSIZE
    poller.register(r, select.POLLIN | select.POLLHUP)
    if poller.poll(0):  # nobody writes: readable means the main process died already
        os._exit(1)


def ignore_sigint() -> None:
    """SIGINT ignored, then unblocked (the parent may start a child with it blocked, see
    ``feeder.processes.parent``): a Ctrl-C that came meanwhile is discarded, not delivered."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def worker_main(conn: Connection, worker_id: int, functions: Sendable, seed: int, validator: ChunkValidator,
                batch_size: int, coalesce: int, lifeline: Tuple[Connection, Tuple[int, ...], Optional[int]]) -> None:
    """The body of a worker process (see the module docstring). ``functions`` carries
    ``(fetch_fun, worker_init_fun)``; ``coalesce``: the most of fetch_fun's chunks one piece sent may
    stand for (the source queue's bound, in chunks), 0 for none coalesced; ``lifeline`` is
    ``arm_lifeline``'s arguments."""
    arm_lifeline(*lifeline)  # the read end stays open (referenced here) as long as the process lives
    ignore_sigint()
    faulthandler.enable()
    ppid = os.getppid()
    chan = Channel(conn)
    # Stacks on request even when the main thread holds the GIL in C code (where the control
    # thread cannot answer): SIGUSR1, which the parent sends to the main thread, makes faulthandler
    # write that thread's stack into this anonymous file, which the parent reads through its own
    # descriptor. That thread's only: the others may run meanwhile, and reading the frames of a
    # running thread can crash the process (feeder.processes.stacks).
    stacks = new_fd(STACKS_BYTES, "feeder-stacks")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=False)
    control_fd = new_fd(CONTROL_BYTES, "feeder-control")
    control = ControlPage(map_fd(control_fd, CONTROL_BYTES, close=False))
    # Initial values first: from the hello on, the parent alone writes these fields (a batch size
    # reset or a parked worker set before the hello must not be overwritten).
    control.fields[BATCH_SIZE] = batch_size
    control.fields[GO] = 1
    try:
        chan.send(("hello", os.getpid(), CONTROL_BYTES, threading.get_native_id()), (control_fd, stacks))
    except OSError:
        return  # the parent gave up on this process while it started (stop): nothing to say, nobody to hear it
    os.close(control_fd)
    child = _Child(chan, control, worker_id)
    ctl = threading.Thread(target=child.control_loop, args=(ppid,), name="feeder:control", daemon=True)
    ctl.start()
    keep_freed_memory()
    seed_worker(seed, worker_id)
    where = "rebuilding fetch_fun and worker_init_fun in the process"
    try:
        fetch_fun, worker_init_fun = functions.get()
        if worker_init_fun is not None:
            where = "worker_init_fun"
            child.status.set("in worker_init_fun")
            worker_init_fun(worker_id)
    except BaseException as e:  # noqa: B902 - whatever it was, the parent must hear of it
        try:
            child.send("error", *_describe_exception(e), True, where)
        except OSError:
            pass  # the parent stopped meanwhile and closed the channel: it no longer listens
        return
    del functions
    child.counters_of = getattr(fetch_fun, "feeder_counters", None)
    child.filtered_of = getattr(fetch_fun, "feeder_filtered_keys", None)
    try:
        _loop(child, fetch_fun, validator, coalesce)
    except BaseException as e:  # noqa: B902 - a bug here must reach the parent, not vanish
        try:
            child.send("error", *_describe_exception(e), True, "the worker loop")
        except OSError:
            pass
    finally:
        try:
            child.send("bye")
        except OSError:
            pass


BURST_CALLS = 64  # calls a burst makes before the loop looks at stop, the go-ahead and the batch size again


def _burst(child: _Child, fetch_fun: Callable[[int, int], Any], wid: int, bs: int,
           single: Optional[Tuple[Any, ...]], most: int) -> Optional[Tuple[Any, Optional[BaseException], float, float]]:
    """The common case in as few steps as possible: fetch tiny chunks of one input and hold them
    until the batch is nearly full (the loop then completes it), the bookkeeping kept in locals.

    Returns None after BURST_CALLS calls, or the call that did not fit, as ``(result, exception,
    start, end)``, for the loop to handle as its own call. The lock is released around each call,
    as in the loop (the control thread may put the held rows meanwhile, see ``_Child.lock``): so
    the rows and chunks it holds are counted on ``child`` as they are taken, not at the end, and
    every message the control thread sends carries figures that include every row it sends."""
    if single is None:
        return None
    dtype, rest = single[0], single[1]
    lock = child.lock
    status = child.status
    monotonic = time.monotonic
    pending = child.pending
    held = child.pending_rows
    deadline = child.held_since + COALESCE_HOLD_S
    calls = 0
    fetch_s = 0.0
    t0 = monotonic()
    try:
        while calls < BURST_CALLS:
            status.since = t0
            child.pending_rows = held  # what the control thread may put during the call
            lock.release()
            try:
                raw = fetch_fun(wid, bs)
            except BaseException as e:  # noqa: B902 - the loop handles it as its own call's
                lock.acquire()
                calls += 1
                return None, e, t0, monotonic()
            lock.acquire()
            calls += 1
            t1 = monotonic()
            fetch_s += t1 - t0
            if pending is not child.pending:  # the control thread put the held rows meanwhile
                return raw, None, t0, t1
            if t1 - t0 > COALESCE_SLOW_CALL_S or t1 > deadline:
                return raw, None, t0, t1
            if type(raw) in (list, tuple) and len(raw) == 1:
                a = raw[0]
                if type(a) is np.ndarray and a.dtype is dtype and a.shape[1:] == rest:
                    n = a.shape[0]
                    if 0 < n and held + n < bs and len(pending) + 1 < most:
                        pending.append(((a,), n))
                        held += n
                        child.chunks += 1
                        child.rows += n
                        t0 = t1
                        continue
            return raw, None, t0, t1
        return None
    finally:
        if pending is child.pending:
            child.pending_rows = held
        child.calls += calls
        child.fetch_s += fetch_s


def _loop(child: _Child, fetch_fun: Callable[[int, int], Any], validator: ChunkValidator, coalesce: int) -> None:
    wid = child.worker_id
    fields = child.control.fields
    axes = child.axes = validator.axes
    child.padded = tuple(s.pad is not None for s in validator.specs) if validator.ragged else ()
    status = child.status
    check = validator.check
    monotonic = time.monotonic
    lock = child.lock
    stats_due = monotonic() + STATS_S
    stop = child.stop
    carried: Optional[Tuple[Any, Optional[BaseException], float, float]] = None  # a call the burst made
    pause = 0.0  # the last pause after fetch_fun returned None; 0.0 once a call returned something else
    lock.acquire()  # released only around fetch_fun (see _Child.lock)
    try:
        while not stop.is_set() and not fields[STOP]:
            if carried is None:
                if not fields[GO]:
                    if not child.flush() or not child.wait_go():
                        return
                bs = fields[BATCH_SIZE]
                status.state = "in fetch_fun"
                status.since = t0 = monotonic()
                child.calls += 1
                lock.release()
                error: Optional[BaseException] = None
                try:
                    raw = fetch_fun(wid, bs)
                except BaseException as e:  # noqa: B902 - KeyboardInterrupt/SystemExit reach the consumer too
                    error = e
                lock.acquire()
                now = monotonic()
                child.fetch_s += now - t0
            else:
                raw, error, t0, now = carried
                carried = None
            if error is not None:
                if isinstance(error, StopIteration):
                    if child.flush():
                        status.set("ended (StopIteration)")
                        child.send("end")
                    return
                child.errors += 1
                fatal = not isinstance(error, Exception)
                status.set("processing a chunk")
                child.send("error", *_describe_exception(error), fatal, "fetch_fun")
                if fatal or not child.verdict():
                    return
                continue
            slow = now - t0 > COALESCE_SLOW_CALL_S
            status.state, status.since = "processing a chunk", now
            if raw is None:
                child.none_chunks += 1
                child.send("none")
                pause = none_pause(pause)  # (feeder.fetchers: as a fetcher thread does)
                if not child.flush() or not child.pause(pause):
                    return
                continue
            pause = 0.0
            if raw is SKIP:  # nothing, on purpose; the parent counts the turn of an ordered source (no coalescing)
                if not coalesce:
                    child.send("skip")
                continue
            try:
                arrays, rows = check(raw, wid)
            except InputValidationError as e:
                child.send("invalid", str(e))
                return
            if rows == 0:
                child.empty_chunks += 1
                child.send("empty")
                continue
            child.chunks += 1
            child.rows += rows
            held = child.pending_rows
            if held + rows < bs and not slow and coalesce and validator._fast is not None \
                    and len(child.pending) + 1 < coalesce and (not held or now - child.held_since <= COALESCE_HOLD_S):
                # the common case: a small chunk that does not complete a batch is held, and the
                # next calls go the short way while they are like it (see _burst)
                if not held:
                    child.held_since = now
                child.pending.append((arrays, rows))
                child.pending_rows = held + rows
                status.state = "in fetch_fun"
                carried = _burst(child, fetch_fun, wid, bs, validator._single, coalesce)  # (_single: learned)
                continue
            # Unlike a fetcher thread, a process copies every chunk once anyway (into its slot), so
            # cutting whole batches here costs nothing extra and saves the parent its copy: the
            # parent gets whole batches, whatever the chunks' sizes (the rest waits for more rows).
            # Object arrays (strings) are pickled as they come; only string inputs can hold them, and
            # a validator with a fast path (every dtype fixed) has none.
            if not coalesce or (validator._fast is None and any(a.dtype.hasobject for a in arrays)):
                if not child.flush() or not child.put([(arrays, rows)], rows, 1, axes):
                    return
            else:
                if not child.pending_rows:
                    child.held_since = now
                child.pending.append((arrays, rows))
                child.pending_rows += rows
                if child.padded and child.pending_rows >= bs:  # one slot for them all; the parent pads
                    if not child.flush():
                        return
                while child.pending_rows >= bs:
                    take, taken = _take(child.pending, bs, axes)
                    child.pending_rows -= bs
                    if not child.put(take, bs, taken, axes):
                        return
                if not child.pending_rows:
                    child.held_since = 0.0
                elif slow or now - child.held_since > COALESCE_HOLD_S or len(child.pending) >= coalesce:
                    # (held long enough, or standing for as many chunks as the source queue may hold)
                    if not child.flush():
                        return
            if now >= stats_due:
                stats_due = now + STATS_S
                child.send("stats")
    finally:
        lock.release()


def _take(pending: List[Tuple[Tuple[np.ndarray, ...], int]], n: int,
          axes: Tuple[int, ...]) -> Tuple[List[Tuple[Tuple[np.ndarray, ...], int]], int]:
    """Remove the first ``n`` rows from ``pending`` (in place, splitting a piece if needed); returns
    them and how many of fetch_fun's chunks they stand for."""
    need = n
    k = 0
    for _, rows in pending:
        if rows > need:
            break
        need -= rows
        k += 1
        if not need:
            break
    out = pending[:k]
    del pending[:k]
    if need:
        arrays, rows = pending[0]
        out.append((tuple(take_rows(a, ax, 0, need) for a, ax in zip(arrays, axes)), need))
        pending[0] = (tuple(take_rows(a, ax, need, rows) for a, ax in zip(arrays, axes)), rows - need)
    return out, max(1, k)
