"""The stores: :class:`Store`, :class:`LocalStore` (this machine's disk) and
:class:`FileSystemStore` (a ``pyarrow.fs.FileSystem``, possibly wrapping an fsspec one): listing,
opening with a version, writing objects whole; and the hashes of what they hold."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from .plainerrors import _NO_BUCKET

PARQUET_SUFFIXES = (".parquet", ".parq")
# Object stores: "directories" are key prefixes; nothing needs creating before an object is put.
OBJECT_STORES = ("s3", "gcs", "abfs")


def sha256_of(f: Any, block: int = 1 << 20) -> str:
    """SHA-256 of what a binary file object reads, in blocks of ``block`` bytes (hashlib releases
    the GIL on each)."""
    h = hashlib.sha256()
    while True:
        data = f.read(block)
        if not data:
            return h.hexdigest()
        h.update(data)


def sha256_file(path: str) -> str:
    """SHA-256 of a local file's bytes."""
    with open(path, "rb") as f:
        return sha256_of(f)


class Store:
    """Where files live, and the few operations feeder needs of them. ``uri(path)`` names a file
    in messages and states; ``local`` stores are read with ``os`` and plain paths."""

    local = False
    object_store = False  # no directories and no rename: outputs are committed with a manifest

    def uri(self, path: str) -> str:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash(type(self))


class LocalStore(Store):
    """This machine's disk, through ``os`` (what feeder did before object stores)."""

    local = True

    def uri(self, path: str) -> str:
        return path

    def __repr__(self) -> str:
        return "LocalStore()"


@dataclass
class Opened:
    """An object opened for reading: its handle (a ``pyarrow.NativeFile``), its size in bytes and
    version as the opening request gave them, and whether every read through the handle is
    checked against that version by the store itself (``pinned``: s3fs sends ``If-Match`` with the
    ETag on each ranged GET, so a replaced object fails the read instead of being read)."""

    handle: Any
    size: int
    version: str
    pinned: bool = False


class FileSystemStore(Store):
    """A ``pyarrow.fs.FileSystem`` (possibly wrapping an fsspec one, kept as ``fsspec`` for the
    versions its ``info`` gives) and the URI scheme its paths are named with. ``built``: the
    options of an S3 filesystem feeder made from a URI, so that a copy in a worker process is
    made the same way (pyarrow's pickling forgets the retry strategy)."""

    def __init__(self, fs: Any, scheme: str, fsspec: Any = None, built: Optional[Dict[str, Any]] = None):
        self.fs = fs
        self.scheme = scheme
        self.fsspec = fsspec
        self.built = built
        self.object_store = fs.type_name in OBJECT_STORES or (fsspec is not None and scheme in ("s3", "s3a", "gs",
                                                                                                "gcs", "az", "abfs"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FileSystemStore) and self.fs is other.fs

    def __hash__(self) -> int:
        return id(self.fs)

    def __repr__(self) -> str:
        return f"FileSystemStore({self.scheme}://)"

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        if self.built is not None:
            state["fs"] = None  # made again from its options where it is unpickled
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.fs is None and self.built is not None:
            self.fs = _s3_with(self.built)

    def uri(self, path: str) -> str:
        if self.fsspec is not None:
            try:
                return str(self.fsspec.unstrip_protocol(path))
            except Exception:
                pass
        if self.scheme == "file":
            return "file://" + (path if path.startswith("/") else "/" + path)
        return f"{self.scheme}://{path.lstrip('/') if self.scheme in ('s3', 'gs', 'abfs') else path}"

    # -- reading --
    def info(self, path: str) -> Any:
        if self.fsspec is not None:
            self._refresh(path)
        return self.fs.get_file_info(path)

    def _refresh(self, path: str) -> None:
        """Forget what an fsspec driver cached of ``path`` (s3fs answers ``info`` from its listing
        cache: a replaced object would keep its old ETag there)."""
        invalidate = getattr(self.fsspec, "invalidate_cache", None)
        if invalidate is not None:
            try:
                invalidate(path)
            except Exception:  # a driver without a cache of that path
                pass

    def _fsspec_info(self, path: str) -> Dict[str, Any]:
        self._refresh(path)
        return dict(self.fsspec.info(path))

    def list_parquet(self, root: str) -> List[Tuple[str, str, Optional[Opened]]]:
        """(path, URI, the object opened or None) of the Parquet files at ``root``: the object
        itself, or every ``.parquet`` and ``.parq`` object under it (recursively, sorted by path).
        A root named like a Parquet file is opened at once (one request, which also gives its
        size and version, handed on); a folder so named is listed after that request found no
        object."""
        pafs = _pafs()
        root = root.rstrip("/") or root
        if root.endswith(PARQUET_SUFFIXES):
            try:
                opened = self.open_versioned(root)
            except (FileNotFoundError, IsADirectoryError):
                pass
            except OSError as e:
                if not re.search(r"[Nn]ot a file|is a directory|[Dd]irectory|does not exist|NOT_FOUND|NoSuchKey",
                                 str(e)):
                    raise
            else:
                return [(root, self.uri(root), opened)]
        info = self.info(root)
        if info.type == pafs.FileType.File:
            return [(root, self.uri(root), None)]
        if info.type == pafs.FileType.Directory:
            infos = self.fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
            found = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(PARQUET_SUFFIXES))
            if not found:
                raise ValueError(f"directory {self.uri(root)!r} holds no .parquet files")
            return [(p, self.uri(p), None) for p in found]
        bucket = self.missing_bucket(root)
        if bucket is not None:
            raise FileNotFoundError(f"no such Parquet file or directory: {self.uri(root)!r}: the bucket {bucket!r} "
                                    f"does not exist")
        raise FileNotFoundError(f"no such Parquet file or directory: {self.uri(root)!r}")

    def missing_bucket(self, path: str) -> Optional[str]:
        """The bucket of ``path`` when this is an object store and the bucket does not exist
        (one request); None otherwise, or when the store cannot tell."""
        if not self.object_store:
            return None
        bucket = path.lstrip("/").split("/", 1)[0]
        if not bucket:
            return None
        try:
            found = self.info(bucket).type != _pafs().FileType.NotFound
        except Exception as e:
            return bucket if _NO_BUCKET.search(str(e)) else None
        return None if found else bucket

    def open_input(self, path: str) -> Any:
        """A random-access file (``pyarrow.NativeFile``); on object stores its ``ReadAt`` may be
        called from several threads at once (each a ranged GET)."""
        return self.open_versioned(path).handle

    def open_versioned(self, path: str) -> Opened:
        """The object opened, with its size and version from the request that opened it (on S3
        one HEAD); for an fsspec driver, after forgetting what it cached of it."""
        if self.fsspec is not None:
            self._refresh(path)
            f = self.fsspec.open(path, mode="rb")
            try:
                details = getattr(f, "details", None)
                if not isinstance(details, dict) or "size" not in details:
                    details = dict(self.fsspec.info(path))
                if details.get("type", "file") != "file":
                    raise IsADirectoryError(f"{self.uri(path)!r} is not a file")
                read_kw = getattr(f, "read_kw", None)
                pinned = (isinstance(read_kw, dict) and bool(read_kw.get("IfMatch"))) or \
                    bool(getattr(f, "version_id", None)) or \
                    (bool(getattr(self.fsspec, "local_expiry_check", False)) and "ETag" in details)
                return Opened(_pa().PythonFile(f, mode="r"), int(details["size"]), _fsspec_version(details), pinned)
            except BaseException:
                f.close()
                raise
        handle = self.fs.open_input_file(path)
        try:
            return Opened(handle, int(handle.size()), self.version_of(path, handle))
        except BaseException:
            handle.close()
            raise

    def version_of(self, path: str, handle: Any = None) -> str:
        """The object's version: ``etag:<ETag>``, ``generation:<n>``, else ``mtime_ns:<ns>`` (or
        ``mtime:<text>`` as an fsspec driver gives it); ``none:`` when the store tells nothing.
        For an fsspec driver, asked afresh (not from its cache)."""
        if self.fsspec is not None:
            return _fsspec_version(self._fsspec_info(path))
        if handle is not None:
            got = _metadata_version(handle)
            if got is not None:
                return got
        info = self.info(path)
        mtime = getattr(info, "mtime_ns", None)
        return f"mtime_ns:{int(mtime)}" if mtime is not None else "none:"

    def stat(self, path: str) -> Tuple[int, str]:
        """(size in bytes, version) of a file, asked afresh. On S3 one HEAD request."""
        if self.fsspec is not None:
            info = self._fsspec_info(path)
            if info.get("type") != "file":
                raise FileNotFoundError(f"no such file: {self.uri(path)!r}")
            return int(info["size"]), _fsspec_version(info)
        f = self.fs.open_input_file(path)
        try:
            return int(f.size()), self.version_of(path, f)
        finally:
            f.close()

    def sha256(self, path: str) -> str:
        with self.fs.open_input_stream(path) as f:
            return sha256_of(f, 8 << 20)

    # -- writing (feeder.predict's output) --
    def listdir(self, prefix: str) -> Dict[str, Tuple[bool, int]]:
        """The entries directly under ``prefix``: name -> (is a file, size in bytes)."""
        pafs = _pafs()
        infos = self.fs.get_file_info(pafs.FileSelector(prefix.rstrip("/"), recursive=False, allow_not_found=True))
        out = {}
        for i in infos:
            name = i.path.rstrip("/").rsplit("/", 1)[-1]
            if name:
                out[name] = (i.type == pafs.FileType.File, int(i.size or 0) if i.type == pafs.FileType.File else 0)
        return out

    def kind(self, path: str) -> str:
        """"file", "directory" or "none"."""
        pafs = _pafs()
        t = self.info(path).type
        return "file" if t == pafs.FileType.File else "directory" if t == pafs.FileType.Directory else "none"

    def size(self, path: str) -> Optional[int]:
        info = self.info(path)
        return int(info.size) if info.type == _pafs().FileType.File else None

    def make_dirs(self, path: str) -> None:
        if not self.object_store:
            self.fs.create_dir(path, recursive=True)

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as f:
            return bytes(f.read())

    def write_bytes(self, path: str, data: bytes) -> None:
        """Put an object whole, replacing any of that name in one step: on an object store one PUT
        (the object appears complete or not at all); elsewhere written under ``<path>.tmp`` and
        moved over it."""
        if self.object_store:
            with self.fs.open_output_stream(path) as f:
                f.write(data)
            return
        tmp = path + ".tmp"
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.move(tmp, path)

    def delete(self, path: str) -> None:
        try:
            self.fs.delete_file(path)
        except FileNotFoundError:
            pass


def _pafs() -> Any:
    import pyarrow.fs as pafs
    return pafs


def _pa() -> Any:
    import pyarrow
    return pyarrow


def _s3_with(options: Dict[str, Any]) -> Any:
    """A ``pyarrow.fs.S3FileSystem`` of these options that makes one attempt per request: feeder's
    own retries (:func:`retrying`) are the only ones, bounded in number and time."""
    pafs = _pafs()
    return pafs.S3FileSystem(**options, retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))


def _metadata_version(handle: Any) -> Optional[str]:
    try:
        meta = handle.metadata()
    except Exception:
        return None
    if not meta:
        return None
    values = {(k.decode() if isinstance(k, bytes) else str(k)).lower():
              (v.decode() if isinstance(v, bytes) else str(v)) for k, v in meta.items()}
    for key, scheme in (("etag", "etag"), ("x-goog-generation", "generation"), ("generation", "generation"),
                        ("versionid", "version_id")):
        value = values.get(key)
        if value:
            return f"{scheme}:{value.strip().strip(chr(34))}"
    return None


def _fsspec_version(info: Dict[str, Any]) -> str:
    lowered = {str(k).lower(): v for k, v in info.items()}
    for key, scheme in (("etag", "etag"), ("e_tag", "etag"), ("generation", "generation"),
                        ("version_id", "version_id"), ("versionid", "version_id"), ("checksum", "checksum")):
        value = lowered.get(key)
        if value not in (None, ""):
            return f"{scheme}:{str(value).strip().strip(chr(34))}"
    for key in ("mtime", "lastmodified", "last_modified", "updated", "modified", "created", "last-modified"):
        value = lowered.get(key)
        if value not in (None, ""):
            if isinstance(value, (int, float)):
                return f"mtime_ns:{int(value * 1e9)}"
            stamp = getattr(value, "timestamp", None)
            if stamp is not None:
                return f"mtime_ns:{int(round(stamp() * 1e6)) * 1000}"
            return f"mtime:{value}"
    return "none:"
