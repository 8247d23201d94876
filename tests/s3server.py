"""A local S3 server for tests: moto's S3 on 127.0.0.1, with faults and latency on demand.

``S3Server`` serves moto's WSGI application on a free port, in threads of its own (named
``s3server:...``): one that accepts connections and one per connection, each connection timing out
after a second of silence. ``stop()`` shuts the server down, closes every connection and joins
every thread it started (bounded), so that a test module leaves nothing running.

Faults: ``fail_every = k`` answers every k-th request (of those whose method is in
``fail_methods``) with ``503 SlowDown`` as S3 does when throttling; ``fail_next = n`` answers the
next n requests so; ``deny = {"key substring", ...}`` answers 403 AccessDenied for keys matching.
``delay_s`` adds latency to every request.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Iterable, List, Optional, Set

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"

_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your '
              b'request rate.</Message><RequestId>feeder-test</RequestId></Error>')
_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code><Message>Access Denied'
           b'</Message><RequestId>feeder-test</RequestId></Error>')


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
        self.requests = 0
        self.failed = 0
        self._counted = 0
        self._lock = threading.Lock()
        self._threads: List[threading.Thread] = []
        self._sockets: Set[socket.socket] = set()
        app = DomainDispatcherApplication(create_backend_app)
        server_self = self

        def faulty(environ: Any, start_response: Any) -> Iterable[bytes]:
            method = environ.get("REQUEST_METHOD", "")
            path = environ.get("PATH_INFO", "")
            with server_self._lock:
                server_self.requests += 1
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
            if server_self.delay_s:
                time.sleep(server_self.delay_s)
            if denied:
                start_response("403 Forbidden", [("Content-Type", "application/xml"),
                                                  ("Content-Length", str(len(_DENIED)))])
                return [_DENIED]
            if fail:
                body = b"" if method == "HEAD" else _SLOW_DOWN
                start_response("503 Slow Down", [("Content-Type", "application/xml"),
                                                 ("Content-Length", str(len(body)))])
                return [body]
            return app(environ, start_response)

        class Handler(WSGIRequestHandler):
            timeout = 1.0  # an idle keep-alive connection ends its thread after a second

            def log_request(self, *args: Any, **kw: Any) -> None:
                pass

        class Server(ThreadedWSGIServer):
            daemon_threads = True

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

    def faults(self, every: int = 0, next: int = 0, methods: Optional[Iterable[str]] = None) -> None:
        with self._lock:
            self.fail_every, self.fail_next = every, next
            self._counted = 0
            if methods is not None:
                self.fail_methods = set(methods)

    def stop(self, timeout: float = 5.0) -> None:
        """Shut down, close every connection, join every thread (within ``timeout`` seconds)."""
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


def s3_env_removed() -> dict:
    """os.environ without AWS_* variables (so a test's own settings are the only ones)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
