"""Everything that knows about ONNX Runtime: signatures, OrtValues, IOBinding, running.

onnxruntime is imported lazily, so the rest of feeder works (with ``session=None``)
where it is not installed.

Facts this module is built on (measured with onnxruntime 1.31 on CPU):

* ``OrtValue.ortvalue_from_numpy`` is zero-copy for a C-contiguous array; the array must
  outlive the OrtValue, so a :class:`PreparedBatch` keeps both.
* ``run_with_iobinding`` releases the GIL and is safe on a shared session, but one
  ``IOBinding`` used from two threads crashes the process: bindings are per thread.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .chunks import InputSpec
from .errors import FeederError

_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int8)": np.int8, "tensor(int16)": np.int16, "tensor(int32)": np.int32, "tensor(int64)": np.int64,
    "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64, "tensor(bool)": np.bool_,
}


def import_onnxruntime():
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


def output_names(session: Any) -> List[str]:
    return [o.name for o in session.get_outputs()]


class PreparedBatch:
    """A batch ready for the runtime: the numpy arrays and, for IOBinding, their OrtValues."""

    __slots__ = ("names", "arrays", "ortvalues", "rows", "nbytes")

    def __init__(self, names: Sequence[str], arrays: Sequence[np.ndarray], rows: int,
                 ortvalues: Optional[List[Any]] = None):
        self.names = names
        self.arrays = arrays
        self.rows = rows
        self.nbytes = sum(a.nbytes for a in arrays)
        self.ortvalues = ortvalues

    def as_dict(self) -> Dict[str, np.ndarray]:
        return dict(zip(self.names, self.arrays))


class Runner:
    """Runs batches through one session for one feed.

    ``prepare`` runs in the enqueuer thread (OrtValues wrap the batch arrays, no copy);
    ``run`` in the consumer thread binds and runs with an IOBinding private to that thread.
    Sessions that are not InferenceSessions (training adapters) implement
    ``run_batch(batch: PreparedBatch, output_names, run_options) -> list`` themselves.
    """

    def __init__(self, session: Any, input_names: Sequence[str]):
        self.session = session
        self.input_names = list(input_names)
        self._custom = callable(getattr(session, "run_batch", None))
        specs = {s.name: s for s in input_specs(session)}
        self._use_binding = (not self._custom and callable(getattr(session, "io_binding", None))
                             and not any(specs[n].is_string for n in self.input_names if n in specs))
        self._ort = import_onnxruntime() if self._use_binding else None
        self._all_outputs = None if self._custom else output_names(session)
        self._local = threading.local()

    def prepare(self, batch: PreparedBatch) -> PreparedBatch:
        if self._use_binding:
            from_numpy = self._ort.OrtValue.ortvalue_from_numpy
            batch.ortvalues = [from_numpy(a if a.flags.c_contiguous else np.ascontiguousarray(a))
                               for a in batch.arrays]
        return batch

    def run(self, batch: PreparedBatch, output_names: Optional[Sequence[str]], run_options: Any) -> List[Any]:
        if self._custom:
            return self.session.run_batch(batch, output_names, run_options)
        names = list(output_names) if output_names is not None else self._all_outputs
        if not self._use_binding:
            return self.session.run(names, batch.as_dict(), run_options)
        binding = getattr(self._local, "binding", None)
        if binding is None:
            binding = self._local.binding = self.session.io_binding()
        ortvalues = batch.ortvalues if batch.ortvalues is not None else self.prepare(batch).ortvalues
        for name, ov in zip(batch.names, ortvalues):
            binding.bind_ortvalue_input(name, ov)
        # Outputs are bound afresh every run: a bound output keeps the shape of its first run, and
        # the next batch of another row count (a short last batch, dont_rebatch, a new batch
        # size, or a model whose output shape depends on the data) would be refused.
        binding.clear_binding_outputs()
        for name in names:
            binding.bind_output(name)
        self.session.run_with_iobinding(binding, run_options)
        outputs = binding.copy_outputs_to_cpu()
        # Drop the input references so that the batch's buffers are only ever held by us.
        binding.clear_binding_inputs()
        return outputs
