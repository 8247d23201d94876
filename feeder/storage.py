"""Where data lives: local paths, object stores and other filesystems behind one small interface.

``ParquetSource`` reads, and ``feeder.predict`` writes, through a :class:`Store`:

* :class:`LocalStore`: a path on this machine's disk (or a ``file://`` URI), read with ``os``
  as feeder always did: files listed with ``os.walk``, a file's version its modification time in
  nanoseconds, ParquetFile opened on the path.
* :class:`FileSystemStore`: anything pyarrow reads through a ``pyarrow.fs.FileSystem``: an
  ``s3://`` or ``gs://`` URI (pyarrow's own filesystems, the default), any fsspec URI
  (``memory://``, ``az://``, ...) when fsspec and its driver are installed, or a path plus the
  ``filesystem=`` a caller passes (a pyarrow filesystem, or an fsspec one, which is wrapped with
  ``pyarrow.fs.PyFileSystem(FSSpecHandler(fs))``). An object is named by its URI
  (``s3://bucket/key``); its version is its ETag (S3, Azure), its generation (GCS) or, where the
  store gives neither, its modification time.

Credentials, regions and endpoints are the filesystem's business: pyarrow's S3 filesystem reads
the environment (``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``, ...) and the
URI's query (``s3://bucket/key?endpoint_override=host:port&scheme=http``); pass ``filesystem=``
for anything else.

Transient failures of a store (time-outs, throttling, 5xx answers, connections reset) are retried
by :func:`retrying` with exponential backoff, a bounded number of times (:class:`Retry`); permanent
ones (a missing object, access denied) are not. Each retry is logged at DEBUG.

pyarrow is imported when a store is first used, never by ``import feeder``; fsspec only when an
fsspec URI or filesystem is given. The library never opens a network socket by itself: only a
URI or filesystem the caller gives does.
"""
from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, TypeVar

log = logging.getLogger("feeder")


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

T = TypeVar("T")
R = TypeVar("R")

PARQUET_SUFFIXES = (".parquet", ".parq")
# Object stores: "directories" are key prefixes; nothing needs creating before an object is put.
OBJECT_STORES = ("s3", "gcs", "abfs")
_SCHEMES = {"s3": "s3", "gcs": "gs", "abfs": "abfs", "local": "file", "hdfs": "hdfs", "mock": "mock"}
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


# ---- retries ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Retry:
    """How transient storage failures are retried: up to ``attempts`` more tries, waiting
    ``backoff_s`` seconds before the first, doubled before each next one up to ``max_backoff_s``
    (each wait drawn at random between half and all of it, so that many readers do not retry in
    step). The defaults wait about 0.1 + 0.2 + 0.4 + 0.8 + 1.6 = 3.1 s at most over 5 retries."""

    attempts: int = 5
    backoff_s: float = 0.1
    max_backoff_s: float = 5.0

    def wait_s(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0 for the first)."""
        full = min(self.max_backoff_s, self.backoff_s * (2.0 ** retry))
        return float(full * random.uniform(0.5, 1.0))


# Messages of transient failures, as pyarrow's AWS, GCS and Azure clients and fsspec drivers word
# them (AWS error names, HTTP statuses, curl's and the OS's words for a broken connection).
_TRANSIENT = re.compile(
    r"HTTP status (5\d\d|429|408)|status code:? (5\d\d|429|408)|\b(500|502|503|504)\b.*(Error|error)|"
    r"SLOW_DOWN|SlowDown|THROTTL|Throttl|TooManyRequests|Too Many Requests|SERVICE_UNAVAILABLE|"
    r"ServiceUnavailable|Service Unavailable|INTERNAL_FAILURE|InternalError|InternalFailure|REQUEST_TIMEOUT|"
    r"RequestTimeout|NETWORK_CONNECTION|timed out|[Tt]imeout|[Cc]onnection (reset|refused|aborted|closed)|"
    r"Broken pipe|Recv failure|Send failure|Couldn't connect|Could not connect|transient|Temporary failure|"
    r"try again|Try again|UNAVAILABLE|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED")
# ... and of permanent ones, which no retry mends (checked first: "403 ... try again" is permanent).
_PERMANENT = re.compile(
    r"ACCESS_DENIED|AccessDenied|Access Denied|HTTP status (400|401|403|404|409|412)|NO_SUCH_|NoSuch|"
    r"RESOURCE_NOT_FOUND|INVALID_|InvalidAccessKeyId|SignatureDoesNotMatch|PERMISSION_DENIED|NOT_FOUND")


def is_transient(e: BaseException) -> bool:
    """Whether a storage failure may go away when tried again: a time-out, throttling (429,
    SlowDown), a 5xx answer, a connection reset or refused. A missing object, access denied or
    bad data are not."""
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (TimeoutError, ConnectionError)):
        return True
    if not isinstance(e, OSError) and type(e).__module__.split(".")[0] not in ("pyarrow", "botocore", "aiohttp",
                                                                              "requests", "urllib3", "google"):
        return False
    marked = getattr(e, "feeder_transient", None)
    if marked is not None:
        return bool(marked)
    text = str(e)
    if _PERMANENT.search(text):
        return False
    return bool(_TRANSIENT.search(text))


def is_io_failure(e: BaseException) -> bool:
    """Whether a failed read failed in the storage (the object is not there, access was denied,
    the network failed) rather than in the bytes (a damaged file): an OSError with an errno, or
    one a store worded."""
    if isinstance(e, OSError) and (e.errno is not None or isinstance(e, (TimeoutError, ConnectionError))):
        return True
    return is_transient(e) or bool(_PERMANENT.search(str(e))) or "AWS Error" in str(e)


# on_retry(exception, retry number (0 for the first), seconds it waits before trying again)
OnRetry = Callable[[BaseException, int, float], None]


def retrying(fn: Callable[[], T], what: str, policy: Retry, on_retry: Optional[OnRetry] = None,
             stop: Optional[threading.Event] = None) -> T:
    """``fn()``, tried again after a transient failure (see :func:`is_transient`) up to
    ``policy.attempts`` times with exponential backoff; each retry logged at DEBUG (naming
    ``what``) and reported to ``on_retry``. The last failure, or a permanent one, is raised as it
    came. A set ``stop`` event ends the waiting (the last failure is raised)."""
    retry = 0
    while True:
        try:
            return fn()
        except Exception as e:
            if retry >= policy.attempts or not is_transient(e):
                raise
            wait = policy.wait_s(retry)
            log.debug("feeder: %s failed (%s: %s); retry %d of %d in %.2f s", what, type(e).__name__,
                      " ".join(str(e).split())[:300], retry + 1, policy.attempts, wait)
            if on_retry is not None:
                on_retry(e, retry, wait)
            if stop is not None:
                if stop.wait(wait):
                    raise
            else:
                time.sleep(wait)
            retry += 1


class RetryCounts:
    """Retries and failures after retries, per worker id (None: outside any worker, when a source
    is created or started). Thread-safe; pickled empty (counts stay in the process that made them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.retries: Dict[Optional[int], int] = {}
        self.exhausted: Dict[Optional[int], int] = {}

    def retried(self, worker: Optional[int]) -> None:
        with self._lock:
            self.retries[worker] = self.retries.get(worker, 0) + 1

    def gave_up(self, worker: Optional[int]) -> None:
        with self._lock:
            self.exhausted[worker] = self.exhausted.get(worker, 0) + 1

    def total(self, workers: Optional[Iterable[Optional[int]]] = None) -> Tuple[int, int]:
        """(retries, failures left after retries) of these workers (None: all, setup included)."""
        with self._lock:
            if workers is None:
                return sum(self.retries.values()), sum(self.exhausted.values())
            ids = set(workers)
            return (sum(n for w, n in self.retries.items() if w in ids),
                    sum(n for w, n in self.exhausted.items() if w in ids))

    def __getstate__(self) -> Dict[str, Any]:
        return {}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


# ---- concurrency ------------------------------------------------------------------------------
def map_bounded(fn: Callable[[T], R], items: Sequence[T], workers: int, name: str) -> List[R]:
    """``[fn(x) for x in items]`` on up to ``workers`` daemon threads named ``name``, results in
    order. The failure of the first item (in order) that failed is raised; every thread has ended
    when this returns. One item, or one worker, runs in the calling thread."""
    n = len(items)
    workers = max(1, min(workers, n))
    if workers == 1:
        return [fn(x) for x in items]
    results: List[Any] = [None] * n
    errors: Dict[int, BaseException] = {}
    lock = threading.Lock()
    nxt = [0]

    def work() -> None:
        while True:
            with lock:
                i = nxt[0]
                if i >= n or errors and min(errors) < i:
                    return  # an earlier item failed: what follows it is not needed
                nxt[0] = i + 1
            try:
                results[i] = fn(items[i])
            except BaseException as e:  # raised in the caller's thread below
                with lock:
                    errors[i] = e

    threads = [threading.Thread(target=work, name=f"{name}-{k}", daemon=True) for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.1)  # in slices: Ctrl-C still interrupts the caller
    if errors:
        raise errors[min(errors)]
    return results


# ---- stores -------------------------------------------------------------------------------------
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


class FileSystemStore(Store):
    """A ``pyarrow.fs.FileSystem`` (possibly wrapping an fsspec one, kept as ``fsspec`` for the
    versions its ``info`` gives) and the URI scheme its paths are named with."""

    def __init__(self, fs: Any, scheme: str, fsspec: Any = None):
        self.fs = fs
        self.scheme = scheme
        self.fsspec = fsspec
        self.object_store = fs.type_name in OBJECT_STORES or (fsspec is not None and scheme in ("s3", "s3a", "gs",
                                                                                                "gcs", "az", "abfs"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FileSystemStore) and self.fs is other.fs

    def __hash__(self) -> int:
        return id(self.fs)

    def __repr__(self) -> str:
        return f"FileSystemStore({self.scheme}://)"

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
        return self.fs.get_file_info(path)

    def list_parquet(self, root: str) -> List[Tuple[str, str]]:
        """(path, URI) of the Parquet files at ``root``: the object itself, or every ``.parquet``
        and ``.parq`` object under it (recursively, sorted by path)."""
        pafs = _pafs()
        root = root.rstrip("/") or root
        info = self.info(root)
        if info.type == pafs.FileType.File:
            return [(root, self.uri(root))]
        if info.type == pafs.FileType.Directory:
            infos = self.fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
            found = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(PARQUET_SUFFIXES))
            if not found:
                raise ValueError(f"directory {self.uri(root)!r} holds no .parquet files")
            return [(p, self.uri(p)) for p in found]
        raise FileNotFoundError(f"no such Parquet file or directory: {self.uri(root)!r}")

    def open_input(self, path: str) -> Any:
        """A random-access file (``pyarrow.NativeFile``); on object stores its ``ReadAt`` may be
        called from several threads at once (each a ranged GET)."""
        return self.fs.open_input_file(path)

    def version_of(self, path: str, handle: Any = None) -> str:
        """The object's version: ``etag:<ETag>``, ``generation:<n>``, else ``mtime_ns:<ns>`` (or
        ``mtime:<text>`` as an fsspec driver gives it); ``none:`` when the store tells nothing."""
        if self.fsspec is not None:
            return _fsspec_version(self.fsspec.info(path))
        if handle is not None:
            got = _metadata_version(handle)
            if got is not None:
                return got
        info = self.info(path)
        mtime = getattr(info, "mtime_ns", None)
        return f"mtime_ns:{int(mtime)}" if mtime is not None else "none:"

    def stat(self, path: str) -> Tuple[int, str]:
        """(size in bytes, version) of a file. On S3 one HEAD request."""
        if self.fsspec is not None:
            info = self.fsspec.info(path)
            if info.get("type") != "file":
                raise FileNotFoundError(f"no such file: {self.uri(path)!r}")
            return int(info["size"]), _fsspec_version(info)
        f = self.open_input(path)
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


# ---- resolving a path or URI ----------------------------------------------------------------------
def split_uri(target: str) -> Tuple[Optional[str], str]:
    """(scheme, rest) of ``scheme://rest``, or (None, target) for a plain path."""
    m = _URI.match(target)
    if m is None:
        return None, target
    return m.group(1).lower(), target[m.end():]


def _strip_query(uri: str) -> str:
    return uri.split("?", 1)[0]


def resolve(target: Any, filesystem: Any = None) -> Tuple[Store, str]:
    """(store, path in it) for a local path, a ``file://``, ``s3://``, ``gs://`` or fsspec URI,
    or a path on ``filesystem`` (a ``pyarrow.fs.FileSystem`` or an fsspec filesystem).

    Raises:
        TypeError: ``target`` is not a str or path, or ``filesystem`` is neither kind.
        ValueError: A URI scheme neither pyarrow nor fsspec knows (naming what to install).
    """
    if isinstance(target, os.PathLike):
        target = os.fspath(target)
    if not isinstance(target, str):
        raise TypeError(f"a path or URI must be a str or os.PathLike, got {type(target).__name__}")
    scheme, rest = split_uri(target)
    if filesystem is not None:
        store = store_of(filesystem)
        if scheme is not None:
            if store.scheme not in (scheme, {"gs": "gcs", "gcs": "gs"}.get(scheme)) and \
                    not (store.fsspec is not None and scheme in _protocols(store.fsspec)):
                raise ValueError(f"{target!r} is a {scheme}:// URI, but filesystem= is a {store.scheme} filesystem; "
                                 f"pass the path inside that filesystem (for S3: 'bucket/key')")
            rest = _strip_query(rest)
            if store.fsspec is not None:
                return store, str(store.fsspec._strip_protocol(target))
            return store, ("/" + rest.lstrip("/")) if store.scheme == "file" else rest
        return store, target
    if scheme is None:
        return LocalStore(), target
    if scheme == "file":  # file:///abs/path (file://host/... is not a local path: read as /host/...)
        return LocalStore(), rest if rest.startswith("/") else "/" + rest
    if scheme in ("s3", "gs", "gcs", "abfs", "abfss", "hdfs", "viewfs"):
        try:
            pafs = _pafs()
            fs, path = pafs.FileSystem.from_uri(target)
        except (ValueError, OSError, ImportError, NotImplementedError) as e:
            fallback = _fsspec_store(target, required=False)
            if fallback is not None:
                return fallback
            raise ValueError(f"cannot open {target!r}: {type(e).__name__}: {e}") from e
        return FileSystemStore(fs, {"gcs": "gs", "abfss": "abfs", "viewfs": "hdfs"}.get(scheme, scheme)), path
    found = _fsspec_store(target, required=True)
    assert found is not None
    return found


def _protocols(fs: Any) -> Tuple[str, ...]:
    p = getattr(fs, "protocol", ())
    return (p,) if isinstance(p, str) else tuple(p)


def _fsspec_store(target: str, required: bool) -> Optional[Tuple[Store, str]]:
    try:
        import fsspec  # type: ignore[import-untyped]
    except ImportError as e:
        if not required:
            return None
        raise ValueError(f"{target!r}: pyarrow has no filesystem for this URI scheme, and reading other schemes "
                         f"needs fsspec and its driver (pip install fsspec, and s3fs, gcsfs, adlfs ... as the "
                         f"scheme needs), or pass filesystem=") from e
    try:
        fs, path = fsspec.core.url_to_fs(target)
    except (ImportError, ValueError) as e:
        if not required:
            return None
        raise ValueError(f"{target!r}: fsspec cannot open this URI ({type(e).__name__}: {e}); install the fsspec "
                         f"driver for its scheme or pass filesystem=") from e
    store = store_of(fs)
    return store, str(path)


def store_of(filesystem: Any) -> FileSystemStore:
    """A store for a filesystem a caller passed: a ``pyarrow.fs.FileSystem`` (used as it is; an
    fsspec one that pyarrow wraps is recognised) or an fsspec ``AbstractFileSystem`` (wrapped).

    Raises:
        TypeError: ``filesystem`` is neither.
    """
    if isinstance(filesystem, FileSystemStore):
        return filesystem
    try:
        pafs = _pafs()
    except ImportError as e:
        raise ImportError("filesystem= needs pyarrow: pip install 'onnx-feeder[parquet]' (or pip install pyarrow)") \
            from e
    if isinstance(filesystem, pafs.FileSystem):
        handler = getattr(filesystem, "handler", None)
        inner = getattr(handler, "fs", None) if isinstance(handler, pafs.FSSpecHandler) else None
        if inner is not None:
            return FileSystemStore(filesystem, _protocols(inner)[0] if _protocols(inner) else "fsspec", inner)
        return FileSystemStore(filesystem, _SCHEMES.get(filesystem.type_name, filesystem.type_name))
    if _is_fsspec(filesystem):
        protocols = _protocols(filesystem)
        return FileSystemStore(pafs.PyFileSystem(pafs.FSSpecHandler(filesystem)),
                               protocols[0] if protocols else "fsspec", filesystem)
    raise TypeError(f"filesystem must be a pyarrow.fs.FileSystem or an fsspec filesystem, got "
                    f"{type(filesystem).__name__}")


def _is_fsspec(obj: Any) -> bool:
    for cls in type(obj).__mro__:
        if cls.__name__ == "AbstractFileSystem" and cls.__module__.startswith("fsspec"):
            return True
    return False


def s3_filesystem(endpoint: str, **options: Any) -> Any:
    """A ``pyarrow.fs.S3FileSystem`` for an S3-compatible server at ``endpoint`` (a URL such as
    ``http://127.0.0.1:9000``: its scheme and host:port); credentials and region from the
    environment unless ``options`` give them.

    Raises:
        ValueError: ``endpoint`` is not an http(s) URL with a host.
    """
    scheme, rest = split_uri(endpoint)
    host = rest.split("/", 1)[0]
    if scheme not in ("http", "https") or not host:
        raise ValueError(f"an S3 endpoint is an http:// or https:// URL with a host (and port), got {endpoint!r}")
    pafs = _pafs()
    return pafs.S3FileSystem(endpoint_override=host, scheme=scheme, **options)
