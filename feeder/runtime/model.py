"""A model for batch inference (``feeder.predict``): its session loaded with one intra-op thread,
its signature, and the bytes or file it was made from (what identifies it)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ..device import default_providers, providers_for
from .signature import import_onnxruntime


def load_session(path: str, providers: Any = None) -> Any:
    """An InferenceSession with one intra-op thread: ``feeder.predict`` scales with replicas (one
    consumer thread each), not with ONNX Runtime's spinning thread pool. ``providers``: as
    :func:`feeder.device.providers_for` takes them (None: the CUDA provider where installed, else
    the CPU; see :func:`feeder.device.default_providers`)."""
    ort = import_onnxruntime()
    chosen = providers_for(providers)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(path, opts, providers=chosen if chosen is not None else default_providers())


def model_signature(session: Any) -> Dict[str, Any]:
    """Element type and shape of each of a session's inputs and outputs, by name (JSON-able)."""
    def args(items: Sequence[Any]) -> Dict[str, List[Any]]:
        return {a.name: [getattr(a, "type", None),
                         None if getattr(a, "shape", None) is None else [d if isinstance(d, (int, str)) else None
                                                                          for d in a.shape]] for a in items}
    return {"inputs": args(session.get_inputs()), "outputs": args(session.get_outputs())}


def session_model_bytes(session: Any) -> Optional[bytes]:
    """The serialized model of an InferenceSession made from bytes, when it kept them."""
    data = getattr(session, "_model_bytes", None)
    return data if isinstance(data, bytes) else None


def session_model_path(session: Any) -> Optional[str]:
    """The file an InferenceSession was made from, when it says."""
    path = getattr(session, "_model_path", None)
    return path if isinstance(path, str) and path else None
