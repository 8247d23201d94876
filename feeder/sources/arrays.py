"""ArraySource: rows of numpy arrays, in memory or memory-mapped, one array per input."""
from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import InputValidationError
from .mapped import FileRegion, file_region
from .sharded import ShardedSource

BLOCK_ROWS = 1024  # rows per unit of work: what one fetch returns, and what a shuffle keeps together


FULL_HASH_BYTES = 64 << 20  # data up to this size is hashed whole for a state's definition
SAMPLE_ROWS = 1024          # beyond it, this many rows spread evenly


class ArraySource(ShardedSource):
    """Feed the rows of numpy arrays (``np.load(path, mmap_mode="r")`` ones too: only the rows
    of each unit are read, by slicing), sharded between every worker and replica.

    Units of work are blocks of ``block_rows`` consecutive rows, one per fetch. Unshuffled, a
    block is a read-only view of ``arrays`` (no copy): a batch inside one block is handed on as
    that view, so writing into it is numpy's read-only error rather than a change to your data.

    Args:
        arrays: ``{input name: array}``, or a list of arrays in input order; all of the same
            length along axis 0. Numpy arrays, memory-mapped ones included (with worker
            processes they travel as their file and offsets).
        shuffle: Permute the blocks and the rows within each block, differently each epoch,
            reproducibly from ``seed``.
        seed: The shuffle's seed (an int >= 0).
        epochs: Passes over the rows (>= 1); None repeats forever.
        block_rows: Rows per unit of work (one fetch).
        shard: ``(rank, world_size)``, or ``"env"`` for the ``RANK`` and ``WORLD_SIZE``
            environment variables: this rank reads its own part of every epoch, disjoint from
            the other ranks' (which need not talk to it). None: every row.
        equal_steps: Every rank the same number of rows per epoch: the epoch's last
            ``rows % world_size`` rows (fewer than the world size) are left out of it.
        shuffle_window: Rows (in all, split between the source's workers) held from several
            units, so that each chunk mixes them; None: a chunk is one unit. See the guide,
            "Many hosts without Ray".

    Raises:
        TypeError: ``arrays`` is not a dict (of str names) or a list of arrays; a bad argument type.
        InputValidationError: A masked array with masked values (nulls).
        ValueError: Arrays of different lengths, or a bad argument value (a negative
            ``seed``, a rank outside the world, fewer rows than ranks).
    """

    def __init__(self, arrays: Union[Mapping[str, Any], Sequence[Any]], *, shuffle: bool = False, seed: int = 0,
                 epochs: Optional[int] = 1, block_rows: int = BLOCK_ROWS, shard: Any = None,
                 equal_steps: bool = False, shuffle_window: Optional[int] = None):
        super().__init__(shuffle=shuffle, seed=seed, epochs=epochs, shard=shard, equal_steps=equal_steps,
                         shuffle_window=shuffle_window)
        if isinstance(arrays, Mapping):
            bad = [k for k in arrays if not isinstance(k, str)]
            if bad:  # (1 would have become the input "1")
                raise TypeError(f"arrays must be a dict of input name (str) -> array; {bad[0]!r} is a "
                                f"{type(bad[0]).__name__}")
            self.names: Optional[List[str]] = [str(k) for k in arrays]  # (np.str_ too)
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
            if isinstance(a, np.ma.MaskedArray):
                # A masked value is numpy's null: refused as a null in any source's column is; an
                # array with nothing masked feeds its values.
                mask = np.ma.getmask(a)  # (nomask when nothing is masked: no array of flags is made)
                masked = int(mask.sum()) if mask is not np.ma.nomask else 0
                if masked:
                    first = int(np.argwhere(mask)[0][0])
                    raise InputValidationError(f"ArraySource: array {self._label(i)} is a masked array with {masked} "
                                               f"masked value(s) (nulls), the first in row {first}: fill them "
                                               f"(a.filled(value)) or leave those rows out")
                a = np.asarray(a.data)
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

    def _check_transformable(self) -> None:
        if self.names is None:
            raise TypeError("ArraySource: map and filter see the arrays by name; give them as a dict "
                            "(name -> array), not a list")

    def _transform_columns(self) -> List[str]:
        assert self.names is not None  # _check_transformable
        return list(self.names)

    def _offered_columns(self) -> Optional[Tuple[List[str], bool]]:
        # every array feeds an input (feeder_validate refuses one that does not)
        return (list(self.names), True) if self.names is not None else None

    def _label(self, i: int) -> str:
        return repr(self.names[i]) if self.names is not None else f"#{i}"

    def feeder_validate(self, input_names: Sequence[str], resume: Optional[Mapping[str, Any]]) -> None:
        """At registration: ValueError when the arrays do not match the inputs one to one (by name
        when given as a dict, by count as a list), or for a ``resume`` state of other arrays.

        Args:
            input_names: The registration's inputs.
            resume: Its ``resume_from`` state, or None.
        """
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
        d["names"] = list(self.names) if self.names is not None else None
        d["sample"] = self._fingerprint()
        return d

    def _fingerprint(self) -> str:
        """A hash of the data, computed once: all of it up to FULL_HASH_BYTES (in-memory arrays,
        so a state from other data is refused even when one value in the middle differs), else
        SAMPLE_ROWS rows spread evenly plus the first and last (a big memory-mapped file is
        not read whole to checkpoint it)."""
        cached = getattr(self, "_fingerprint_cache", None)
        if cached is not None:
            return str(cached)
        h = hashlib.sha1()
        total = sum(a.nbytes for a in self.arrays)
        for a in self.arrays:
            n = len(a)
            if total <= FULL_HASH_BYTES or n <= SAMPLE_ROWS:
                parts = [a]
            else:
                idx = np.unique(np.concatenate([np.linspace(0, n - 1, SAMPLE_ROWS).astype(np.int64), [0, n - 1]]))
                parts = [a[idx]]
            for part in parts:
                data = repr(part.tolist()).encode() if part.dtype.kind == "O" else np.ascontiguousarray(part).tobytes()
                h.update(data)
        self._fingerprint_cache = h.hexdigest()[:16]
        return self._fingerprint_cache

    def __getstate__(self) -> Dict[str, Any]:
        """Memory-mapped arrays are pickled as their file and offsets, not their contents (see
        ``feeder.sources.mapped``): a worker process maps the file again."""
        state = super().__getstate__()
        state["arrays"] = [file_region(a) or a for a in self.arrays]
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state["arrays"] = [a.open() if isinstance(a, FileRegion) else a for a in state["arrays"]]
        super().__setstate__(state)

    gathers_rows = True  # a shuffle window keeps row indices, not rows (ShardedSource._from_window)

    def _gather(self, rows: np.ndarray) -> List[np.ndarray]:
        """The arrays of the table's rows ``rows`` (indices in the whole table, in that order):
        one gather per input (a memory-mapped one reads just those rows). ``np.take`` along axis 0
        rather than ``a[rows]``: the same copy, 2-3x faster for rows of many values."""
        return [np.take(a, rows, axis=0) for a in self.arrays]

    def _read(self, unit: int, rows: np.ndarray, worker_id: int) -> List[np.ndarray]:
        start = int(self._offsets[unit])
        n = int(self._units[unit])
        if len(rows) == n and (n < 2 or (rows[0] == 0 and bool((np.diff(rows) == 1).all()))):
            # in order: a slice, which for a memory-mapped array reads just these rows, once. It is
            # a view of the user's own array, which later epochs read again: read-only, so that
            # nothing downstream writes into it (a batch inside one block is handed on as this view).
            return [_read_only(np.asarray(a[start:start + n])) for a in self.arrays]
        lo = int(rows.min())
        hi = int(rows.max()) + 1
        # take the block's span once, then gather: one sequential read of a memory-mapped file
        return [np.take(np.asarray(a[start + lo:start + hi]), rows - lo, axis=0) for a in self.arrays]


def _read_only(view: np.ndarray) -> np.ndarray:
    """``view`` made read-only (the array it views keeps its own flag)."""
    view.flags.writeable = False
    return view
