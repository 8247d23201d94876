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
by :func:`retrying` with exponential backoff, a bounded number of times within a bounded time
(:class:`Retry`); permanent ones (a missing object, access denied) are not. That is the one retry
layer: the S3 filesystems feeder makes from a URI do not retry by themselves (their
``retry_strategy`` makes one attempt) and give up a connection after :data:`CONNECT_TIMEOUT_S` and
a request that stalls for :data:`REQUEST_TIMEOUT_S` (``?connect_timeout=``/``?request_timeout=``
in the URI change them). The first failure a source or an output meets is logged at WARNING at
once (naming the URI and the error), later retries at DEBUG. :func:`plain_error` words the
failures a user must act on (access denied, a missing bucket, an endpoint that cannot be reached)
in plain words, keeping the store's own as the cause.

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
from urllib.parse import parse_qsl, urlencode

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
# The S3 filesystems feeder makes from a URI: seconds to connect, and seconds a request may stall
# (no byte sent or received: the AWS SDK's low-speed limit, so a long transfer is never cut).
CONNECT_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 10.0
_TIMEOUT_QUERY = ("connect_timeout", "request_timeout")  # ... and the URI's query parameters setting them


# ---- retries ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Retry:
    """How transient storage failures are retried: up to ``attempts`` more tries, waiting
    ``backoff_s`` seconds before the first, doubled before each next one up to ``max_backoff_s``
    (each wait drawn at random between half and all of it, so that many readers do not retry in
    step), and none that would start more than ``budget_s`` seconds after the first failure (a
    long transfer that fails late is still tried again). The defaults wait about 0.1 + 0.2 + 0.4
    + 0.8 + 1.6 = 3.1 s at most over 5 retries; with requests that hang until their time-out, the
    budget ends the retries."""

    attempts: int = 5
    backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    budget_s: float = 10.0

    def about_s(self) -> float:
        """The most the waits between tries add up to (seconds)."""
        return float(sum(min(self.max_backoff_s, self.backoff_s * (2.0 ** k)) for k in range(self.attempts)))

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


# Failures a user must act on, as pyarrow's AWS, GCS and Azure clients, fsspec drivers and curl word them.
_DENIED = re.compile(
    r"ACCESS_DENIED|AccessDenied|Access Denied|HTTP status 40[13]\b|InvalidAccessKeyId|INVALID_ACCESS_KEY_ID|"
    r"SignatureDoesNotMatch|SIGNATURE_DOES_NOT_MATCH|ExpiredToken|EXPIRED_TOKEN|PERMISSION_DENIED|403 Forbidden|"
    r"UNAUTHENTICATED|Unauthorized")
_NO_BUCKET = re.compile(r"NO_SUCH_BUCKET|NoSuchBucket|[Bb]ucket does not exist|The specified bucket does not exist")
_UNREACHABLE = re.compile(r"Could not connect|Couldn't connect|Could not resolve|Couldn't resolve|Connection refused|"
                          r"Failed to connect|Cannot connect to host|Name or service not known")
_CREDENTIALS = {"s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), AWS_PROFILE, or the "
                      "machine's role",
                "gs": "GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default login, or the machine's "
                      "service account",
                "abfs": "AZURE_STORAGE_ACCOUNT_NAME and its key, a SAS token, or the default Azure credential"}


def _bucket_of(uri: str) -> str:
    """The bucket (container) of an object store's URI: what follows ``scheme://`` up to ``/``."""
    scheme, rest = split_uri(uri)
    return rest.split("/", 1)[0].split("?", 1)[0] if scheme is not None else ""


def plain_error(e: BaseException, uri: str) -> Optional[OSError]:
    """A store's failure that the user must act on, in plain words naming ``uri`` (raise it from
    ``e``, which stays its cause), or None when ``e`` is none of them:

    * access denied, an unknown access key, a bad signature, an expired token: a PermissionError
      saying that the credentials were refused or lack permission, and where they come from;
    * a missing bucket: a FileNotFoundError saying that the bucket does not exist;
    * an endpoint that cannot be reached (connection refused, a host that does not resolve): a
      ConnectionError asking whether the endpoint is right (transient: it was retried first).
    """
    if getattr(e, "feeder_plain", False) or not isinstance(e, OSError) and not is_io_failure(e):
        return None
    text = " ".join(str(e).split())
    said = text if len(text) <= 300 else text[:297] + "..."
    scheme = split_uri(uri)[0] or ""
    out: OSError
    if _NO_BUCKET.search(text):
        out = FileNotFoundError(f"the bucket {_bucket_of(uri)!r} does not exist ({uri!r}): check its name, the "
                                f"account and the endpoint (the store said: {said})")
    elif isinstance(e, PermissionError) or _DENIED.search(text):
        where = _CREDENTIALS.get({"gcs": "gs", "s3a": "s3", "az": "abfs"}.get(scheme, scheme),
                                 "the filesystem's credentials")
        out = PermissionError(f"access denied to {uri!r}: the store refused the credentials, or they lack the "
                              f"permission for it; check the credentials ({where}) and the bucket's permissions "
                              f"(the store said: {said})")
    elif _UNREACHABLE.search(text):
        out = ConnectionError(f"cannot reach the store of {uri!r}: is the endpoint right and the server up? (the "
                              f"store's client said: {said})")
    else:
        return None
    marked: Any = out
    marked.feeder_plain = True  # already in plain words: not worded again, its cause not repeated
    return out


# on_retry(exception, retry number (0 for the first), seconds it waits before trying again)
OnRetry = Callable[[BaseException, int, float], None]


def retrying(fn: Callable[[], T], what: str, policy: Retry, on_retry: Optional[OnRetry] = None,
             stop: Optional[threading.Event] = None, counts: Optional["RetryCounts"] = None,
             worker: Optional[int] = None) -> T:
    """``fn()``, tried again after a transient failure (see :func:`is_transient`) up to
    ``policy.attempts`` times with exponential backoff, none starting later than
    ``policy.budget_s`` seconds after the first failure; each retry reported to ``on_retry`` and
    counted in ``counts`` (for ``worker``), and logged naming ``what``: the first failure that
    ``counts`` sees at WARNING, at once (a store that stopped answering is said before the
    retries run out), the others at DEBUG. The last failure, or a permanent one, is raised as it
    came. A set ``stop`` event ends the waiting (the last failure is raised)."""
    retry = 0
    failed_at: Optional[float] = None
    while True:
        try:
            return fn()
        except Exception as e:
            if retry >= policy.attempts or not is_transient(e):
                raise
            wait = policy.wait_s(retry)
            now = time.monotonic()
            failed_at = now if failed_at is None else failed_at
            if now + wait - failed_at > policy.budget_s:
                raise
            first = counts.retried(worker) if counts is not None else False
            text = " ".join(str(e).split())[:300]
            if first:
                log.warning("feeder: %s failed (%s: %s); retrying up to %d times within %.0f s (further retries "
                            "are logged at DEBUG)", what, type(e).__name__, text, policy.attempts, policy.budget_s)
            else:
                log.debug("feeder: %s failed (%s: %s); retry %d of %d in %.2f s", what, type(e).__name__, text,
                          retry + 1, policy.attempts, wait)
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

    def retried(self, worker: Optional[int]) -> bool:
        """Count a retry; True for the first these counts have seen."""
        with self._lock:
            first = not self.retries
            self.retries[worker] = self.retries.get(worker, 0) + 1
            return first

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


class SharedCheck:
    """Checks shared by the callers that each need one begun after they asked (that an object is
    still the version a read got, say): a caller waits for the next check of its key to begin and
    end, at most one runs per key at a time, and every caller that asked while one ran shares the
    next. So N reads of one object that end together cost one request, not N; each waits for
    at most two checks."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._keys: Dict[Any, List[Any]] = {}  # key -> [checks begun, checks ended, one running, last result]

    def check(self, key: Any, fn: Callable[[], T]) -> T:
        """The result of a call of ``fn`` begun after this call began (``fn`` should return its
        failures as values: they are handed to every caller sharing it)."""
        with self._cond:
            st = self._keys.setdefault(key, [0, 0, False, None])
            mine = st[0] + 1  # the first check that begins from now on
            while st[1] < mine:
                if st[2]:
                    self._cond.wait(0.05)
                    continue
                st[0] += 1
                st[2] = True
                self._cond.release()
                try:
                    result = fn()
                finally:
                    self._cond.acquire()
                    st[2] = False
                    self._cond.notify_all()
                st[1] = st[0]
                st[3] = result
            return st[3]  # type: ignore[no-any-return]


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


def resolve(target: Any, filesystem: Any = None, cache: Optional[Dict[Any, Store]] = None) -> Tuple[Store, str]:
    """(store, path in it) for a local path, a ``file://``, ``s3://``, ``gs://`` or fsspec URI,
    or a path on ``filesystem`` (a ``pyarrow.fs.FileSystem`` or an fsspec filesystem). A URI's
    scheme is case-insensitive (``S3://`` is ``s3://``). ``cache``: stores made for earlier URIs
    of the same scheme, bucket and query, reused (one client for many objects; see
    :func:`resolve_all`).

    An S3 filesystem made from a URI does not retry by itself (feeder retries, see
    :class:`Retry`) and has time-outs: :data:`CONNECT_TIMEOUT_S` to connect and
    :data:`REQUEST_TIMEOUT_S` for a request that stalls, or ``connect_timeout=`` and
    ``request_timeout=`` (seconds) in the URI's query.

    Raises:
        TypeError: ``target`` is not a str or path, or ``filesystem`` is neither kind.
        ValueError: A URI scheme neither pyarrow nor fsspec knows (naming what to install).
    """
    if isinstance(target, os.PathLike):
        target = os.fspath(target)
    if not isinstance(target, str):
        raise TypeError(f"a path or URI must be a str or os.PathLike, got {type(target).__name__}")
    scheme, rest = split_uri(target)
    if scheme is not None:
        target = f"{scheme}://{rest}"  # schemes are case-insensitive (RFC 3986); pyarrow and fsspec want them lower
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
    base, _, query = rest.partition("?")
    key = (scheme, base.split("/", 1)[0], query)
    known = cache.get(key) if cache is not None else None
    if isinstance(known, FileSystemStore):
        if known.fsspec is not None:
            return known, str(known.fsspec._strip_protocol(target))
        if known.scheme in ("s3", "gs", "abfs"):
            return known, base
    if scheme in ("s3", "gs", "gcs", "abfs", "abfss", "hdfs", "viewfs"):
        try:
            found: Tuple[Store, str] = _pyarrow_store(scheme, target)
        except (ValueError, OSError, ImportError, NotImplementedError) as e:
            fallback = _fsspec_store(target, required=False)
            if fallback is None:
                raise ValueError(f"cannot open {target!r}: {type(e).__name__}: {e}") from e
            found = fallback
    else:
        fsspec_found = _fsspec_store(target, required=True)
        assert fsspec_found is not None
        found = fsspec_found
    if cache is not None:
        cache[key] = found[0]
    return found


def resolve_all(targets: Sequence[Any], filesystem: Any = None) -> List[Tuple[Store, str]]:
    """:func:`resolve` for each target, URIs of one scheme, bucket and query sharing one store
    (one client, its connections reused), not one per URI."""
    cache: Dict[Any, Store] = {}
    return [resolve(t, filesystem, cache) for t in targets]


def _pyarrow_store(scheme: str, target: str) -> Tuple["FileSystemStore", str]:
    """pyarrow's own filesystem for ``target``; an S3 one made with feeder's retry strategy and
    time-outs (the query's ``connect_timeout`` and ``request_timeout`` taken out for it)."""
    pafs = _pafs()
    base, _, query = target.partition("?")
    params = parse_qsl(query, keep_blank_values=True)
    timeouts: Dict[str, float] = {"connect_timeout": CONNECT_TIMEOUT_S, "request_timeout": REQUEST_TIMEOUT_S}
    for name, value in params:
        if name in _TIMEOUT_QUERY:
            try:
                timeouts[name] = float(value)
            except ValueError:
                raise ValueError(f"{target!r}: {name} must be a number of seconds, got {value!r}") from None
            if not timeouts[name] > 0:
                raise ValueError(f"{target!r}: {name} must be > 0 seconds, got {value!r}")
    rest = [(k, v) for k, v in params if k not in _TIMEOUT_QUERY]
    if len(rest) != len(params) and scheme != "s3":
        raise ValueError(f"{target!r}: {', '.join(_TIMEOUT_QUERY)} apply to s3:// URIs")
    fs, path = pafs.FileSystem.from_uri(base + ("?" + urlencode(rest) if rest else ""))
    if fs.type_name == "s3":
        options = {k: v for k, v in fs.__reduce__()[1][0].items() if k not in _TIMEOUT_QUERY}
        options.update(timeouts)
        return FileSystemStore(_s3_with(options), "s3", built=options), path
    return FileSystemStore(fs, {"gcs": "gs", "abfss": "abfs", "viewfs": "hdfs"}.get(scheme, scheme)), path


def _s3_with(options: Dict[str, Any]) -> Any:
    """A ``pyarrow.fs.S3FileSystem`` of these options that makes one attempt per request: feeder's
    own retries (:func:`retrying`) are the only ones, bounded in number and time."""
    pafs = _pafs()
    return pafs.S3FileSystem(**options, retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))


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
    environment unless ``options`` give them. Made as feeder makes one from a URI: one attempt
    per request (feeder retries) and feeder's time-outs, unless ``options`` say otherwise.

    Raises:
        ValueError: ``endpoint`` is not an http(s) URL with a host.
    """
    return s3_store(endpoint, **options).fs


def s3_store(endpoint: str, **options: Any) -> FileSystemStore:
    """:func:`s3_filesystem`, as a store that worker processes make again with the same options
    (what ``feeder predict --s3-endpoint`` passes as ``filesystem=``)."""
    scheme, rest = split_uri(endpoint)
    host = rest.split("/", 1)[0]
    if scheme not in ("http", "https") or not host:
        raise ValueError(f"an S3 endpoint is an http:// or https:// URL with a host (and port), got {endpoint!r}")
    if "retry_strategy" in options:  # the caller's own: pickled as pyarrow pickles it
        return FileSystemStore(_pafs().S3FileSystem(endpoint_override=host, scheme=scheme, **options), "s3")
    built = {"endpoint_override": host, "scheme": scheme, "connect_timeout": CONNECT_TIMEOUT_S,
             "request_timeout": REQUEST_TIMEOUT_S, **options}
    return FileSystemStore(_s3_with(built), "s3", built=built)
