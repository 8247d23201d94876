"""The files of a ParquetSource: found, their footers read, their columns, and what a state records of them.

The first of the three parts of :class:`~feeder.sources.parquet.ParquetSource`, each a class the
next one extends. :class:`ParquetFiles` plans the source when it is created: it lists the files
(local paths, or objects in a store: listed, and their footers read, concurrently), cuts them into
units of work (one per row group), checks ``columns`` against their schemas, and says what
identifies each file in a checkpoint (its size, version and a fingerprint of its footer) and
whether one changed since. :mod:`feeder.sources.parquetstore` reads the objects of a store;
:mod:`feeder.sources.parquet` is the source itself (its arguments, the binding protocol, reading
local files, converting row groups to numpy).
"""
from __future__ import annotations

import fnmatch
import functools
import hashlib
import logging
import os
import threading
from collections import OrderedDict
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
from ..validation import int_arg
from .arrow import import_pyarrow
from .readahead import Readahead
from .sharded import ShardedSource

log = logging.getLogger("feeder")

PathLike = Union[str, "os.PathLike[str]"]


IDENTITIES = ("metadata", "content")
FOOTER_THREADS = 32        # footers (and versions) of objects in a store read at once at creation and start
LOCAL_FOOTER_THREADS = 8   # ... and of local files (a network disk gains; a local one loses nothing)
READAHEAD_UNITS = 128      # readahead=None on a store: units (row groups) taken ahead per source (and process)
READAHEAD_BYTES = 256 << 20  # readahead_bytes=None: bytes (decoded) read ahead and not yet taken, at most
# The Arrow types (as str() names them) of the scalar numeric columns a stacked input takes.
STACKABLE_TYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                             "halffloat", "float", "double"})
GLOB_CHARS = "*?["

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


class ParquetFiles(ShardedSource):
    """The files of a :class:`~feeder.sources.parquet.ParquetSource` (its arguments are
    documented there), as units of work: listed and their footers read at creation, their
    columns checked, and what a state records of them (see the module docstring)."""

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
