"""The shuffle window: rows of several units held together, so that each chunk mixes them.

Units are shuffled and so are the rows within a unit, but a chunk is one unit: with row groups of
10k-100k rows, every batch would come from one row group, which for data sorted by time or by
label is close to no shuffling at all. A worker with a window of N rows reads units until it holds
N rows, then hands out a random draw of rows from everything it holds (as many as the unit it just
read), and reads on; at the end of its units it hands out what it holds. Rows keep their row keys,
so a checkpoint stays exact: what was handed out and delivered is in the state, what the window
still held is not and comes again after a resume.

Pure logic (numpy, no threads): one :class:`ShuffleWindow` per worker, used by that worker alone.
"""
from __future__ import annotations

from typing import List

import numpy as np


class ShuffleWindow:
    """Up to ``capacity`` rows (plus the last unit read) of any number of pieces, drawn from at
    random. A piece is a list of arrays (the inputs and the row keys), all of one row count."""

    def __init__(self, capacity: int, rng: np.random.Generator):
        self.capacity = int(capacity)
        self.rows = 0
        self.ended = False  # the worker's units are all read: hand out what is held, then stop
        self._rng = rng
        self._pieces: List[List[np.ndarray]] = []
        self._left: List[np.ndarray] = []  # per piece: the row positions not handed out yet

    def wants_more(self) -> bool:
        return not self.ended and self.rows < self.capacity

    def add(self, arrays: List[np.ndarray]) -> None:
        n = len(arrays[0])
        if n:
            self._pieces.append(arrays)
            self._left.append(np.arange(n, dtype=np.int64))
            self.rows += n

    def take(self, k: int) -> List[np.ndarray]:
        """``k`` rows (fewer if fewer are held) drawn at random, in random order, as new arrays
        (one copy of each row); they leave the window."""
        k = min(int(k), self.rows)
        counts = np.array([len(left) for left in self._left], dtype=np.int64)
        ends = np.cumsum(counts)
        pick = self._rng.choice(self.rows, size=k, replace=False)  # in random order: the chunk's order
        which = np.searchsorted(ends, pick, side="right")
        first = self._pieces[0]
        out = []
        for j, a in enumerate(first):
            dtype = np.result_type(*[p[j] for p in self._pieces]) if len(self._pieces) > 1 else a.dtype
            out.append(np.empty((k,) + a.shape[1:], dtype=dtype))
        keep_pieces, keep_left = [], []
        for i, (piece, left) in enumerate(zip(self._pieces, self._left)):
            dest = np.flatnonzero(which == i)
            if len(dest):
                local = pick[dest] - (ends[i] - counts[i])
                rows = left[local]
                for j, a in enumerate(piece):
                    out[j][dest] = a[rows]
                left = np.delete(left, local)
            if len(left):
                keep_pieces.append(piece)
                keep_left.append(left)
        self._pieces, self._left = keep_pieces, keep_left
        self.rows -= k
        return out

    def clear(self) -> None:
        self._pieces, self._left, self.rows = [], [], 0
