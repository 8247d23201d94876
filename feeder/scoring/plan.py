"""The model opened (:func:`_open_model`) and planned against the source (:class:`_Plan`): which
inputs the source feeds, which model outputs and kept inputs become the output's columns, all
checked before anything is written."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..device import providers_for
from ..runtime import (
    import_onnxruntime,
    is_session,
    load_session,
    session_model_bytes,
    session_model_path,
)
from ..sources.base import ROW_KEY
from .modelid import model_identity
from .session import PredictSession

SOURCE_NAME = "predict"  # the name the source is registered under (and its threads named after)


def _names(what: str, value: Any) -> List[str]:
    """A list of distinct names; a single str is one name (``keep="id"``)."""
    if isinstance(value, str):
        value = [value]
    if not hasattr(value, "__iter__"):
        raise TypeError(f"{what} must be a list of names, got {type(value).__name__}")
    names = list(value)
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"{what} must hold str names, got {n!r}")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{what} names {dupes} more than once")
    return names


def _open_model(model: Any, providers: Any = None) -> Tuple[Any, Dict[str, Any]]:
    """(session, the model's identity: see :func:`~feeder.scoring.modelid.model_identity`; empty
    for a session that keeps neither its bytes nor its file's path)."""
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no such ONNX model file: {path!r}")
        import_onnxruntime()
        providers_for(providers)  # a provider not installed is its own ValueError, not "cannot be loaded"
        try:
            session = load_session(path, providers)
        except Exception as e:  # onnxruntime's own exception types (Fail, InvalidProtobuf...) derive from Exception
            text = " ".join(str(e).split())
            raise ValueError(f"model {path!r} cannot be loaded by onnxruntime (is it an ONNX model, with its external "
                             f"data files beside it?): {text}") from e
        return session, model_identity(path=path)
    if providers is not None:
        raise ValueError("providers= applies to a model given as a path; a session runs where it was made "
                         "(onnxruntime.InferenceSession(..., providers=...))")
    if isinstance(model, bytes) or not is_session(model) or not callable(getattr(model, "get_outputs", None)):
        raise TypeError(f"model must be a path to an ONNX file or an onnxruntime.InferenceSession, "
                        f"got {type(model).__name__}")
    data = session_model_bytes(model)
    if data is not None:
        return model, model_identity(data=data)
    path = session_model_path(model)
    return model, model_identity(path=path) if path is not None and os.path.isfile(path) else {}


@dataclass
class _Plan:
    """Which names go where: the source's inputs (``feed_names``), the model's, the written columns."""

    adapter: PredictSession
    feed_names: List[str]
    outputs: List[str]
    keep: List[str]
    keyed: bool
    ordered: bool = False
    squeeze: bool = False

    @property
    def columns(self) -> List[str]:
        """The output's columns: the kept inputs first (an id reads best on the left), then outputs."""
        return self.keep + self.outputs

    @classmethod
    def make(cls, session: Any, source: Any, outputs: Optional[Sequence[str]], keep: Sequence[str],
             batch_size: int, *, ordered: bool = False, squeeze: bool = False) -> "_Plan":
        model_inputs = [a.name for a in session.get_inputs()]
        model_outputs = {o.name: o for o in session.get_outputs()}
        out_names = list(model_outputs) if outputs is None else _names("outputs", outputs)
        if not out_names:
            raise ValueError("outputs names no model output: nothing to write")
        unknown = [n for n in out_names if n not in model_outputs]
        if unknown:
            raise ValueError(f"outputs {unknown} are not outputs of the model (its outputs: {list(model_outputs)})")
        for n in out_names:
            o = model_outputs[n]
            kind = getattr(o, "type", None) or ""
            if kind.startswith("seq(map("):
                # skl2onnx's classifiers end with ZipMap: one {label: probability} map per row.
                others = [m for m in model_outputs if m != n and (model_outputs[m].type or "").startswith("tensor(")]
                raise ValueError(f"model output {n!r} is a {kind}: a sequence of maps, one per row (skl2onnx's "
                                 f"ZipMap), which feeder.predict does not write. Convert the model with zipmap=False "
                                 f"(skl2onnx: to_onnx(model, X, options={{'zipmap': False}})) to get the probabilities "
                                 f"as one [N, classes] tensor, or leave this output out with outputs="
                                 f"{others or '[...]'}")
            if not kind.startswith("tensor("):
                raise ValueError(f"model output {n!r} is a {kind}, not a tensor: feeder.predict writes tensors "
                                 f"(choose them with outputs=)")
            shape = getattr(o, "shape", None)
            if shape is not None and len(shape) == 0:
                raise ValueError(f"model output {n!r} is a scalar per run, not one value per row "
                                 f"(choose per-row outputs with outputs=)")
        kept = _names("keep", keep)
        clash = [n for n in kept if n in out_names]
        if clash:
            raise ValueError(f"keep {clash} has the name of a written model output: each column needs its own name")
        if ROW_KEY in model_inputs + kept:
            raise ValueError(f"{ROW_KEY!r} is reserved for feeder's row keys")
        feed_names = model_inputs + [k for k in kept if k not in model_inputs]
        _check_source_inputs(source, model_inputs, kept, feed_names)
        adapter = PredictSession(session, feed_names, model_inputs, out_names, kept, ordered=ordered)
        if adapter.fixed_batch is not None and batch_size != adapter.fixed_batch:
            raise ValueError(f"the model's batch dimension is fixed at {adapter.fixed_batch} rows; pass "
                             f"batch_size={adapter.fixed_batch} (a short last batch is padded, never dropped)")
        for n in out_names:
            # Where the signature decides: a first dimension fixed at a size that cannot be the
            # batch's. Otherwise the first batch decides (PredictSession checks it at two row counts).
            shape = getattr(model_outputs[n], "shape", None)
            first = shape[0] if shape else None
            if isinstance(first, int) and first != adapter.fixed_batch:
                batch = ("the batch dimension is free" if adapter.fixed_batch is None
                         else f"the batch is {adapter.fixed_batch} rows")
                raise ValueError(f"model output {n!r} has shape {list(shape or ())}: its first dimension is fixed at "
                                 f"{first} ({batch}), so it is not one value per row (a reduction over the batch?); "
                                 f"feeder.predict writes per-row outputs (choose them with outputs=)")
        return cls(adapter, feed_names, out_names, kept, bool(getattr(source, "feeder_row_keys", False)),
                   ordered=ordered, squeeze=squeeze)


def _check_source_inputs(source: Any, model_inputs: List[str], kept: List[str], feed_names: List[str]) -> None:
    """ValueError naming a model input or kept input the source lacks, where the source can tell
    (a plain fetch function is checked at its first chunk, before the model runs)."""
    from ..sources.arrays import ArraySource
    from ..sources.parquet import ParquetSource
    from ..sources.transform import TransformedSource

    names: Optional[List[str]] = None
    if isinstance(source, ArraySource) and source.names is not None:
        names = list(source.names)
    elif isinstance(source, ParquetSource) and source.columns is not None:
        names = list(source.columns)
    elif isinstance(source, TransformedSource):
        # Without a map, the columns it reads (every column of a ParquetSource with columns=None:
        # those not fed are left out); with one, what the map returns, checked at the first chunk.
        known = source.feeder_input_names()
        missing = [n for n in model_inputs if known is not None and n not in known]
        if missing:
            raise ValueError(f"model input(s) {missing} are not inputs of the {type(source.wrapped).__name__} "
                             f"(it has {known}); a filter passes its columns on as they are")
        missing = [n for n in kept if known is not None and n not in known]
        if missing:
            raise ValueError(f"keep names {missing}, which are not inputs of the {type(source.wrapped).__name__} "
                             f"(it has {known})")
    if names is not None:
        missing = [n for n in model_inputs if n not in names]
        if missing:
            raise ValueError(f"model input(s) {missing} are not inputs of the {type(source).__name__} "
                             f"(it has {names})")
        missing = [n for n in kept if n not in names]
        if missing:
            raise ValueError(f"keep names {missing}, which are not inputs of the {type(source).__name__} "
                             f"(it has {names})")
        extra = [n for n in names if n not in feed_names]
        if extra:
            raise ValueError(f"the {type(source).__name__} has inputs {extra} that are neither model inputs nor "
                             f"kept: keep them (keep={kept + extra}) or leave them out of the source")
    validate = getattr(source, "feeder_validate", None)
    if validate is not None:
        # The source's own check (a ParquetSource reads its files' schemas): a ValueError naming
        # the missing column. Registration repeats it; it is idempotent.
        validate(tuple(feed_names), None)


def _wrapped(source: Any) -> Any:
    """The source a ``map``/``filter`` wraps (see ``feeder.sources.transform``), else ``source``."""
    from ..sources.transform import TransformedSource

    return source.wrapped if isinstance(source, TransformedSource) else source
