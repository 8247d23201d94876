"""Pacing a fetcher whose ``fetch_fun`` returned None ("nothing this time"), threads and worker
processes alike: the pause before its next call, and the warning, logged at most once in a while.

A fetch function that polls (an inbox, a socket, a directory) returns None when it found
nothing, and its next call is unlikely to find something a microsecond later: calling it again
at once spins a core and, logged per call, floods the log (hundreds of thousands of lines a
minute). So the next call waits ``NONE_PAUSE_FIRST_S`` after the first None of a run, twice as
long after each further one, at most ``NONE_PAUSE_MAX_S``, and not at all once a call returned
something else; the wait ends at once on stop.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Set

log = logging.getLogger("feeder")

NONE_PAUSE_FIRST_S = 0.001  # seconds before the call after the first None of a run
NONE_PAUSE_MAX_S = 0.05     # the longest pause (a fetcher's wait slice: data is never waited on longer)
NONE_LOG_S = 10.0           # the warning, with a count, at most this often per feed
AFTER_NONE = "pausing after fetch_fun returned None"  # the fetcher's state meanwhile (a FeedTimeout says it)


def none_pause(previous: float) -> float:
    """Seconds to wait before the next call after a None: NONE_PAUSE_FIRST_S after the first of a
    run of them (``previous`` 0), then twice the previous pause, at most NONE_PAUSE_MAX_S."""
    return NONE_PAUSE_FIRST_S if previous <= 0 else min(NONE_PAUSE_MAX_S, 2.0 * previous)


class NoneReport:
    """The warning for ``fetch_fun`` returning None, for the fetchers of one feed (threads or
    worker processes): the first one at once, then at most one line every NONE_LOG_S seconds,
    with how many calls returned None meanwhile. Thread-safe."""

    def __init__(self, source_name: str, interval_s: float = NONE_LOG_S):
        self.source_name = source_name
        self.interval_s = interval_s
        self.total = 0
        self._pending = 0
        self._workers: Set[int] = set()
        self._since = 0.0
        self._next = 0.0
        self._lock = threading.Lock()

    def note(self, worker_id: int) -> None:
        """One call of worker ``worker_id`` returned None."""
        now = time.monotonic()
        with self._lock:
            self.total += 1
            self._pending += 1
            self._workers.add(worker_id)
            if now < self._next:
                return
            first = self.total == 1
            pending, workers, since = self._pending, sorted(self._workers), self._since
            self._pending, self._workers, self._since = 0, set(), now
            self._next = now + self.interval_s
        if first:
            self._first(worker_id)
        else:
            log.warning("source %r: fetch_fun returned %s %d times in the last %.0f s (workers %s; %d in all); "
                        "skipped", self.source_name, self.what, pending, now - since, workers, self.total)

    what = "None"

    def _first(self, worker_id: int) -> None:
        log.warning("source %r worker %d: fetch_fun returned None (nothing this time); skipped. The next calls "
                    "wait %.0f ms, doubling up to %.0f ms, while it goes on returning None; this is logged at "
                    "most every %.0f s", self.source_name, worker_id, NONE_PAUSE_FIRST_S * 1e3,
                    NONE_PAUSE_MAX_S * 1e3, self.interval_s)


class EmptyReport(NoneReport):
    """The warning for chunks of 0 rows, paced as :class:`NoneReport`'s (a fetch function that
    returns nothing but empty chunks made one line per call: 100,000 lines a second)."""

    what = "a chunk with 0 rows"

    def _first(self, worker_id: int) -> None:
        log.warning("source %r worker %d: fetch_fun returned a chunk with 0 rows; skipped (logged at most every "
                    "%.0f s)", self.source_name, worker_id, self.interval_s)
