"""ParquetSource: columns of Parquet files as inputs, one row group per unit of work.

pyarrow is an optional extra (``pip install 'feeder[parquet]'``); it is imported when a
ParquetSource is created, never by ``import feeder``.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import InputValidationError
from .base import ShardedSource

PathLike = Union[str, "os.PathLike[str]"]


def import_pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        raise ImportError("ParquetSource needs pyarrow: pip install 'feeder[parquet]' (or pip install pyarrow)") \
            from e
    return pyarrow


def _list_files(paths: Union[PathLike, Sequence[PathLike]]) -> List[Tuple[str, str]]:
    """(path, name recorded in a state) of every Parquet file, in a fixed order."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    elif not isinstance(paths, (list, tuple)):
        raise TypeError(f"paths must be a file, a directory or a list of them, got {type(paths).__name__}")
    out: List[Tuple[str, str]] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            found = []
            for root, _, files in os.walk(p):
                found += [os.path.join(root, f) for f in files if f.endswith((".parquet", ".parq"))]
            if not found:
                raise ValueError(f"directory {p!r} holds no .parquet files")
            out += [(f, os.path.relpath(f, p)) for f in sorted(found)]
        elif os.path.isfile(p):
            out.append((p, os.path.basename(p)))
        else:
            raise FileNotFoundError(f"no such Parquet file or directory: {p!r}")
    if not out:
        raise ValueError("paths names no Parquet file")
    return out


class ParquetSource(ShardedSource):
    """Feed columns of Parquet files: ``columns`` maps input name -> column name (None: the
    columns named like the inputs). Only those columns are read; each row group is a unit of
    work (one fetch), sharded between every worker and replica, shuffled per epoch from
    ``seed`` when ``shuffle`` (the order of row groups and the rows within each).

    Conversion to numpy: numeric columns without nulls are not copied (read-only views of
    Arrow's buffers), fixed-size lists (nested too), fixed-shape tensors and lists that all
    have one length become n-d arrays, strings become str arrays. A null in a used column is an
    InputValidationError naming it; a column that is missing is a ValueError at registration
    (at creation when ``columns`` is given).
    """

    def __init__(self, paths: Union[PathLike, Sequence[PathLike]], columns: Optional[Mapping[str, str]] = None, *,
                 shuffle: bool = False, seed: int = 0, epochs: Optional[int] = 1):
        super().__init__(shuffle=shuffle, seed=seed, epochs=epochs)
        pa = import_pyarrow()
        if columns is not None and not isinstance(columns, Mapping):
            raise TypeError(f"columns must be a dict of input name -> column name or None, "
                            f"got {type(columns).__name__}")
        self.columns: Optional[Dict[str, str]] = dict(columns) if columns is not None else None
        self.files = _list_files(paths)
        self._schemas: List[List[str]] = []
        units: List[int] = []
        self._unit_at: List[Tuple[int, int]] = []  # unit -> (file index, row group)
        for i, (path, _) in enumerate(self.files):
            meta = pa.parquet.ParquetFile(path).metadata
            self._schemas.append(list(meta.schema.to_arrow_schema().names))
            for rg in range(meta.num_row_groups):
                n = meta.row_group(rg).num_rows
                if n:
                    units.append(n)
                    self._unit_at.append((i, rg))
        self._file_rows = [0] * len(self.files)
        for (i, _), n in zip(self._unit_at, units):
            self._file_rows[i] += n
        self._init_units(units)
        if self.columns is not None:
            self._check_columns(list(self.columns.values()))
        self._handles: Dict[int, Tuple[int, Any]] = {}  # worker id -> (file index, open ParquetFile)

    def _check_columns(self, wanted: Sequence[str]) -> None:
        for (path, _), names in zip(self.files, self._schemas):
            missing = [c for c in wanted if c not in names]
            if missing:
                raise ValueError(f"ParquetSource: column(s) {missing} not in {path!r} (its columns: {names})")

    def feeder_validate(self, input_names: Sequence[str], resume: Optional[Mapping[str, Any]]) -> None:
        if self.columns is None:
            self._check_columns(input_names)
            self.columns = {n: n for n in input_names}
        else:
            unknown = [n for n in input_names if n not in self.columns]
            extra = [n for n in self.columns if n not in input_names]
            if unknown or extra:
                raise ValueError(f"ParquetSource columns {self.columns} must map exactly the inputs "
                                 f"{list(input_names)}" + (f"; missing {unknown}" if unknown else "")
                                 + (f"; not inputs {extra}" if extra else ""))
            self.columns = {n: self.columns[n] for n in input_names}
        super().feeder_validate(input_names, resume)

    def _definition(self) -> Dict[str, Any]:
        d = super()._definition()
        d["files"] = [[name, rows] for (_, name), rows in zip(self.files, self._file_rows)]
        d["columns"] = self.columns
        d["row_groups"] = hashlib.sha1(np.asarray(self._units).tobytes()).hexdigest()[:16]
        return d

    def feeder_describe(self) -> str:
        return f"{super().feeder_describe()} (row groups) of {len(self.files)} Parquet file(s)"

    def feeder_release(self) -> None:
        super().feeder_release()
        self._handles = {}

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state["_handles"] = {}  # open files stay with their process
        return state

    def _file(self, worker_id: int, index: int) -> Any:
        held = self._handles.get(worker_id)
        if held is not None and held[0] == index:
            return held[1]
        pa = import_pyarrow()
        pf = pa.parquet.ParquetFile(self.files[index][0])
        self._handles[worker_id] = (index, pf)  # one open file per worker: each thread its own
        return pf

    def _read(self, unit: int, rows: np.ndarray, worker_id: int) -> List[np.ndarray]:
        index, rg = self._unit_at[unit]
        assert self.columns is not None  # set at registration
        cols = list(self.columns.values())
        table = self._file(worker_id, index).read_row_group(rg, columns=cols)
        n = int(self._units[unit])
        whole = len(rows) == n and (n < 2 or (rows[0] == 0 and bool((np.diff(rows) == 1).all())))
        out = []
        for name, col in zip(self.columns, cols):
            where = f"column {col!r} (input {name!r}) of {self.files[index][0]!r}, row group {rg}"
            a = to_numpy(table.column(col), where)
            out.append(a if whole else a[rows])
        return out


def to_numpy(column: Any, where: str) -> np.ndarray:
    """A pyarrow (Chunked)Array as a numpy array, without a copy where the type allows."""
    pa = import_pyarrow()
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    return _convert(pa, arr, where)


def _convert(pa: Any, arr: Any, where: str) -> np.ndarray:
    if arr.null_count:  # checked at every level: a list's values may hold nulls of their own
        raise InputValidationError(f"{where} has {arr.null_count} null value(s); feeder inputs cannot hold nulls "
                                   f"(fill or filter them before feeding)")
    t = arr.type
    if isinstance(t, pa.BaseExtensionType):
        if isinstance(t, pa.FixedShapeTensorType):
            return np.asarray(arr.to_numpy_ndarray())
        return _convert(pa, arr.storage, where)
    if pa.types.is_fixed_size_list(t):
        values = _convert(pa, arr.flatten(), where)
        return values.reshape((len(arr), t.list_size) + values.shape[1:])
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        lengths = np.diff(np.asarray(arr.offsets))
        if len(lengths) and (lengths != lengths[0]).any():
            raise InputValidationError(f"{where}: lists of different lengths ({int(lengths.min())} to "
                                       f"{int(lengths.max())}) cannot make an array; store fixed-size lists")
        values = _convert(pa, arr.flatten(), where)
        size = int(lengths[0]) if len(lengths) else 0
        return values.reshape((len(arr), size) + values.shape[1:])
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=str)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=bytes)
    if pa.types.is_boolean(t) or pa.types.is_dictionary(t):
        return np.asarray(arr.to_numpy(zero_copy_only=False))
    try:
        return np.asarray(arr.to_numpy(zero_copy_only=True))
    except (pa.ArrowInvalid, NotImplementedError):
        return np.asarray(arr.to_numpy(zero_copy_only=False))
