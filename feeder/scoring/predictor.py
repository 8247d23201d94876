"""``feeder.predict``: run an ONNX model over a source into a Parquet dataset, exactly once across crashes.

Usage::

    from feeder.sources import ParquetSource

    result = feeder.predict("model.onnx", ParquetSource("data/"), "scores/", keep=["id"])
    result.rows, result.rows_computed, result.seconds, result.files

How it runs: one private coordinator; ``replicas`` registrations of the source under the name
"predict", each consumed by its own thread calling ``feed.run()`` on one
:class:`~feeder.scoring.session.PredictSession` (IOBinding on the shared session, one binding and one set
of reused output buffers per thread); each replica hands its batch's outputs, kept columns and
row keys to a :class:`~feeder.scoring.partwriter.PartWriter`, whose writer thread appends them to Parquet
part files and commits each part (:mod:`feeder.scoring.outputdir`).

Exactly once: the state file (``_feeder_predict.json``, format :data:`~feeder.scoring.job.STATE_FORMAT`) lists the
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

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from ..runtime import model_signature
from ..validation import int_arg
from .destination import _output, _refuse_output_in_input, rank_output
from .job import _Job
from .plan import _open_model, _Plan

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


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)
