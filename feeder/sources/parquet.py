"""ParquetSource: columns of Parquet files as inputs, one row group per unit of work.

pyarrow is an optional extra (``pip install 'onnx-feeder[parquet]'``); it is imported when a
ParquetSource is created, never by ``import feeder``.

Files live on the local disk or in a store (:mod:`feeder.storage`: ``s3://``, ``gs://``, fsspec
URIs, or ``filesystem=``). Local files are read as they always were (a ParquetFile per worker on
the path). Objects in a store are read through the store: their footers concurrently when the
source is created, their row groups through one shared handle per object (no second request for
its size or footer), with transient failures retried (:func:`feeder.storage.retrying`) and, to
hide each request's latency, the next units of the sequence read ahead on a small pool of threads
(:mod:`feeder.sources.readahead`).

The source is built in three parts, each a class the next one extends:
:mod:`~feeder.sources.parquetfiles` (the files: listed, footers read, columns checked, what a
state records of them), :mod:`~feeder.sources.parquetstore` (reading objects of a store, and
reading ahead), and here :class:`ParquetSource` itself: its arguments, the binding protocol,
reading local files and converting row groups to numpy.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from ..errors import InputValidationError
from ..validation import can_cast
from .arrow import import_pyarrow, to_numpy
from .base import SourceBinding
from .parquetfiles import Columns, PathLike, _read_error
from .parquetstore import ParquetStoreReads, _Failed

log = logging.getLogger("feeder")

__all__ = ["ParquetSource", "import_pyarrow", "to_numpy"]  # to_numpy: moved to .arrow, importable here too

# Stacking scalar columns into an [N, k] input fills the output in blocks of rows of about this
# many bytes, column by column: each block stays in cache while its k columns are written.
STACK_BLOCK_BYTES = 256 << 10


class ParquetSource(ParquetStoreReads):
    """Feed columns of Parquet files: ``columns`` maps input name -> column name (None: the
    columns named like the inputs). Only those columns are read; each row group is a unit of
    work (one fetch), sharded between every worker and replica, shuffled per epoch from
    ``seed`` when ``shuffle`` (the order of row groups and the rows within each).

    Files are local paths, or objects in a store: ``s3://bucket/prefix/``, ``gs://...``,
    ``file:///...``, any fsspec URI when fsspec and its driver are installed (``memory://``
    included), or paths on ``filesystem`` (a ``pyarrow.fs.FileSystem`` or an fsspec filesystem).
    An object is named by its URI in states and messages. The footers of many objects are read
    concurrently when the source is created; transient failures of the store (time-outs,
    throttling, 5xx answers, connections reset) are retried ``retries`` times with exponential
    backoff (0.1 s doubling, at most 5 s, about 3 s in all for 5; none begun 10 s after the
    first failure), then the read fails as a fetch error (which ``max_fetch_errors`` may tolerate); a
    missing object or access denied is not retried (access denied and a missing bucket are said in
    plain words). The first failure is logged at WARNING at once. An S3 filesystem made from an
    ``s3://`` URI does not retry by itself (feeder's retries are the only ones) and gives up a
    stalled request after 10 s. :meth:`feeder_counters` reports the retries. Reading from a store, the next
    ``readahead`` units of the sequence are taken ahead and read on up to 16 threads (named
    ``feeder:<source>:readahead-<k>``), adjacent row groups of one object in one request (up to
    8 MiB), so that many requests are in flight while the fetchers hand on what came back; what
    they hold is bounded by ``readahead_bytes``.

    Conversion to numpy: numeric columns without nulls are not copied (read-only views of
    Arrow's buffers), fixed-size lists (nested too), fixed-shape tensors and lists that all
    have one length become n-d arrays, lists of different lengths a :class:`~feeder.Ragged` (for an
    input named in ``pad=``), strings become str arrays. A null in a used column is an
    InputValidationError naming it; a column that is missing is a ValueError at registration
    (at creation when ``columns`` is given).

    ``shard``, ``equal_steps`` and ``shuffle_window`` as for ArraySource: ranks read disjoint
    parts of every epoch, and a window of N rows mixes rows of several row groups into each chunk
    (with row groups of 10k-100k rows, each batch would otherwise come from one row group).

    What a checkpoint must match (``feeder_definition``) is one record per file (its name, row
    count, size in bytes, version and a fingerprint of its footer: schema, row groups and, for
    the used columns, their Arrow types, the column chunks' statistics and sizes), plus the used
    columns' Arrow types. ``identity`` says what a file's version is: ``"metadata"`` (the
    default) what the file system says without reading the file: a local file's modification
    time (ns), an object's ETag (S3, Azure) or generation (GCS), else its modification time; so
    that nothing but the footers is read, and a local file whose modification time moved is
    another file, even when touched or copied with the same contents; ``"content"`` a SHA-256 of
    its bytes, read whole when the source is created (and again when a file's size or version
    moved), for data copied between machines, whose time stamps do not survive. A file that
    changes after the source was created is a ValueError at ``start()`` or an
    InputValidationError at the first read of it, naming the file (an object in a store: when a
    worker first opens it, with the one request that opens it, or at the first read after it was
    replaced, even by an object of the same size: each read is confirmed by a request begun after
    it, shared by the reads of the object that end together, or by s3fs's ``If-Match``). A file
    that is not Parquet (or is truncated) is a ValueError naming it at creation, and an
    InputValidationError naming it and the row group at a read.

    Tabular data: an input may take a list of scalar columns, ``columns={"X": ["f0", "f1"]}``,
    stacked into one ``[N, k]`` input in that order (the output is allocated once and filled
    column by column; with ``cast=True`` at registration the columns are converted to the
    model's type as they are copied, with the same checks as the validator's casts). A name with
    ``*``, ``?`` or ``[`` that is not a column is a glob pattern, expanded in the order of the
    first file's schema (``{"X": "f*"}`` or ``{"X": ["a", "f*"]}`` stack what they match). A
    single scalar column feeding a model input of shape ``[N, 1]`` is reshaped to it (no copy).

    With ``map`` or ``filter`` (see :mod:`feeder.sources.transform`), the functions see the
    inputs ``columns`` maps, or with ``columns=None`` every column of the files.

    Args:
        paths: A Parquet file, a folder (its ``.parquet`` and ``.parq`` files, recursively,
            in sorted order), or a list of files and folders; each a local path or a URI
            (``s3://bucket/prefix/``, ``gs://...``, ``file:///...``, an fsspec URI), or a path
            on ``filesystem``.
        columns: ``{input name: column name}``, or a list of scalar columns (or glob patterns)
            to stack into one ``[N, k]`` input; None: the columns named like the inputs.
        shuffle: Shuffle the row groups and the rows within each, per epoch, from ``seed``.
        seed: The shuffle's seed (an int >= 0).
        epochs: Passes over the rows (>= 1); None repeats forever.
        identity: What a file's version is in a checkpoint: ``"metadata"`` (its modification
            time, or an object's ETag or generation) or ``"content"`` (a SHA-256 of its bytes,
            for data copied between machines).
        filesystem: The filesystem ``paths`` are on: a ``pyarrow.fs.FileSystem`` (for example
            ``pyarrow.fs.S3FileSystem(endpoint_override=..., scheme="http")`` with the path
            ``bucket/prefix``) or an fsspec filesystem; None: from each path (a URI's scheme; a
            plain path is local). Credentials are the filesystem's business.
        retries: How many times a transient failure of the store is retried (an int >= 0),
            with exponential backoff, before the read fails.
        readahead: Units (row groups) taken and read ahead of the fetch calls, per source and
            worker process (an int >= 0; 0: none), on up to 16 threads; None: 128 for a store, 0
            for local files.
        readahead_bytes: Bytes (decoded) of the units read ahead and not yet taken, at most
            (one unit is always allowed); None: 256 MiB.
        shard: ``(rank, world_size)``, or ``"env"`` for ``RANK`` and ``WORLD_SIZE``: this rank's
            own part of every epoch (see ArraySource and the guide, "Many hosts without Ray").
        equal_steps: Every rank the same number of rows per epoch (the epoch's last
            ``rows % world_size`` rows left out of it).
        shuffle_window: Rows (in all, split between the workers) held from several row groups,
            so that each chunk mixes them; None: a chunk is one row group.

    Raises:
        ImportError: pyarrow (the ``parquet`` extra) is not installed, or an fsspec URI's driver.
        ValueError: A column ``columns`` names that a file lacks; a folder without Parquet files;
            a URI scheme that neither pyarrow nor fsspec knows; a bad argument value.
        FileNotFoundError: A path or object that does not exist.
        OSError: The store failed (after ``retries``), or access was denied.
        TypeError: A bad argument type.
    """

    def __init__(self, paths: Union[PathLike, Sequence[PathLike]], columns: Optional[Columns] = None, *,
                 shuffle: bool = False, seed: int = 0, epochs: Optional[int] = 1, identity: str = "metadata",
                 filesystem: Any = None, retries: int = 5, readahead: Optional[int] = None,
                 readahead_bytes: Optional[int] = None, shard: Any = None, equal_steps: bool = False,
                 shuffle_window: Optional[int] = None):
        super().__init__(paths, columns, shuffle=shuffle, seed=seed, epochs=epochs, identity=identity,
                         filesystem=filesystem, retries=retries, readahead=readahead, readahead_bytes=readahead_bytes,
                         shard=shard, equal_steps=equal_steps, shuffle_window=shuffle_window)

    def feeder_counters(self, worker_ids: Optional[Sequence[int]] = None) -> Dict[str, float]:
        """This source's counters for those workers (in this process): ``retries``,
        transient storage failures retried; ``retries_exhausted``, reads that still failed
        after every retry (each then a fetch error). None: every worker, and creating and starting
        the source.

        Args:
            worker_ids: The worker ids to count, or None for all.

        Returns:
            ``{"retries": n, "retries_exhausted": m}``.
        """
        retries, exhausted = self._counts.total(None if worker_ids is None else list(worker_ids))
        # Not "source_..." names: those are the source's own figures, which PrometheusLogger takes
        # from one feed; these are the feed's workers', summed over a source's replicas.
        return {"retries": float(retries), "retries_exhausted": float(exhausted)}

    def feeder_validate(self, input_names: Sequence[str], resume: Optional[Mapping[str, Any]]) -> None:
        """At registration: ValueError naming a column the files lack (None ``columns``: the columns
        named like the inputs), when ``columns`` does not map exactly the inputs, or for a
        ``resume`` state of other files, columns or contents.

        Args:
            input_names: The registration's inputs.
            resume: Its ``resume_from`` state, or None.
        """
        if self.columns is None:
            self._check_columns(input_names)
            self.columns = {n: n for n in input_names}  # (a str each: no stacking)
        else:
            unknown = [n for n in input_names if n not in self.columns]
            extra = [n for n in self.columns if n not in input_names]
            if unknown or extra:
                raise ValueError(f"ParquetSource columns {self.columns} must map exactly the inputs "
                                 f"{list(input_names)}" + (f"; missing {unknown}" if unknown else "")
                                 + (f"; not inputs {extra}" if extra else "")
                                 + (" (arrays kept with keep= are read like inputs: map them too)"
                                    if unknown else ""))
            self.columns = {n: self.columns[n] for n in input_names}
        self._fingerprint()
        super().feeder_validate(input_names, resume)

    # ---- the binding protocol ----
    def feeder_bind(self, binding: SourceBinding) -> None:
        """At ``start()``: ValueError naming a local file that changed since the source was
        created; then as :meth:`ShardedSource.feeder_bind`. Objects in a store are checked when
        a worker opens them (their size and version come with the handle, one request), an
        InputValidationError naming the object: checking them all here would cost a request per
        object at every start.

        Args:
            binding: What feeder tells the source (see :class:`SourceBinding`).
        """
        self._release_io()
        self._stop = threading.Event()
        for index in range(len(self.files)):
            changed = self._changed(index) if self._stores[index].local else None
            if changed is not None:
                raise ValueError(f"source {binding.source_name!r}: {changed}")
        self._targets, self._as_column = {}, set()
        for name, spec in zip(binding.input_names, binding.specs):
            col = (self.columns or {}).get(name)
            if isinstance(col, list) and binding.cast and spec.dtype is not None and not spec.is_string:
                self._targets[name] = np.dtype(spec.dtype)
            if isinstance(col, str) and spec.shape is not None and len(spec.shape) == 2 and spec.shape[1] == 1:
                self._as_column.add(name)
        super().feeder_bind(binding)
        self._active = True

    def feeder_describe(self) -> str:
        """A phrase for FeedTimeout and ``diagnose()`` messages: rows, row groups, files, epochs."""
        return f"{super().feeder_describe()} (row groups) of {len(self.files)} Parquet file(s)"

    def feeder_release(self) -> None:
        """At ``stop()``: close the workers' open files, stop and join the readahead threads, and
        log the store's retries at INFO (forget the cursors)."""
        super().feeder_release()
        self._handles = {}
        self._release_io()
        retries, exhausted = self._counts.total()
        if retries:
            log.info("ParquetSource: %d transient storage failure(s) retried, %d read(s) failed after %d retries",
                     retries, exhausted, self._retry.attempts)

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state["_handles"] = {}  # open files stay with their process
        state["_metas"] = None  # footers are not sent: the fingerprint was taken at registration
        state["_footers"] = [None] * len(self._footers)  # read again where needed, once per object
        for name in ("_io_lock", "_open", "_opening", "_pool", "_ahead", "_ended", "_stop", "_checks"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self._reset_io()

    # ---- reading ----
    def _file(self, worker_id: int, index: int) -> Any:
        held = self._handles.get(worker_id)
        if held is not None and held[0] == index:
            return held[1]
        changed = self._changed(index)
        if changed is not None:
            raise InputValidationError(changed)
        pa = import_pyarrow()
        path = self.files[index][0]
        try:
            pf = pa.parquet.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise _read_error(e, f"Parquet file {path!r}") from e
        self._handles[worker_id] = (index, pf)  # one open file per worker: each thread its own
        return pf

    def _row_group(self, unit: int, worker_id: int) -> Any:
        """The used columns of ``unit``'s row group as an Arrow table: a local file's through the
        worker's own ParquetFile; an object's as read ahead, or read now."""
        index, rg = self._unit_at[unit]
        if not self._stores[index].local:
            pool = self._pool
            got = pool.take(unit) if pool is not None else None
            value = got() if got is not None else self._read_remote([unit], worker_id)[0]
            if isinstance(value, _Failed):
                raise value.error
            return value
        assert self.columns is not None  # set at registration
        pf = self._file(worker_id, index)
        try:
            return pf.read_row_group(rg, columns=self._flat(self.columns))
        except (import_pyarrow().ArrowException, OSError) as e:
            raise _read_error(e, f"Parquet file {self.files[index][0]!r}, row group {rg}") from e

    def _read(self, unit: int, rows: np.ndarray, worker_id: int) -> List[np.ndarray]:
        index, rg = self._unit_at[unit]
        assert self.columns is not None  # set at registration
        table = self._row_group(unit, worker_id)
        n = int(self._units[unit])
        if table.num_rows != n:  # changed under an open handle: never a short or mixed chunk
            raise InputValidationError(f"Parquet file {self.files[index][0]!r} changed since the ParquetSource was "
                                       f"created: row group {rg} has {table.num_rows} rows, it had {n}")
        whole = len(rows) == n and (n < 2 or (rows[0] == 0 and bool((np.diff(rows) == 1).all())))
        out = []
        for name, col in self.columns.items():
            if not isinstance(col, str):
                out.append(self._stack(table, name, col, None if whole else rows, index, rg))
                continue
            where = f"column {col!r} (input {name!r}) of {self.files[index][0]!r}, row group {rg}"
            a = to_numpy(table.column(col), where)
            if not whole:  # np.take: the same gather as a[rows], 2-3x faster for rows of many values
                a = np.take(a, rows, axis=0) if isinstance(a, np.ndarray) else a[rows]
            if name in self._as_column and isinstance(a, np.ndarray) and a.ndim == 1:
                a = a.reshape(len(a), 1)  # a view: the model's input is [N, 1]
            out.append(a)
        return out

    def _stack(self, table: Any, name: str, cols: List[str], rows: Optional[np.ndarray], index: int,
               rg: int) -> np.ndarray:
        """Scalar columns ``cols`` as one ``[N, k]`` array (``rows`` of them, in that order, or all):
        allocated once and filled block of rows by block, column by column, converted to the
        model's type as it is copied when ``cast=True`` asked for it (checked as the validator
        checks its casts: no finite value may overflow, integers must fit)."""
        path = self.files[index][0]
        parts = []
        for c in cols:
            where = f"column {c!r} (input {name!r}) of {path!r}, row group {rg}"
            a = to_numpy(table.column(c), where)
            if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "biuf":
                what = ("rows of different lengths" if not isinstance(a, np.ndarray) else
                        f"dtype {a.dtype}" if a.ndim == 1 else f"shape {a.shape} per chunk")
                raise InputValidationError(f"{where}: a stacked input takes scalar numeric columns, this one has "
                                           f"{what}; name it alone (columns={{{name!r}: {c!r}}}) or leave it out")
            parts.append((c, a))
        dtype = np.result_type(*(a.dtype for _, a in parts))
        target = self._targets.get(name)
        if target is not None and all(can_cast(a.dtype, target) for _, a in parts):
            dtype = target
            for c, a in parts:  # integers narrowed must fit (as the validator's cast checks)
                if dtype.kind in "iu" and a.dtype.kind in "iu" and a.size and not np.can_cast(a.dtype, dtype):
                    info = np.iinfo(dtype)
                    lo, hi = a.min(), a.max()
                    if lo < info.min or hi > info.max:
                        raise InputValidationError(f"column {c!r} (input {name!r}) of {path!r}, row group {rg}: "
                                                   f"values in [{lo}, {hi}] do not fit {dtype}")
        n = len(parts[0][1]) if rows is None else len(rows)
        out = np.empty((n, len(parts)), dtype)
        step = max(1, STACK_BLOCK_BYTES // max(1, len(parts) * dtype.itemsize))
        j = 0
        try:
            with np.errstate(over="raise"):
                for lo in range(0, n, step):
                    hi = min(n, lo + step)
                    block = out[lo:hi]
                    picked = None if rows is None else rows[lo:hi]
                    for j, (_, a) in enumerate(parts):
                        block[:, j] = a[lo:hi] if picked is None else a[picked]
        except FloatingPointError:
            raise InputValidationError(f"column {parts[j][0]!r} (input {name!r}) of {path!r}, row group {rg}: "
                                       f"finite values that do not fit {dtype} (at most "
                                       f"{float(np.finfo(dtype).max):g} in magnitude)") from None
        return out
