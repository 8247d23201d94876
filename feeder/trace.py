"""A trace of what a feed's threads do, as Chrome / Perfetto trace events (``feed.trace(path)``).

The file is the JSON trace event format (``{"traceEvents": [...]}``) that ui.perfetto.dev and
chrome://tracing open: one complete event (``"ph": "X"``, ``ts`` and ``dur`` in microseconds since
the trace began) per span, on the track of the thread that did it, and a ``thread_name`` metadata
event per track. Spans:

* ``fetch``: a ``fetch_fun`` call that returned a chunk (fetcher threads); for worker processes,
  on a track of the process's own, the time the child reported for the chunk, ending when the
  parent received it;
* ``assemble``: a batch written on the host (its bytes copied out of its chunks), in whichever
  thread wrote it;
* ``copy``: a batch's copy to the device, on the track of the feed's stream: from when it could
  start to when it was done, as the device timed it (``cpu:staged``: the stand-in's memmove);
* ``wait``: a consumer waiting for a batch (nothing ready), or for its copy to the device;
* ``run``: a consumer running the session on a batch.

Recording costs one attribute read where no trace is active (``hook.tracer is None``).
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Dict, List, Optional


class TraceHook:
    """Where a feed's threads look for the active :class:`Tracer` (None: no trace)."""

    __slots__ = ("tracer",)

    def __init__(self) -> None:
        self.tracer: Optional[Tracer] = None


class Tracer:
    """Spans recorded by any thread, written as a trace file by :meth:`write`. Times are
    ``time.monotonic()`` seconds."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self._events: List[Dict[str, Any]] = []
        self._tids: Dict[Any, int] = {}
        self._names: Dict[int, str] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _tid(self, track: Optional[str]) -> int:
        key: Any = track if track is not None else threading.get_ident()
        tid = self._tids.get(key)
        if tid is None:
            with self._lock:
                tid = self._tids.get(key)
                if tid is None:
                    tid = self._tids[key] = len(self._tids) + 1
                    self._names[tid] = track if track is not None else threading.current_thread().name
        return tid

    def span(self, name: str, start: float, end: float, track: Optional[str] = None, **args: Any) -> None:
        """A span ``name`` from ``start`` to ``end`` (monotonic seconds), on the calling thread's track
        or on the named ``track`` (a worker process, a stream)."""
        event = {"name": name, "cat": "feeder", "ph": "X", "ts": round((start - self.start) * 1e6, 1),
                 "dur": round(max(0.0, end - start) * 1e6, 1), "pid": self._pid, "tid": self._tid(track)}
        if args:
            event["args"] = args
        self._events.append(event)  # list.append is atomic

    def events(self) -> List[Dict[str, Any]]:
        """The trace events so far, thread names first."""
        meta = [{"name": "thread_name", "ph": "M", "pid": self._pid, "tid": tid, "args": {"name": name}}
                for tid, name in sorted(self._names.items())]
        meta.append({"name": "process_name", "ph": "M", "pid": self._pid, "tid": 0, "args": {"name": "feeder"}})
        return meta + sorted(self._events, key=lambda e: e["ts"])

    def write(self, path: Any) -> None:
        """Write the trace to ``path`` (JSON trace event format)."""
        with open(os.fspath(path), "w", encoding="utf-8") as f:
            json.dump({"traceEvents": self.events(), "displayTimeUnit": "ms"}, f)
