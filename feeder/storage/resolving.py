"""A path, URI or filesystem resolved to its store (:func:`resolve`, :func:`resolve_all`,
:func:`store_of`), and the S3 filesystems feeder makes (one attempt per request, time-outs)."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import parse_qsl, urlencode

from .stores import FileSystemStore, LocalStore, Store, _pafs, _s3_with
from .uris import _strip_query, split_uri

_SCHEMES = {"s3": "s3", "gcs": "gs", "abfs": "abfs", "local": "file", "hdfs": "hdfs", "mock": "mock"}
# The S3 filesystems feeder makes from a URI: seconds to connect, and seconds a request may stall
# (no byte sent or received: the AWS SDK's low-speed limit, so a long transfer is never cut).
CONNECT_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 10.0
_TIMEOUT_QUERY = ("connect_timeout", "request_timeout")  # ... and the URI's query parameters setting them


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
