"""ArraySource: rows of numpy arrays, in memory or memory-mapped, one array per input."""
from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from .base import ShardedSource

BLOCK_ROWS = 1024  # rows per unit of work: what one fetch returns, and what a shuffle keeps together


class ArraySource(ShardedSource):
    """Feed the rows of numpy arrays (``np.load(path, mmap_mode="r")`` ones too: only the rows
    of each unit are read, by slicing), sharded between every worker and replica.

    ``arrays``: a dict input name -> array, or a list in input order; all of the same length
    along axis 0. Units of work are blocks of ``block_rows`` consecutive rows; ``shuffle``
    permutes the blocks and the rows within each block, differently each epoch, reproducibly
    from ``seed``. ``epochs=None`` repeats forever.
    """

    def __init__(self, arrays: Union[Mapping[str, Any], Sequence[Any]], *, shuffle: bool = False, seed: int = 0,
                 epochs: Optional[int] = 1, block_rows: int = BLOCK_ROWS):
        super().__init__(shuffle=shuffle, seed=seed, epochs=epochs)
        if isinstance(arrays, Mapping):
            self.names: Optional[List[str]] = [str(k) for k in arrays]
            items = list(arrays.values())
        elif isinstance(arrays, (list, tuple)):
            self.names = None
            items = list(arrays)
        else:
            raise TypeError(f"arrays must be a dict of input name -> array or a list of arrays, "
                            f"got {type(arrays).__name__}")
        if not items:
            raise ValueError("arrays must hold at least one array")
        self.arrays: List[np.ndarray] = []
        for i, a in enumerate(items):
            if not isinstance(a, np.ndarray):
                raise TypeError(f"array {self._label(i)} must be a numpy array, got {type(a).__name__}")
            if a.ndim < 1:
                raise ValueError(f"array {self._label(i)} must have a row axis (rank >= 1), got a scalar")
            self.arrays.append(a)
        n = len(self.arrays[0])
        for i, a in enumerate(self.arrays):
            if len(a) != n:
                raise ValueError(f"arrays must have the same number of rows: {self._label(0)} has {n}, "
                                 f"{self._label(i)} has {len(a)}")
        if isinstance(block_rows, bool) or not isinstance(block_rows, (int, np.integer)) or block_rows < 1:
            raise ValueError(f"block_rows must be an int >= 1, got {block_rows!r}")
        self.block_rows = int(block_rows)
        self._init_units([min(self.block_rows, n - s) for s in range(0, n, self.block_rows)])

    def _label(self, i: int) -> str:
        return repr(self.names[i]) if self.names is not None else f"#{i}"

    def feeder_validate(self, input_names: Sequence[str], resume: Optional[Mapping[str, Any]]) -> None:
        if self.names is not None:
            missing = [n for n in input_names if n not in self.names]
            if missing:
                raise ValueError(f"ArraySource has no array for input(s) {missing}; it has {self.names}")
            if len(input_names) != len(self.names):
                extra = [n for n in self.names if n not in input_names]
                raise ValueError(f"ArraySource has arrays {extra} for no input; inputs are {list(input_names)}")
            self.arrays = [self.arrays[self.names.index(n)] for n in input_names]
            self.names = list(input_names)
        elif len(input_names) != len(self.arrays):
            raise ValueError(f"ArraySource has {len(self.arrays)} arrays for {len(input_names)} inputs "
                             f"{list(input_names)}")
        super().feeder_validate(input_names, resume)

    def _definition(self) -> Dict[str, Any]:
        d = super()._definition()
        d["block_rows"] = self.block_rows
        d["arrays"] = [[str(a.dtype), list(a.shape[1:])] for a in self.arrays]
        # a cheap fingerprint of the data: the first and last rows of every array
        h = hashlib.sha1()
        for a in self.arrays:
            for part in (a[:2], a[-2:]):
                h.update(np.ascontiguousarray(part).tobytes() if part.dtype.kind != "O" else repr(part).encode())
        d["sample"] = h.hexdigest()[:16]
        return d

    def _read(self, unit: int, rows: np.ndarray, worker_id: int) -> List[np.ndarray]:
        start = int(self._offsets[unit])
        n = int(self._units[unit])
        if len(rows) == n and (n < 2 or (rows[0] == 0 and bool((np.diff(rows) == 1).all()))):
            # in order: a slice, which for a memory-mapped array reads just these rows, once
            return [np.asarray(a[start:start + n]) for a in self.arrays]
        lo = int(rows.min())
        hi = int(rows.max()) + 1
        # take the block's span once, then gather: one sequential read of a memory-mapped file
        return [np.asarray(a[start + lo:start + hi])[rows - lo] for a in self.arrays]
