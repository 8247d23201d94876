"""Padded batches and length windows: rows that differ in shape, cut into batches of one shape.

Pure logic, like ``feeder.rebatcher``: no threads, no queues, no locks. A feed registered with
``pad=`` owns one :class:`PadRebatcher` instead of a ``Rebatcher``; tests drive it directly.

* **Padding.** Each batch of a padded input is as long, along each of its rows' axes, as its
  longest row there (rounded up to ``pad_to_multiple_of`` along the axes on which rows vary, or
  exactly the size a session fixes for that axis), and gains a mask of the same shape: 1 where a
  row has a value, 0 where it was padded. Each row's values are copied once, straight into the
  padded batch (no concatenate-then-pad): rows that lie one after the other in their chunk go
  with one masked assignment (``batch[mask] = values``), others with one gather (``np.take``
  into the batch). The padding positions are then written with the pad value. Batch buffers
  come from a ring of byte buffers reused whatever the batch's shape (:class:`ByteRing`).
* **Length windows.** With ``window=N`` up to N rows are held; once N are, the oldest whole
  batches' worth of them is sorted by length (stable) and cut into batches, so a batch holds
  rows of similar length; the newest rows that do not make a whole batch wait for the next
  window, so that no row waits more than about two windows. Rows are referred to by index
  into the chunks they came in (no copy until the batch is written); at the end of the data
  the last window is cut the same way, and what is left is the short last batch.

A row's *length* is its number of elements, summed over the padded inputs.
"""
from __future__ import annotations

import math
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple, Union

import numpy as np

from .ragged import Ragged, dense_as_ragged
from .rebatcher import _REFCOUNTS_TELL, take_rows

Piece = Union[np.ndarray, Ragged]
Sel = Union[slice, np.ndarray]  # the rows of a chunk a piece stands for: a slice, or row numbers


@dataclass(frozen=True)
class PadInput:
    """How one input is padded.

    Attributes:
        index: Its position among the inputs of a chunk.
        name: The input's name.
        value: The pad value.
        fixed: Per axis of a row: the size the session fixes for it (rows are padded to exactly
            that), or None (padded to the longest row of the batch, rounded up).
        mask_name: The name of its mask in the batch.
        mask_dtype: The mask's dtype.
    """

    index: int
    name: str
    value: Any
    fixed: Tuple[Optional[int], ...]
    mask_name: str
    mask_dtype: np.dtype


@dataclass(frozen=True)
class Padding:
    """A feed's ``pad=`` options: the padded inputs, ``pad_to_multiple_of`` and ``length_window``."""

    pads: Tuple[PadInput, ...]
    multiple: Optional[int] = None
    window: Optional[int] = None

    def mask_names(self) -> List[str]:
        """The masks' names, in the order they follow the inputs in a batch."""
        return [p.mask_name for p in self.pads]


# Rows of one chunk in a batch up to which they are copied row by row rather than through an index
# array (a gather's fixed cost is that of several rows' copies).
FEW_ROWS = 8

# Pieces held before the window (or the FIFO) compacts them into one: bounds the Python work per
# batch and what a window of tiny chunks keeps alive (each piece pins its chunk, and in worker-
# process mode the chunk's shared-memory slot, of which a worker has a bounded number).
MAX_PIECES = 512


class ByteRing:
    """A ring of reusable byte buffers, one set per batch in flight, reused by capacity.

    Padded batches change shape from batch to batch, so a ring keyed by shapes (``BufferRing``)
    would allocate every time; here each output of a batch is a view of a byte buffer that is
    at least as big, and a set of buffers is reused once nothing references it (reference
    counts, as in ``BufferRing``: the views keep their buffer referenced).
    """

    def __init__(self, size: int, allocate: Optional[Callable[[Tuple[int, ...], Any], np.ndarray]] = None):
        if size < 1:
            raise ValueError(f"ring size must be >= 1, got {size}")
        self.size = size
        # (shape, dtype) -> array: np.empty, or a device feed's staging memory (feeder.device)
        self._allocate = allocate if allocate is not None else np.empty
        self._sets: List[List[np.ndarray]] = []
        self._last = 0
        self._free_refs = 0
        self.allocations = 0  # byte buffers allocated so far (for tests)

    def _held(self, bufs: List[np.ndarray]) -> bool:
        return any(sys.getrefcount(b) > self._free_refs for b in bufs)

    def take(self, shapes: Sequence[Tuple[int, ...]], dtypes: Sequence[np.dtype]) -> List[np.ndarray]:
        """Arrays of these shapes and dtypes, views of buffers that nobody else references."""
        need = [max(1, math.prod(s) * d.itemsize) for s, d in zip(shapes, dtypes)]
        n = len(self._sets) if _REFCOUNTS_TELL else 0
        bufs: Optional[List[np.ndarray]] = None
        for i in range(n):
            slot = (self._last - i) % n
            cand = self._sets[slot]
            if len(cand) == len(need) and not self._held(cand):
                for k, (b, nb) in enumerate(zip(cand, need)):
                    if b.nbytes < nb:  # too small for this batch: grow it, with room for the next
                        cand[k] = self._alloc(nb + nb // 4)
                bufs, self._last = cand, slot
                break
        if bufs is None:
            bufs = [self._alloc(nb) for nb in need]
            if n < self.size:
                self._sets.append(bufs)
                self._last = n
                if n == 0:
                    self._free_refs = max(sys.getrefcount(b) for b in bufs)
            elif n:
                self._last = (self._last + 1) % n
                self._sets[self._last] = bufs
        out = []
        for b, s, d in zip(bufs, shapes, dtypes):
            count = math.prod(s)
            out.append(b[:count * d.itemsize].view(d).reshape(s))
        return out

    def _alloc(self, nbytes: int) -> np.ndarray:
        self.allocations += 1
        return self._allocate((nbytes,), np.uint8)


def _rows(sel: Sel, n: int) -> int:
    return len(range(n)[sel]) if isinstance(sel, slice) else len(sel)


def _sub(sel: Sel, start: int, stop: int) -> Sel:
    """Rows ``start:stop`` of a selection."""
    if isinstance(sel, slice):
        base = sel.start or 0
        return slice(base + start, base + stop)
    return sel[start:stop]


def _select(a: Piece, sel: Sel, axis: int) -> Piece:
    """The selected rows of one input of a chunk: a view, or a Ragged over the same values."""
    if isinstance(a, Ragged):
        return a[sel]
    if isinstance(sel, slice):
        return take_rows(a, axis, sel.start or 0, sel.stop)
    return np.take(a, sel, axis=axis)  # row numbers of a plain input: only when it is not padded


class PadRebatcher:
    """Cuts chunks whose padded inputs differ in shape into padded batches of ``batch_size`` rows.

    Offers what the feed uses of :class:`~feeder.rebatcher.Rebatcher` (``add``, ``append``,
    ``pop``, ``flush``, ``drop``, ``pending_rows``, ``set_batch_size``...) plus
    :meth:`end_of_data` (the window is cut whatever it holds) and :meth:`has_batch`. Each batch
    is the chunks' inputs in order, each padded one padded, with the masks inserted after them
    (before the last input when ``keyed``: the row keys stay last).

    Args:
        batch_size: Rows per batch.
        batch_axes: The batch axis of each input (padded inputs: 0).
        pads: The padded inputs.
        multiple: Round padded axes up to a multiple of this: the axes on which rows vary (see
            ``_dims``; axes a session fixes excepted).
        window: Rows held to sort by length (None: batches in arrival order).
        ring: The buffers' ring (or None: fresh buffers for every batch).
        keyed: The last input is the row keys (the masks go before it).
    """

    def __init__(self, batch_size: int, batch_axes: Sequence[int], pads: Sequence[PadInput],
                 multiple: Optional[int] = None, window: Optional[int] = None, ring: Optional[ByteRing] = None,
                 keyed: bool = False):
        self._axes = tuple(int(a) for a in batch_axes)
        self._pads = {p.index: p for p in pads}
        self._pad_list = list(pads)
        self._multiple = multiple
        # Per padded input, the axes of its rows along which rows have differed so far: those are
        # rounded up to ``multiple`` from then on (see _dims). Part of a source's state (each batch
        # carries what it was after it, ``PadPlan.varies``), so that a resumed run rounds as the
        # uninterrupted run would have: ``seed_varies``.
        self._varies: Dict[int, Set[int]] = {}
        self.window = window
        self._ring = ring
        self._mask_at = len(self._axes) - (1 if keyed else 0)
        self._pending: Deque[Tuple[int, Tuple[Piece, ...], Sel]] = deque()  # (rows, arrays, selection)
        self._unplanned = 0
        self._planned: Deque[List[Tuple[int, Tuple[Piece, ...], Sel]]] = deque()  # whole batches, cut
        self._ended = False
        self.pending_rows = 0  # rows held: waiting for a window, or in batches cut and not handed out
        self.batch_size = 0
        self.set_batch_size(batch_size)
        self.reorder = False  # (the Rebatcher's option; rows here keep their order unless windowed)
        self.hold_gil = True
        self.last_nbytes: Optional[int] = None  # the chunks' bytes of the rows of the last batch
        self.copied_bytes = 0      # bytes of rows written into batches (each once)
        self.copied_batches = 0
        self.zero_copy_batches = 0  # (never: a padded batch is always written)
        self.real_elements = 0      # elements of padded inputs that hold a row's value ...
        self.padded_elements = 0    # ... and those that hold the pad value

    # ---- the Rebatcher's interface ------------------------------------------------------------
    def seed_varies(self, varies: Optional[Dict[str, Sequence[int]]]) -> None:
        """Start from the axes a checkpoint says rows had differed along (``state["pad_varies"]``:
        per padded input's name, axes of its rows), as if the batches before it were made here."""
        if not varies or not self._multiple:
            return
        for i, pad in self._pads.items():
            axes = varies.get(pad.name)
            if axes:
                self._varies.setdefault(i, set()).update(int(a) for a in axes)

    def set_batch_size(self, batch_size: int) -> None:
        """Change the batch size; rows already held are kept (batches already cut are cut again)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.batch_size = int(batch_size)
        while self._planned:  # cut for the old size: back in front, in their order, to be cut again
            for piece in reversed(self._planned.pop()):
                self._pending.appendleft(piece)
                self._unplanned += piece[0]

    @property
    def pending_nbytes(self) -> int:
        """The chunks' bytes of the rows held."""
        pieces = [p for p in self._pending] + [p for b in self._planned for p in b]
        return sum(self._nbytes(p) for p in pieces)

    def add(self, arrays: Sequence[Piece], rows: Optional[int] = None) -> int:
        """Append a chunk (one array or Ragged per input); returns the rows now held."""
        if rows is None:
            if len(arrays) != len(self._axes):
                raise ValueError(f"expected {len(self._axes)} arrays, got {len(arrays)}")
            rows = len(arrays[0]) if isinstance(arrays[0], Ragged) else int(arrays[0].shape[self._axes[0]])
            for a, ax in zip(arrays, self._axes):
                n = len(a) if isinstance(a, Ragged) else a.shape[ax]
                if n != rows:
                    raise ValueError(f"row counts differ between inputs: {n} vs {rows}")
        if rows:
            self.append(tuple(arrays), rows)
        return self.pending_rows

    def append(self, arrays: Tuple[Piece, ...], rows: int) -> None:
        """``add`` for a caller that has checked the chunk (rows > 0)."""
        self._pending.append((rows, arrays, slice(0, rows)))
        self._unplanned += rows
        self.pending_rows += rows
        if len(self._pending) > MAX_PIECES:
            self._compact()

    def has_batch(self) -> bool:
        """Whether :meth:`pop` would return a batch now."""
        if self._planned:
            return True
        if self.window is None:
            return self._unplanned >= self.batch_size
        return self._unplanned >= max(self.window, self.batch_size) or (
            self._ended and self._unplanned >= self.batch_size)

    def pop(self) -> Optional[List[np.ndarray]]:
        """The next padded batch of ``batch_size`` rows, or None if none can be made yet."""
        plan = self.plan()
        if plan is None:
            return None
        self.buffers(plan)
        return plan.execute()

    def plan(self) -> Optional["PadPlan"]:
        """The next padded batch decided, not written (see ``feeder.rebatcher.Plan``): its rows,
        its shapes, what is copied where; :meth:`buffers` gives it its buffers."""
        if not self._planned:
            if not self.has_batch():
                return None
            if self.window is None:
                self._planned.append(self._take_front(self.batch_size))
            else:
                self._plan()
        batch = self._planned.popleft()
        self.pending_rows -= sum(p[0] for p in batch)
        return self._layout(batch)

    def buffers(self, plan: "PadPlan", use_ring: bool = True) -> None:
        """Give ``plan`` its buffers: views of the ring's byte buffers, or fresh arrays. Not
        thread-safe: call it where :meth:`plan` is called."""
        if plan.out is not None:
            return
        if use_ring and self._ring is not None:
            plan.out = self._ring.take(plan.shapes, plan.dtypes)
        else:
            plan.out = [np.empty(s, d) for s, d in zip(plan.shapes, plan.dtypes)]

    def end_of_data(self) -> None:
        """No more chunks will come: the window is cut whatever it holds."""
        self._ended = True

    def flush(self) -> Optional[List[np.ndarray]]:
        """All rows held (fewer than a batch once ``pop`` returned None) as one short batch."""
        plan = self.plan_flush()
        if plan is None:
            return None
        self.buffers(plan, use_ring=False)
        return plan.execute()

    def plan_flush(self) -> Optional["PadPlan"]:
        """:meth:`flush` as a plan (its buffers: ``buffers(plan, use_ring=False)``)."""
        if not self.pending_rows:
            return None
        pieces = [p for b in self._planned for p in b]
        self._planned.clear()
        pieces += self._take_front(self._unplanned)
        self.pending_rows = 0
        return self._layout(pieces)

    def pad_whole(self, arrays: Sequence[Piece], rows: int) -> List[np.ndarray]:
        """One chunk padded as one batch, whatever its row count (``dont_rebatch``)."""
        plan = self.plan_whole(arrays, rows)
        self.buffers(plan)
        return plan.execute()

    def plan_whole(self, arrays: Sequence[Piece], rows: int) -> "PadPlan":
        """:meth:`pad_whole` as a plan."""
        return self._layout([(rows, tuple(arrays), slice(0, rows))])

    def drop(self) -> int:
        """Discard every row held; returns how many."""
        n = self.pending_rows
        self._pending.clear()
        self._planned.clear()
        self._unplanned = self.pending_rows = 0
        return n

    # ---- cutting ------------------------------------------------------------------------------
    def _take_front(self, n: int) -> List[Tuple[int, Tuple[Piece, ...], Sel]]:
        """Remove the oldest ``n`` unplanned rows, as pieces (a piece that straddles is split)."""
        out = []
        need = n
        while need:
            rows, arrays, sel = self._pending[0]
            if rows <= need:
                self._pending.popleft()
                out.append((rows, arrays, sel))
                need -= rows
            else:
                out.append((need, arrays, _sub(sel, 0, need)))
                self._pending[0] = (rows - need, arrays, _sub(sel, need, rows))
                need = 0
        self._unplanned -= n
        return out

    def _lengths(self, arrays: Tuple[Piece, ...], sel: Sel, rows: int) -> np.ndarray:
        total = np.zeros(rows, np.int64)
        for p in self._pad_list:
            a = arrays[p.index]
            if isinstance(a, Ragged):
                total += a[sel].sizes()
            else:
                total += math.prod(a.shape[1:])
        return total

    def _plan(self) -> None:
        """Cut the oldest whole batches' worth of held rows, sorted by length, into batches."""
        bs = self.batch_size
        k = (self._unplanned // bs) * bs
        pieces = self._take_front(k)
        lengths = np.concatenate([self._lengths(arrays, sel, rows) for rows, arrays, sel in pieces])
        order = np.argsort(lengths, kind="stable")
        bounds = np.cumsum([0] + [rows for rows, _, _ in pieces])
        for j in range(0, k, bs):
            chosen = np.sort(order[j:j + bs])  # grouped by piece, each piece's rows in their order
            which = np.searchsorted(bounds, chosen, side="right") - 1
            cuts = np.flatnonzero(np.diff(which)) + 1
            batch = []
            for part, w in zip(np.split(chosen, cuts), which[np.concatenate([[0], cuts])]):
                rows, arrays, sel = pieces[int(w)]
                local = part - bounds[w]
                if local[-1] - local[0] + 1 == len(local):  # a run of consecutive rows: a slice
                    picked = _sub(sel, int(local[0]), int(local[-1]) + 1)
                elif isinstance(sel, slice):
                    picked = local + (sel.start or 0)
                else:
                    picked = sel[local]
                batch.append((len(local), arrays, picked))
            self._planned.append(batch)

    def _compact(self) -> None:
        """Too many pieces held: write the unplanned rows into one chunk of their own (one more
        copy of those rows, which only a stream of tiny chunks ever costs)."""
        pieces = list(self._pending)
        self._pending.clear()
        n = sum(p[0] for p in pieces)
        merged: List[Piece] = []
        for i, ax in enumerate(self._axes):
            parts = [_select(arrays[i], sel, ax) for _, arrays, sel in pieces]
            if i in self._pads:
                merged.append(_concat_ragged(parts))
            else:
                merged.append(np.concatenate([p for p in parts if isinstance(p, np.ndarray)], axis=ax))
        self._pending.append((n, tuple(merged), slice(0, n)))

    # ---- writing a batch ----------------------------------------------------------------------
    def _dims(self, i: int, pad: PadInput, row_shapes: np.ndarray) -> List[int]:
        """The padded batch's size along each axis of padded input ``i``'s rows (``row_shapes``:
        one row per row of the batch): exactly the size the session fixes, else the longest row's,
        rounded up to ``pad_to_multiple_of`` along the axes on which rows vary: rows of one axis
        (token ids), and any axis on which rows of this feed have differed, in this batch or an
        earlier one. An axis on which every row so far has had one size (the 80 features of
        ``[L, 80]`` frames, the 3 channels of ``[H, W, 3]`` images) keeps that size."""
        n, nd = row_shapes.shape
        longest = row_shapes.max(axis=0) if n else np.zeros(nd, np.int64)
        varies = self._varies.setdefault(i, set())
        if n > 1:
            varies.update(np.flatnonzero((row_shapes != row_shapes[0]).any(axis=0)).tolist())
        m = self._multiple or 1
        dims = []
        for j in range(nd):
            want = pad.fixed[j] if j < len(pad.fixed) else None
            if want is not None:
                if longest[j] > want:  # (validation refuses such rows before they get here)
                    raise ValueError(f"input {pad.name!r}: a row of {int(longest[j])} along axis {j + 1} does "
                                     f"not fit the session's {want}")
                dims.append(int(want))
            elif nd == 1 or j in varies:
                dims.append(int(-(-int(longest[j]) // m) * m))
            else:
                dims.append(int(longest[j]))
        return dims

    def _nbytes(self, piece: Tuple[int, Tuple[Piece, ...], Sel]) -> int:
        rows, arrays, sel = piece
        total = 0
        for a, ax in zip(arrays, self._axes):
            if isinstance(a, Ragged):
                total += a[sel].nbytes
            else:
                total += a.nbytes // max(1, a.shape[ax]) * rows if a.shape[ax] else 0
        return total

    def _layout(self, pieces: List[Tuple[int, Tuple[Piece, ...], Sel]]) -> "PadPlan":
        """What a batch of these pieces is: each input's shape and dtype, and how its values are
        written (the plan :meth:`PadPlan.execute` follows)."""
        n = sum(p[0] for p in pieces)
        plans: List[Any] = []
        shapes: List[Tuple[int, ...]] = []
        dtypes: List[np.dtype] = []
        mask_shapes: List[Tuple[int, ...]] = []
        mask_dtypes: List[np.dtype] = []
        nbytes = 0
        for i, ax in enumerate(self._axes):
            parts = [_select(arrays[i], sel, ax) if i in self._pads or isinstance(sel, slice) else arrays[i]
                     for _, arrays, sel in pieces]
            pad = self._pads.get(i)
            if pad is None:
                first = parts[0]
                shape = list(first.shape)
                shape[ax] = n
                dt = first.dtype if first.dtype.kind not in "USO" else np.result_type(*(p.dtype for p in parts))
                plans.append(("plain", parts, [sel for _, _, sel in pieces]))
                shapes.append(tuple(shape))
                dtypes.append(dt)
                nbytes += math.prod(shape) * first.dtype.itemsize
                continue
            rag = [p if isinstance(p, Ragged) else dense_as_ragged(p) for p in parts]
            row_shapes = rag[0].shapes if len(rag) == 1 else np.concatenate([r.shapes for r in rag])
            nd = row_shapes.shape[1]
            dims = self._dims(i, pad, row_shapes)
            differ = np.flatnonzero((row_shapes != np.asarray(dims, np.int64)).any(axis=0)) if n else np.zeros(0)
            kvar = int(differ[-1]) if len(differ) else -1
            unit = math.prod(dims[kvar + 1:])
            if unit == 0:  # an axis of size 0 after the last that differs: no values at all
                kvar, unit = nd - 1, 1
            if unit > 1 and not all(r.rows_list is not None or r.starts is None or not len(r)
                                    or not (r.starts % unit).any() for r in rag):
                kvar, unit = nd - 1, 1  # rows that do not start on whole units: element by element
            dt = rag[0].dtype
            plans.append(("pad", rag, row_shapes, dims, kvar, unit, pad))
            shapes.append((n, *dims))
            dtypes.append(dt)
            mask_shapes.append((n, *dims))
            mask_dtypes.append(pad.mask_dtype)
            real = int(row_shapes.prod(axis=1).sum()) if n else 0
            self.real_elements += real
            self.padded_elements += n * math.prod(dims) - real
            nbytes += real * dt.itemsize
        self.copied_bytes += nbytes
        self.copied_batches += 1
        self.last_nbytes = nbytes
        plan = PadPlan(n, self._axes, plans, shapes + mask_shapes, dtypes + mask_dtypes, len(shapes), self._mask_at,
                       nbytes)
        if self._multiple:  # (without rounding the history decides nothing: no state needs it)
            plan.varies = {self._pads[i].name: sorted(v) for i, v in self._varies.items() if v} or None
        return plan


class PadPlan:
    """A padded batch decided, not written (``feeder.rebatcher.Plan``'s counterpart): its arrays'
    shapes and dtypes (the inputs, then the masks), how each input is written, and ``out``, the
    buffers (:meth:`PadRebatcher.buffers`). :meth:`execute` writes it, in any thread."""

    parts = None  # (a padded batch is always written: no piece lands as it is)
    views = None
    direct = False
    varies: Optional[Dict[str, List[int]]] = None  # PadRebatcher._varies after this batch, by input name

    def __init__(self, rows: int, axes: Sequence[int], plans: List[Any], shapes: List[Tuple[int, ...]],
                 dtypes: List[np.dtype], inputs: int, mask_at: int, source_nbytes: int):
        self.rows = rows
        self.axes = axes
        self._plans = plans
        self._inputs = inputs
        self._mask_at = mask_at
        # The batch's arrays in the order handed on: the inputs, with the masks before the keys.
        order = list(range(mask_at)) + list(range(inputs, len(shapes))) + list(range(mask_at, inputs))
        self.shapes = shapes
        self.dtypes = dtypes
        self._order = order
        self.out: Optional[List[np.ndarray]] = None
        self.nbytes = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))
        self.source_nbytes: Optional[int] = source_nbytes
        self.hold_gil = True

    @property
    def copy_nbytes(self) -> int:
        return self.nbytes

    def execute(self) -> List[np.ndarray]:
        out = self.out
        if out is None:
            raise RuntimeError("a plan executed before it was given buffers (PadRebatcher.buffers)")
        outs, masks = out[:self._inputs], out[self._inputs:]
        m = 0
        for i, (plan, dst) in enumerate(zip(self._plans, outs)):
            if plan[0] == "plain":
                _gather_plain(dst, plan[1], plan[2], self.axes[i])
            else:
                _write_padded(dst, masks[m], *plan[1:])
                m += 1
        return [out[k] for k in self._order]


def _write_padded(dst: np.ndarray, mask_out: np.ndarray, rag: List[Ragged], row_shapes: np.ndarray,
                  dims: List[int], kvar: int, unit: int, pad: PadInput) -> None:
    n = dst.shape[0]
    lead = (n, *dims[:kvar + 1])
    # Where each row has values, over the axes up to the last one on which rows differ.
    mask: Optional[np.ndarray] = None
    for j in range(kvar + 1):
        shape = [1] * len(lead)
        shape[j + 1] = dims[j]
        inside = np.arange(dims[j]).reshape(shape) < row_shapes[:, j].reshape((n,) + (1,) * (kvar + 1))
        mask = inside if mask is None else mask & inside
    if mask is None:  # no axis on which rows differ: every position holds a value
        mask = np.ones(lead, bool)
    elif mask.shape != lead:
        mask = np.broadcast_to(mask, lead)
    real = int(row_shapes.prod(axis=1).sum()) if n else 0
    np.copyto(mask_out, mask.reshape(lead + (1,) * (len(dims) - kvar - 1)), casting="unsafe")
    if not dst.size:  # rows without values (empty rows, or an axis of size 0): nothing to write
        return
    # Each unit (the elements after the last axis on which rows differ) as ONE element, so that
    # numpy copies it as a block: a boolean index with a trailing axis takes a path 30x slower.
    block = np.dtype((np.void, unit * dst.dtype.itemsize)) if unit > 1 else dst.dtype
    dv = dst.reshape(lead + (unit,)).view(block).reshape(lead) if unit > 1 else dst.reshape(lead)
    k0 = 0
    for r in rag:
        b = len(r)
        if not b:
            continue
        if r.rows_list is not None:  # rows given one by one: each copied once, in turn
            for t, row in enumerate(r.rows_list):
                dst[(k0 + t,) + tuple(slice(0, s) for s in row.shape)] = row
        elif b <= FEW_ROWS:  # a few rows of a chunk (a window's pick): row by row costs less than an index
            assert r.values is not None and r.starts is not None
            for t, (start, shape) in enumerate(zip(r.starts.tolist(), r.shapes.tolist())):
                size = math.prod(shape)
                dst[(k0 + t,) + tuple(slice(0, s) for s in shape)] = r.values[start:start + size].reshape(shape)
        else:
            assert r.values is not None and r.starts is not None
            count = len(r.values) // unit
            values = r.values[:count * unit].view(block) if unit > 1 else r.values
            if r.is_contiguous():  # one slice of values: one masked assignment
                first = int(r.starts[0]) // unit
                dv[k0:k0 + b][mask[k0:k0 + b]] = values[first:first + int(r.sizes().sum()) // unit]
            else:  # rows here and there (a window, a shuffle): one gather, straight into the batch
                index = (r.starts // unit).reshape((b,) + (1,) * (kvar + 1))
                stride = np.ones(b, np.int64)
                for j in range(kvar, -1, -1):
                    shape = [1] * (kvar + 2)
                    shape[j + 1] = dims[j]
                    index = index + np.arange(dims[j]).reshape(shape) * stride.reshape((b,) + (1,) * (kvar + 1))
                    stride = stride * r.shapes[:, j]
                np.take(values, index, out=dv[k0:k0 + b], mode="clip")
        k0 += b
    if real < dst.size:
        holes = ~mask
        if unit > 1:
            np.copyto(dst.reshape(lead + (unit,)), pad.value, where=holes.reshape(lead + (1,)), casting="unsafe")
        else:
            dv[holes] = pad.value


def _gather_plain(dst: np.ndarray, parts: List[np.ndarray], sels: List[Sel], axis: int) -> None:
    """An input that is not padded: its selected rows, one piece after the other, copied once."""
    k0 = 0
    for p, sel in zip(parts, sels):
        if isinstance(sel, slice):  # p is already the selected rows (a view)
            b = p.shape[axis]
            target = take_rows(dst, axis, k0, k0 + b)
            np.copyto(target, p, casting="same_kind" if dst.dtype.kind in "USO" else "equiv")
        else:
            b = len(sel)
            if axis == 0 and dst.dtype == p.dtype:
                np.take(p, sel, axis=0, out=dst[k0:k0 + b], mode="clip")
            else:
                take_rows(dst, axis, k0, k0 + b)[...] = np.take(p, sel, axis=axis)
        k0 += b


def _concat_ragged(parts: Sequence[Piece]) -> Ragged:
    """Pieces of one padded input as one Ragged with its own values (one copy)."""
    rag = [p if isinstance(p, Ragged) else dense_as_ragged(p) for p in parts]
    shapes = np.concatenate([r.shapes for r in rag])
    sizes = shapes.prod(axis=1) if shapes.shape[1] else np.ones(len(shapes), np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    values = np.empty(int(sizes.sum()), rag[0].dtype)
    pos = 0
    for r in rag:
        for row in r:
            values[pos:pos + row.size] = row.reshape(-1)
            pos += row.size
    return Ragged._make(values, starts, shapes)
