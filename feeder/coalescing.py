"""Coalescing: a fetcher cuts the tiny chunks of fast calls into whole batches itself.

A fast ``fetch_fun`` returning tiny chunks would otherwise cost one queue round trip, one
wake-up of the enqueuer and one copy call per chunk, all under the GIL.
When calls are fast and chunks small (at most a quarter of a batch), each fetcher therefore
cuts its own chunks into whole batches (one copy per input, into a buffer it reuses) and
puts those; the enqueuer then hands them on without copying, so every byte is still copied
once. Rows wait in a fetcher about ``COALESCE_HOLD_S`` at most (when its next call blocks,
the enqueuer puts them for it, see ``Coalescer``), and not at all when a call is slow (the
per-chunk overhead does not matter then). Off for ``ordered`` sources (their chunk sequence
is the contract) and for ``dont_rebatch``.

A piece put counts as every chunk in it against the source queue's bound (``max_buffered_batches``,
in chunks), so a fetcher never holds more chunks than that bound before it puts them
(``Coalescer.most_chunks``): the queue holds at most its bound, however small.

Rows put uncoalesced (after a hold or a slow call) would shift the enqueuer's batch
boundaries, and every later assembled batch would be cut apart and copied again. With
several workers or feeds the enqueuer avoids that by letting whole batches go first (no
order is promised there); with one worker and one feed, where rows keep their order, the
fetcher instead puts raw rows up to the next batch boundary before it coalesces again.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from .chunkqueue import Chunk, ChunkQueue
from .errors import InputValidationError
from .rebatcher import BufferRing, Rebatcher
from .trace import TraceHook
from .workerstate import WorkerState

COALESCE_HOLD_S = 0.02    # longest a coalescing fetcher keeps rows before putting them as they are
COALESCE_SLOW_CALL_S = 0.002  # a fetch_fun call slower than this turns coalescing off for its rows
COALESCE_RING = 4         # reusable batch buffers per coalescing fetcher
COALESCE_FRACTION = 4     # only chunks of at most 1/4 of a batch are coalesced (but see MADE_BYTES_PER_S)
# A chunk of more than that (and less than a batch) is cut into batches by its own fetcher too when
# the call made it (a chunk the call wrote, not a view it returned) and other fetchers feed the
# source: the copy then reads rows still in this core's cache, beside the other fetchers' copies,
# instead of every copy falling to the one thread that plans batches. Measured on 2 cores
# (benchmarks/compare.py s-large: 64-row chunks of 3 MB, made by a copy, batch 128): 2 fetcher
# threads went from 0.86-1.0x to 1.17-1.32x the serial loop; chunks that are views (scenario b) keep
# the old way. "Made" is read from the call's time: at least MADE_MIN_CALL_S, and at least what
# writing its bytes at MADE_BYTES_PER_S takes. A view comes back in a few microseconds whatever its
# size; a copy of a big chunk runs at memory speed, 10-40 GB/s on one core. The rate must stay
# above the fastest copy: at 20 GB/s, a machine that copies 3 MB chunks at 25 GB/s (measured, AMD
# EPYC, 2026-12-05) read them as views, and feeding ran at 0.96-1.0x the serial loop instead of 1.3x.
# Chunks under MADE_MIN_BYTES keep the old way: their copy is cheap wherever it runs.
MADE_BYTES_PER_S = 100e9
MADE_MIN_CALL_S = 20e-6
MADE_MIN_BYTES = 256 << 10


def made(arrays: Tuple[np.ndarray, ...], call_s: float) -> bool:
    """Whether a call that took ``call_s`` seconds made ``arrays`` (wrote their bytes, at memory
    speed at most) rather than returning views of memory it had: see MADE_BYTES_PER_S. Only big
    chunks (MADE_MIN_BYTES) are ever read as made."""
    if call_s < MADE_MIN_CALL_S:
        return False
    nbytes = sum(a.nbytes for a in arrays)
    return nbytes >= MADE_MIN_BYTES and call_s * MADE_BYTES_PER_S >= nbytes


class Coalescer:
    """One fetcher's coalescing state: the rows it holds, cut into whole batches as they come.

    Held rows must not wait on a ``fetch_fun`` call that blocks, so another thread (the
    enqueuer, whenever it finds the queue empty) may put them with ``flush_if_stale``. The
    fetcher owns this state except while it is parked: before calling ``fetch_fun`` with rows
    held, the fetcher parks it (appends a token to ``parked``, inline in the fetch loop) and
    reclaims it afterwards (pops the token, or ``reclaim``). A flusher that pops the token first
    owns the state until it sets ``returned``. list.append and list.pop are atomic, so the
    fetcher's common path takes no lock.
    """

    def __init__(self, state: WorkerState, source: ChunkQueue, axes: Sequence[int], batch_size: int,
                 put: Callable[[Chunk], bool], allocate: Optional[Callable[..., np.ndarray]] = None,
                 trace: Optional[TraceHook] = None):
        self.parked: List[bool] = []
        self.returned = threading.Event()
        # (allocate: a device feed's staging memory, which the device copies batches from as they are)
        self.rb = Rebatcher(batch_size, axes, BufferRing(COALESCE_RING, allocate=allocate))
        self.held_since = 0.0  # when the oldest held row arrived (monotonic s); 0.0: holds none
        # With one worker and one feed the enqueuer sees exactly this fetcher's rows, in order:
        # keep coalesced batches on its batch boundaries (see the module docstring).
        self.realign = source.single_stream()
        self.shared = not self.realign  # other fetchers (or feeds) share the source: see MADE_BYTES_PER_S
        self.offset = 0  # rows put so far, modulo the batch size: where the enqueuer's next batch starts
        self.unput = 0   # chunks added since the last put: the queue slots a batch stands for
        self._wid = state.worker_id
        self._state = state
        self._source = source
        self._put = put
        self._trace = trace  # the coalescing copies are "assemble" spans on a trace

    def tracer(self) -> Any:
        """The feed's active trace, or None."""
        return self._trace.tracer if self._trace is not None else None

    def reclaim(self) -> None:
        """After the call: take the state back, waiting for a flusher that is using it."""
        try:
            self.parked.pop()
        except IndexError:  # a flusher took it: it hands it back within one non-blocking put each
            self.returned.wait()
            self.returned.clear()

    def _put_raw(self, arrays: Tuple[np.ndarray, ...], rows: int, put: Callable[[Chunk], bool]) -> bool:
        if not put(Chunk(self._wid, arrays, rows)):
            return False
        self.offset = (self.offset + rows) % self.rb.batch_size
        return True

    def put_pending(self, limit: Optional[int] = None, put: Optional[Callable[[Chunk], bool]] = None) -> bool:
        """Put (up to ``limit`` of) the held rows, uncopied (the enqueuer copies them once).
        False if a put failed; the rows not put are kept, in order."""
        put = put or self._put
        self.unput = 0
        pieces = self.rb.take_pieces(limit)
        for i, (rows, arrays) in enumerate(pieces):
            if not self._put_raw(arrays, rows, put):
                self.rb.restore_front(pieces[i:])
                return False
        if not self.rb.pending_rows:
            self.held_since = 0.0
        return True

    def add(self, arrays: Tuple[np.ndarray, ...], rows: int, bs: int, now: float, slow_call: bool,
            made_chunk: bool = False) -> bool:
        """Take a validated chunk (``made_chunk``: the call made it, see :func:`made`); put what
        makes whole batches. False if a put failed (stop)."""
        rb = self.rb
        if bs != rb.batch_size:
            rb.set_batch_size(bs)
            self.realign = False  # the enqueuer's boundaries moved: alignment is no longer known
        if rows * COALESCE_FRACTION > bs and not (
                self.shared and not slow_call and rows < bs and made_chunk):
            # Not tiny: its overhead is small next to its copy, which the enqueuer makes into a
            # buffer it reuses. Rows held before it go first, so that order is kept.
            if rb.pending_rows and not self.put_pending():
                return False
            return self._put_raw(arrays, rows, self._put)
        if not rb.pending_rows:
            self.held_since = now
        pending = rb.add(arrays, rows)
        self.unput += 1
        if pending < bs:
            if slow_call:
                return self.put_pending()  # a slow source: put rows as they come
            if self.unput >= self.most_chunks():
                return self._put_held()
            return True
        if self.realign and self.offset:
            if not self.put_pending(bs - self.offset):
                return False
            if rb.pending_rows < bs:
                self.held_since = time.monotonic() if rb.pending_rows else 0.0
                return True
        state = self._state
        while True:
            t0 = time.monotonic()
            batch = rb.pop()
            if batch is None:
                break
            t1 = time.monotonic()
            state.assemble_s += t1 - t0
            tracer = self.tracer()
            if tracer is not None:
                tracer.span("assemble", t0, t1, rows=bs, coalesced=True)
            slots, self.unput = max(1, self.unput), 0
            if not self._put(Chunk(self._wid, tuple(batch), bs, slots)):
                return False
        self.held_since = time.monotonic() if rb.pending_rows else 0.0
        if self.held_since and slow_call:
            return self.put_pending()
        return True

    def may_hold(self, rows: int, bs: int) -> bool:
        """Whether a tiny chunk of ``rows`` joins the held rows without completing a batch of ``bs``
        (nor making them more chunks than the queue may hold): the fetch loop's short way."""
        rb = self.rb
        return bs == rb.batch_size and rows * COALESCE_FRACTION <= bs and rb.pending_rows + rows < bs \
            and self.unput + 1 < self.most_chunks()

    def most_chunks(self) -> int:
        """The most of fetch_fun's chunks one piece put may stand for: the source queue's bound."""
        return max(1, self._source.maxsize)

    def _put_held(self) -> bool:
        """Put the held rows, short of a batch, as one chunk of pieces, uncopied: they stand for as
        many of fetch_fun's chunks as the source queue may hold (``max_buffered_batches``, in
        chunks), and one piece standing for more would overfill it. The enqueuer copies them once,
        into its batches, as it would have copied them put one by one. False if the put failed (stop)."""
        rb = self.rb
        pieces, rows = rb.take_all()  # (never none: it is called with the chunk just held)
        slots, self.unput = max(1, self.unput), 0
        self.held_since = 0.0
        if not self._put(Chunk(self._wid, (), rows, slots, pieces=pieces)):
            rb.restore_front(pieces)
            return False
        self.offset = (self.offset + rows) % rb.batch_size
        return True

    def flush_if_stale(self, now: float) -> None:
        """Put rows held longer than COALESCE_HOLD_S while the fetcher is parked; never blocks."""
        if not self.held_since or now - self.held_since < COALESCE_HOLD_S:
            return
        try:
            self.parked.pop()
        except IndexError:
            return  # not parked: the fetcher is working with its rows itself
        try:
            self.put_pending(put=self._put_now)
        finally:
            self.returned.set()

    def _put_now(self, chunk: Chunk) -> bool:
        """Put without waiting (a flusher must never block); counted as the fetcher's put."""
        if self._source.put(chunk, 0.0) is not True:
            return False
        self._state.rows_put += chunk.rows
        return True


BURST_CALLS = 64  # calls a burst makes before the fetch loop looks at stop, failure, throttle and size again


def burst(co: Coalescer, fetch_fun: Callable[[int, int], Any], wid: int, bs: int, single: Optional[Tuple[Any, ...]],
          check: Callable[[Any, int], Tuple[Tuple[np.ndarray, ...], int]], state: WorkerState
           ) -> Optional[Tuple[Any, Optional[BaseException], float]]:
    """The common case in as few steps as possible: fetch tiny chunks and hold them until the batch
    is nearly full (the fetch loop then completes it), with the per-call bookkeeping kept in locals.

    Returns None after BURST_CALLS calls (or when holding rows would pass COALESCE_HOLD_S), or the
    call that did not fit, as ``(result, exception, start)``, for the fetch loop to handle as its own
    call. Like the fetch loop, it parks the held rows around each call (see ``Coalescer``).
    """
    rb = co.rb
    pending = rb._pending
    parked = co.parked
    monotonic = time.monotonic
    limit = bs // COALESCE_FRACTION
    most = co.most_chunks()
    held = rb.pending_rows
    deadline = co.held_since + COALESCE_HOLD_S
    if single is not None:
        dtype, rest = single[0], single[1]
    calls = 0
    fetch_s = 0.0
    arrays: Tuple[np.ndarray, ...]
    try:
        while calls < BURST_CALLS:
            rb.pending_rows = held  # what a flusher may take during the call (see Coalescer)
            parked.append(True)
            t0 = monotonic()
            state.since = t0
            state.calls += 1
            try:
                raw = fetch_fun(wid, bs)
            except BaseException as e:  # noqa: B902 - the fetch loop handles it as its own call's
                co.reclaim()
                held = rb.pending_rows  # a flusher may have taken the held rows meanwhile
                return None, e, t0
            calls += 1
            try:
                parked.pop()
            except IndexError:  # a flusher took the held rows meanwhile
                co.reclaim()
                held = rb.pending_rows
                return raw, None, t0
            t1 = monotonic()
            fetch_s += t1 - t0
            tracer = co.tracer()
            if tracer is not None:
                tracer.span("fetch", t0, t1)
            if t1 - t0 > COALESCE_SLOW_CALL_S or t1 > deadline:
                return raw, None, t0
            if single is not None:  # one input, its dtype and row shape known: no validator call
                a = raw[0] if type(raw) in (list, tuple) and len(raw) == 1 else None
                if type(a) is not np.ndarray or a.dtype is not dtype or a.shape[1:] != rest:
                    return raw, None, t0
                arrays, n = (a,), a.shape[0]
            else:
                try:
                    arrays, n = check(raw, wid)
                except InputValidationError:
                    return raw, None, t0  # the fetch loop checks it again and fails the source
            if 0 < n <= limit and held + n < bs and co.unput + 1 < most:
                pending.append((n, arrays))
                held += n
                co.unput += 1
                state.chunks += 1
                state.rows += n
                continue
            return raw, None, t0
        return None
    finally:
        rb.pending_rows = held
        state.fetch_s += fetch_s
