"""Everything that knows about ONNX Runtime: signatures, OrtValues, IOBinding, running.

* :mod:`~feeder.runtime.signature`: what a session declares (inputs as ``InputSpec``, outputs,
  intra-op threads), ONNX Runtime's type names, the lazy import of onnxruntime;
* :mod:`~feeder.runtime.batch`: ``PreparedBatch``, a batch as the runtime takes it;
* :mod:`~feeder.runtime.runner`: ``Runner``, one feed's batches through its session (IOBinding,
  output rings, the device path, CUDA graphs);
* :mod:`~feeder.runtime.training`: the training adapters ``StatefulSession`` and ``OrtTrainingModule``;
* :mod:`~feeder.runtime.model`: a model for batch inference: loading it, what identifies it.

``feeder.predict``'s model adapter (``PredictSession``) is batch inference's own:
:mod:`feeder.scoring.session`. The devices (GPUs, the CUDA runtime) are :mod:`feeder.device`'s.

onnxruntime is imported lazily, so the rest of feeder works (with ``session=None``)
where it is not installed.

Facts this package is built on (measured with onnxruntime 1.31 on CPU):

* ``OrtValue.ortvalue_from_numpy`` is zero-copy for a C-contiguous array; the array must
  outlive the OrtValue, so a :class:`PreparedBatch` keeps both.
* ``run_with_iobinding`` releases the GIL and is safe on a shared session, but one
  ``IOBinding`` used from two threads crashes the process: bindings are per thread.
"""
from .batch import PreparedBatch
from .model import load_session, model_signature, session_model_bytes, session_model_path
from .runner import Runner
from .signature import import_onnxruntime, input_specs, intra_op_threads, is_session, output_names
from .training import OrtTrainingModule, StatefulSession

__all__ = [
    "PreparedBatch", "Runner", "StatefulSession", "OrtTrainingModule",
    "import_onnxruntime", "input_specs", "intra_op_threads", "is_session", "output_names",
    "load_session", "model_signature", "session_model_bytes", "session_model_path",
]
