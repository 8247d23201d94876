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
"""
from __future__ import annotations

import errno
import fnmatch
import functools
import hashlib
import logging
import os
import re
import threading
from collections import OrderedDict, deque
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import numpy as np

from ..errors import InputValidationError
from ..storage import (
    Opened,
    Retry,
    RetryCounts,
    SharedCheck,
    Store,
    is_io_failure,
    is_transient,
    map_bounded,
    plain_error,
    resolve_all,
    retrying,
    sha256_file,
)
from ..validation import can_cast, int_arg
from .arrow import import_pyarrow, to_numpy
from .base import SourceBinding
from .readahead import Readahead
from .sharded import ShardedSource

log = logging.getLogger("feeder")

__all__ = ["ParquetSource", "import_pyarrow", "to_numpy"]  # to_numpy: moved to .arrow, importable here too

PathLike = Union[str, "os.PathLike[str]"]


IDENTITIES = ("metadata", "content")
FOOTER_THREADS = 32        # footers (and versions) of objects in a store read at once at creation and start
LOCAL_FOOTER_THREADS = 8   # ... and of local files (a network disk gains; a local one loses nothing)
READAHEAD_UNITS = 128      # readahead=None on a store: units (row groups) taken ahead per source (and process)
READAHEAD_THREADS = 16     # ... read by at most this many threads (requests in flight)
COALESCE_BYTES = 8 << 20   # adjacent row groups of one object read in one request up to this many bytes on disk
READAHEAD_BYTES = 256 << 20  # readahead_bytes=None: bytes (decoded) read ahead and not yet taken, at most
OPEN_HANDLES = 64          # objects kept open per source (and process), least recently used closed first
PRE_BUFFER = True          # a row group's column chunks fetched in few coalesced, concurrent requests
# The Arrow types (as str() names them) of the scalar numeric columns a stacked input takes.
STACKABLE_TYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                             "halffloat", "float", "double"})
GLOB_CHARS = "*?["
# Stacking scalar columns into an [N, k] input fills the output in blocks of rows of about this
# many bytes, column by column: each block stays in cache while its k columns are written.
STACK_BLOCK_BYTES = 256 << 10

Columns = Mapping[str, Union[str, Sequence[str]]]


def _as_list(paths: Union[PathLike, Sequence[PathLike]]) -> List[str]:
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    if not isinstance(paths, (list, tuple)):
        raise TypeError(f"paths must be a file, a directory or a list of them, got {type(paths).__name__}")
    return [os.fspath(p) for p in paths]


def _list_files(paths: Sequence[str]) -> List[Tuple[str, str]]:
    """(path, name recorded in a state) of every Parquet file, in a fixed order."""
    out: List[Tuple[str, str]] = []
    for p in paths:
        if os.path.isdir(p):
            found = []
            for root, _, files in os.walk(p):
                found += [os.path.join(root, f) for f in files if f.endswith((".parquet", ".parq"))]
            if not found:
                raise ValueError(f"directory {p!r} holds no .parquet files")
            out += [(f, os.path.relpath(f, p)) for f in sorted(found)]
        elif os.path.isfile(p):
            out.append((p, os.path.basename(p)))
        else:
            raise FileNotFoundError(f"no such Parquet file or directory: {p!r}")
    if not out:
        raise ValueError("paths names no Parquet file")
    return out


class ParquetSource(ShardedSource):
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
        super().__init__(shuffle=shuffle, seed=seed, epochs=epochs, shard=shard, equal_steps=equal_steps,
                         shuffle_window=shuffle_window)
        import_pyarrow()
        if columns is not None and not isinstance(columns, Mapping):
            raise TypeError(f"columns must be a dict of input name -> column name (or list of column names) or "
                            f"None, got {type(columns).__name__}")
        if not isinstance(identity, str):
            raise TypeError(f"identity must be one of {IDENTITIES}, got {type(identity).__name__}")
        if identity not in IDENTITIES:
            raise ValueError(f"identity must be one of {IDENTITIES}, got {identity!r}")
        retries = int_arg("retries", retries, 0)
        if readahead is not None:
            readahead = int_arg("readahead", readahead, 0)
        if readahead_bytes is not None and int_arg("readahead_bytes", readahead_bytes, 0) < 1:
            raise ValueError(f"readahead_bytes must be >= 1 or None, got {readahead_bytes}")
        self.identity = identity
        given = _column_spec(columns) if columns is not None else None
        self._retry = Retry(attempts=retries)
        self._counts = RetryCounts()
        self._active = False  # between feeder_bind and feeder_release: a readahead pool may start
        self._reset_io()
        given_paths = _as_list(paths)
        # One store per filesystem (URIs of one bucket share a client), and what is at each path
        # listed concurrently: a list of many objects costs what a prefix holding them costs.
        located = resolve_all(given_paths, filesystem)
        listed = map_bounded(self._list, located, FOOTER_THREADS if any(not st.local for st, _ in located) else 1,
                             "feeder:parquet:list")
        # Per file: (where it is shown and what it is, the name recorded in a state): a local file's
        # path and its name relative to the folder given; an object's URI, twice.
        self.files: List[Tuple[str, str]] = []
        self._stores: List[Store] = []
        self._paths: List[str] = []     # each file's path inside its store
        opened: Dict[int, Opened] = {}  # file index -> the object as listing it opened it (its footer is read next)
        roots = []
        for (store, path), found in zip(located, listed):
            if store.local:
                self._paths += [f for f, _, _ in found]
                self.files += [(f, name) for f, name, _ in found]
                roots.append(os.path.abspath(path))
            else:
                for f, uri, pre in found:
                    if pre is not None:
                        opened[len(self._paths)] = pre
                    self._paths.append(f)
                    self.files.append((uri, uri))
                roots.append(store.uri(path.rstrip("/") or path))
            self._stores += [store] * len(found)
        if not self.files:
            raise ValueError("paths names no Parquet file")
        # What was given: local folders and files as absolute paths, objects as URIs (feeder.predict
        # refuses an output inside them).
        self.roots = roots
        self.remote = any(not s.local for s in self._stores)
        self._readahead = (READAHEAD_UNITS if self.remote else 0) if readahead is None else readahead
        self._readahead_bytes = READAHEAD_BYTES if readahead_bytes is None else int(readahead_bytes)
        # Per file: its columns' Arrow types (files of one schema share one dict), its (size in
        # bytes, version) when read here, the row counts of all its row groups, and (content
        # identity) the SHA-256 of its bytes.
        self._fields: List[Dict[str, str]] = []
        self._stamps: List[Tuple[int, str]] = []
        self._groups: List[List[int]] = []
        self._hashes: List[Optional[str]] = []
        # The footers read here, kept until the used columns' fingerprint is taken from them
        # (at registration, when the columns are known), so a file is never read twice for it;
        # objects' footers are kept on (not pickled): a read then needs no request for them.
        self._metas: Optional[List[Any]] = []
        self._footers: List[Any] = []
        self._prints: Optional[List[str]] = None  # per file, see _file_print
        self._printed_for: Optional[Tuple[str, ...]] = None
        self._unit_bytes: Optional[np.ndarray] = None  # per unit, the used columns' decoded bytes
        self._unit_disk: Optional[np.ndarray] = None   # ... and their bytes in the file
        shared: Dict[Tuple[Tuple[str, str], ...], Dict[str, str]] = {}
        units: List[int] = []
        self._unit_at: List[Tuple[int, int]] = []  # unit -> (file index, row group)
        self._pre_opened = opened
        try:
            probes = map_bounded(self._probe, list(range(len(self.files))),
                                 FOOTER_THREADS if self.remote else LOCAL_FOOTER_THREADS, "feeder:parquet:footers")
        finally:
            for pre in self._pre_opened.values():  # left by a probe that never ran (an earlier one failed)
                pre.handle.close()
            self._pre_opened = {}
        for i, (stamp, meta, digest) in enumerate(probes):
            fields = tuple((f.name, str(f.type)) for f in meta.schema.to_arrow_schema())
            self._fields.append(shared.setdefault(fields, dict(fields)))
            self._stamps.append(stamp)
            self._hashes.append(digest)
            self._metas.append(meta)
            self._footers.append(None if self._stores[i].local else meta)
            groups = [meta.row_group(rg).num_rows for rg in range(meta.num_row_groups)]
            self._groups.append(groups)
            for rg, n in enumerate(groups):
                if n:
                    units.append(n)
                    self._unit_at.append((i, rg))
        self._file_rows = [sum(g) for g in self._groups]
        self._init_units(units)
        # input name -> column name, or the list of scalar columns stacked into it (globs expanded)
        self.columns: Optional[Dict[str, Union[str, List[str]]]] = None
        if given is not None:
            self.columns = self._expand(given)
            self._check_columns(self._flat(self.columns))
            self._check_stacked(self.columns)
        # Set at bind from what the sessions declare: the dtype each stacked input is cast to as
        # it is filled (cast=True), and the inputs of shape [N, 1] fed by one scalar column.
        self._targets: Dict[str, np.dtype] = {}
        self._as_column: Set[str] = set()
        self._handles: Dict[int, Tuple[int, Any]] = {}  # worker id -> (file index, open ParquetFile)

    def _expand(self, given: Dict[str, Union[str, List[str]]]) -> Dict[str, Union[str, List[str]]]:
        """Glob patterns (a name with ``*?[`` that is not a column) replaced by the columns they
        match, in the order of the first file's schema: a pattern always makes a stacked input."""
        schema = list(self._fields[0]) if self._fields else []
        out: Dict[str, Union[str, List[str]]] = {}
        for name, col in given.items():
            items = [col] if isinstance(col, str) else col
            expanded: List[str] = []
            globbed = False
            for item in items:
                if item not in schema and any(c in item for c in GLOB_CHARS):
                    found = [c for c in schema if fnmatch.fnmatchcase(c, item)]
                    if not found:
                        raise ValueError(f"ParquetSource: the pattern {item!r} (input {name!r}) matches no column of "
                                         f"{self.files[0][0]!r} (its columns: {schema})")
                    expanded += found
                    globbed = True
                else:
                    expanded.append(item)
            twice = sorted({c for c in expanded if expanded.count(c) > 1})
            if twice:
                raise ValueError(f"ParquetSource: input {name!r} names column(s) {twice} more than once")
            out[name] = expanded if (globbed or not isinstance(col, str)) else expanded[0]
        return out

    @staticmethod
    def _flat(columns: Mapping[str, Union[str, List[str]]]) -> List[str]:
        """Every column name used, once each, in order."""
        out: List[str] = []
        for col in columns.values():
            for c in ([col] if isinstance(col, str) else col):
                if c not in out:
                    out.append(c)
        return out

    def _transform_columns(self) -> List[str]:
        """What ``map`` and ``filter`` functions see: the inputs ``columns`` maps, or with
        ``columns=None`` every column of the files (of the first file's schema; every file must
        have them)."""
        if self.columns is not None:
            return list(self.columns)
        return list(self._fields[0]) if self._fields else []

    def _offered_columns(self) -> Optional[Tuple[List[str], bool]]:
        # columns= maps exactly the inputs; without it, inputs are read from the columns of their names
        if self.columns is not None:
            return list(self.columns), True
        return (list(self._fields[0]) if self._fields else []), False

    def _reset_io(self) -> None:
        """What reading from a store holds in one process: open objects, the readahead pool, the
        units taken ahead. Made empty here, at bind, at release and when unpickled."""
        self._io_lock = threading.Lock()
        self._open: "OrderedDict[int, List[Any]]" = OrderedDict()  # file index -> [handle, users, pinned]
        self._opening: Dict[int, threading.Event] = {}             # file index -> set once it is open
        self._pool: Optional[Readahead] = None
        self._ahead: Dict[int, Deque[List[Any]]] = {}  # readahead key -> [[sequence index, unit, submitted]]
        self._ended: Set[int] = set()                     # readahead keys whose sequence has ended
        self._stop = threading.Event()
        self._checks = SharedCheck()  # per object: the checks that reads of it did not meet another version

    # ---- I/O through the store, with retries ----
    def _io(self, fn: Any, what: str, worker: Optional[int], uri: Optional[str] = None) -> Any:
        """``fn()`` with transient failures retried (see feeder.storage.retrying), counted for
        ``worker`` (None: creating or starting the source); the source's first failure is logged
        at WARNING at once. A failure the user must act on (access denied, a missing bucket, an
        endpoint that cannot be reached) is raised in plain words naming ``uri`` (the store's own
        error its cause)."""
        try:
            return retrying(fn, what, self._retry, stop=self._stop, counts=self._counts, worker=worker)
        except Exception as e:
            if is_transient(e):
                self._counts.gave_up(worker)
                log.warning("ParquetSource: %s failed after its retries (up to %d within %.0f s): %s: %s", what,
                            self._retry.attempts, self._retry.budget_s, type(e).__name__,
                            " ".join(str(e).split())[:300])
            plain = plain_error(e, uri) if uri is not None else None
            if plain is not None:
                raise plain from e
            raise

    def _list(self, located: Tuple[Store, str]) -> List[Tuple[str, str, Optional[Opened]]]:
        """(path, name, the object opened or None) of each Parquet file at one given path."""
        store, path = located
        if store.local:
            return [(f, name, None) for f, name in _list_files([path])]
        return self._io(functools.partial(store.list_parquet, path),  # type: ignore[attr-defined,no-any-return]
                        f"listing {store.uri(path)!r}", None, store.uri(path))

    def _probe(self, index: int) -> Tuple[Tuple[int, str], Any, Optional[str]]:
        """((size, version), footer, SHA-256 or None) of file ``index``, read at creation."""
        pa = import_pyarrow()
        store, path, shown = self._stores[index], self._paths[index], self.files[index][0]
        if store.local:
            stamp = _stamp(path)
            meta = _read_footer(pa, path)
            return stamp, meta, sha256_file(path) if self.identity == "content" else None
        # opened by the listing: the first try needs no request to open it (a retry opens it again)
        pre: List[Opened] = [p for p in [self._pre_opened.pop(index, None)] if p is not None]

        def once() -> Tuple[Tuple[int, str], Any]:
            opened: Opened = pre.pop() if pre else store.open_versioned(path)  # type: ignore[attr-defined]
            try:
                return (opened.size, opened.version), _read_footer(pa, opened.handle, shown)
            finally:
                opened.handle.close()

        stamp, meta = self._io(once, f"reading the footer of {shown!r}", None, shown)
        digest = (self._io(lambda: store.sha256(path), f"hashing {shown!r}", None, shown)  # type: ignore
                  if self.identity == "content" else None)
        return stamp, meta, digest

    def _stat(self, index: int, worker: Optional[int]) -> Tuple[int, str]:
        store, path = self._stores[index], self._paths[index]
        if store.local:
            return _stamp(path)
        return self._io(lambda: store.stat(path), f"checking {self.files[index][0]!r}", worker)  # type: ignore

    def _hash(self, index: int, worker: Optional[int]) -> str:
        store, path = self._stores[index], self._paths[index]
        if store.local:
            return sha256_file(path)
        return self._io(lambda: store.sha256(path), f"hashing {self.files[index][0]!r}", worker)  # type: ignore

    def _footer(self, index: int, worker: Optional[int]) -> Any:
        store, path = self._stores[index], self._paths[index]
        pa = import_pyarrow()
        if store.local:
            return _read_footer(pa, path)
        shown = self.files[index][0]

        def once() -> Any:
            with store.open_input(path) as f:  # type: ignore[attr-defined]
                return _read_footer(pa, f, shown)
        return self._io(once, f"reading the footer of {shown!r}", worker)

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

    def _check_stacked(self, columns: Mapping[str, Union[str, List[str]]]) -> None:
        """ValueError naming a column a stacked input cannot take (a string, a list: see _stack),
        from the files' schemas, before anything is read."""
        seen: Set[int] = set()
        for (path, _), fields in zip(self.files, self._fields):
            if id(fields) in seen:  # files of one schema share one dict
                continue
            seen.add(id(fields))
            for name, cols in columns.items():
                if isinstance(cols, str):
                    continue
                for c in cols:
                    t = fields[c]
                    values = t[len("dictionary<values="):].split(",", 1)[0] if t.startswith("dictionary<") else t
                    if values not in STACKABLE_TYPES:
                        raise ValueError(f"ParquetSource: input {name!r} stacks column {c!r}, which is {t} in "
                                         f"{path!r}: a stacked input takes scalar numeric columns; name it alone "
                                         f"(columns={{{name!r}: {c!r}}}) or leave it out")

    def _check_columns(self, wanted: Sequence[str]) -> None:
        for (path, _), fields in zip(self.files, self._fields):
            missing = [c for c in wanted if c not in fields]
            if missing:
                raise ValueError(f"ParquetSource: column(s) {missing} not in {path!r} (its columns: {list(fields)})")

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
                                 + (f"; not inputs {extra}" if extra else ""))
            self.columns = {n: self.columns[n] for n in input_names}
        self._fingerprint()
        super().feeder_validate(input_names, resume)

    # ---- what a state must match ----
    def _used(self) -> Tuple[str, ...]:
        if self.columns is not None:
            return tuple(self._flat(self.columns))
        return tuple(self._fields[0]) if self._fields else ()

    def _fingerprint(self) -> List[str]:
        """Each file's footer fingerprint for the used columns (see _file_print), taken once."""
        used = self._used()
        if self._prints is None or self._printed_for != used:
            metas = self._metas
            if metas is None:  # taken before for other columns: read the footers again
                metas = [f if f is not None else self._footer(i, None) for i, f in enumerate(self._footers)]
            self._prints = [_file_print(meta, size, used) for meta, (size, _) in zip(metas, self._stamps)]
            if self.remote:
                sizes = np.array([_group_bytes(metas[i].row_group(rg), used) for i, rg in self._unit_at],
                                 dtype=np.int64).reshape(-1, 2)
                self._unit_bytes, self._unit_disk = sizes[:, 0].copy(), sizes[:, 1].copy()
            self._printed_for = used
            self._metas = None
        return self._prints

    def _version(self, index: int) -> str:
        """File ``index``'s version as a state records it: ``sha256:<hex>`` (identity "content"), or
        what the store says: ``mtime_ns:<ns>``, ``etag:<ETag>``, ``generation:<n>``..."""
        digest = self._hashes[index]
        return f"sha256:{digest}" if digest is not None else self._stamps[index][1]

    def _definition(self) -> Dict[str, Any]:
        d = super()._definition()
        prints = self._fingerprint()
        d["identity"] = self.identity
        # One record per file, {name, size, version, ...}: an object in a store is named by its URI
        # and versioned by its ETag or generation, so that a message can name the file that differs.
        d["files"] = [{"name": name, "rows": rows, "size": self._stamps[i][0], "version": self._version(i),
                       "footer": prints[i]}
                      for i, ((_, name), rows) in enumerate(zip(self.files, self._file_rows))]
        d["columns"] = self.columns
        d["dtypes"] = {name: " | ".join(sorted({f[c] for f in self._fields for c in ([col] if isinstance(col, str)
                                                                                      else col) if c in f}))
                       for name, col in (self.columns or {c: c for c in self._used()}).items()}
        return d

    def _changed(self, index: int, worker: Optional[int] = None) -> Optional[str]:
        """None if file ``index`` is as it was when the source was created, else a sentence saying
        how it changed. ``identity="metadata"``: its size and version (modification time, ETag,
        generation) are what they were; ``"content"``: its size, and its bytes' hash whenever its
        size or version moved."""
        path = self.files[index][0]
        size, version = self._stamps[index]
        try:
            now = self._stat(index, worker)
        except OSError as e:
            if is_transient(e):  # the store failed: it cannot tell (the caller's own failure stands)
                return None
            return f"Parquet file {path!r} cannot be read any more ({type(e).__name__}: {e})"
        return self._how_changed(index, now, worker)

    def _how_changed(self, index: int, now: Tuple[int, str], worker: Optional[int]) -> Optional[str]:
        path = self.files[index][0]
        size, version = self._stamps[index]
        if now == (size, version):
            return None
        what = [f"{size} -> {now[0]} bytes"] if now[0] != size else []
        if not what and self.identity == "content":
            try:
                same = self._hash(index, worker) == self._hashes[index]
            except OSError as e:
                return f"Parquet file {path!r} cannot be read any more ({type(e).__name__}: {e})"
            if same:
                self._stamps[index] = now  # touched or copied, not changed: no need to hash it again
                return None
            what.append("other contents")
        try:
            meta = self._footer(index, worker)
        except ValueError:
            what.append("no longer a readable Parquet file")
        except OSError as e:
            return f"Parquet file {path!r} cannot be read any more ({type(e).__name__}: {e})"
        else:
            groups = [meta.row_group(rg).num_rows for rg in range(meta.num_row_groups)]
            if groups != self._groups[index]:
                what.append(f"row groups of {self._groups[index]} -> {groups} rows")
            elif _file_print(meta, now[0], self._used()) != self._fingerprint()[index]:
                what.append("other schema or column statistics in its footer")
        if not what:
            if version.startswith("mtime_ns:"):
                what.append("its modification time moved, its size and footer did not: if its contents are the "
                            "same (touched, copied), identity='content' compares contents instead of time stamps")
            else:
                what.append(f"its version moved ({version} -> {now[1]}), its size and footer did not: if its "
                            f"contents are the same (copied), identity='content' compares contents instead")
        return (f"Parquet file {path!r} changed since the ParquetSource was created ({', '.join(what)}); "
                f"create the source again to read it as it is now (a state of the old contents cannot resume "
                f"on the new ones)")

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

    def _release_io(self) -> None:
        with self._io_lock:
            self._active = False  # a fetch still under way after stop() reads without a pool
            pool, self._pool = self._pool, None
            handles = [entry[0] for entry in self._open.values()]
            self._open.clear()
            self._ahead, self._ended = {}, set()
        self._stop.set()  # a retry waiting out its backoff gives up
        if pool is not None and not pool.close():
            log.warning("ParquetSource: readahead threads of %r did not end within %.0f s", pool.name, 2.0)
        for h in handles:
            try:
                h.close()
            except Exception:
                pass

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

    def _read_remote(self, units: Sequence[int], worker_id: int) -> List[Any]:
        """Row groups of one object (adjacent ones, fetched in one request), each as its own table
        (or a ``_Failed`` holding what reading it raised), read through the object's shared handle
        with transient failures retried. When a read of several fails, each is read on its own, so
        that a damaged row group fails only itself."""
        index = self._unit_at[units[0]][0]
        rgs = [self._unit_at[u][1] for u in units]
        assert self.columns is not None  # set at registration
        cols = self._flat(self.columns)
        pa = import_pyarrow()
        shown = self.files[index][0]
        where = f"Parquet file {shown!r}, row group{'s' if len(rgs) > 1 else ''} {', '.join(map(str, rgs))}"

        def once() -> Any:
            handle, footer, pinned = self._acquire(index, worker_id)
            try:
                table = pa.parquet.ParquetFile(handle, metadata=footer, pre_buffer=PRE_BUFFER).read_row_groups(
                    rgs, columns=cols)
            except Exception as e:
                if is_transient(e) or _expired(e):
                    # the retry opens the object again, checking its size and version: one deleted
                    # or replaced under this handle is then named, never read through it again
                    self._forget(index, handle)
                if _expired(e):  # s3fs: the object's ETag no longer matches (its If-Match failed)
                    raise InputValidationError(self._changed(index, worker_id) or
                                               f"Parquet file {shown!r} changed while it was read ({e})") from e
                raise
            finally:
                self._unuse(index)
            if not pinned:
                # The handle's GETs carry no If-Match: the object must still be the version the
                # handle opened once they are answered, or the bytes may be another object's
                # (replaced by one of the same size). One HEAD begun after the read, shared by
                # every read of the object that ended meanwhile.
                self._confirm(index, worker_id, handle)
            return table
        try:
            table = self._io(once, f"reading {where}", worker_id, shown)
        except Exception as e:
            if len(units) > 1:
                return [self._read_remote([u], worker_id)[0] for u in units]
            if isinstance(e, (InputValidationError, _CheckFailed)) or not isinstance(e, (pa.ArrowException, OSError)):
                return [_Failed(e)]
            if not is_transient(e) and is_io_failure(e):
                # A failure no retry mends (the object is gone, or denied now): the object changed
                # (bad data, never skipped) when it is no longer what the source was created from.
                changed = self._changed(index, worker_id)
                if changed is not None:
                    gone = InputValidationError(changed)
                    gone.__cause__ = e
                    return [_Failed(gone)]
            failed = _read_error(e, where)
            failed.__cause__ = e
            return [_Failed(failed)]
        out, at = [], 0
        for u in units:
            n = int(self._units[u])
            out.append(table.slice(at, n) if len(units) > 1 else table)
            at += n
        return out

    def _acquire(self, index: int, worker: Optional[int]) -> Tuple[Any, Any, bool]:
        """(the object's open handle, its footer, whether the store checks its version at each
        read), opened once per process by one thread while the others wait (on S3 a HEAD request,
        whose size and ETag must be what they were: InputValidationError if not)."""
        while True:
            with self._io_lock:
                entry = self._open.get(index)
                if entry is not None:
                    entry[1] += 1
                    self._open.move_to_end(index)
                    return entry[0], self._footers[index], entry[2]
                opening = self._opening.get(index)
                if opening is None:
                    opening = self._opening[index] = threading.Event()
                    break
            opening.wait(1.0)  # another thread opens it (a request): use its handle, or try again
        try:
            handle, footer, pinned = self._open_object(index, worker)
        finally:
            with self._io_lock:
                del self._opening[index]
            opening.set()
        idle = []
        with self._io_lock:
            self._footers[index] = footer
            self._open[index] = [handle, 1, pinned]
            while len(self._open) > OPEN_HANDLES:
                oldest = next((i for i, (_, users, _) in self._open.items() if users == 0), None)
                if oldest is None:
                    break
                idle.append(self._open.pop(oldest)[0])
        for h in idle:
            h.close()
        return handle, footer, pinned

    def _open_object(self, index: int, worker: Optional[int]) -> Tuple[Any, Any, bool]:
        """(an open handle, the footer, whether reads through the handle are checked against its
        version by the store) of object ``index``, whose size and version must be what they were
        (InputValidationError naming how it changed, or that it is gone). A transient failure is
        raised as it came (the read that opens it retries)."""
        store, path, shown = self._stores[index], self._paths[index], self.files[index][0]
        try:
            opened = store.open_versioned(path)  # type: ignore[attr-defined]
        except (FileNotFoundError, PermissionError, IsADirectoryError) as e:  # gone or denied: as a local stat says
            raise InputValidationError(f"Parquet file {shown!r} cannot be read any more ({type(e).__name__}: "
                                       f"{e})") from e
        handle = opened.handle
        try:
            now = (opened.size, opened.version)
            if now != self._stamps[index]:
                changed = self._how_changed(index, now, worker)
                if changed is not None:
                    raise InputValidationError(changed)
            footer = self._footers[index]
            if footer is None:  # in a worker process: footers are not pickled
                footer = _read_footer(import_pyarrow(), handle, shown)
        except BaseException:
            handle.close()
            raise
        return handle, footer, opened.pinned

    def _confirm(self, index: int, worker: Optional[int], handle: Any) -> None:
        """InputValidationError when object ``index`` is no longer the version the source was
        created from, checked by a request begun after this call (the read before it was then of
        that version); a transient failure of the check (after its retries) is an OSError. Reads
        of one object that end together share one check (:class:`~feeder.storage.SharedCheck`)."""
        store, path, shown = self._stores[index], self._paths[index], self.files[index][0]

        def check() -> Tuple[str, Any]:
            try:
                now = retrying(lambda: store.stat(path), f"checking {shown!r}", self._retry,  # type: ignore
                               stop=self._stop, counts=self._counts, worker=worker)
            except Exception as e:
                if is_transient(e):
                    return "failed", e
                return "changed", f"Parquet file {shown!r} cannot be read any more ({type(e).__name__}: {e})"
            changed = self._how_changed(index, now, worker) if now != self._stamps[index] else None
            return ("changed", changed) if changed is not None else ("same", None)

        outcome, detail = self._checks.check(index, check)
        if outcome == "changed":
            self._forget(index, handle)
            raise InputValidationError(detail)
        if outcome == "failed":
            raise _CheckFailed(f"checking that {shown!r} did not change while it was read failed (after "
                               f"{self._retry.attempts} retries): {type(detail).__name__}: {detail}") from detail

    def _forget(self, index: int, handle: Any) -> None:
        """Stop sharing ``handle`` (its users finish with it; it closes when they let go)."""
        with self._io_lock:
            entry = self._open.get(index)
            if entry is not None and entry[0] is handle:
                del self._open[index]

    def _unuse(self, index: int) -> None:
        with self._io_lock:
            entry = self._open.get(index)
            if entry is not None:
                entry[1] -= 1

    # ---- reading ahead (objects in a store) ----
    def _take(self, worker_id: int) -> int:
        """The sequence index this call reads, as :meth:`ShardedSource._take`; reading from a store
        with ``readahead``, the next units of the sequence are taken too and read ahead (per worker
        when ordered, since each worker's units are its own; otherwise shared by the process's
        fetchers), so that their requests are in flight while this call hands its unit on."""
        if not self._readahead or not self.remote:
            return super()._take(worker_id)
        binding = self._binding
        key = worker_id if binding is not None and binding.ordered else -1
        with self._io_lock:
            pool = self._pool
            if pool is None:
                if not self._active:  # released (stopped): no pool that nobody would close
                    return super()._take(worker_id)
                pool = self._pool = self._start_pool(binding.source_name if binding is not None else "parquet")
            queue = self._ahead.setdefault(key, deque())
            if not queue:
                queue.append(self._claim(worker_id, key))
            entry = queue.popleft()
            self._top_up(pool, queue, worker_id, key)
        return int(entry[0])

    def _start_pool(self, name: str) -> Readahead:
        threads = min(self._readahead, READAHEAD_THREADS)
        pa = import_pyarrow()
        if pa.io_thread_count() < threads:
            # pre-buffered reads run on pyarrow's I/O pool (8 threads by default): as many as the
            # readahead's, or its requests would queue there (process-wide; never lowered)
            log.debug("ParquetSource: pyarrow's I/O thread pool raised from %d to %d threads", pa.io_thread_count(),
                      threads)
            pa.set_io_thread_count(threads)
        return Readahead(f"feeder:{name}:readahead", threads, self._readahead_bytes)

    def _claim(self, worker_id: int, key: int) -> List[Any]:
        index = super()._take(worker_id)
        where = self._locate(index)
        if where is None:
            self._ended.add(key)  # every later index is past the end too
        return [index, None if where is None else where[0], False]

    def _adjacent(self, unit: int, after: int) -> bool:
        f0, r0 = self._unit_at[after]
        f1, r1 = self._unit_at[unit]
        return f0 == f1 and r1 == r0 + 1

    def _top_up(self, pool: Readahead, queue: Deque[List[Any]], worker_id: int, key: int) -> None:
        """Once half of what was taken ahead is consumed, take units up to ``readahead`` ahead again
        (in batches, so that adjacent units are read together); then read ahead those not yet
        submitted: runs of adjacent row groups of one object in one request each (up to
        COALESCE_BYTES on disk and ``readahead_bytes`` decoded), as far as ``readahead_bytes``
        allows. Called under the I/O lock."""
        if len(queue) <= self._readahead // 2:  # in batches, so that adjacent units make one request
            while len(queue) < self._readahead and key not in self._ended:
                queue.append(self._claim(worker_id, key))
        decoded, disk = self._unit_bytes, self._unit_disk
        assert decoded is not None and disk is not None  # taken at registration with the columns
        runs: List[List[List[Any]]] = []
        run: List[List[Any]] = []
        run_disk = run_decoded = 0
        for entry in queue:
            unit = entry[1]
            if entry[2] or unit is None:
                if run:
                    runs.append(run)
                run = []
                continue
            if run and self._adjacent(unit, run[-1][1]) and run_disk + int(disk[unit]) <= COALESCE_BYTES \
                    and run_decoded + int(decoded[unit]) <= self._readahead_bytes:
                run.append(entry)
                run_disk += int(disk[unit])
                run_decoded += int(decoded[unit])
            else:
                if run:
                    runs.append(run)
                run, run_disk, run_decoded = [entry], int(disk[unit]), int(decoded[unit])
        if run:
            runs.append(run)
        for r in runs:
            units = [e[1] for e in r]
            sizes = [int(decoded[u]) for u in units]
            if not pool.room(sum(sizes)):
                break
            pool.submit(units, _ReadRun(self, units, worker_id), sizes)
            for e in r:
                e[2] = True

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


class _ReadRun:
    """A readahead job: adjacent row groups of one object, read for the worker that took them."""

    __slots__ = ("source", "units", "worker_id")

    def __init__(self, source: ParquetSource, units: List[int], worker_id: int):
        self.source, self.units, self.worker_id = source, units, worker_id

    def __call__(self) -> List[Any]:
        return self.source._read_remote(self.units, self.worker_id)


class _CheckFailed(OSError):
    """The check that an object did not change while it was read failed, after its own retries:
    a fetch error (retried no more), never taken for a changed object."""

    feeder_transient = False


def _expired(e: BaseException) -> bool:
    """Whether a read failed because the object is no longer the version its handle opened: s3fs's
    ``FileExpired`` (an OSError EBUSY: its ``If-Match`` on the ETag failed), or a store's 412."""
    if type(e).__name__ == "FileExpired" or (isinstance(e, OSError) and e.errno == errno.EBUSY
                                             and "no longer exists" in str(e)):
        return True
    return bool(re.search(r"PreconditionFailed|PRECONDITION_FAILED|HTTP status 412", str(e)))


class _Failed:
    """What reading one unit ahead raised, re-raised by the fetch call that takes the unit."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _column_spec(columns: Mapping[Any, Any]) -> Dict[str, Union[str, List[str]]]:
    """``columns`` checked: input name -> a column name, or a non-empty list of them."""
    out: Dict[str, Union[str, List[str]]] = {}
    for name, col in columns.items():
        if not isinstance(name, str):
            raise TypeError(f"columns maps input names (str) to columns, got the key {name!r}")
        if isinstance(col, str):
            out[name] = col
        elif isinstance(col, (list, tuple)) and col and all(isinstance(c, str) for c in col):
            out[name] = list(col)
        else:
            raise TypeError(f"columns[{name!r}] must be a column name or a non-empty list of column names, "
                            f"got {col!r}")
    return out


def _group_bytes(group: Any, used: Sequence[str]) -> Tuple[int, int]:
    """Bytes of a row group's used columns once decoded (their uncompressed size) and in the file
    (compressed), at least 1 each."""
    decoded = disk = 0
    for j in range(group.num_columns):
        chunk = group.column(j)
        path = chunk.path_in_schema
        if any(path == c or path.startswith(c + ".") for c in used):
            decoded += int(chunk.total_uncompressed_size)
            disk += int(chunk.total_compressed_size)
    return max(1, decoded), max(1, disk)


def _read_footer(pa: Any, path: Any, shown: Optional[str] = None) -> Any:
    """The footer (FileMetaData) of a Parquet file (a path, or an open object of a store shown as
    ``shown``); ValueError naming the file when it is not Parquet or is damaged (pyarrow's own
    message does not name it). A failure of the store (after its retries) stays an OSError."""
    try:
        return pa.parquet.read_metadata(path)
    except (FileNotFoundError, PermissionError):
        raise  # pyarrow's message names the file
    except (pa.ArrowException, OSError) as e:
        if shown is not None and is_io_failure(e):
            raise
        raise ValueError(f"{shown or path!r} is not a readable Parquet file (truncated, damaged or not Parquet): "
                         f"{type(e).__name__}: {e}") from e


def _read_error(e: BaseException, where: str) -> Exception:
    """What a failed read of ``where`` raises: an I/O failure (an OSError with an errno, or a
    store's failure: missing, denied, the network), which may be transient, stays an OSError
    naming the file; anything else pyarrow raises means the file is damaged, bad data that no retry
    mends (an InputValidationError)."""
    text = str(e).strip().replace("\n", " ")
    if isinstance(e, OSError) and e.errno is not None:
        return OSError(e.errno, f"{e.strerror or text} ({where})")
    if is_io_failure(e):
        failed = OSError(f"{text} ({where})")
        failed.feeder_transient = is_transient(e)  # type: ignore[attr-defined]
        return failed
    return InputValidationError(f"{where} cannot be read (damaged or truncated?): {type(e).__name__}: {text}")


def _stamp(path: str) -> Tuple[int, str]:
    """(size in bytes, version: ``mtime_ns:<mtime in ns>``) of a local file."""
    st = os.stat(path)
    return int(st.st_size), f"mtime_ns:{int(st.st_mtime_ns)}"


def _file_print(meta: Any, size: int, used: Sequence[str]) -> str:
    """A fingerprint of a Parquet file's data from its footer alone: its size, its schema, its row
    groups' row counts and, for each column chunk of the ``used`` columns, its value count, its
    compressed size and its statistics (min, max, null count). Other values or another dtype
    change it; reading the file does not come into it."""
    h = hashlib.sha1()
    fields = [(f.name, str(f.type)) for f in meta.schema.to_arrow_schema()]
    h.update(repr((size, fields, [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])).encode())
    leaves = []
    for j in range(meta.num_columns):
        path = meta.schema.column(j).path
        if any(path == c or path.startswith(c + ".") for c in used):
            leaves.append(j)
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for j in leaves:
            chunk = group.column(j)
            h.update(repr((j, chunk.num_values, chunk.total_compressed_size, _stats(chunk.statistics))).encode())
    return h.hexdigest()[:16]


def _stats(st: Any) -> Any:
    if st is None:
        return None
    try:
        minmax = (st.min, st.max) if st.has_min_max else None
    except Exception:  # a logical type pyarrow cannot turn into a Python value: its raw bytes
        minmax = (st.physical_type, st.has_min_max)
    return minmax, st.null_count if st.has_null_count else None, st.num_values
