"""ParquetSource: columns of Parquet files as inputs, one row group per unit of work.

pyarrow is an optional extra (``pip install 'onnx-feeder[parquet]'``); it is imported when a
ParquetSource is created, never by ``import feeder``.
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import numpy as np

from ..errors import InputValidationError
from ..validation import can_cast
from .arrow import import_pyarrow, to_numpy
from .base import ShardedSource, SourceBinding

__all__ = ["ParquetSource", "import_pyarrow", "to_numpy"]  # to_numpy: moved to .arrow, importable here too

PathLike = Union[str, "os.PathLike[str]"]


IDENTITIES = ("metadata", "content")
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

    Tabular data: an input may take a list of scalar columns, ``columns={"X": ["f0", "f1"]}``,
    stacked into one ``[N, k]`` input in that order (the output is allocated once and filled
    column by column; with ``cast=True`` at registration the columns are converted to the
    model's type as they are copied, with the same checks as the validator's casts). A name with
    ``*``, ``?`` or ``[`` that is not a column is a glob pattern, expanded in the order of the
    first file's schema (``{"X": "f*"}`` or ``{"X": ["a", "f*"]}`` stack what they match). A
    single scalar column feeding a model input of shape ``[N, 1]`` is reshaped to it (no copy).

    Conversion to numpy: numeric columns without nulls are not copied (read-only views of
    Arrow's buffers), fixed-size lists (nested too), fixed-shape tensors and lists that all
    have one length become n-d arrays, strings become str arrays. A null in a used column is an
    InputValidationError naming it; a column that is missing is a ValueError at registration
    (at creation when ``columns`` is given).

    What a checkpoint must match (``feeder_definition``) is one record per file (its name, row
    count, size in bytes, version and a fingerprint of its footer: schema, row groups and, for
    the used columns, their Arrow types, the column chunks' statistics and sizes), plus the used
    columns' Arrow types. ``identity`` says what a file's version is: ``"metadata"`` (the
    default) its modification time (ns), so that nothing but the footers is read, and a file
    whose modification time moved is another file, even when touched or copied with the same
    contents; ``"content"`` a SHA-256 of its bytes, read whole when the source is created (and
    again when a file's size or modification time moved), for data copied between machines,
    whose time stamps do not survive. A file that changes after the source was created is a
    ValueError at ``start()`` or an InputValidationError at the first read of it, naming the
    file. A file that is not Parquet (or is truncated) is a ValueError naming it at creation,
    and an InputValidationError naming it and the row group at a read.

    With ``map`` or ``filter`` (see :mod:`feeder.sources.transform`), the functions see the
    inputs ``columns`` maps, or with ``columns=None`` every column of the files.

    Args:
        paths: A Parquet file, a folder (its ``.parquet`` and ``.parq`` files, recursively,
            in sorted order), or a list of files and folders.
        columns: ``{input name: column name}``, or a list of scalar columns (or glob patterns)
            to stack into one ``[N, k]`` input; None: the columns named like the inputs.
        shuffle: Shuffle the row groups and the rows within each, per epoch, from ``seed``.
        seed: The shuffle's seed (an int >= 0).
        epochs: Passes over the rows (>= 1); None repeats forever.
        identity: What a file's version is in a checkpoint: ``"metadata"`` (its modification
            time) or ``"content"`` (a SHA-256 of its bytes, for data copied between machines).

    Raises:
        ImportError: pyarrow (the ``parquet`` extra) is not installed.
        ValueError: A column ``columns`` names that a file lacks; a folder without Parquet files;
            a bad argument value.
        FileNotFoundError: A path that does not exist.
        TypeError: A bad argument type.
    """

    def __init__(self, paths: Union[PathLike, Sequence[PathLike]], columns: Optional[Columns] = None, *,
                 shuffle: bool = False, seed: int = 0, epochs: Optional[int] = 1, identity: str = "metadata"):
        super().__init__(shuffle=shuffle, seed=seed, epochs=epochs)
        pa = import_pyarrow()
        if columns is not None and not isinstance(columns, Mapping):
            raise TypeError(f"columns must be a dict of input name -> column name (or list of column names) or "
                            f"None, got {type(columns).__name__}")
        if not isinstance(identity, str):
            raise TypeError(f"identity must be one of {IDENTITIES}, got {type(identity).__name__}")
        if identity not in IDENTITIES:
            raise ValueError(f"identity must be one of {IDENTITIES}, got {identity!r}")
        self.identity = identity
        given = _column_spec(columns) if columns is not None else None
        given_paths = _as_list(paths)
        self.files = _list_files(given_paths)
        # What was given, as absolute paths (feeder.predict refuses an output inside them).
        self.roots = [os.path.abspath(p) for p in given_paths]
        # Per file: its columns' Arrow types (files of one schema share one dict), its (size in
        # bytes, mtime in ns) when read here, the row counts of all its row groups, and (content
        # identity) the SHA-256 of its bytes.
        self._fields: List[Dict[str, str]] = []
        self._stamps: List[Tuple[int, int]] = []
        self._groups: List[List[int]] = []
        self._hashes: List[Optional[str]] = []
        # The footers read here, kept until the used columns' fingerprint is taken from them
        # (at registration, when the columns are known), so a file is never read twice for it.
        self._metas: Optional[List[Any]] = []
        self._prints: Optional[List[str]] = None  # per file, see _file_print
        self._printed_for: Optional[Tuple[str, ...]] = None
        shared: Dict[Tuple[Tuple[str, str], ...], Dict[str, str]] = {}
        units: List[int] = []
        self._unit_at: List[Tuple[int, int]] = []  # unit -> (file index, row group)
        for i, (path, _) in enumerate(self.files):
            stamp = _stamp(path)
            meta = _read_footer(pa, path)
            fields = tuple((f.name, str(f.type)) for f in meta.schema.to_arrow_schema())
            self._fields.append(shared.setdefault(fields, dict(fields)))
            self._stamps.append(stamp)
            self._hashes.append(_sha256(path) if identity == "content" else None)
            self._metas.append(meta)
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
                pa = import_pyarrow()
                metas = [_read_footer(pa, path) for path, _ in self.files]
            self._prints = [_file_print(meta, size, used) for meta, (size, _) in zip(metas, self._stamps)]
            self._printed_for = used
            self._metas = None
        return self._prints

    def _version(self, index: int) -> str:
        """File ``index``'s version as a state records it: ``mtime_ns:<ns>`` or ``sha256:<hex>``."""
        digest = self._hashes[index]
        return f"sha256:{digest}" if digest is not None else f"mtime_ns:{self._stamps[index][1]}"

    def _definition(self) -> Dict[str, Any]:
        d = super()._definition()
        prints = self._fingerprint()
        d["identity"] = self.identity
        # One record per file, {name, size, version, ...}: what a store's object (an ETag, a
        # generation) is recorded as too, so that a message can name the file that differs.
        d["files"] = [{"name": name, "rows": rows, "size": self._stamps[i][0], "version": self._version(i),
                       "footer": prints[i]}
                      for i, ((_, name), rows) in enumerate(zip(self.files, self._file_rows))]
        d["columns"] = self.columns
        d["dtypes"] = {name: " | ".join(sorted({f[c] for f in self._fields for c in ([col] if isinstance(col, str)
                                                                                      else col) if c in f}))
                       for name, col in (self.columns or {c: c for c in self._used()}).items()}
        return d

    def _changed(self, index: int) -> Optional[str]:
        """None if file ``index`` is as it was when the source was created, else a sentence saying
        how it changed. ``identity="metadata"``: its size and modification time are what they
        were; ``"content"``: its size, and its bytes' hash whenever its size or time stamp moved."""
        path = self.files[index][0]
        size, mtime = self._stamps[index]
        try:
            now = _stamp(path)
        except OSError as e:
            return f"Parquet file {path!r} cannot be read any more ({type(e).__name__}: {e})"
        if now == (size, mtime):
            return None
        what = [f"{size} -> {now[0]} bytes"] if now[0] != size else []
        if not what and self.identity == "content":
            try:
                same = _sha256(path) == self._hashes[index]
            except OSError as e:
                return f"Parquet file {path!r} cannot be read any more ({type(e).__name__}: {e})"
            if same:
                self._stamps[index] = now  # touched or copied, not changed: no need to hash it again
                return None
            what.append("other contents")
        try:
            meta = _read_footer(import_pyarrow(), path)
        except ValueError:
            what.append("no longer a readable Parquet file")
        else:
            groups = [meta.row_group(rg).num_rows for rg in range(meta.num_row_groups)]
            if groups != self._groups[index]:
                what.append(f"row groups of {self._groups[index]} -> {groups} rows")
            elif _file_print(meta, now[0], self._used()) != self._fingerprint()[index]:
                what.append("other schema or column statistics in its footer")
        if not what:
            what.append("its modification time moved, its size and footer did not: if its contents are the same "
                        "(touched, copied), identity='content' compares contents instead of time stamps")
        return (f"Parquet file {path!r} changed since the ParquetSource was created ({', '.join(what)}); "
                f"create the source again to read it as it is now (a state of the old contents cannot resume "
                f"on the new ones)")

    # ---- the binding protocol ----
    def feeder_bind(self, binding: SourceBinding) -> None:
        """At ``start()``: ValueError naming a file that changed since the source was created;
        then as :meth:`ShardedSource.feeder_bind`.

        Args:
            binding: What feeder tells the source (see :class:`SourceBinding`).
        """
        for index in range(len(self.files)):
            changed = self._changed(index)
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

    def feeder_describe(self) -> str:
        """A phrase for FeedTimeout and ``diagnose()`` messages: rows, row groups, files, epochs."""
        return f"{super().feeder_describe()} (row groups) of {len(self.files)} Parquet file(s)"

    def feeder_release(self) -> None:
        """At ``stop()``: close the workers' open files (and forget the cursors)."""
        super().feeder_release()
        self._handles = {}

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state["_handles"] = {}  # open files stay with their process
        state["_metas"] = None  # footers are not sent: the fingerprint was taken at registration
        return state

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

    def _read(self, unit: int, rows: np.ndarray, worker_id: int) -> List[np.ndarray]:
        index, rg = self._unit_at[unit]
        assert self.columns is not None  # set at registration
        cols = self._flat(self.columns)
        pf = self._file(worker_id, index)
        try:
            table = pf.read_row_group(rg, columns=cols)
        except (import_pyarrow().ArrowException, OSError) as e:
            raise _read_error(e, f"Parquet file {self.files[index][0]!r}, row group {rg}") from e
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
            a = a if whole else a[rows]
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


def _read_footer(pa: Any, path: str) -> Any:
    """The footer (FileMetaData) of a Parquet file; ValueError naming the file when it is not
    Parquet or is damaged (pyarrow's own message does not name it)."""
    try:
        return pa.parquet.read_metadata(path)
    except (FileNotFoundError, PermissionError):
        raise  # pyarrow's message names the file
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path!r} is not a readable Parquet file (truncated, damaged or not Parquet): "
                         f"{type(e).__name__}: {e}") from e


def _read_error(e: BaseException, where: str) -> Exception:
    """What a failed read of ``where`` raises: an OSError with an errno (an I/O failure, which may
    be transient) stays an OSError, naming the file; anything else pyarrow raises means the file is
    damaged, bad data that no retry mends (an InputValidationError)."""
    text = str(e).strip().replace("\n", " ")
    if isinstance(e, OSError) and e.errno is not None:
        return OSError(e.errno, f"{e.strerror or text} ({where})")
    return InputValidationError(f"{where} cannot be read (damaged or truncated?): {type(e).__name__}: {text}")


def _sha256(path: str) -> str:
    """SHA-256 of a file's bytes (read in 1 MiB blocks; hashlib releases the GIL on each)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _stamp(path: str) -> Tuple[int, int]:
    """(size in bytes, mtime in ns) of a file."""
    st = os.stat(path)
    return int(st.st_size), int(st.st_mtime_ns)


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
