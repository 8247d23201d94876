"""The shuffle window: rows of several units held together, so that each chunk mixes them.

Units are shuffled and so are the rows within a unit, but a chunk is one unit: with row groups of
10k-100k rows, every batch would come from one row group, which for data sorted by time or by
label is close to no shuffling at all. A worker with a window of N rows reads units until it holds
N rows, then hands out a random draw of rows from everything it holds (as many as the unit it just
read), and reads on; at the end of its units it hands out what it holds. Rows keep their row keys,
so a checkpoint stays exact: what was handed out and delivered is in the state, what the window
still held is not and comes again after a resume.

The window is one set of buffers (one per input, and the row keys) with a slot per row: a unit is
written into the slots the last draw freed (then at the end), a draw gathers random slots into new
arrays. So each row is copied twice on its way through (in, and out in its random place), and a
unit can be read in its stored order (no copy) since the window does the shuffling.

What a draw costs is proportional to the rows it draws, never to the rows held: the slots of the
rows held are kept in a dense array (``_live``, in no order), a draw picks random places in it and
fills the holes with the slots from its end (swap-remove), and freed slots go on a stack
(``_free``) that the next unit fills. Draws are reproducible from the window's generator.

An input whose rows differ in shape (a padded input's: a Parquet list column comes as a
:class:`~feeder.ragged.Ragged`, or as a plain array when a unit's rows happen to agree) is held
row by row, each row a view of what its unit read (no copy), and drawn as a Ragged: its values are
copied once, into the padded batch.

Pure logic (numpy, no threads): one :class:`ShuffleWindow` per worker, used by that worker alone.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Set

import numpy as np

from ..ragged import Ragged


def _as_rows(x: np.ndarray) -> Optional[np.ndarray]:
    """``x`` seen as a 1-d array of its rows, each one opaque value of the row's bytes (numpy copies
    such rows in one memcpy each, 2x faster than the values one by one), or None when it cannot be
    (objects, which must be copied as references, or memory that is not C-contiguous)."""
    if x.dtype.hasobject or not x.flags.c_contiguous or x.ndim == 0 or x.itemsize == 0:
        return None
    row = x.itemsize * int(np.prod(x.shape[1:], dtype=np.int64))
    if row == 0:
        return None
    return x.reshape(len(x), -1).view(np.dtype((np.void, row))).reshape(len(x))


def _row_objects(a: Any) -> np.ndarray:
    """The rows of a column (a Ragged, a list of rows, an array) as a 1-d object array of them (views)."""
    out = np.empty(len(a), dtype=object)
    for i, row in enumerate(a):
        out[i] = row
    return out


def narrowed(a: Any) -> Any:
    """A string array (``U``, ``S``) at the width of its longest value, else ``a`` as it is.

    A window's buffer of strings only widens (to the longest value of every unit it read), so a
    draw as the buffer holds it would have a width that depends on the window's whole history; at
    its own rows' width, a draw is the same whether the window was filled from the run's start or
    rebuilt from a checkpoint (feeder.sources.windowreplay)."""
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "US" or not a.size:
        return a
    longest = max(1, int(np.char.str_len(a).max()))
    width = a.dtype.itemsize // (4 if a.dtype.kind == "U" else 1)
    return a.astype(np.dtype((a.dtype.type, longest))) if longest < width else a


class ShuffleWindow:
    """Up to ``capacity`` rows (plus the last unit read) drawn from at random. A piece is a list of
    arrays (the inputs, then the row keys), all of one row count; pieces must agree in dtype kind
    and row shape (a wider string dtype widens the window)."""

    def __init__(self, capacity: int, rng: np.random.Generator):
        self.capacity = int(capacity)
        self.rows = 0       # rows held
        self.ended = False  # the worker's units are all read: hand out what is held, then stop
        self._rng = rng
        self._buffers: Optional[List[np.ndarray]] = None
        self._size = 0                             # slots ever written (held or freed): the buffers' high mark
        self._live = np.zeros(0, dtype=np.int64)   # _live[:rows]: the slot of each row held, in no order
        self._free = np.zeros(0, dtype=np.int64)   # _free[:_nfree]: slots below _size a draw emptied (a stack)
        self._nfree = 0
        self._by_row: Set[int] = set()  # inputs held row by row (rows of different shapes), see _rows

    def wants_more(self) -> bool:
        return not self.ended and self.rows < self.capacity

    def draw(self, next_piece: Callable[[], Optional[List[Any]]], largest: int) -> Optional[List[Any]]:
        """One call of a worker: top the window up with ``next_piece()`` (a unit's piece, keys last;
        None once the worker's units are all read), then draw as many rows as the last piece read
        had (``largest`` when it read none); None when it holds nothing more. A source's calls and
        their replay (feeder.sources.windowreplay) both go through here, so they draw alike."""
        last = 0
        while self.wants_more():
            piece = next_piece()
            if piece is None:
                self.ended = True
                break
            last = len(piece[-1])
            self.add(piece)
        if not self.rows:
            return None
        return self.take(last or largest)

    def add(self, arrays: List[np.ndarray]) -> None:
        n = len(arrays[0])
        if not n:
            return
        arrays = self._rows(arrays)
        f = min(n, self._nfree)
        self._fit(arrays, self._size + n - f)
        bufs = self._buffers
        assert bufs is not None
        at = self.rows
        if f:  # into the slots the last draws freed (the top of the stack)
            slots = self._free[self._nfree - f:self._nfree].copy()
            self._nfree -= f
            for b, a in zip(bufs, arrays):
                rb, ra = _as_rows(b), _as_rows(a[:f])
                if rb is not None and ra is not None and rb.dtype == ra.dtype:
                    rb[slots] = ra
                else:
                    b[slots] = a[:f]
            self._live[at:at + f] = slots
        if f < n:  # the rest after the slots ever written
            end = self._size + n - f
            for b, a in zip(bufs, arrays):
                b[self._size:end] = a[f:]
            self._live[at + f:at + n] = np.arange(self._size, end, dtype=np.int64)
            self._size = end
        self.rows += n

    def _rows(self, arrays: List[Any]) -> List[np.ndarray]:
        """``arrays`` with each input whose rows differ in shape (not an array, or an array whose
        rows are not the shape of those held) as an object array of its rows; from then on that
        input is held row by row (what the window held of it too)."""
        bufs = self._buffers
        out = list(arrays)
        for j, a in enumerate(out):
            if j not in self._by_row:
                if isinstance(a, np.ndarray) and (bufs is None or a.shape[1:] == bufs[j].shape[1:]):
                    continue
                self._by_row.add(j)
                if bufs is not None:
                    held = np.empty(len(bufs[j]), dtype=object)
                    for i in range(self._size):
                        held[i] = bufs[j][i]  # (a view of the row held)
                    bufs[j] = held
            out[j] = _row_objects(a)
        return out

    def _fit(self, arrays: List[np.ndarray], size: int) -> None:
        """Buffers of at least ``size`` slots whose dtypes hold these arrays' values."""
        bufs = self._buffers
        if bufs is None:
            cap = max(size, self.capacity + len(arrays[0]))
            self._buffers = [np.empty((cap,) + a.shape[1:], dtype=a.dtype) for a in arrays]
            self._fit_slots()
            return
        for j, (b, a) in enumerate(zip(bufs, arrays)):
            if a.shape[1:] != b.shape[1:]:
                raise ValueError(f"shuffle_window: rows of shape {a.shape[1:]} and {b.shape[1:]} in one input; the "
                                 f"window holds rows of one shape")
            dtype = np.result_type(b.dtype, a.dtype) if a.dtype != b.dtype else b.dtype
            if dtype != b.dtype or len(b) < size:
                grown = np.empty((max(size, 2 * len(b)),) + b.shape[1:], dtype=dtype)
                grown[:self._size] = b[:self._size]
                bufs[j] = grown
        self._fit_slots()

    def _fit_slots(self) -> None:
        """The slot arrays as long as the buffers (rows held and slots freed never exceed them)."""
        assert self._buffers is not None
        cap = len(self._buffers[0])
        if len(self._live) < cap:
            live = np.empty(cap, dtype=np.int64)
            live[:self.rows] = self._live[:self.rows]
            free = np.empty(cap, dtype=np.int64)
            free[:self._nfree] = self._free[:self._nfree]
            self._live, self._free = live, free

    def take(self, k: int) -> List[Any]:
        """``k`` rows (fewer if fewer are held) drawn at random, in random order, as new arrays
        (a Ragged for an input held row by row); they leave the window. Costs O(k), whatever
        the rows held."""
        bufs = self._buffers
        k = min(int(k), self.rows)
        if bufs is None or not k:
            return []
        rows = self.rows
        # k distinct places among the rows held, in random order (the chunk's order); numpy draws
        # them in O(k) (Floyd's algorithm, or a tail shuffle of at most 50 k places).
        pick = self._rng.choice(rows, size=k, replace=False)
        live = self._live
        slots = live[pick]
        # Swap-remove: the rows held beyond rows - k fill the places picked below it.
        cut = rows - k
        tail = np.ones(k, dtype=bool)
        tail[pick[pick >= cut] - cut] = False  # places at the end that were picked themselves
        live[pick[pick < cut]] = live[cut + np.flatnonzero(tail)]
        self.rows = cut
        out: List[Any] = []
        for b in bufs:
            rb = _as_rows(b)
            out.append(narrowed(np.take(b, slots, axis=0) if rb is None else
                                np.take(rb, slots).view(b.dtype).reshape((k,) + b.shape[1:])))
        for j in self._by_row:
            out[j] = Ragged.from_rows(list(out[j]))
            bufs[j][slots] = None  # the window no longer holds those rows (nor the chunks they are views of)
        if self.rows:
            self._free[self._nfree:self._nfree + k] = slots
            self._nfree += k
        else:
            self._size = self._nfree = 0
        return out

    def held(self, j: int) -> np.ndarray:
        """What buffer ``j`` holds of each row held, in the order of the window's places."""
        if self._buffers is None or not self.rows:
            return np.zeros(0, dtype=np.int64)
        return self._buffers[j][self._live[:self.rows]]

    def repaint(self, values: List[np.ndarray], by_row: Set[int]) -> None:
        """Hold ``values`` (one array per input, in the order of :meth:`held`; for the inputs in
        ``by_row``, whose rows differ in shape, an object array of the rows) in place of buffer 0
        for each row held, the last buffer (the row keys) kept. A window replayed with row indices
        alone (feeder.sources.windowreplay) becomes the window of the rows themselves: its next
        draws are the same."""
        bufs = self._buffers
        if bufs is None or not self.rows:
            self._buffers, self._by_row = None, set()
            return
        live = self._live[:self.rows]
        out: List[np.ndarray] = []
        self._by_row = set(by_row)
        for v in values:
            b = np.empty((len(bufs[0]),) + v.shape[1:], dtype=v.dtype)
            b[live] = v
            out.append(b)
        self._buffers = out + [bufs[-1]]

    def clear(self) -> None:
        self._buffers, self._size, self.rows = None, 0, 0
        self._by_row = set()
        self._live = np.zeros(0, dtype=np.int64)
        self._free = np.zeros(0, dtype=np.int64)
        self._nfree = 0
