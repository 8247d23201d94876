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
"""
from __future__ import annotations

import sys
from collections import deque
from typing import Deque, List, Optional, Sequence, Tuple

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
    Changing shapes or dtypes (a new batch size) starts a new ring.
    """

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"ring size must be >= 1, got {size}")
        self.size = size
        self._key: Optional[tuple] = None
        self._sets: List[List[np.ndarray]] = []
        self._next = 0
        self._free_refs = 0
        self.allocations = 0  # buffer sets allocated so far (for metrics and tests)

    @staticmethod
    def _refs(bufs: List[np.ndarray], i: int) -> int:
        return sys.getrefcount(bufs[i])

    def _held(self, bufs: List[np.ndarray]) -> bool:
        return any(self._refs(bufs, i) > self._free_refs for i in range(len(bufs)))

    def _allocate(self, shapes, dtypes) -> List[np.ndarray]:
        self.allocations += 1
        return [np.empty(s, dtype=d) for s, d in zip(shapes, dtypes)]

    def take(self, shapes: Sequence[Tuple[int, ...]], dtypes: Sequence[np.dtype]) -> List[np.ndarray]:
        key = (tuple(shapes), tuple(dtypes))
        if key != self._key:
            self._key, self._sets, self._next = key, [], 0
        if len(self._sets) < self.size:
            bufs = self._allocate(shapes, dtypes)
            self._sets.append(bufs)
            if len(self._sets) == 1:
                # Calibrate on a set nobody else can hold yet: what "free" reads as here.
                self._free_refs = max(self._refs(self._sets[0], i) for i in range(len(bufs)))
            return list(bufs)  # a new list: holders must reference the arrays, not our slot
        slot = self._next
        self._next = (slot + 1) % self.size
        if self._held(self._sets[slot]):
            self._sets[slot] = self._allocate(shapes, dtypes)
        return list(self._sets[slot])


class Rebatcher:
    """Cuts a stream of aligned chunks into batches of exactly ``batch_size`` rows.

    ``batch_axes[i]`` is the batch axis of input ``i``. Rows keep their order, and every
    input is cut at the same row positions, so rows of all inputs stay aligned.

    ``ring`` (optional) supplies reusable output buffers; without it every assembled
    batch is freshly allocated (safe for callers that keep batches indefinitely).
    """

    def __init__(self, batch_size: int, batch_axes: Sequence[int], ring: Optional[BufferRing] = None):
        self._axes = tuple(int(a) for a in batch_axes)
        self._ring = ring
        self._pending: Deque[Arrays] = deque()
        self._pending_rows = 0
        self.batch_size = 0
        self.set_batch_size(batch_size)
        self.copied_bytes = 0  # bytes copied into assembled batches
        self.zero_copy_batches = 0
        self.copied_batches = 0

    @property
    def pending_rows(self) -> int:
        """Rows received and not yet handed out in a batch."""
        return self._pending_rows

    @property
    def pending_nbytes(self) -> int:
        """Bytes of the pending rows (views of their chunks)."""
        return sum(a.nbytes for piece in self._pending for a in piece)

    def set_batch_size(self, batch_size: int) -> None:
        """Change the batch size; rows already pending are kept."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.batch_size = int(batch_size)

    def add(self, arrays: Sequence[np.ndarray]) -> None:
        """Append a chunk (one array per input, equal row counts). Empty chunks are ignored."""
        if len(arrays) != len(self._axes):
            raise ValueError(f"expected {len(self._axes)} arrays, got {len(arrays)}")
        n = rows_of(arrays, self._axes)
        for a, ax in zip(arrays, self._axes):
            if a.shape[ax] != n:
                raise ValueError(f"row counts differ between inputs: {a.shape[ax]} vs {n}")
        if n:
            self._pending.append(tuple(arrays))
            self._pending_rows += n

    def pop(self) -> Optional[List[np.ndarray]]:
        """The next full batch, or None if fewer than ``batch_size`` rows are pending."""
        if self._pending_rows < self.batch_size:
            return None
        return self._cut(self.batch_size, use_ring=True)

    def flush(self) -> Optional[List[np.ndarray]]:
        """All pending rows (fewer than a batch after ``pop`` returned None) as one short batch."""
        if not self._pending_rows:
            return None
        return self._cut(self._pending_rows, use_ring=False)

    def drop(self) -> int:
        """Discard all pending rows; returns how many were discarded."""
        n = self._pending_rows
        self._pending.clear()
        self._pending_rows = 0
        return n

    def _cut(self, n: int, use_ring: bool) -> List[np.ndarray]:
        axes = self._axes
        first = self._pending[0]
        first_rows = rows_of(first, axes)
        if first_rows >= n:
            views = [take_rows(a, ax, 0, n) for a, ax in zip(first, axes)]
            if all(v.flags.c_contiguous for v in views):
                self._consume_front(n, first_rows, first)
                self.zero_copy_batches += 1
                return views
        shapes = [_batch_shape(a, ax, n) for a, ax in zip(first, axes)]
        dtypes = [a.dtype for a in first]
        if use_ring and self._ring is not None:
            out = self._ring.take(shapes, dtypes)
        else:
            out = [np.empty(s, dtype=d) for s, d in zip(shapes, dtypes)]
        pos = 0
        while pos < n:
            piece = self._pending[0]
            piece_rows = rows_of(piece, axes)
            k = min(piece_rows, n - pos)
            for dst, src, ax in zip(out, piece, axes):
                np.copyto(take_rows(dst, ax, pos, pos + k), take_rows(src, ax, 0, k))
            self._consume_front(k, piece_rows, piece)
            pos += k
        self.copied_bytes += sum(o.nbytes for o in out)
        self.copied_batches += 1
        return out

    def _consume_front(self, k: int, piece_rows: int, piece: Arrays) -> None:
        if k == piece_rows:
            self._pending.popleft()
        else:
            self._pending[0] = tuple(take_rows(a, ax, k, piece_rows) for a, ax in zip(piece, self._axes))
        self._pending_rows -= k
