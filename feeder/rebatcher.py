"""Rebatching: chunks of any row count in, batches of exactly ``batch_size`` rows out.

Pure logic: no threads, no queues, no locks. The feed's enqueuer thread owns one
:class:`Rebatcher`; tests drive it directly.

Design (after Grain's ``rebatch.py``, against Caffe2's ``np.append`` loop):

* Pending rows are kept as *views* of the chunks they came from, never copied on
  arrival and never put back on a shared queue.
* A batch that lies within one chunk and is contiguous there is handed on as a view:
  zero copies.
* A batch that spans chunks is assembled with exactly one copy per byte, into an
  output buffer taken from a small ring (:class:`BufferRing`) so steady state
  allocates nothing.
* Deciding a batch and writing it are two steps: :meth:`Rebatcher.plan` says which rows
  of which chunks (views) land at which offset of the batch (a :class:`Plan`), and
  :meth:`Plan.execute` writes the bytes. The feed plans under its lock, in order, and lets
  several threads execute plans at once outside it (``feeder.assembly``): plans refer to
  disjoint buffers and to chunks nobody writes, so executing them in any order, in any
  thread, gives exactly the batches :meth:`Rebatcher.pop` gives (``pop`` is plan, then
  execute).
"""
from __future__ import annotations

import math
import sys
from collections import deque
from typing import Any, Callable, Deque, List, Literal, Optional, Sequence, Tuple

import numpy as np

Arrays = Tuple[np.ndarray, ...]


def rows_of(arrays: Sequence[np.ndarray], axes: Sequence[int]) -> int:
    """Row count of a chunk: the length of its first input along that input's batch axis."""
    return int(arrays[0].shape[axes[0]])


def take_rows(a: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    """A view of rows ``start:stop`` of ``a`` along ``axis`` (no copy)."""
    if axis == 0:
        return a[start:stop]
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, stop)
    return a[tuple(index)]


# Whether a reference count says that nobody else holds a buffer. Not on a free-threaded build,
# where counts of objects shared between threads are deferred: there the ring never reuses.
_REFCOUNTS_TELL = getattr(sys, "_is_gil_enabled", lambda: True)()

SMALL_COPY_BYTES = 64 * 1024  # pieces up to this size are copied without releasing the GIL


def concatenate_into(dst: np.ndarray, pieces: Sequence[np.ndarray], axis: int) -> None:
    """``np.concatenate(pieces, axis, out=dst)``, but small pieces are copied holding the GIL.

    numpy releases the GIL around every copy of more than a few hundred elements. Under
    contention (another Python thread, such as a second fetcher, wants the GIL) each release
    costs a hand-over and the reacquisition can wait out the interpreter's switch interval:
    measured here, concatenating 57 pieces of 1-8 rows of 256 float32 took 15 us alone and
    21 ms next to one busy Python thread, against 51 us for this memcpy loop. Big pieces still
    go through numpy, which releases the GIL while it copies them.
    """
    if not dst.nbytes:
        return  # rows without bytes (a shape like (rows, 0)): nothing to copy, and memoryview refuses them
    if axis != 0 or dst.dtype.kind not in "biufc" or not dst.flags.c_contiguous:
        np.concatenate(list(pieces), axis=axis, out=dst, casting=_casting(dst))
        return
    mv = memoryview(dst).cast("B")  # type: ignore[arg-type]  # ndarray exports the buffer protocol
    pos = row = 0
    for p in pieces:
        nbytes = p.nbytes
        rows = p.shape[0]
        if nbytes <= SMALL_COPY_BYTES and p.flags.c_contiguous and p.dtype == dst.dtype:
            mv[pos:pos + nbytes] = memoryview(p).cast("B")  # type: ignore[arg-type]
        else:
            np.copyto(dst[row:row + rows], p, casting=_casting(dst))
        pos += nbytes
        row += rows


def _casting(dst: np.ndarray) -> Literal["same_kind", "equiv"]:
    """Copies into a batch buffer never convert values: the chunks were validated to the buffer's
    dtype, so a mismatch is a bug to raise, not a cast to make (strings widen, see ``_cut``)."""
    return "same_kind" if dst.dtype.kind in "USO" else "equiv"


def _batch_shape(a: np.ndarray, axis: int, rows: int) -> Tuple[int, ...]:
    shape = list(a.shape)
    shape[axis] = rows
    return tuple(shape)


class BufferRing:
    """A ring of preallocated output buffer sets, reused in order once nobody holds them.

    Before a set is reused, its reference counts are checked: if anything outside the ring
    still holds one of its arrays (a consumer keeping a batch, or a view of it), that set is
    left to its holder and a fresh one takes its slot. So a batch stays valid for as long
    as it is referenced, and a consumer that drops each batch before taking the next (the
    steady state of ``feed.run()`` and of most loops) allocates nothing.
    Changing shapes or dtypes (a new batch size) starts a new ring. ``allocate(shape, dtype)``
    makes the buffers (default ``np.empty``; a device feed's: staging memory the device copies
    from fast, see ``feeder.device``).

    Not thread-safe (pure logic, like the rest of this module): one thread at a time may call
    :meth:`take`. The feed's ring is used under its pump lock; the runtime's output rings under
    their own lock (``feeder.runtime.Runner``).
    """

    def __init__(self, size: int, allocate: Optional[Callable[[Tuple[int, ...], Any], np.ndarray]] = None):
        if size < 1:
            raise ValueError(f"ring size must be >= 1, got {size}")
        self.size = size
        self._alloc = allocate if allocate is not None else np.empty  # (shape, dtype) -> array
        self._key: Optional[Tuple[Any, ...]] = None
        self._sets: List[List[np.ndarray]] = []
        self._last = 0  # the slot handed out last
        self._free_refs = 0
        self.allocations = 0  # buffer sets allocated so far (for metrics and tests)

    @staticmethod
    def _refs(bufs: List[np.ndarray], i: int) -> int:
        return sys.getrefcount(bufs[i])

    def _held(self, bufs: List[np.ndarray]) -> bool:
        for i in range(len(bufs)):
            if self._refs(bufs, i) > self._free_refs:
                return True
        return False

    def _allocate(self, shapes: Sequence[Tuple[int, ...]], dtypes: Sequence[np.dtype]) -> List[np.ndarray]:
        self.allocations += 1
        return [self._alloc(s, d) for s, d in zip(shapes, dtypes)]

    def take(self, shapes: Sequence[Tuple[int, ...]], dtypes: Sequence[np.dtype]) -> List[np.ndarray]:
        """A buffer set of these shapes and dtypes that nobody else references."""
        key = (tuple(shapes), tuple(dtypes))
        if key != self._key:
            self._key, self._sets, self._last = key, [], 0
        n = len(self._sets) if _REFCOUNTS_TELL else 0
        for i in range(n):
            # Newest free set first: the buffer the consumer dropped last is the likeliest to
            # still be in cache.
            slot = (self._last - i) % n
            if not self._held(self._sets[slot]):
                self._last = slot
                return list(self._sets[slot])  # a new list: holders must reference the arrays
        bufs = self._allocate(shapes, dtypes)
        if n < self.size:
            self._sets.append(bufs)
            self._last = n
            if n == 0:
                # Calibrate on a set nobody else can hold yet: what "free" reads as here.
                self._free_refs = max(self._refs(self._sets[0], i) for i in range(len(bufs)))
        else:  # all held: the holders keep theirs, a fresh set takes the slot after the newest
            self._last = (self._last + 1) % n
            self._sets[self._last] = bufs
        return list(bufs)


class Plan:
    """One batch as decided by :meth:`Rebatcher.plan`: which rows of which chunks land at which
    offset of which buffers. Nothing is written until :meth:`execute`; until then the rows are
    still held (the plan keeps its chunks' views, so nothing reuses their memory).

    Attributes:
        rows: Rows of the batch.
        axes: The batch axis of each input.
        parts: Per input, the pieces (views of chunks, in order) whose rows make the batch, one
            after the other along the batch axis; None for a batch handed on as it is.
        views: The batch's arrays when it needs no copy (a view of one chunk, or a chunk passed on
            whole), else None.
        shapes, dtypes: Per input, the batch's shape and dtype.
        out: The buffers the batch is written into (set by :meth:`Rebatcher.buffers`, or by the
            caller: a device feed may copy the pieces elsewhere).
        nbytes: Bytes the batch's arrays hold.
        source_nbytes: The chunks' bytes of its rows where they differ from ``nbytes`` (padding),
            else None.
        hold_gil: Copy small pieces holding the GIL (see :func:`concatenate_into`).
        direct: The batch's pieces go to a device straight from where they lie (no host copy:
            ``feeder.device``); ``out`` then holds None for those inputs, and :meth:`execute` writes
            only the others.
    """

    __slots__ = ("rows", "axes", "parts", "views", "shapes", "dtypes", "out", "nbytes", "source_nbytes", "hold_gil",
                 "direct")

    def __init__(self, rows: int, axes: Sequence[int], parts: Optional[List[Tuple[np.ndarray, ...]]],
                 views: Optional[List[np.ndarray]], shapes: List[Tuple[int, ...]], dtypes: List[np.dtype],
                 hold_gil: bool = True):
        self.rows = rows
        self.axes = axes
        self.parts = parts
        self.views = views
        self.shapes = shapes
        self.dtypes = dtypes
        self.out: Optional[List[np.ndarray]] = None
        self.nbytes = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))
        self.source_nbytes: Optional[int] = None
        self.hold_gil = hold_gil
        self.direct = False

    @classmethod
    def whole(cls, arrays: Sequence[np.ndarray], rows: int, axes: Sequence[int]) -> "Plan":
        """A batch that is these arrays as they are (no copy: ``dont_rebatch``)."""
        views = list(arrays)
        return cls(rows, axes, [(v,) for v in views], views, [a.shape for a in views], [a.dtype for a in views])

    @property
    def copy_nbytes(self) -> int:
        """Bytes :meth:`execute` writes (0 for a batch handed on without a copy)."""
        if self.views is not None:
            return 0
        if self.direct:
            return sum(o.nbytes for o in self.out or () if o is not None)
        return self.nbytes

    def execute(self) -> List[np.ndarray]:
        """Write the batch (one copy per byte, into ``out``) and return its arrays (None for an
        input that goes to the device straight from its pieces). Safe in any thread, at the same
        time as other plans' (they write other buffers)."""
        if self.views is not None:
            return self.views
        out = self.out
        if out is None:
            raise RuntimeError("a plan executed before it was given buffers (Rebatcher.buffers)")
        assert self.parts is not None
        hold_gil = self.hold_gil
        for dst, part, ax in zip(out, self.parts, self.axes):
            if dst is None:
                continue
            if len(part) == 1:
                np.copyto(dst, part[0], casting=_casting(dst))
            elif hold_gil:
                concatenate_into(dst, part, ax)
            else:
                np.concatenate(part, axis=ax, out=dst, casting=_casting(dst))
        return out


class Rebatcher:
    """Cuts a stream of aligned chunks into batches of exactly ``batch_size`` rows.

    ``batch_axes[i]`` is the batch axis of input ``i``. Rows keep their order, and every
    input is cut at the same row positions, so rows of all inputs stay aligned.

    ``ring`` (optional) supplies reusable output buffers; without it every assembled
    batch is freshly allocated.

    ``reorder=True`` lets a pending chunk that holds a whole batch go first, as a view,
    ahead of smaller pieces received before it (which wait to be combined with later
    ones). Rows then leave in a different order than they came, so it is only for sources
    that promise no order; in exchange, batches that fetchers already assembled are
    never copied a second time just because a short piece arrived before them.
    """

    def __init__(self, batch_size: int, batch_axes: Sequence[int], ring: Optional[BufferRing] = None,
                 reorder: bool = False):
        self._axes = tuple(int(a) for a in batch_axes)
        self._ring = ring
        self.reorder = reorder
        self._pending: Deque[Tuple[int, Arrays]] = deque()  # (rows, arrays) of views not yet handed out
        self.pending_rows = 0  # rows received and not yet handed out in a batch (read-only outside)
        self.batch_size = 0
        self.set_batch_size(batch_size)
        # Copy small pieces holding the GIL (concatenate_into), or let numpy release it around each
        # piece: faster alone, slower next to another busy Python thread (see concatenate_into).
        self.hold_gil = True
        self.copied_bytes = 0  # bytes copied into assembled batches
        self.zero_copy_batches = 0
        self.copied_batches = 0
        self.last_nbytes: Optional[int] = None  # (feeder.padding's: a batch's bytes are its chunks' here)

    @property
    def pending_nbytes(self) -> int:
        """Bytes of the pending rows (views of their chunks)."""
        return sum(a.nbytes for _, piece in self._pending for a in piece)

    def set_batch_size(self, batch_size: int) -> None:
        """Change the batch size; rows already pending are kept."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.batch_size = int(batch_size)

    def add(self, arrays: Sequence[np.ndarray], rows: Optional[int] = None) -> int:
        """Append a chunk (one array per input, equal row counts); returns the rows now pending.
        Empty chunks are ignored. ``rows``, when the caller has already checked the chunk,
        skips the alignment check.
        """
        if rows is None:
            if len(arrays) != len(self._axes):
                raise ValueError(f"expected {len(self._axes)} arrays, got {len(arrays)}")
            rows = rows_of(arrays, self._axes)
            for a, ax in zip(arrays, self._axes):
                if a.shape[ax] != rows:
                    raise ValueError(f"row counts differ between inputs: {a.shape[ax]} vs {rows}")
        if rows:
            self._pending.append((rows, tuple(arrays)))
            self.pending_rows += rows
        return self.pending_rows

    def append(self, arrays: Arrays, rows: int) -> None:
        """``add`` for a caller that has checked the chunk: a tuple of arrays with ``rows`` > 0 rows."""
        self._pending.append((rows, arrays))
        self.pending_rows += rows

    def extend(self, pieces: Sequence[Tuple[int, Arrays]], rows: int) -> None:
        """:meth:`append` each of ``pieces`` ((rows, arrays), checked), ``rows`` in all, in one step."""
        self._pending.extend(pieces)
        self.pending_rows += rows

    def take_all(self) -> Tuple[List[Tuple[int, Arrays]], int]:
        """Hand back every pending piece, uncopied, in order, and their rows (:meth:`take_pieces`
        without a limit, in one step rather than a piece at a time)."""
        pieces, rows = list(self._pending), self.pending_rows
        self._pending.clear()
        self.pending_rows = 0
        return pieces, rows

    def has_batch(self) -> bool:
        """Whether :meth:`pop` would return a batch now."""
        return self.pending_rows >= self.batch_size

    def end_of_data(self) -> None:
        """No more chunks will come (nothing is held back here: see ``feeder.padding``)."""

    def pop(self) -> Optional[List[np.ndarray]]:
        """The next full batch, or None if fewer than ``batch_size`` rows are pending: :meth:`plan`,
        its buffers from the ring, then :meth:`Plan.execute`."""
        plan = self.plan()
        if plan is None:
            return None
        self.buffers(plan)
        return plan.execute()

    def plan(self) -> Optional[Plan]:
        """Decide the next full batch without writing it (see :class:`Plan`); None if fewer than
        ``batch_size`` rows are pending. Its rows leave the pending rows now; a plan that needs a
        copy gets its buffers from :meth:`buffers` (or from the caller)."""
        if self.pending_rows < self.batch_size:
            return None
        if self.reorder and self._pending[0][0] < self.batch_size:
            for i, (rows, _) in enumerate(self._pending):
                if rows >= self.batch_size:
                    self._pending.rotate(-i)  # bring the whole-batch piece to the front ...
                    try:
                        return self._cut(self.batch_size)
                    finally:
                        self._pending.rotate(i)  # ... and put the waiting pieces back before it
        return self._cut(self.batch_size)

    def buffers(self, plan: Plan, use_ring: bool = True) -> None:
        """Give ``plan`` the buffers it is written into: a set of the ring (reused once nobody holds
        it), or fresh arrays (``use_ring=False``, or no ring). Nothing for a plan without a copy.
        Not thread-safe (the ring is not): call it where :meth:`plan` is called."""
        if plan.views is not None or plan.out is not None:
            return
        if use_ring and self._ring is not None:
            plan.out = self._ring.take(plan.shapes, plan.dtypes)
        else:
            plan.out = [np.empty(sh, dtype=d) for sh, d in zip(plan.shapes, plan.dtypes)]

    def flush(self) -> Optional[List[np.ndarray]]:
        """All pending rows (fewer than a batch after ``pop`` returned None) as one short batch."""
        plan = self.plan_flush()
        if plan is None:
            return None
        self.buffers(plan, use_ring=False)
        return plan.execute()

    def plan_flush(self) -> Optional[Plan]:
        """:meth:`flush` as a plan (its buffers: ``buffers(plan, use_ring=False)``, a short batch of
        its own shape)."""
        if not self.pending_rows:
            return None
        return self._cut(self.pending_rows)

    def take_pieces(self, limit: Optional[int] = None) -> List[Tuple[int, Arrays]]:
        """Hand back up to ``limit`` pending rows (all by default), uncopied, as (rows, arrays) views
        in order; a piece that straddles the limit is split there."""
        limit = self.pending_rows if limit is None else min(limit, self.pending_rows)
        pieces = []
        while limit > 0:
            rows, piece = self._pending[0]
            k = min(rows, limit)
            pieces.append((k, piece if k == rows else tuple(take_rows(a, ax, 0, k)
                                                             for a, ax in zip(piece, self._axes))))
            self._consume_front(k, rows, piece)
            limit -= k
        return pieces

    def restore_front(self, pieces: Sequence[Tuple[int, Arrays]]) -> None:
        """Put pieces from ``take_pieces`` back in front, in their order."""
        for rows, piece in reversed(pieces):
            self._pending.appendleft((rows, piece))
            self.pending_rows += rows

    def drop(self) -> int:
        """Discard all pending rows; returns how many were discarded."""
        n = self.pending_rows
        self._pending.clear()
        self.pending_rows = 0
        return n

    def _cut(self, n: int) -> Plan:
        axes = self._axes
        pending = self._pending
        first_rows, first = pending[0]
        if first_rows >= n:
            if first_rows == n:
                views = list(first)
            else:
                views = [take_rows(a, ax, 0, n) for a, ax in zip(first, axes)]
            if all(v.flags.c_contiguous for v in views):
                self._consume_front(n, first_rows, first)
                self.zero_copy_batches += 1
                return Plan(n, axes, [(v,) for v in views], views, [v.shape for v in views],
                            [v.dtype for v in views])
        # Gather the pieces of this batch (whole chunks, plus a view of the one that straddles the
        # boundary); executing the plan is then one concatenate per input into the output buffer:
        # each byte is copied exactly once, in C, and the Python work per piece is a pop and an append.
        pieces = []
        need = n
        while need:
            rows, piece = pending[0]
            if rows <= need:
                pending.popleft()
                pieces.append(piece)
                need -= rows
            else:
                pieces.append(tuple(take_rows(a, ax, 0, need) for a, ax in zip(piece, axes)))
                pending[0] = (rows - need, tuple(take_rows(a, ax, need, rows) for a, ax in zip(piece, axes)))
                need = 0
        self.pending_rows -= n
        parts = list(zip(*pieces))  # per input
        shapes = [_batch_shape(p[0], ax, n) for p, ax in zip(parts, axes)]
        # Strings of different widths (or str and object) widen to hold them all, never truncate.
        dtypes = [p[0].dtype if p[0].dtype.kind not in "USO" else np.result_type(*(q.dtype for q in p))
                  for p in parts]
        plan = Plan(n, axes, parts, None, shapes, dtypes, self.hold_gil)
        self.copied_bytes += plan.nbytes
        self.copied_batches += 1
        return plan

    def _consume_front(self, k: int, rows: int, piece: Arrays) -> None:
        if k == rows:
            self._pending.popleft()
        else:
            self._pending[0] = (rows - k, tuple(take_rows(a, ax, k, rows) for a, ax in zip(piece, self._axes)))
        self.pending_rows -= k
