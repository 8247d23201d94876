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

One mechanism per module, each importing only those listed before it:

* :mod:`~feeder.storage.uris`: ``split_uri`` and the parts of a URI.
* :mod:`~feeder.storage.retry`: transient or permanent, :class:`Retry`, :func:`retrying`, :class:`RetryCounts`.
* :mod:`~feeder.storage.plainerrors`: :func:`plain_error`.
* :mod:`~feeder.storage.concurrency`: :func:`map_bounded`, :class:`SharedCheck`.
* :mod:`~feeder.storage.stores`: :class:`Store`, :class:`LocalStore`, :class:`FileSystemStore`, objects'
  versions and hashes.
* :mod:`~feeder.storage.resolving`: :func:`resolve`, :func:`resolve_all`, :func:`store_of`,
  :func:`s3_filesystem`: a path, URI or filesystem to its store.
"""
from __future__ import annotations

# The package's names, as they were when this was one module (feeder.storage): sources, predict,
# the tests and the reference page (docs/reference/beyond-the-contract.md) import them from here.
from .concurrency import SharedCheck, map_bounded
from .plainerrors import plain_error
from .resolving import (
    CONNECT_TIMEOUT_S,
    REQUEST_TIMEOUT_S,
    resolve,
    resolve_all,
    s3_filesystem,
    s3_store,
    store_of,
)
from .retry import OnRetry, Retry, RetryCounts, is_io_failure, is_transient, retrying
from .stores import (
    OBJECT_STORES,
    PARQUET_SUFFIXES,
    FileSystemStore,
    LocalStore,
    Opened,
    Store,
    sha256_file,
    sha256_of,
)
from .uris import split_uri

__all__ = [
    "CONNECT_TIMEOUT_S", "REQUEST_TIMEOUT_S", "OBJECT_STORES", "PARQUET_SUFFIXES",
    "FileSystemStore", "LocalStore", "OnRetry", "Opened", "Retry", "RetryCounts", "SharedCheck", "Store",
    "is_io_failure", "is_transient", "map_bounded", "plain_error", "resolve", "resolve_all", "retrying",
    "s3_filesystem", "s3_store", "sha256_file", "sha256_of", "split_uri", "store_of",
]
