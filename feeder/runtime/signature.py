"""What a session declares, in ONNX Runtime's terms: its inputs (as feeder's ``InputSpec``), its
outputs, its intra-op threads; ONNX Runtime's element type names; NodeArg-like descriptions for
the adapters that declare their own signature.

onnxruntime is imported lazily (:func:`import_onnxruntime`), so the rest of feeder works (with
``session=None``) where it is not installed.
"""
from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from ..errors import FeederError
from ..validation import InputSpec

_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int8)": np.int8, "tensor(int16)": np.int16, "tensor(int32)": np.int32, "tensor(int64)": np.int64,
    "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64, "tensor(bool)": np.bool_,
}


def import_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as e:  # pragma: no cover - exercised only where onnxruntime is absent
        raise FeederError("onnxruntime is not installed; pip install onnxruntime") from e
    return onnxruntime


def is_session(obj: Any) -> bool:
    """Anything with an ONNX Runtime style input signature can be fed."""
    return callable(getattr(obj, "get_inputs", None))


def input_specs(session: Any) -> List[InputSpec]:
    """The session's (data) inputs as InputSpecs, in the session's order."""
    specs = []
    for arg in session.get_inputs():
        type_str = getattr(arg, "type", None) or ""
        shape = getattr(arg, "shape", None)
        dims = None
        if shape is not None:
            dims = tuple(d if isinstance(d, int) and d >= 0 else None for d in shape)
        is_string = type_str == "tensor(string)"
        dtype = None if is_string else _ORT_TYPES.get(type_str)
        specs.append(InputSpec(arg.name, np.dtype(dtype) if dtype is not None else None, dims, is_string))
    return specs


def intra_op_threads(session: Any) -> Optional[int]:
    """The session's intra-op thread setting (0: ONNX Runtime's default, all cores), or None
    when it cannot be told (a training adapter, or an older onnxruntime)."""
    inner = getattr(session, "session", session)  # StatefulSession wraps an InferenceSession
    try:
        return int(inner.get_session_options().intra_op_num_threads)
    except Exception:  # not an InferenceSession: nothing to advise about
        return None


def output_names(session: Any) -> List[str]:
    return [o.name for o in session.get_outputs()]


class _Arg:
    """An input or output description shaped like onnxruntime's NodeArg (name, type, shape)."""

    __slots__ = ("name", "type", "shape")

    def __init__(self, name: str, type: Optional[str] = None, shape: Optional[List[Any]] = None):
        self.name, self.type, self.shape = name, type, shape

    def __repr__(self) -> str:
        return f"_Arg({self.name!r}, {self.type!r}, {self.shape!r})"

