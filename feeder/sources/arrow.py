"""Arrow columns as numpy arrays: the one converter of ParquetSource and RayDataSource.

pyarrow is an optional extra; it is imported when a source that needs it is created (or a
conversion runs), never by ``import feeder``. Supported from pyarrow 14 (the declared minimum,
tested in CI): types that came later (string views, from 16) are recognised only where
pyarrow has them.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InputValidationError
from ..ragged import Ragged


def import_pyarrow(what: str = "ParquetSource") -> Any:
    """pyarrow with its parquet module, or ImportError saying what to install for ``what``."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{what} needs pyarrow: pip install 'onnx-feeder[parquet]' (or pip install pyarrow)") from e
    return pyarrow


def to_numpy(column: Any, where: str) -> Any:
    """A pyarrow (Chunked)Array as a numpy array (or a Ragged), without a copy where the type allows.

    A null anywhere in it (a list's values included) is an InputValidationError naming
    ``where``. Lists of different lengths make a :class:`~feeder.Ragged` (the list's values and
    offsets, not copied), which only a padded input takes (``pad=``); lists whose values are
    themselves lists of different lengths are an InputValidationError.
    """
    import pyarrow as pa
    if isinstance(column, pa.ChunkedArray):
        # one chunk (a row group, a Ray block) is taken as it is: combining would copy it
        arr = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    else:
        arr = column
    return _convert(pa, arr, where)


def _is(pa: Any, name: str, t: Any) -> bool:
    """``pa.types.<name>(t)``, False where this pyarrow does not know that type yet."""
    test = getattr(pa.types, name, None)
    return bool(test(t)) if test is not None else False


def _nested(values: Any, where: str) -> np.ndarray:
    """The values of lists that all have one length, as an array: lists inside them that differ in
    length (``list<list<int64>>``) are bad data for every input, an InputValidationError naming
    ``where`` (never a fetch error that ``max_fetch_errors`` could skip)."""
    if isinstance(values, Ragged):
        raise InputValidationError(f"{where}: lists whose values are lists of different lengths: only numeric lists "
                                   f"of one level may differ in length (a padded input); a list of lists must have "
                                   f"one length at every level but the first")
    out: np.ndarray = values
    return out


def _convert(pa: Any, arr: Any, where: str) -> Any:
    if arr.null_count:  # checked at every level: a list's values may hold nulls of their own
        raise InputValidationError(f"{where} has {arr.null_count} null value(s); feeder inputs cannot hold nulls "
                                   f"(fill or filter them before feeding)")
    t = arr.type
    if isinstance(t, pa.BaseExtensionType):
        if isinstance(t, pa.FixedShapeTensorType):
            return np.asarray(arr.to_numpy_ndarray())
        if type(arr).to_numpy is not pa.ExtensionArray.to_numpy:
            # An extension array that knows its numpy form (Ray Data's tensor columns give their
            # n-d arrays, which their storage, flat lists, would not).
            return np.asarray(arr.to_numpy(zero_copy_only=False))
        return _convert(pa, arr.storage, where)
    if pa.types.is_fixed_size_list(t):
        values = _nested(_convert(pa, arr.flatten(), where), where)
        return values.reshape((len(arr), t.list_size) + values.shape[1:])
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        offsets = np.asarray(arr.offsets)
        lengths = np.diff(offsets)
        if len(lengths) and (lengths != lengths[0]).any():
            # Rows of different lengths: the values and the offsets as they are (no loop over rows,
            # no copy); offsets count from the first row's first value, which flatten() starts at.
            values = _convert(pa, arr.flatten(), where)
            if isinstance(values, Ragged) or values.dtype.kind not in "biufc":
                what = "lists of different lengths" if isinstance(values, Ragged) else f"of dtype {values.dtype}"
                raise InputValidationError(f"{where}: lists of different lengths whose values are {what}: only "
                                           f"numeric lists of one level may differ in length (a padded input)")
            return Ragged(values, offsets - offsets[0])
        values = _nested(_convert(pa, arr.flatten(), where), where)
        size = int(lengths[0]) if len(lengths) else 0
        return values.reshape((len(arr), size) + values.shape[1:])
    if pa.types.is_string(t) or pa.types.is_large_string(t) or _is(pa, "is_string_view", t):
        return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=str)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or _is(pa, "is_binary_view", t):
        return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=bytes)
    if pa.types.is_boolean(t) or pa.types.is_dictionary(t):
        return np.asarray(arr.to_numpy(zero_copy_only=False))
    try:
        return np.asarray(arr.to_numpy(zero_copy_only=True))
    except (pa.ArrowInvalid, NotImplementedError):
        return np.asarray(arr.to_numpy(zero_copy_only=False))
