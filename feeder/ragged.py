"""Rows of one input that differ in shape (token ids, audio frames, point clouds): :class:`Ragged`.

A padded input (``pad=`` in :func:`feeder.init_data_input_workers`) may come from ``fetch_fun``
in any of these forms, one per chunk:

* a list (or tuple) of numpy arrays, one per row, all of the same rank (``[ids0, ids1, ...]``);
* a 1-d numpy object array of such arrays (what pandas and Ray Data hand over);
* a :class:`Ragged`: the values of all rows in one array and the offsets where each row starts
  (what Arrow and Parquet list columns are, and how chunks cross from worker processes);
* an ordinary numpy array, whose rows then all have the same shape (other chunks may differ).

Internally every form but the list of rows keeps its values in ONE flat array, rows being
``(start, shape)`` pairs into it: a slice, a shuffle or a reordering of rows moves these small
integers, never the values, which are copied once, into the padded batch
(``feeder.padding``).
"""
from __future__ import annotations

import math
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np


class Ragged:
    """Rows that differ in shape along their first axis, as one values array and offsets.

    Row ``i`` is ``values[offsets[i]:offsets[i + 1]]``: with 1-d ``values`` the rows are 1-d
    (token ids); with ``values`` of shape ``(N, 80)`` they are ``(length, 80)`` (frames of 80
    features). Nothing is copied: the rows are views of ``values``. ``len()`` is the row count,
    iteration yields the rows, indexing with a slice or an integer array gives another Ragged
    of those rows (still without copying values).

    Args:
        values: The rows' values, concatenated along axis 0 (C-contiguous, numeric).
        offsets: ``rows + 1`` non-decreasing integers into ``values``'s first axis (the
            ``offsets`` of an Arrow list array); the first need not be 0.

    Raises:
        TypeError: ``values`` or ``offsets`` is not a numpy array (or array-like) of numbers.
        ValueError: Offsets that are not 1-d, decrease, or point outside ``values``.
    """

    __slots__ = ("values", "starts", "shapes", "_rows", "dtype", "_nbytes")

    def __init__(self, values: Any, offsets: Any):
        values = np.asarray(values)
        offsets = np.asarray(offsets)
        if values.dtype.hasobject or values.ndim < 1:
            raise TypeError(f"Ragged values must be a numeric array of rank >= 1, got {_what(values)}")
        if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) < 1:
            raise ValueError(f"Ragged offsets must be a 1-d integer array of rows + 1 entries, got {_what(offsets)}")
        offsets = offsets.astype(np.int64, copy=False)
        if len(offsets) > 1 and (np.diff(offsets).min() < 0 or offsets[0] < 0 or offsets[-1] > len(values)):
            raise ValueError(f"Ragged offsets must be non-decreasing and within the {len(values)} values, "
                             f"got {int(offsets.min())}..{int(offsets.max())}")
        unit = math.prod(values.shape[1:])
        trailing = values.shape[1:]
        flat = np.ascontiguousarray(values).reshape(-1)
        n = len(offsets) - 1
        shapes = np.empty((n, 1 + len(trailing)), np.int64)
        shapes[:, 0] = np.diff(offsets)
        if trailing:
            shapes[:, 1:] = trailing
        self._set(flat, offsets[:-1] * unit, shapes, None)

    @classmethod
    def from_rows(cls, rows: Sequence[Any]) -> "Ragged":
        """Rows given one by one (numpy arrays, or what ``np.asarray`` makes one of), kept as
        they are: each is copied once, into the padded batch.

        Args:
            rows: The rows, all of the same rank and dtype.

        Returns:
            A Ragged holding those rows (not copied).

        Raises:
            ValueError: Rows of different ranks or dtypes, or of object dtype.
        """
        arrays = [r if type(r) is np.ndarray else np.asarray(r) for r in rows]
        if arrays:
            first = arrays[0]
            for i, r in enumerate(arrays):
                if r.ndim != first.ndim or r.dtype != first.dtype:
                    raise ValueError(f"row {i} has dtype {r.dtype} and rank {r.ndim}, row 0 dtype {first.dtype} and "
                                     f"rank {first.ndim}: the rows of an input must share dtype and rank")
            if first.dtype.hasobject or first.ndim < 1:
                raise ValueError(f"rows must be numeric arrays of rank >= 1, got {_what(first)}")
            shapes = np.array([r.shape for r in arrays], np.int64).reshape(len(arrays), first.ndim)
            dtype = first.dtype
        else:
            shapes, dtype = np.zeros((0, 1), np.int64), np.dtype(np.float64)
        out = cls.__new__(cls)
        out._set(None, None, shapes, arrays, dtype)
        return out

    @classmethod
    def _make(cls, flat: np.ndarray, starts: np.ndarray, shapes: np.ndarray) -> "Ragged":
        """From a flat values array, row starts (elements) and row shapes (rows, rank): no checks."""
        out = cls.__new__(cls)
        out._set(flat, starts, shapes, None)
        return out

    def _set(self, flat: Optional[np.ndarray], starts: Optional[np.ndarray], shapes: np.ndarray,
             rows: Optional[List[np.ndarray]], dtype: Optional[np.dtype] = None) -> None:
        self.values = flat        # 1-d, or None when the rows are kept one by one
        self.starts = starts      # (rows,) int64 element offsets into values, or None
        self.shapes = shapes      # (rows, row rank) int64
        self._rows = rows
        self.dtype: np.dtype = flat.dtype if flat is not None else dtype  # type: ignore[assignment]
        self._nbytes = -1

    # ---- what the rest of feeder reads --------------------------------------------------
    def __len__(self) -> int:
        return int(self.shapes.shape[0])

    @property
    def row_ndim(self) -> int:
        """The rank of each row."""
        return int(self.shapes.shape[1])

    @property
    def ndim(self) -> int:
        """The rank of the padded batch these rows make (rows + the rows' own axes)."""
        return 1 + self.row_ndim

    @property
    def shape(self) -> Tuple[Optional[int], ...]:
        """``(rows, None, ...)``: the row count, and None for each axis of the rows."""
        return (len(self),) + (None,) * self.row_ndim

    def sizes(self) -> np.ndarray:
        """Elements per row, as an int64 array."""
        if self.row_ndim == 1:
            return self.shapes[:, 0]
        out: np.ndarray = self.shapes.prod(axis=1) if self.row_ndim else np.ones(len(self), np.int64)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the rows' values (gaps between rows not counted)."""
        if self._nbytes < 0:
            if self._rows is not None:
                self._nbytes = sum(r.nbytes for r in self._rows)
            else:
                self._nbytes = int(self.sizes().sum()) * self.dtype.itemsize
        return self._nbytes

    @property
    def rows_list(self) -> Optional[List[np.ndarray]]:
        """The rows one by one when they were given so (``from_rows``), else None."""
        return self._rows

    def row(self, i: int) -> np.ndarray:
        """One row as a numpy array (a view of the values).

        Args:
            i: The row's number, from 0.

        Returns:
            The row, of shape ``shapes[i]``.
        """
        if self._rows is not None:
            return self._rows[i]
        assert self.values is not None and self.starts is not None
        shape = tuple(int(d) for d in self.shapes[i])
        start = int(self.starts[i])
        return self.values[start:start + math.prod(shape)].reshape(shape)

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self.row(i)

    def __getitem__(self, key: Union[slice, np.ndarray, Sequence[int]]) -> "Ragged":
        if isinstance(key, (int, np.integer)):
            raise TypeError("index a Ragged with a slice or an array of row numbers; Ragged.row(i) gives one row")
        out = Ragged.__new__(Ragged)
        if self._rows is not None:
            idx = range(len(self))[key] if isinstance(key, slice) else np.asarray(key).tolist()
            out._set(None, None, self.shapes[key], [self._rows[i] for i in idx], self.dtype)
        else:
            assert self.starts is not None
            out._set(self.values, self.starts[key], self.shapes[key], None)
        return out

    def astype(self, dtype: Any) -> "Ragged":
        """The same rows converted to another dtype (a copy of the values).

        Args:
            dtype: The numpy dtype to convert to.

        Returns:
            A Ragged of the converted rows.
        """
        dtype = np.dtype(dtype)
        if self._rows is not None:
            out = Ragged.from_rows([r.astype(dtype) for r in self._rows])
            if not self._rows:
                out.dtype = dtype
            return out
        assert self.values is not None and self.starts is not None
        return Ragged._make(self.values.astype(dtype), self.starts, self.shapes)

    @property
    def base(self) -> Any:
        """What the values are a view of (None when they own their memory, or come row by row)."""
        return self.values.base if self.values is not None else None

    def copy(self) -> "Ragged":
        """The same rows with values, starts and shapes of their own."""
        if self._rows is not None:
            return Ragged.from_rows([r.copy() for r in self._rows])
        assert self.values is not None and self.starts is not None
        return Ragged._make(self.values.copy(), self.starts.copy(), self.shapes.copy())

    def value_range(self) -> Tuple[Any, Any]:
        """(smallest, largest) value of the rows (for range checks before a cast); rows not empty."""
        if self._rows is not None:
            parts = [r for r in self._rows if r.size]
            return min(r.min() for r in parts), max(r.max() for r in parts)
        assert self.values is not None
        return self.values.min(), self.values.max()

    def is_contiguous(self) -> bool:
        """Whether the rows lie one after the other in ``values`` (their values one slice of it)."""
        if self._rows is not None or len(self) < 2:
            return self._rows is None
        assert self.starts is not None
        return bool((self.starts[1:] == self.starts[:-1] + self.sizes()[:-1]).all())

    def __repr__(self) -> str:
        return f"Ragged({len(self)} rows of rank {self.row_ndim}, dtype {self.dtype})"


def dense_as_ragged(a: np.ndarray) -> Ragged:
    """An ordinary array's rows (axis 0) as a Ragged whose rows all have the same shape (a view
    when ``a`` is C-contiguous)."""
    n = a.shape[0]
    size = math.prod(a.shape[1:])
    shapes = np.empty((n, a.ndim - 1), np.int64)
    shapes[:] = a.shape[1:]
    return Ragged._make(np.ascontiguousarray(a).reshape(-1), np.arange(n, dtype=np.int64) * size, shapes)


def concat_shapes(pieces: Sequence[Union[Ragged, np.ndarray]]) -> np.ndarray:
    """The row shapes of several pieces of one input, one after the other, as (rows, rank) int64."""
    parts = []
    for p in pieces:
        if isinstance(p, Ragged):
            parts.append(p.shapes)
        else:
            s = np.empty((p.shape[0], p.ndim - 1), np.int64)
            s[:] = p.shape[1:]
            parts.append(s)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _what(a: np.ndarray) -> str:
    return f"an array of dtype {a.dtype} and shape {a.shape}"
