"""``feeder.predict``: run an ONNX model over a source into a Parquet dataset, exactly once across crashes.

Usage::

    from feeder.sources import ParquetSource

    result = feeder.predict("model.onnx", ParquetSource("data/"), "scores/", keep=["id"])
    result.rows, result.rows_computed, result.seconds, result.files

How it runs: one private coordinator; ``replicas`` registrations of the source under the name
"predict", each consumed by its own thread calling ``feed.run()`` on one
:class:`~feeder.runtime.PredictSession` (IOBinding on the shared session, one binding and one set
of reused output buffers per thread); each replica hands its batch's outputs, kept columns and
row keys to a :class:`~feeder.scoring.partwriter.PartWriter`, whose writer thread appends them to Parquet
part files and commits each part (:mod:`feeder.scoring.outputdir`).

Exactly once: the state file (``_feeder_predict.json``, format :data:`STATE_FORMAT`) lists the
committed parts and holds a source state (``feeder.source-state/1``, as ``coord.state_dict``
gives it) whose delivered rows are exactly the rows in those parts: it is built from the row keys
of each part as the part is committed, never from what the replicas were handed. Calling again
with the same arguments resumes from it (``resume_from=``): committed rows are not fetched
again, everything else is. The state also records a fingerprint of the model (its signature, and
hashes of its bytes and external data files: :mod:`~feeder.scoring.modelid`) and the options that
shape the output, so that an output is never continued with another model or other columns. A
state that commits no part is never held against a call: it holds nothing to lose.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union, cast

import numpy as np

from ..api import init_data_input_workers
from ..coordinator import GlobalCoordinator
from ..device import providers_for
from ..errors import FeederError
from ..runtime import (
    PredictSession,
    import_onnxruntime,
    is_session,
    load_session,
    model_signature,
    session_model_bytes,
    session_model_path,
)
from ..sources.base import ROW_KEY
from ..sources.rowkeys import KeyLedger, source_state
from ..sources.sharded import ShardedSource
from ..sources.state import definition_differences, jsonish, ranges_of
from ..validation import int_arg
from .modelid import model_identity
from .outputdir import STATE_NAME, Listing, OutputDir
from .partwriter import CommittedPart, Output, PartWriter
from .storeout import StoreOutput

log = logging.getLogger("feeder")

SOURCE_NAME = "predict"
STATE_FORMAT = "feeder.predict/1"
PROGRESS_S = 0.2  # how often the calling thread refreshes the progress bar (and checks on the threads)

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class PredictResult:
    """What :func:`predict` did.

    Attributes:
        rows: Rows in the output, this call's and earlier calls' together.
        rows_computed: Rows this call computed (0 when the output was already complete).
        seconds: Wall-clock seconds of this call.
        files: The output's part files (paths, in part order).
    """

    rows: int
    rows_computed: int
    seconds: float
    files: List[str]

    @property
    def rows_per_s(self) -> float:
        """Rows computed per second of this call."""
        return self.rows_computed / self.seconds if self.seconds > 0 else 0.0


def predict(model: Any, source: Callable[[int, int], Any], output: PathLike, *,
            batch_size: int = 256,
            outputs: Optional[Sequence[str]] = None,
            keep: Sequence[str] = (),
            replicas: Optional[int] = None,
            num_worker_threads: Union[int, str] = 2,
            num_worker_processes: Union[int, str] = 0,
            mp_context: Any = None,
            rows_per_file: int = 262_144,
            overwrite: bool = False,
            progress: Optional[bool] = None,
            cast: bool = False,
            providers: Any = None,
            filesystem: Any = None,
            ordered: bool = False,
            squeeze: bool = False,
            _durable: bool = True) -> PredictResult:
    """Run ``model`` over every row of ``source`` and write the outputs to Parquet part files in
    ``output``, every row exactly once even when a call is killed and called again.

    Calling it again with the same arguments after a crash continues where the last commit left
    off; on a finished output it returns at once (``rows_computed == 0``). Rows are written in no
    particular order (keep an id to join them to their inputs), unless ``ordered``. Rows a
    source's ``filter`` drops are recorded as done in the output's state (``rows_filtered``), so
    that the output is complete when committed + filtered rows make the source's rows. Needs
    pyarrow (the ``parquet`` extra). ``_durable=False`` skips the fsyncs and the per-part state (for benchmarks that
    measure what the commits cost; not crash-safe). The output holds ``_SUCCESS`` exactly when
    it is complete.

    Args:
        model: A path to an ONNX file (loaded on the CPU with one intra-op thread and shared by
            the replicas) or an ``onnxruntime.InferenceSession`` (used as given).
        source: A source of ``feeder.sources`` or any fetch function. The model's inputs are fed
            from the source's inputs of the same names; a list-returning fetch function returns
            the model's inputs in the model's order, then the kept ones that are not model inputs.
        output: The folder that becomes the Parquet dataset (created if missing). With a source
            sharded between ranks (``shard=``), each rank writes its own folder: ``output`` with
            ``{rank}`` and ``{world}`` filled in, or else (no ``{rank}``) ``output``, its
            ``{world}`` filled in, then ``/rank-RRRRR-of-WWWWW``. Unsharded, ``{rank}`` is 0 and
            ``{world}`` 1.
        batch_size: Rows per batch handed to the model (> 0).
        outputs: Names of the model outputs to write, in that order; None writes all of them.
        keep: Names of source inputs written beside the predictions (an id, a path); they need
            not be model inputs. Kept columns come first in the output.
        replicas: Consumer threads running the model, each on its own registration of the
            source; None: one per core.
        num_worker_threads: Fetcher threads per replica (an int >= 1, or ``"auto"``), as in
            :func:`~feeder.init_data_input_workers`.
        num_worker_processes: Worker processes per replica instead of threads (0: threads), as in
            :func:`~feeder.init_data_input_workers`.
        mp_context: Start method of the worker processes (``"forkserver"``, ``"spawn"``,
            ``"fork"`` or a multiprocessing context); None: ``"forkserver"`` where available.
        rows_per_file: Rows per Parquet part file (the last one has fewer).
        overwrite: Start afresh on an output written from another source definition or model
            (or by a fetch function that cannot resume), deleting only the parts feeder wrote.
        progress: A tqdm progress bar on stderr: None draws it when stderr is a terminal;
            True or False force it (no bar without tqdm).
        cast: Convert safe dtype mismatches of the model's inputs (float64 to float32, int64 to
            int32 when the values fit), as in :func:`~feeder.init_data_input_workers`.
        providers: For a model given as a path, where it runs: ``"cpu"``, ``"cuda"``,
            ``"cuda:N"`` or a list as ``onnxruntime.InferenceSession`` takes it; None: the CUDA
            provider where the installed onnxruntime has it, else the CPU. A provider that is not
            installed is a ValueError naming those that are, before anything is written.
        filesystem: The filesystem ``output`` is on: a ``pyarrow.fs.FileSystem`` or an fsspec
            filesystem (``output`` is then a path in it, for S3 ``bucket/prefix``); None: from
            ``output`` itself (a local path, or a URI: ``s3://``, ``gs://``, an fsspec one). In an
            object store the parts are committed by replacing a manifest, ``_manifest.json``.
        ordered: Write the rows in the source's order: part files in order, and rows within
            each in order, are the source's rows in sequence (its files' order for an
            unshuffled ``ParquetSource``). The source is read with ``ordered=True`` by one
            registration; the ``replicas`` threads still run the model side by side, and the
            writer puts their batches back in order. A continued output stays in order.
        squeeze: Write a model output of shape ``[N, 1]`` as a plain column (one value per
            row) instead of lists of one value.

    Returns:
        A :class:`PredictResult`: the rows in the output, those this call computed, the call's
        seconds and the output's part files.

    Raises:
        ValueError: Before any row is computed: a model file onnxruntime cannot load, a model
            input or kept input the source lacks, an output the model lacks or one that is not
            one value per row (from the signature, or at the first batch before any row is
            written), an output folder holding files feeder did not write or inside a folder a
            ``ParquetSource`` reads, an output of another source definition or model (unless
            ``overwrite``; the message names the files, inputs, outputs or external data files
            that differ), an endless source, a source with ``equal_steps=True`` (it leaves rows
            out).
        ImportError: pyarrow (the ``parquet`` extra) is missing.
        FeederError: Writing failed (the original error is its ``__cause__``); the output stays
            at its last commit, ready to be continued. A fetch failure, a bad chunk or a failing
            model is re-raised as it came.
    """
    t0 = time.perf_counter()
    _import_pyarrow()
    _check_args(batch_size, rows_per_file, replicas, overwrite, progress)
    for name, flag in (("ordered", ordered), ("squeeze", squeeze), ("cast", cast)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if not callable(source):
        raise TypeError(f"source must be a source of feeder.sources or a fetch function, got {type(source).__name__}")
    if getattr(source, "epochs", 1) is None:
        raise ValueError(f"{type(source).__name__} is endless (epochs=None): feeder.predict needs a finite source "
                         f"(epochs=1 scores every row once)")
    if getattr(source, "feeder_equal_steps", False):
        # equal_steps leaves each epoch's last rows out so that training ranks take equal steps;
        # scoring has no collective step, and an output without those rows would say it is complete.
        raise ValueError(f"{type(source).__name__} has equal_steps=True, which leaves rows of every epoch out (the "
                         f"remainder of rows // world_size): feeder.predict writes every row, and its ranks need "
                         f"no equal steps; create the source without equal_steps")
    session, identity = _open_model(model, providers)
    plan = _Plan.make(session, source, outputs, keep, batch_size, ordered=ordered, squeeze=squeeze)
    fingerprint = {**model_signature(session), **identity}
    options: Dict[str, Any] = {"outputs": plan.outputs, "keep": plan.keep}
    if ordered:  # (only when set: outputs written before these options existed continue as they were)
        options["ordered"] = True
    if squeeze:
        options["squeeze"] = True
    output = rank_output(output, source)
    out = _output(output, filesystem)
    _refuse_output_in_input(source, out)
    # Everything is checked before this call writes anything (in an object store, before it puts
    # its lease): a call refused changes nothing, and never stops another call writing the output.
    out.open()
    try:
        job = _Job(out, plan, source, fingerprint, options, durable=_durable)
        finished = job.prepare(overwrite)
        if finished:
            job.mark_finished()
            return PredictResult(job.rows, 0, time.perf_counter() - t0, job.files())
        nrep = replicas if replicas is not None else _cores()
        counts = dict(num_worker_threads=num_worker_threads, num_worker_processes=num_worker_processes,
                      mp_context=mp_context, cast=cast)
        computed = job.run(nrep, batch_size, rows_per_file, counts, progress)
        return PredictResult(job.rows, computed, time.perf_counter() - t0, job.files())
    finally:
        out.close()


# ---- arguments -------------------------------------------------------------------------------------
def _import_pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        raise ImportError("feeder.predict writes Parquet and needs pyarrow: pip install 'onnx-feeder[parquet]' "
                          "(or pip install pyarrow)") from e
    return pyarrow


def _check_args(batch_size: Any, rows_per_file: Any, replicas: Any, overwrite: Any, progress: Any) -> None:
    int_arg("batch_size", batch_size, 1)
    int_arg("rows_per_file", rows_per_file, 1)
    if replicas is not None:
        int_arg("replicas", replicas, 1)
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {type(overwrite).__name__}")
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be None, True or False, got {type(progress).__name__}")


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


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


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


def rank_output(output: Any, source: Any) -> Any:
    """The output folder of this call: ``output`` itself, or for a source sharded between ranks
    (``shard=``), the rank's own: ``output`` with ``{rank}`` and ``{world}`` filled in, or else
    (no ``{rank}`` in it) ``output`` with ``{world}`` filled in, then ``/rank-RRRRR-of-WWWWW``
    (so that ranks never write one folder, and the parent folder reads as one dataset of every
    rank's parts). Unsharded, ``{rank}`` and ``{world}`` are 0 and 1."""
    source = _wrapped(source)  # a map or filter of a sharded source is sharded the same way
    shard = getattr(source, "shard", None)
    if not isinstance(source, ShardedSource) or shard is None or shard[1] < 2:
        # unsharded: rank 0 of 1 (so that one script serves both), never a folder named "{rank}"
        if isinstance(output, (str, os.PathLike)) and ("{rank}" in os.fspath(output) or
                                                      "{world}" in os.fspath(output)):
            return os.fspath(output).replace("{rank}", "0").replace("{world}", "1")
        return output
    given = os.fspath(output)
    rank, world = shard
    path = given.replace("{rank}", str(rank)).replace("{world}", str(world))
    if "{rank}" in given:
        return path
    if "://" not in path and os.path.exists(os.path.join(path, STATE_NAME)):  # (a local output, that is)
        raise ValueError(f"output {path!r} is itself an output of feeder.predict, and this call's source is rank "
                         f"{rank} of {world}, whose output would go inside it: pass the folder that holds the ranks' "
                         f"outputs, or put {{rank}} in the output path")
    return path.rstrip("/") + f"/rank-{rank:05d}-of-{world:05d}"


def _output(output: Any, filesystem: Any) -> Output:
    """The output folder: a local directory (``OutputDir``: temporary names, fsync and rename), or a
    prefix in a store (``StoreOutput``: unique part names, committed by a manifest)."""
    from ..storage import resolve

    store, path = resolve(output, filesystem)
    if store.local:
        return OutputDir(path)
    return StoreOutput(store, path)  # type: ignore[arg-type]


def _refuse_output_in_input(source: Any, out: Output) -> None:
    """ValueError when the output folder is inside (or is) a folder a ``ParquetSource`` reads, or
    holds one of its files: the output's parts are Parquet files, so the next call's source would
    read them as input (and this output would hold files that are not ours). Objects are compared
    by their URIs."""
    from ..sources.parquet import ParquetSource

    source = _wrapped(source)
    if not isinstance(source, ParquetSource):
        return
    local = isinstance(out, OutputDir)
    outside = os.path.realpath(out.path) if local else out.path.rstrip("/")
    sep = os.sep if local else "/"
    for root in source.roots:
        if _is_uri(root) == local:
            continue
        real = os.path.realpath(root) if local else root.rstrip("/")
        if (not local or os.path.isdir(real)) and (outside == real or outside.startswith(real + sep)):
            raise ValueError(f"output {out.path!r} is inside the input folder {root!r}: the next call would "
                             f"read the output's part files as input; choose an output folder outside it")
    for path, _ in source.files:
        if _is_uri(path) == local:
            continue
        if (os.path.realpath(path) if local else path).startswith(outside + sep):
            raise ValueError(f"input file {path!r} is inside the output folder {out.path!r}; choose an output "
                             f"folder that holds no input")


def _is_uri(path: str) -> bool:
    from ..storage import split_uri

    return split_uri(path)[0] is not None


def _wrapped(source: Any) -> Any:
    """The source a ``map``/``filter`` wraps (see ``feeder.sources.transform``), else ``source``."""
    from ..sources.transform import TransformedSource

    return source.wrapped if isinstance(source, TransformedSource) else source


# ---- the job -----------------------------------------------------------------------------------------
class _Job:
    """One call's work on one output directory: check and recover it, run, commit."""

    def __init__(self, out: Output, plan: _Plan, source: Any, fingerprint: Dict[str, Any],
                 options: Dict[str, Any], *, durable: bool):
        self.out = out
        self.plan = plan
        self.source = source
        self.fingerprint = fingerprint
        self.options = options
        self.durable = durable
        self.parts: List[Dict[str, Any]] = []
        self.rows = 0
        # Rows the source's filter dropped: done, never written. Their keys join the committed rows'
        # in _done (recorded at each commit from _filtered_keys, as the source's ledger got them),
        # loose until they touch committed rows, as in the source's own ledger (feeder.rowkeys): the
        # state stays a few ranges whatever the filter drops. ``filtered`` counts those in the state.
        self.filtered = 0
        self._filtered_keys: List[np.ndarray] = []
        self._filtered_lock = threading.Lock()
        self.resume: Optional[Dict[str, Any]] = None
        self._done = KeyLedger(SOURCE_NAME)
        self._fresh = True
        self._read = False  # prepare() read a state (checked again once the lease is put)
        self._found = Listing()
        self.overwrite = False

    def files(self) -> List[str]:
        return [self.out.join(p["file"]) for p in self.parts]

    # -- before anything runs --
    def prepare(self, overwrite: bool) -> bool:
        """Check the output directory and its state, writing nothing; True when it is already
        complete (:meth:`mark_finished` then writes its ``_SUCCESS`` if a crash left it out)."""
        self.overwrite = overwrite
        self.parts, self.rows, self.resume, self.filtered = [], 0, None, 0
        self._done, self._fresh, self._read = KeyLedger(SOURCE_NAME), True, False
        found = self.out.scan()
        self._found = found
        self.out.refuse_foreign(found)  # again, now under the lock
        if not found.state:
            if found.parts:
                raise ValueError(f"output {self.out.path!r} holds part files ({sorted(found.parts.values())[:3]}) but "
                                 f"no {self.out.state_name}, so feeder.predict did not write them (it writes its "
                                 f"state before the first part); use another directory")
            return False
        if overwrite:
            return False  # start afresh: run() replaces the state, then removes the old parts
        state = self.out.read_state()
        self._read = True
        self._check_rank(state)
        if state.get("parts") == [] and not state.get("rows"):
            # A state that commits no part (a run refused for bad data, or killed before its first
            # commit) holds nothing to lose: it never makes a call refuse "other data".
            try:
                self._check_state(state)
            except ValueError as e:
                log.info("feeder.predict: %s: its state commits no part and does not match this call (%s); "
                         "starting afresh", self.out.path, e)
                return False
        else:
            self._check_state(state)
        self.parts = list(state["parts"])
        self.rows = int(state["rows"])
        self.resume = state["source"]
        self.filtered = int(self.resume.get("rows_filtered", 0) or 0) if self.resume else 0
        self._done = KeyLedger(SOURCE_NAME, ranges_of(self.resume), self.filtered)
        self._fresh = False
        total = self._total()
        if total is not None and self.rows + self.filtered > total:
            raise ValueError(f"output {self.out.path!r} holds {self.rows} rows"
                             + (f" and {self.filtered} filtered" if self.filtered else "")
                             + f", more than this source's {total} (fewer epochs?); pass overwrite=True to start "
                             f"afresh (it removes that output)")
        # Complete only while the source has no more rows: a source given more epochs continues.
        return bool(state.get("complete")) and (total is None or self.rows + self.filtered == total)

    def mark_finished(self) -> None:
        """On a complete output: write its ``_SUCCESS`` if a crash left it out (after the final
        manifest), having deleted any part its state does not list; otherwise touch nothing."""
        if self._found.success:
            return
        self.out.acquire()
        self.out.recover({p["file"] for p in self.parts})
        self.out.write_marker(durable=self.durable)

    def _check_rank(self, state: Dict[str, Any]) -> None:
        """ValueError when the output was written by another rank (or world size) than this call's
        source: each rank writes, and resumes, an output of its own."""
        src = state.get("source")
        theirs = src.get("shard") if isinstance(src, dict) else None
        record = getattr(self.source, "feeder_shard_record", None)
        mine = record() if record is not None else None
        def who(r: Optional[Dict[str, Any]]) -> str:
            return "an unsharded source" if r is None else f"rank {r['ranks'][0]} of {r['world']}"
        if (theirs is None) != (mine is None) or (theirs is not None and mine is not None and (
                theirs.get("world"), theirs.get("ranks")) != (mine["world"], mine["ranks"])):
            raise ValueError(f"output {self.out.path!r} was written by {who(theirs)}, and this call reads "
                             f"{who(mine)}: each rank writes an output of its own (put {{rank}} in the output "
                             f"path, or let feeder.predict add rank-RRRRR-of-WWWWW to it)")

    def _check_state(self, state: Dict[str, Any]) -> None:
        where = f"output {self.out.path!r}"
        afresh = "pass overwrite=True to start afresh (it removes that output)"
        state_file = self.out.state_name
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"{where}: {state_file} has format {state.get('format')!r}, not {STATE_FORMAT!r} (another "
                             f"version of feeder?); {afresh}")
        if not state.get("resumable"):
            raise ValueError(f"{where} was written from a fetch function without row keys, so it cannot be continued "
                             f"or checked; {afresh}")
        if not self.plan.keyed:
            raise ValueError(f"{where} exists, and this source ({type(self.source).__name__}) has no row keys, so it "
                             f"cannot continue it; {afresh}")
        diffs = _model_differences(state.get("model") or {}, self.fingerprint)
        diffs += _differences("option", state.get("options") or {}, self.options)
        src = state.get("source")
        if not isinstance(src, dict) or src.get("format") is None:
            raise ValueError(f"{where}: {state_file} holds no source state; {afresh}")
        definition = getattr(self.source, "feeder_definition", None)
        mine = definition() if definition is not None else {}
        diffs += _differences("source", src.get("definition") or {}, mine)
        if diffs:
            raise ValueError(f"{where} was written from another source definition or model: " + "; ".join(diffs)
                             + f"; {afresh}")
        parts = state.get("parts")
        if not isinstance(parts, list) or not all(isinstance(p, dict) and {"file", "rows", "bytes"} <= set(p)
                                                  for p in parts):
            raise ValueError(f"{where}: {state_file} does not list its parts; {afresh}")
        for p in parts:
            if not isinstance(p["file"], str) or not self.out.is_part(p["file"]):
                raise ValueError(f"{where}: {state_file} lists {p['file']!r}, which is not a part file; {afresh}")
            # Sizes as the listing gave them (one request for every part, not a HEAD each).
            size = self._found.sizes.get(p["file"])
            if size != p["bytes"]:
                got = "missing" if size is None else f"{size} bytes, not {p['bytes']}"
                raise ValueError(f"{where} is damaged: its committed part {p['file']} is {got}; {afresh}")

    # -- the run --
    def run(self, replicas: int, batch_size: int, rows_per_file: int, counts: Dict[str, Any],
            progress: Optional[bool]) -> int:
        """Compute every row not yet committed; returns how many rows this call computed."""
        plan = self.plan
        coord = self._register(replicas, batch_size, counts)
        try:
            # Only now is anything written. In an object store, this call's lease first (another
            # call writing here stops at its next commit); if a call committed between the check of
            # the manifest and the lease, the manifest is read (and registered from) again.
            self.out.acquire()
            if self._read and self.out.changed_since_read():
                coord.stop()
                log.info("feeder.predict: %s: another call committed to the output while this one checked it; "
                         "its manifest is read again", self.out.path)
                if self.prepare(self.overwrite):
                    self.mark_finished()
                    return 0
                coord = self._register(replicas, batch_size, counts)
        except BaseException:
            coord.stop()
            raise
        try:
            # First the completion marker goes (durably), before any
            # part or state of this run: a folder with _SUCCESS is always a complete output. Then a
            # fresh state before the first part (a directory with parts and no state is never
            # ours), then whatever the state does not commit is deleted.
            self.out.remove_marker(durable=self.durable)
            if self._fresh:
                self.parts, self.rows, self._done = [], 0, KeyLedger(SOURCE_NAME)
                self.filtered = 0
                self.out.write_state(self._state(complete=False), durable=self.durable)
            removed = self.out.recover({p["file"] for p in self.parts})
            if removed:
                log.info("feeder.predict: %s: removed %d file(s) that no commit covers: %s", self.out.path,
                         len(removed), removed[:5])
            first = 1 + max((self.out.part_index(p["file"]) for p in self.parts), default=-1)
            writer = PartWriter(self.out, plan.columns, rows_per_file=rows_per_file, first_part=first,
                                on_commit=self._on_commit, keyed=plan.keyed, durable=self.durable)
        except BaseException:
            coord.stop()
            raise
        return _Replicas(coord, writer, plan, self._todo(), progress, replicas).run()

    def _register(self, replicas: int, batch_size: int, counts: Dict[str, Any]) -> GlobalCoordinator:
        """A coordinator with the source registered from the state read (not started)."""
        plan = self.plan
        coord = GlobalCoordinator()
        try:
            # Registration checks everything the source and feeder can. Ordered: one registration,
            # read in the source's order, whose batches the replica threads share (the writer puts
            # them back in order); otherwise one registration per replica.
            for _ in range(1 if plan.ordered else replicas):
                init_data_input_workers(plan.adapter, plan.feed_names, self.source, batch_size,
                                        input_source_name=SOURCE_NAME, coordinator=coord, resume_from=self.resume,
                                        ordered=plan.ordered, replica=True, **counts)
            ledger = coord.get_queue(SOURCE_NAME, 1).row_keys
            if ledger is not None:  # the keys of filtered rows, committed with the next part
                ledger.on_filtered = self._note_filtered
        except BaseException:
            coord.stop()
            raise
        return coord

    def _total(self) -> Optional[int]:
        """The rows of the whole source, when it can tell (rows x epochs; a rank's share of them)."""
        source = _wrapped(self.source)
        total = getattr(source, "feeder_total_rows", None)
        if isinstance(source, ShardedSource) and total is not None:
            return cast(Optional[int], total())
        return None

    def _todo(self) -> Optional[int]:
        """Rows still to compute or filter, when the source can tell."""
        total = self._total()
        return None if total is None else max(0, total - self.rows - self.filtered)

    def _note_filtered(self, keys: np.ndarray) -> None:
        """From the source's key ledger (any thread): keys of rows its filter dropped."""
        with self._filtered_lock:
            self._filtered_keys.append(np.array(keys, dtype=np.int64))

    def _take_filtered(self) -> np.ndarray:
        with self._filtered_lock:
            keys, self._filtered_keys = self._filtered_keys, []
        return np.concatenate(keys) if keys else np.zeros(0, np.int64)

    def _on_commit(self, part: Optional[CommittedPart], keys: Optional[np.ndarray], final: bool) -> None:
        """In the writer thread, once ``part`` is durable under its final name: record it in the state."""
        if part is not None:
            self.parts.append({"file": part.name, "rows": part.rows, "bytes": part.nbytes})
            self.rows += part.rows
        if self.plan.keyed and (part is not None or final):
            # The rows filtered so far are done too (they will never be written): committed with this part.
            done = self._done
            if keys is not None:
                done.record_keys(keys)
            done.record_filtered(self._take_filtered())
            if final:
                done.settle()
            ranges, self.filtered = done.snapshot()
            covered = int((ranges[:, 1] - ranges[:, 0]).sum())
            twice = done.duplicates
            if twice or covered != self.rows + self.filtered:  # a bug, never a user's error: refuse to commit it
                raise FeederError(f"feeder.predict: the committed parts hold {self.rows} rows and {self.filtered} were "
                                  f"filtered, but their row keys cover {covered} ({twice} twice); the output is left "
                                  f"at its last commit")
        if final:
            expected = self._todo()
            if expected is not None and expected != 0:
                raise FeederError(f"feeder.predict: the source ended with {self.rows} rows committed"
                                  + (f" and {self.filtered} filtered" if self.filtered else "")
                                  + f", {expected} short of its {self._total()} rows")
        if self.durable or final:
            self.out.write_state(self._state(complete=final), durable=self.durable)
        if final:
            # Nothing but the committed parts beside _SUCCESS (a part a stopped call uploaded late,
            # say): a reader of the folder or prefix reads exactly the state's rows.
            self.out.recover({p["file"] for p in self.parts})
            self.out.write_marker(durable=self.durable)  # after the state that says it is complete

    def _state(self, complete: bool) -> Dict[str, Any]:
        src = None
        if self.plan.keyed:
            src = source_state(SOURCE_NAME, self._done, self.source)
        state = {"format": STATE_FORMAT, "complete": complete, "resumable": self.plan.keyed,
                 "model": self.fingerprint, "options": self.options, "rows": self.rows, "parts": list(self.parts),
                 "source": src}
        if self.filtered:
            state["rows_filtered"] = self.filtered
        return state


def _differences(what: str, theirs: Dict[str, Any], mine: Dict[str, Any]) -> List[str]:
    """``what key: the output has X, this call Y`` for every entry that differs, one level into
    dicts (so that a message names the input, output or column that differs); files are named
    (added, removed, changed and how), hashes are said to differ, never shown (see
    :func:`~feeder.sources.base.definition_differences`)."""
    return definition_differences(theirs, mine, theirs_has="the output has", mine_has="this call", depth=1,
                                  prefix=f"{what} ")


def _model_differences(theirs: Dict[str, Any], mine: Dict[str, Any]) -> List[str]:
    """What differs between the model that wrote an output and this call's: its inputs' and
    outputs' types and shapes, its bytes, its external data files (by name). A hash one side does
    not know (a session that kept neither its bytes nor its path) is not compared."""
    out = _differences("model", {k: theirs.get(k) for k in ("inputs", "outputs")},
                       {k: mine.get(k) for k in ("inputs", "outputs")})
    a, b = theirs.get("sha256"), mine.get("sha256")
    if a is not None and b is not None and a != b:
        out.append("model sha256: the output was written by a model of other bytes (other weights or graph)")
    if a is not None and b is not None:
        ta, tb = jsonish(theirs.get("external_data") or {}), jsonish(mine.get("external_data") or {})
        for name in list(tb) + [n for n in ta if n not in tb]:
            if name not in ta:
                out.append(f"model external data file {name!r}: this call's model has it, the output's had not")
            elif name not in tb:
                out.append(f"model external data file {name!r}: the output's model had it, this call's has not")
            elif ta[name] != tb[name]:
                out.append(f"model external data file {name!r}: other contents than when the output was written "
                           f"(other weights: retrained?)")
    return out


# ---- replicas and progress ------------------------------------------------------------------------------
class _Replicas:
    """The replica threads, the calling thread's watch over them, and the end of a run."""

    def __init__(self, coord: GlobalCoordinator, writer: PartWriter, plan: _Plan, todo: Optional[int],
                 progress: Optional[bool], replicas: int = 1):
        self.coord = coord
        self.writer = writer
        self.plan = plan
        self.todo = todo
        self.progress = progress
        self.replicas = replicas
        self.errors: List[BaseException] = []
        self.wake = threading.Event()

    def _replica(self, feed: Any) -> None:
        writer, plan = self.writer, self.plan
        n_out, n_keep = len(plan.outputs), len(plan.keep)
        try:
            while True:
                try:
                    got = feed.run()
                except StopIteration:
                    return
                # outputs, kept, keys[, seq] -> the part's columns (kept first), copied before the next run
                outs = got[:n_out]
                if plan.squeeze:
                    outs = [g.reshape(len(g)) if g.ndim == 2 and g.shape[1] == 1 else g for g in outs]
                keys = got[n_out + n_keep] if plan.keyed else None
                writer.add(got[n_out:n_out + n_keep] + outs, keys, got[-1] if plan.ordered else None)
        except BaseException as e:  # re-raised by the calling thread
            self.errors.append(e)
        finally:
            self.wake.set()

    def run(self) -> int:
        coord, writer = self.coord, self.writer
        threads: List[threading.Thread] = []
        bar = None
        ok = False
        try:
            coord.start()
            feeds = coord.feeds(SOURCE_NAME)
            consumers = feeds * self.replicas if self.plan.ordered else feeds  # ordered: one feed, shared
            threads = [threading.Thread(target=self._replica, args=(f,), name=f"feeder:{SOURCE_NAME}:replica-{i}",
                                        daemon=True) for i, f in enumerate(consumers)]
            for t in threads:
                t.start()
            bar = _progress_bar(self.progress, self.todo)
            while any(t.is_alive() for t in threads) and not self.errors and writer.failure is None:
                self.wake.wait(PROGRESS_S)
                self.wake.clear()
                if bar is not None:
                    bar.update(writer.rows_added - bar.n)
            if self.errors and writer.failure is None:  # a replica's own failure (the writer's is raised below)
                raise self.errors[0]
            writer.finish()  # the last part, and the state that says the output is complete
            if bar is not None:
                bar.update(writer.rows_added - bar.n)
            for i, feed in enumerate(feeds):
                log.info("feeder.predict replica %d: %s", i, feed.diagnose())
            ok = True
            return writer.rows_committed
        finally:
            if bar is not None:
                bar.close()
            if not ok:  # first, so that replicas waiting in add() for a writer that hangs stop at once
                writer.abort(timeout=0.0)
            coord.stop()  # wakes replicas still waiting for a batch (FeedStopped)
            deadline = time.monotonic() + coord.join_timeout
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            if not ok:
                writer.abort()  # the part being written is dropped; the output stays at its last commit


def _progress_bar(progress: Optional[bool], total: Optional[int]) -> Any:
    """A tqdm bar on stderr (rows, rows/s, ETA when the total is known), or None."""
    if progress is False:
        return None
    if progress is None:
        try:
            if sys.stderr is None or not sys.stderr.isatty():
                return None
        except (AttributeError, ValueError):
            return None
    try:
        tqdm = importlib.import_module("tqdm").tqdm  # the `examples` / `test` extras; without it, no bar
    except ImportError:
        if progress:
            log.warning("feeder.predict: progress=True needs tqdm (pip install tqdm); no progress bar")
        return None
    return tqdm(total=total, unit="row", unit_scale=True, desc="feeder.predict", file=sys.stderr,
                mininterval=PROGRESS_S, dynamic_ncols=True)
