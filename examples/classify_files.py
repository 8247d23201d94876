"""Content-type detection of every file under a folder with Magika's real ONNX model, fed by feeder.

Run:  python examples/classify_files.py [DIR] [--workers N | --processes N] [--batch-size N] [--replicas N] [--limit N]
      python examples/classify_files.py [DIR] --predict OUTPUT   (the same labels through feeder.predict)
      (needs ``pip install magika``; DIR defaults to the Python standard library folder,
      without its site-packages/dist-packages)

The model is the one shipped inside the ``magika`` package (``models/standard_v3_3/model.onnx``,
input ``bytes`` int32 [N, 2048], output ``target_label`` float32 [N, 214], softmax scores).
Fetcher threads open the files and build the model's byte features; ``feed.run()`` scores
them; each label is written back at the file's index; a tqdm progress bar is drawn on stderr
(when it is a terminal) and a table of the most common labels is printed at the end.

What "the same labels as magika" takes (magika 1.0.x, ``magika/magika.py``; all constants come
from the installed ``config.min.json`` and ``content_types_kb.min.json``, none is hard-coded):

* Files are resolved like ``Magika().identify_paths`` with its defaults (symlinks followed):
  missing path or broken symlink -> status ``file_not_found_error``; a regular file without
  read permission -> ``permission_error``; a directory -> ``directory``; anything else that is
  not a regular file (FIFO, socket, device) -> ``unknown``, never opened.
* Size 0 -> ``empty``. Size < ``min_file_size_for_dl`` (8) -> no model: ``txt`` if the bytes
  decode as UTF-8, else ``unknown``.
* Otherwise read ``min(block_size, size)`` (4096) bytes from the start and as many from the
  end; ``lstrip()`` the first block and ``rstrip()`` the last (ASCII whitespace, like
  ``bytes.strip``); ``beg`` = the first ``beg_size`` (1024) stripped bytes, padded at the end
  with ``padding_token`` (256); ``end`` = the last ``end_size`` (1024), padded at the front.
  The model row is ``beg + end`` as int32. If fewer than ``min_file_size_for_dl`` bytes are
  left after stripping the start (``beg[7]`` is padding), the model is not used: the first
  block decides ``txt``/``unknown`` as above.
* Scores: argmax of the softmax row (first maximum, like magika's ``max(range(...))``),
  compared in float64 exactly as magika compares its ``tolist()`` floats; the dl label goes
  through ``overwrite_map`` (randombytes -> unknown, randomtxt -> txt); in the default
  high-confidence mode a score below the dl label's threshold (``thresholds`` or
  ``medium_confidence_threshold``) gives ``txt`` or ``unknown`` by whether the (overwritten)
  label is text.

Design: how rows find their way back to their paths. Each chunk carries the file indices of its
rows as a kept array (``keep=["row_index"]`` at registration): kept arrays are rebatched with
the model's input, row for row, and never bound to the session, so Magika's model runs as
shipped. ``feed.runs([SCORES_OUTPUT], with_batch=True)`` yields each batch's scores with the
batch's arrays, and ``labels[batch["row_index"]] = ...`` puts every label in its place. Nothing
depends on arrival order, so fetchers take files from one shared cursor (load balancing instead
of a fixed split), ``ordered=False`` (the fastest mode) is safe, and several replicas can run at
once.

Short last batches: each feed ends with a short batch (``last_batch="keep"``, the default),
scored like any other.

Threads: the session has ``intra_op_num_threads=1`` (feeder's advice: leave cores to the
Python fetchers). The model costs milliseconds per file, reading a file microseconds, so
scoring is the bottleneck; ``--replicas R`` registers R feeds on the same source (feeder's
data-parallel replicas sharing one queue), each consumed by its own thread calling
``feed.run()`` on the one shared session, which gives R cores to ONNX Runtime.

The same job with ``feeder.predict`` (``--predict OUTPUT``, :func:`classify_with_predict`): the
replicas, the loop and the bookkeeping above become one call, and the scores land in Parquet files,
exactly once, continuing after a crash. The row index rides along there too:
``feeder.predict`` writes kept source columns (``keep=["row_index", "decided"]``) beside the
outputs of Magika's model as shipped. Its source (:class:`PathFeatures`) gives every path a row,
so the few files decided without the model (0.6% of the standard library) go through it too, their
scores unused; and the labels are read back from the output. The ``feed.run()`` loop stays the
default because it returns labels in memory and scores only the files that need the model.
"""
from __future__ import annotations

import argparse
import collections
import errno
import hashlib
import importlib.util
import json
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import stat
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import onnxruntime as ort

import feeder
from feeder.sources import ShardedSource

MODEL_NAME = "standard_v3_3"
BYTES_INPUT = "bytes"
SCORES_OUTPUT = "target_label"
INDEX_INPUT = "row_index"  # kept with each batch (keep=), not an input of the model
SOURCE = "magika"

# What magika reports for paths it cannot read (``MagikaResult.status``; ``.output`` is unset).
FILE_NOT_FOUND_ERROR = "file_not_found_error"
PERMISSION_ERROR = "permission_error"

PREDICTION_MODES = ("high-confidence", "medium-confidence", "best-guess")

PathLike = Union[str, "os.PathLike[str]"]


# ---- the installed magika package: model and configuration ---------------------------------
def magika_package_dir() -> Path:
    """The folder of the installed ``magika`` package (found without importing it)."""
    spec = importlib.util.find_spec("magika")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("this example needs the magika package for its model: pip install magika")
    return Path(list(spec.submodule_search_locations)[0])


def model_dir(name: str = MODEL_NAME) -> Path:
    return magika_package_dir() / "models" / name


def model_path(name: str = MODEL_NAME) -> str:
    """Path of Magika's ONNX model inside the installed package."""
    path = model_dir(name) / "model.onnx"
    if not path.is_file():
        raise FileNotFoundError(f"Magika model not found at {path}")
    return str(path)


class MagikaConfig:
    """Magika's model configuration and content-type knowledge base, read from the package."""

    def __init__(self, directory: Optional[Path] = None, prediction_mode: str = "high-confidence"):
        directory = Path(directory) if directory is not None else model_dir()
        cfg = json.loads((directory / "config.min.json").read_text())
        kb = json.loads((magika_package_dir() / "config" / "content_types_kb.min.json").read_text())
        self.beg_size: int = cfg["beg_size"]
        self.mid_size: int = cfg["mid_size"]
        self.end_size: int = cfg["end_size"]
        self.block_size: int = cfg["block_size"]
        self.padding_token: int = cfg["padding_token"]
        self.min_file_size_for_dl: int = cfg["min_file_size_for_dl"]
        self.medium_confidence_threshold: float = cfg["medium_confidence_threshold"]
        self.labels: List[str] = list(cfg["target_labels_space"])
        self.thresholds: Dict[str, float] = dict(cfg["thresholds"])
        self.overwrite_map: Dict[str, str] = dict(cfg["overwrite_map"])
        self.is_text: Dict[str, bool] = {k: bool(v["is_text"]) for k, v in kb.items()}
        self.descriptions: Dict[str, str] = {k: v["description"] or k for k, v in kb.items()}
        # The feature extraction below is magika's "v2" (beg + end only), with magika's own asserts.
        if self.mid_size != 0 or cfg["use_inputs_at_offsets"]:
            raise ValueError("only models with beg/end features are supported (mid_size=0, no offsets)")
        if not (self.beg_size < self.block_size and self.end_size < self.block_size):
            raise ValueError("beg_size and end_size must be smaller than block_size")
        if not self.min_file_size_for_dl <= self.beg_size:
            raise ValueError("min_file_size_for_dl must not exceed beg_size")
        self.width = self.beg_size + self.end_size
        if prediction_mode not in PREDICTION_MODES:
            raise ValueError(f"prediction_mode must be one of {PREDICTION_MODES}, got {prediction_mode!r}")
        self.prediction_mode = prediction_mode
        # Per model class: the label kept when confident, its threshold, and the fallback label.
        out = [self.overwrite_map.get(dl, dl) for dl in self.labels]
        self._confident = np.array(out, dtype=object)
        self._fallback = np.array(["txt" if self.is_text[o] else "unknown" for o in out], dtype=object)
        if prediction_mode == "high-confidence":
            thr = [self.thresholds.get(dl, self.medium_confidence_threshold) for dl in self.labels]
        elif prediction_mode == "medium-confidence":
            thr = [self.medium_confidence_threshold] * len(self.labels)
        else:
            thr = [-np.inf] * len(self.labels)
        self._threshold = np.array(thr, dtype=np.float64)

    def labels_from_scores(self, scores: np.ndarray) -> List[str]:
        """Output labels for model output rows [N, classes], as magika maps them."""
        s = np.asarray(scores, dtype=np.float64)  # magika compares Python floats (float64)
        top = s.argmax(axis=1)                    # first maximum, like max(range(n), key=...)
        best = s[np.arange(len(s)), top]
        return np.where(best >= self._threshold[top], self._confident[top], self._fallback[top]).tolist()


# ---- features: what magika computes for one path --------------------------------------------
def _few_bytes_label(content: bytes) -> str:
    try:
        content.decode("utf-8")
    except UnicodeDecodeError:
        return "unknown"
    return "txt"


def _features_from_stream(f, cfg: MagikaConfig, row: np.ndarray) -> Optional[str]:
    f.seek(0, os.SEEK_END)  # magika's Seekable: size = seek to the end, tell
    size = f.tell()
    if size == 0:
        return "empty"
    if size < cfg.min_file_size_for_dl:
        f.seek(0)
        return _few_bytes_label(f.read(size))
    n = min(cfg.block_size, size)
    f.seek(0)
    head = f.read(n)
    beg = head.lstrip()
    if len(beg) < cfg.min_file_size_for_dl:  # == magika's "beg[min_file_size_for_dl - 1] is padding"
        return _few_bytes_label(head)
    if n == size:
        tail = head                          # read_at(size - n, n) reads the same bytes again
    else:
        f.seek(size - n)
        tail = f.read(n)
    end = tail.rstrip()
    beg = beg[:cfg.beg_size]
    end = end[len(end) - cfg.end_size:] if len(end) > cfg.end_size else end
    row[:len(beg)] = np.frombuffer(beg, dtype=np.uint8)
    row[cfg.width - len(end):] = np.frombuffer(end, dtype=np.uint8)
    return None


def features_or_label(path: PathLike, cfg: MagikaConfig, row: np.ndarray) -> Optional[str]:
    """Fill ``row`` (int32 [beg_size + end_size], pre-filled with ``padding_token``) with
    magika's model features for ``path`` and return None, or return the label magika gives
    this path without the model (empty, small files, directories, errors...)."""
    try:
        st = os.stat(path)  # Path.exists / is_file / is_dir: follow symlinks
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return FILE_NOT_FOUND_ERROR
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EBADF, errno.ENAMETOOLONG):
            return FILE_NOT_FOUND_ERROR
        return PERMISSION_ERROR  # magika raises here (e.g. EACCES on a parent folder)
    if stat.S_ISREG(st.st_mode):
        if not os.access(path, os.R_OK):
            return PERMISSION_ERROR
        try:
            with open(path, "rb") as f:
                return _features_from_stream(f, cfg, row)
        except FileNotFoundError:  # removed since the stat; magika raises
            return FILE_NOT_FOUND_ERROR
        except PermissionError:
            return PERMISSION_ERROR
        except OSError:
            return "unknown"
    if stat.S_ISDIR(st.st_mode):
        return "directory"
    return "unknown"


# ---- the session: Magika's model as shipped ---------------------------------------------------
def make_session(path: Optional[str] = None) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # leave cores to the fetchers; use replicas for more ORT cores
    return ort.InferenceSession(path or model_path(), opts, providers=["CPUExecutionProvider"])


# ---- the feeder job ---------------------------------------------------------------------------
def extract_chunk(paths: Sequence[PathLike], start: int, stop: int,
                  cfg: MagikaConfig) -> Tuple[Optional[Dict[str, np.ndarray]], List[Tuple[int, str]]]:
    """Features of ``paths[start:stop]`` that need the model, as a chunk with their indices (None if
    none does), and the (index, label) of those decided without it (empty, tiny, unreadable)."""
    feats = np.full((stop - start, cfg.width), cfg.padding_token, dtype=np.int32)
    index = np.empty(stop - start, dtype=np.int64)
    decided: List[Tuple[int, str]] = []
    k = 0
    for i in range(start, stop):
        label = features_or_label(paths[i], cfg, feats[k])
        if label is None:
            index[k] = i
            k += 1
        else:
            decided.append((i, label))
    return ({BYTES_INPUT: feats[:k], INDEX_INPUT: index[:k]} if k else None), decided


class _Job:
    """Shared state of one run: a cursor over the paths, the labels, progress counts."""

    def __init__(self, paths: Sequence[PathLike], cfg: MagikaConfig, files_per_chunk: int):
        self.paths = list(paths)
        self.cfg = cfg
        self.files_per_chunk = files_per_chunk
        self.labels: List[Optional[str]] = [None] * len(self.paths)
        self.done = 0
        self.model_rows = 0
        self._cursor = 0
        self._lock = threading.Lock()

    def _take(self):
        with self._lock:
            start = self._cursor
            self._cursor = min(len(self.paths), start + self.files_per_chunk)
            return start, self._cursor

    def rewind(self) -> None:
        """Start over from the first path (for an endless fetch)."""
        with self._lock:
            self._cursor = 0

    def add_done(self, n: int, model_rows: int = 0) -> None:
        with self._lock:
            self.done += n
            self.model_rows += model_rows

    def fetch(self, worker_id: int, batch_size: int):
        """Features of the next few files that need the model, with their indices.

        Files that need no model are labelled here. A chunk never has zero rows (feeder would
        warn about it): the loop goes on to the next files instead.
        """
        cfg = self.cfg
        while True:
            start, stop = self._take()
            if start >= stop:
                raise StopIteration
            chunk, decided = extract_chunk(self.paths, start, stop, cfg)
            for i, label in decided:
                self.labels[i] = label
            if decided:
                self.add_done(len(decided))
            if chunk is not None:
                return chunk

    def consume(self, feed: feeder.Feed, on_batch: Optional[Callable[[], None]] = None) -> None:
        """Score batches until the source ends; write each label at its file's index (the batch's
        kept ``row_index``)."""
        for (scores,), batch in feed.runs([SCORES_OUTPUT], with_batch=True):
            rows = batch[INDEX_INPUT]
            for i, label in zip(rows.tolist(), self.cfg.labels_from_scores(scores)):
                self.labels[i] = label
            self.add_done(len(rows), model_rows=len(rows))
            if on_batch is not None:
                on_batch()


class _ShardFetch:
    """The fetch step for worker processes (``--processes N``): reading and feature extraction
    run in the processes, past the GIL.

    A process has its own copy of this object, so there is no shared cursor: chunk ``c`` of the
    path list (``files_per_chunk`` paths) belongs to worker ``c % shards`` (worker ids of a private
    coordinator start at 0). Labels decided without the model (empty, tiny, unreadable files) are
    sent to the parent over ``labels[worker_id]``, one pipe per worker (no locks, no named
    semaphores), with a ``None`` at its end; the parent drains them in a thread (see ``classify``).
    """

    def __init__(self, paths: Sequence[PathLike], cfg: MagikaConfig, files_per_chunk: int, shards: int,
                 labels: Sequence[Connection]):
        self.paths = list(paths)
        self.cfg = cfg
        self.files_per_chunk = files_per_chunk
        self.shards = shards
        self.labels = labels
        self._next: Dict[int, int] = {}

    def __call__(self, worker_id: int, batch_size: int):
        cfg, n = self.cfg, self.files_per_chunk
        while True:
            c = self._next.get(worker_id, worker_id)
            start, stop = c * n, min(len(self.paths), (c + 1) * n)
            if start >= len(self.paths):
                self.labels[worker_id].send(None)
                raise StopIteration
            self._next[worker_id] = c + self.shards
            chunk, decided = extract_chunk(self.paths, start, stop, cfg)
            if decided:
                self.labels[worker_id].send(decided)
            if chunk is not None:
                return chunk


def _drain_labels(job: _Job, labels: Sequence[Connection], stop: threading.Event) -> None:
    """Write the labels the worker processes decided without the model, until every worker ended."""
    open_ = list(labels)
    while open_ and not stop.is_set():
        for conn in mp_connection.wait(open_, timeout=0.1):
            try:
                item = conn.recv()
            except EOFError:  # a worker process died: the feed reports it
                item = None
            if item is None:
                open_.remove(conn)
                conn.close()
                continue
            for i, label in item:
                job.labels[i] = label
            job.add_done(len(item))


def default_replicas() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores)


def classify(paths: Sequence[PathLike], workers: int = 2, batch_size: int = 64, *, replicas: int = 1,
             session: Optional[ort.InferenceSession] = None, config: Optional[MagikaConfig] = None,
             progress: Optional[Callable[[int, int], None]] = None, stats: Optional[dict] = None,
             processes: int = 0) -> List[str]:
    """Magika output labels of ``paths``, in the same order (what ``Magika().identify_paths``
    reports as ``result.output.label``, or its status such as ``"file_not_found_error"`` for a
    path it cannot read).

    ``workers`` fetcher threads per replica read files; ``replicas`` feeds of one source are
    scored by as many threads (``feed.run()`` on one shared session). ``progress(done, total)``
    is called from the calling thread after each of its batches and at the end. ``stats``, if a
    dict, receives timings and feeder metrics. A private coordinator is used and stopped.
    ``processes`` > 0: that many worker processes per replica read files instead of threads.
    """
    cfg = config or MagikaConfig()
    session = session or make_session()
    replicas = int(replicas)
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    job = _Job(paths, cfg, files_per_chunk=max(1, min(32, batch_size)))
    total = len(job.paths)
    start = time.perf_counter()
    drain: Optional[threading.Thread] = None
    drained = threading.Event()
    if total:
        coord = feeder.GlobalCoordinator()
        fetch: Callable = job.fetch
        counts: dict = {"num_worker_threads": workers}
        if processes:
            ctx = multiprocessing.get_context("forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                                              else "spawn")
            pipes = [ctx.Pipe(duplex=False) for _ in range(processes * replicas)]
            fetch = _ShardFetch(job.paths, cfg, job.files_per_chunk, len(pipes), [w for _, w in pipes])
            counts = {"num_worker_processes": processes, "mp_context": ctx}
            drain = threading.Thread(target=_drain_labels, args=(job, [r for r, _ in pipes], drained),
                                     name="classify:labels", daemon=True)
            drain.start()
        for _ in range(replicas):
            feeder.init_data_input_workers(session, [BYTES_INPUT], fetch, batch_size, keep=[INDEX_INPUT],
                                           input_source_name=SOURCE, max_buffered_batches=64, coordinator=coord,
                                           replica=True, **counts)
        errors: List[BaseException] = []

        def replica(feed):
            try:
                job.consume(feed)
            except BaseException as e:  # reported by the calling thread
                errors.append(e)

        report = (lambda: progress(job.done, total)) if progress is not None else None
        with coord:
            feeds = coord.feeds(SOURCE)
            others = [threading.Thread(target=replica, args=(f,), name=f"classify:replica-{r}", daemon=True)
                      for r, f in enumerate(feeds[1:], 1)]
            for t in others:
                t.start()
            try:
                job.consume(feeds[0], report)
            except BaseException:
                coord.stop()  # wakes the other replicas (FeedStopped) before they are joined
                raise
            finally:
                for t in others:
                    t.join()
            if stats is not None:
                ms = [f.metrics() for f in feeds]
                stats["consumer_wait_s"] = sum(m["consumer_wait_s"] for m in ms)
                stats["batches"] = sum(m["batches"] for m in ms)
                stats["diagnosis"] = feeds[0].diagnose()  # where the time went, for the first replica
        if drain is not None:
            drain.join(10)  # every worker ended (the source did), so its last labels are on their way
            drained.set()
            for _, w in pipes:
                w.close()
        if errors:
            raise errors[0]
    missing = [p for p, label in zip(job.paths, job.labels) if label is None]
    if missing:
        raise RuntimeError(f"{len(missing)} paths got no label, e.g. {missing[:3]}")
    if progress is not None:
        progress(total, total)
    if stats is not None:
        stats.update(files=total, model_rows=job.model_rows, seconds=time.perf_counter() - start)
    return job.labels  # type: ignore[return-value]


# ---- the same job with feeder.predict: scores into Parquet, exactly once, resumable ---------------
DECIDED = "decided"   # the label of a file decided without the model ("" when the model decides)


class PathFeatures(ShardedSource):
    """Every path as one row: Magika's features (``bytes``), the label decided without the model
    (``decided``, "" when the model decides) and the path's index (``row_index``). A feeder source
    (units of ``files_per_chunk`` paths, row keys, exact resume), so ``feeder.predict`` can write
    its scores exactly once and continue after a crash. Files decided without the model (0.6% of
    the standard library) still get a row of padding through the model, whose score is unused:
    ``feeder.predict`` runs the model on every row of its source.
    """

    NAMES = (BYTES_INPUT, DECIDED, INDEX_INPUT)

    def __init__(self, paths: Sequence[PathLike], cfg: MagikaConfig, files_per_chunk: int = 32):
        super().__init__(shuffle=False, seed=0, epochs=1)
        self.paths = [os.fspath(p) for p in paths]
        self.cfg = cfg
        self.files_per_chunk = int(files_per_chunk)
        self._order = [0, 1, 2]
        n = len(self.paths)
        self._init_units([min(self.files_per_chunk, n - s) for s in range(0, n, self.files_per_chunk)])

    def feeder_validate(self, input_names: Sequence[str], resume: Optional[dict]) -> None:
        """Called at registration with the inputs in feeding order: remember it (``_read`` follows it)."""
        if sorted(input_names) != sorted(self.NAMES):
            raise ValueError(f"PathFeatures gives the inputs {list(self.NAMES)}, not {list(input_names)}")
        self._order = [self.NAMES.index(n) for n in input_names]
        super().feeder_validate(input_names, resume)

    def _definition(self) -> dict:
        d = super()._definition()
        d["paths"] = hashlib.sha1("\0".join(self.paths).encode("utf-8", "surrogateescape")).hexdigest()[:16]
        return d

    def _read(self, unit: int, rows: np.ndarray, worker_id: int) -> List[np.ndarray]:
        index = int(self._offsets[unit]) + rows
        feats = np.full((len(rows), self.cfg.width), self.cfg.padding_token, dtype=np.int32)
        decided = [features_or_label(self.paths[i], self.cfg, feats[k]) or "" for k, i in enumerate(index)]
        arrays = [feats, np.array(decided, dtype=str), index.astype(np.int64)]
        return [arrays[k] for k in self._order]


def labels_from_output(output: PathLike, total: int, cfg: MagikaConfig) -> List[str]:
    """The labels of ``total`` paths from a ``feeder.predict`` output of :class:`PathFeatures`."""
    if not total:
        return []
    import pyarrow.parquet as pq

    table = pq.read_table(os.fspath(output), columns=[INDEX_INPUT, DECIDED, SCORES_OUTPUT])
    index = table[INDEX_INPUT].to_numpy()
    scores = table[SCORES_OUTPUT].combine_chunks()
    scores = scores.flatten().to_numpy().reshape(len(scores), scores.type.list_size)
    labels: List[Optional[str]] = [None] * total
    for i, decided, label in zip(index.tolist(), table[DECIDED].to_pylist(), cfg.labels_from_scores(scores)):
        labels[i] = decided or label
    missing = sum(1 for label in labels if label is None)
    if missing:
        raise RuntimeError(f"{missing} paths have no row in {output}")
    return labels  # type: ignore[return-value]


def classify_with_predict(paths: Sequence[PathLike], output: PathLike, *, batch_size: int = 64,
                          replicas: Optional[int] = None, workers: int = 2, processes: int = 0,
                          config: Optional[MagikaConfig] = None, overwrite: bool = False,
                          progress: Optional[bool] = None) -> Tuple[List[str], "feeder.PredictResult"]:
    """What :func:`classify` returns, the ``feeder.predict`` way: Magika's model as shipped scores
    every path into Parquet files in ``output`` (columns ``row_index``, ``decided``, ``target_label``),
    exactly once; killed and called again, it continues where its last commit left off. The labels
    are then read back from the output."""
    cfg = config or MagikaConfig()
    source = PathFeatures(paths, cfg)  # units of 32 paths whatever the batch size, which a resume may change
    result = feeder.predict(model_path(), source, output, batch_size=batch_size, outputs=[SCORES_OUTPUT],
                            keep=[INDEX_INPUT, DECIDED], replicas=replicas, num_worker_threads=workers,
                            num_worker_processes=processes, overwrite=overwrite, progress=progress)
    return labels_from_output(output, len(source.paths), cfg), result


# ---- command line -----------------------------------------------------------------------------
def list_files(root: str, skip_dirs: Sequence[str] = ()) -> List[str]:
    """Every non-directory entry under ``root`` (symlinks not followed into), sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
        out.extend(os.path.join(dirpath, f) for f in filenames)
    out.sort()
    return out


class Progress:
    """``progress(done, total)`` drawn as a tqdm bar on stderr; quiet when stderr is not a terminal."""

    def __init__(self) -> None:
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm  # the `examples` extra; imported here so that fetch() works without it

            self.bar = tqdm(total=total, unit="file", unit_scale=True, disable=None, mininterval=0.1)
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.bar.close()


# ---- a module-level fetch function, for `feeder bench` ---------------------------------------
_bench_job: Optional[_Job] = None
_bench_lock = threading.Lock()


def fetch(worker_id: int, batch_size: int):
    """This example's fetch step alone, endlessly: ``{"bytes": features}`` of the next standard-library
    files that need the model, cycling over them. For ``feeder bench``, with ``--model`` set to
    ``model_path()`` (Magika's model as shipped, whose only input is ``bytes``)::

        feeder bench examples/classify_files.py:fetch --model "$(python examples/classify_files.py --model-path)"
    """
    global _bench_job
    with _bench_lock:
        if _bench_job is None:
            paths = list_files(os.path.dirname(os.__file__), ("site-packages", "dist-packages"))
            _bench_job = _Job(paths, MagikaConfig(), files_per_chunk=max(1, min(32, batch_size)))
        job = _bench_job
    while True:
        try:
            chunk = job.fetch(worker_id, batch_size)
        except StopIteration:
            job.rewind()
            continue
        return {BYTES_INPUT: chunk[BYTES_INPUT]}


def print_table(labels: Sequence[str], cfg: MagikaConfig, top: int) -> None:
    counts = collections.Counter(labels)
    total = len(labels)
    print(f"{'label':<22} {'files':>7} {'share':>7}  description")
    for label, n in counts.most_common(top):
        print(f"{label:<22} {n:>7,} {n / total:>7.1%}  {cfg.descriptions.get(label, '')}")
    rest = total - sum(n for _, n in counts.most_common(top))
    if rest:
        print(f"{'(%d other labels)' % (len(counts) - top):<22} {rest:>7,} {rest / total:>7.1%}")


def compare_with_magika(paths: Sequence[str], labels: Sequence[str]) -> None:
    from magika import Magika

    t0 = time.perf_counter()
    results = Magika().identify_paths(paths)
    elapsed = time.perf_counter() - t0
    theirs = [str(r.output.label) if r.ok else str(r.status) for r in results]
    diff = [(p, a, b) for p, a, b in zip(paths, labels, theirs) if a != b]
    print(f"magika.Magika().identify_paths: {elapsed:.2f} s ({len(paths) / elapsed:,.0f} files/s); "
          f"{len(diff)} of {len(paths)} labels differ")
    for p, a, b in diff[:20]:
        print(f"  {p}: feeder {a!r}, magika {b!r}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", nargs="?", default=None,
                        help="folder to scan (default: the standard library, without site-packages)")
    parser.add_argument("--workers", type=int, default=2, help="fetcher threads per replica (default 2)")
    parser.add_argument("--processes", type=int, default=0,
                        help="worker processes per replica instead of threads (reading and features past the GIL)")
    parser.add_argument("--batch-size", type=int, default=64, help="files per model batch (default 64)")
    parser.add_argument("--replicas", type=int, default=None,
                        help="feeds scored in parallel, one thread and one ORT core each (default: CPU count)")
    parser.add_argument("--limit", type=int, default=None, help="classify only the first N files (sorted)")
    parser.add_argument("--top", type=int, default=15, help="rows of the label table (default 15)")
    parser.add_argument("--compare-magika", action="store_true",
                        help="also run magika.Magika().identify_paths, time it and list differences")
    parser.add_argument("--model-path", action="store_true", help="print the path of Magika's model and exit")
    parser.add_argument("--predict", metavar="OUTPUT", default=None,
                        help="score with feeder.predict into Parquet files in OUTPUT (exactly once; run the same "
                             "command again after a crash or Ctrl-C to continue) instead of the feed.run() loop")
    args = parser.parse_args(argv)
    if args.model_path:
        print(model_path())
        return

    if args.dir is None:
        root, skip = os.path.dirname(os.__file__), ("site-packages", "dist-packages")
    else:
        root, skip = args.dir, ()
    if not os.path.isdir(root):
        parser.error(f"not a folder: {root}")
    paths = list_files(root, skip)
    if args.limit is not None:
        paths = paths[:args.limit]
    replicas = args.replicas or default_replicas()
    cfg = MagikaConfig()
    print(f"classifying {len(paths):,} files under {root} with {model_path()}\n"
          f"  batch size {args.batch_size}, {replicas} replica(s) x "
          + (f"{args.processes} worker process(es)" if args.processes else f"{args.workers} fetcher thread(s)"),
          file=sys.stderr)
    if args.predict is not None:
        labels, result = classify_with_predict(paths, args.predict, batch_size=args.batch_size, replicas=replicas,
                                               workers=args.workers, processes=args.processes, config=cfg)
        print_table(labels, cfg, args.top)
        print(f"feeder.predict: {result.rows:,} files in {args.predict}, {result.rows_computed:,} scored by this run "
              f"in {result.seconds:.2f} s ({result.rows_per_s:,.0f} files/s)")
        if args.compare_magika:
            compare_with_magika(paths, labels)
        return
    stats: dict = {}
    labels = classify(paths, workers=args.workers, batch_size=args.batch_size, replicas=replicas, config=cfg,
                      progress=Progress(), stats=stats, processes=args.processes)
    secs = stats["seconds"]
    print_table(labels, cfg, args.top)
    print(f"{stats['files']:,} files ({stats['model_rows']:,} scored by the model) in {secs:.2f} s: "
          f"{stats['files'] / secs:,.0f} files/s; consumers waited {stats.get('consumer_wait_s', 0.0):.2f} s "
          f"for data over {stats.get('batches', 0):.0f} batches")
    if stats.get("diagnosis"):
        print(f"replica 0: {stats['diagnosis']}")
    if args.compare_magika:
        compare_with_magika(paths, labels)


if __name__ == "__main__":
    main()
