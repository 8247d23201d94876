"""A local S3 server for tests: moto's S3 on 127.0.0.1, with faults and latency on demand.

``S3Server`` serves moto's WSGI application on a free port, in threads of its own (named
``s3server:...``): one that accepts connections and one per connection, each connection timing out
after a second of silence. ``stop()`` shuts the server down, ends every hang, closes every
connection and joins every thread it started (bounded), so that a test module leaves nothing
running.

Faults are rules, checked in the order they were added, that answer chosen requests otherwise:

    f = server.fault(methods={"PUT"}, key=r"_manifest\\.json$", status=500)      # every such PUT fails
    f = server.fault(key=r"/part-", query=r"uploadId", methods={"POST"}, hang=True, times=1)
    f.hit.wait(10)          # the request arrived and hangs ...
    f.release()             # ... until now: it is then answered as the rule says (by moto, or its status)
    server.clear()          # every rule gone, every hang released

A rule matches by method (a set, None: any), by a regular expression searched in the request's
path (``/bucket/key``, None: any) and in its query string (``uploads``, ``uploadId=...``,
``list-type=2``...); ``after`` lets that many matching requests pass first, ``times`` limits how
many it answers (None: all). What it does: ``delay_s`` (latency, then the rest), ``hang`` (wait
until released, the server stops or ``hang_s`` pass) and ``status`` (503 SlowDown, 500
InternalError, 403 AccessDenied, 404 NoSuchKey or NoSuchBucket by ``code``, or any other with an
error body) instead of moto's answer. ``f.matched`` and ``f.applied`` count its requests; ``f.hit``
is set at the first it applies to.

Every request is recorded (``server.requests``: method, path, query, status, when): count them
with ``server.count(methods=..., key=...)`` and start afresh with ``server.reset_log()``.
``delay_s`` adds latency to every request.

The older knobs stay: ``faults(every=k)`` answers every k-th request (of ``fail_methods``) with
``503 SlowDown``, ``faults(next=n)`` the next n; ``deny = {"key substring"}`` answers 403 for keys
matching.
"""
from __future__ import annotations

import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Set

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"

_CODES = {503: ("Slow Down", "SlowDown", "Please reduce your request rate."),
          500: ("Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
          403: ("Forbidden", "AccessDenied", "Access Denied"),
          404: ("Not Found", "NoSuchKey", "The specified key does not exist."),
          400: ("Bad Request", "InvalidRequest", "Bad request"),
          412: ("Precondition Failed", "PreconditionFailed", "At least one of the pre-conditions you specified "
                                                             "did not hold")}


def error_body(code: str, message: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
            f'<RequestId>feeder-test</RequestId></Error>').encode()


_SLOW_DOWN = error_body("SlowDown", "Please reduce your request rate.")
_DENIED = error_body("AccessDenied", "Access Denied")


@dataclass
class Request:
    """One request the server got: its method, path (``/bucket/key``), query string, the status
    it was answered with, and when it arrived (``time.monotonic()``)."""

    method: str
    path: str
    query: str
    status: int = 0
    t: float = 0.0


@dataclass(eq=False)
class Fault:
    """A rule answering chosen requests otherwise (see the module docstring)."""

    methods: Optional[Set[str]] = None
    key: Optional[str] = None
    query: Optional[str] = None
    status: Optional[int] = None
    code: Optional[str] = None
    delay_s: float = 0.0
    hang: bool = False
    hang_s: float = 120.0
    times: Optional[int] = None
    after: int = 0
    matched: int = 0
    applied: int = 0
    hit: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)

    def matches(self, method: str, path: str, query: str) -> bool:
        return ((self.methods is None or method in self.methods)
                and (self.key is None or re.search(self.key, path) is not None)
                and (self.query is None or re.search(self.query, query) is not None))

    def release(self) -> None:
        """End the hangs of this rule (those waiting and those to come)."""
        self.released.set()

    def answer(self, method: str) -> Optional[tuple]:
        """(status line, headers, body) of its error answer, or None to let moto answer."""
        if self.status is None:
            return None
        reason, code, message = _CODES.get(self.status, ("Error", "Error", "Error"))
        if self.code is not None:
            code = self.code
            message = {"NoSuchBucket": "The specified bucket does not exist",
                       "InvalidAccessKeyId": "The AWS Access Key Id you provided does not exist in our records."}.get(
                code, message)
        body = b"" if method == "HEAD" else error_body(code, message)
        return (f"{self.status} {reason}", [("Content-Type", "application/xml"),
                                            ("Content-Length", str(len(body)))], body)


class S3Server:
    """moto's S3 on 127.0.0.1 (a free port), with fault injection; see the module docstring."""

    def __init__(self, delay_s: float = 0.0):
        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

        self.delay_s = delay_s
        self.fail_every = 0
        self.fail_next = 0
        self.fail_methods: Set[str] = {"GET", "HEAD", "PUT", "POST", "DELETE"}
        self.deny: Set[str] = set()
        self.failed = 0
        self.requests: List[Request] = []
        self.rules: List[Fault] = []
        self._counted = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._threads: List[threading.Thread] = []
        self._sockets: Set[socket.socket] = set()
        app = DomainDispatcherApplication(create_backend_app)
        server_self = self

        def faulty(environ: Any, start_response: Any) -> Iterable[bytes]:
            method = environ.get("REQUEST_METHOD", "")
            path = environ.get("PATH_INFO", "")
            query = environ.get("QUERY_STRING", "")
            record = Request(method, path, query, 0, time.monotonic())
            rule: Optional[Fault] = None
            with server_self._lock:
                server_self.requests.append(record)
                fail = False
                if method in server_self.fail_methods:
                    server_self._counted += 1
                    if server_self.fail_next > 0:
                        server_self.fail_next -= 1
                        fail = True
                    elif server_self.fail_every and server_self._counted % server_self.fail_every == 0:
                        fail = True
                if fail:
                    server_self.failed += 1
                denied = any(d in path for d in server_self.deny)
                for r in server_self.rules:
                    if r.matches(method, path, query):
                        r.matched += 1
                        if r.matched > r.after and (r.times is None or r.applied < r.times):
                            r.applied += 1
                            rule = r
                            break

            def answer(status: str, headers: Any, *rest: Any) -> Any:
                record.status = int(status.split()[0])
                return start_response(status, headers, *rest)

            if server_self.delay_s:
                time.sleep(server_self.delay_s)
            if rule is not None:
                rule.hit.set()
                if rule.delay_s:
                    time.sleep(rule.delay_s)
                if rule.hang:
                    deadline = time.monotonic() + rule.hang_s
                    while not rule.released.is_set() and not server_self._stopping.is_set() \
                            and time.monotonic() < deadline:
                        rule.released.wait(0.05)
                got = rule.answer(method)
                if got is not None:
                    answer(got[0], got[1])
                    return [got[2]]
            if denied:
                answer("403 Forbidden", [("Content-Type", "application/xml"), ("Content-Length", str(len(_DENIED)))])
                return [_DENIED]
            if fail:
                body = b"" if method == "HEAD" else _SLOW_DOWN
                answer("503 Slow Down", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
                return [body]
            return app(environ, answer)

        class Handler(WSGIRequestHandler):
            timeout = 1.0  # an idle keep-alive connection ends its thread after a second

            def log_request(self, *args: Any, **kw: Any) -> None:
                pass

            def log_error(self, *args: Any, **kw: Any) -> None:
                pass  # a client that gave up on a hung request: not the test's business

        class Server(ThreadedWSGIServer):
            daemon_threads = True
            request_queue_size = 256

            def process_request(self, request: Any, client_address: Any) -> None:
                t = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                     name="s3server:connection", daemon=True)
                with server_self._lock:
                    server_self._threads = [x for x in server_self._threads if x.is_alive()] + [t]
                    server_self._sockets.add(request)
                t.start()

            def shutdown_request(self, request: Any) -> None:
                with server_self._lock:
                    server_self._sockets.discard(request)
                super().shutdown_request(request)

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a connection the client closed under a hung answer

        self._server = Server("127.0.0.1", 0, faulty, handler=Handler)
        self.host, self.port = self._server.server_address[:2]
        self.endpoint = f"{self.host}:{self.port}"
        self._serve = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="s3server:accept", daemon=True)

    def start(self) -> "S3Server":
        self._serve.start()
        return self

    def env(self) -> dict:
        """Environment variables that make pyarrow's S3 filesystem (``s3://`` URIs) talk to this
        server (subprocesses: ``dict(os.environ, **server.env())``)."""
        return {"AWS_ENDPOINT_URL": f"http://{self.endpoint}", "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION, "AWS_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def filesystem(self, **options: Any) -> Any:
        """A ``pyarrow.fs.S3FileSystem`` talking to this server."""
        import pyarrow.fs as pafs

        kw = dict(access_key=ACCESS_KEY, secret_key=SECRET_KEY, endpoint_override=self.endpoint, scheme="http",
                  allow_bucket_creation=True, allow_bucket_deletion=True, region=REGION)
        kw.update(options)
        return pafs.S3FileSystem(**kw)

    def s3fs(self, **options: Any) -> Any:
        """An ``s3fs.S3FileSystem`` (fsspec) talking to this server (ImportError without s3fs)."""
        import s3fs  # type: ignore[import-untyped]

        kw = dict(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=f"http://{self.endpoint}",
                  client_kwargs={"region_name": REGION}, skip_instance_cache=True)
        kw.update(options)
        return s3fs.S3FileSystem(**kw)

    # ---- faults --------------------------------------------------------------------------------
    def fault(self, methods: Optional[Iterable[str]] = None, key: Optional[str] = None, *,
              query: Optional[str] = None, status: Optional[int] = None, code: Optional[str] = None,
              delay_s: float = 0.0, hang: bool = False, hang_s: float = 120.0, times: Optional[int] = None,
              after: int = 0) -> Fault:
        """Add a rule (see the module docstring); returns it."""
        if isinstance(methods, str):
            methods = {methods}
        rule = Fault(set(methods) if methods is not None else None, key, query, status, code, delay_s, hang, hang_s,
                     times, after)
        with self._lock:
            self.rules.append(rule)
        return rule

    def remove(self, rule: Fault) -> None:
        """Take one rule away (its hangs released)."""
        with self._lock:
            self.rules = [r for r in self.rules if r is not rule]
        rule.release()

    def clear(self) -> None:
        """Every rule gone (hangs released), the older knobs reset, no added latency."""
        with self._lock:
            rules, self.rules = self.rules, []
            self.fail_every = self.fail_next = 0
            self._counted = 0
            self.fail_methods = {"GET", "HEAD", "PUT", "POST", "DELETE"}
            self.deny = set()
            self.delay_s = 0.0
        for r in rules:
            r.release()

    def faults(self, every: int = 0, next: int = 0, methods: Optional[Iterable[str]] = None) -> None:
        with self._lock:
            self.fail_every, self.fail_next = every, next
            self._counted = 0
            if methods is not None:
                self.fail_methods = set(methods)

    # ---- what it was asked ---------------------------------------------------------------------
    def reset_log(self) -> None:
        with self._lock:
            self.requests = []

    def log(self, methods: Optional[Iterable[str]] = None, key: Optional[str] = None,
            query: Optional[str] = None) -> List[Request]:
        """The requests recorded since the last ``reset_log()`` that match (as a rule matches)."""
        probe = Fault(set([methods] if isinstance(methods, str) else methods) if methods is not None else None,
                      key, query)
        with self._lock:
            return [r for r in self.requests if probe.matches(r.method, r.path, r.query)]

    def count(self, methods: Optional[Iterable[str]] = None, key: Optional[str] = None,
              query: Optional[str] = None) -> int:
        return len(self.log(methods, key, query))

    def stop(self, timeout: float = 5.0) -> None:
        """Shut down, end every hang, close every connection, join every thread (within ``timeout``
        seconds)."""
        self._stopping.set()
        self.clear()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for t in [self._serve] + threads:
            t.join(max(0.0, deadline - time.monotonic()))
        left = [t for t in [self._serve] + threads if t.is_alive()]
        assert not left, f"S3 server threads left: {left}"


def moto_available() -> bool:
    try:
        import moto.server  # noqa: F401
        import werkzeug  # noqa: F401
    except ImportError:
        return False
    return True


def s3fs_available() -> bool:
    try:
        import s3fs  # noqa: F401
    except ImportError:
        return False
    return True


def s3_env_removed() -> dict:
    """os.environ without AWS_* variables (so a test's own settings are the only ones)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
