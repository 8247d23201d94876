"""Concurrency that tunes itself: how many of a feed's fetchers run (``num_worker_threads="auto"``).

Two pieces:

* :class:`Tuner`, pure logic: it is shown, every window, the rows consumers took and the seconds
  they waited, and answers how many fetchers should run. It hill-climbs on the rows delivered per
  second. It tries one more fetcher only while consumers wait for data (more cannot help a
  consumer that never waits) and keeps it only if throughput rises by at least ``GAIN`` in two
  windows running (a GIL-bound fetch that more fetchers cannot speed up measured 6% over its
  baseline in one window by chance, one run in sixteen, and kept the step); it tries one fewer now
  and then and keeps that if throughput holds within ``HOLD`` (fewer fetchers contend less for the
  GIL, cores and caches). A probe that failed is not repeated for a while (``COOLDOWN`` windows,
  doubling up to ``COOLDOWN_MAX`` each time it fails again; one that lost more than 15% waits
  twice that), so a changed workload (a fetch that became I/O-bound, a consumer that slowed down)
  is found again without constant churn. A step up that paid off by ``FAST`` or more is kept after
  one window and followed by the next one at once, so an I/O-bound fetch that needs eight fetchers
  gets them in seconds, not in tens of windows.
* :class:`Throttle`: which fetchers may call ``fetch_fun`` now. The first ``limit`` fetchers
  that have not ended run; the others are parked. A fetcher that ends (``StopIteration``)
  hands its place to a parked one, so every worker still runs before a finite source ends
  (sharded sources need every worker's share).
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Deque, FrozenSet, List, Optional, Sequence

WINDOW_S = 0.3        # seconds of measurement behind each decision
GAIN = 1.05           # one more fetcher is kept only if rows/s rise at least this much, twice
HOLD = 0.97           # one fewer is kept if rows/s stay at least this share
WAITING = 0.05        # consumers waiting this share of a window are waiting for data
FAST = 1.25           # a step up that gained this much is followed at once by the next (no steady windows)
COSTLY = 0.85         # a probe that lost more than this share waits twice as long before the next
COOLDOWN = 4          # windows before a failed probe in the same direction is tried again ...
COOLDOWN_MAX = 32     # ... doubling each time it fails, up to this many
MIN_BATCHES = 2       # a window is evidence once it holds this many delivered batches, and at least
                      # one per fetcher running (about one call of each, when a call makes a batch);
                      # until then it grows (a fetch slower than WINDOW_S delivers none in most
                      # windows of 0.3 s, and a window shorter than a call misses some fetchers) ...
MAX_WINDOW_S = 10.0   # ... up to this long, when consumers that waited through it are evidence too


class Tuner:
    """Hill-climbing on delivered rows/s over ``1 .. max_workers`` fetchers (see module docstring)."""

    def __init__(self, max_workers: int, start: int = 1, window_s: float = WINDOW_S):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.active = max(1, min(start, max_workers))
        self.window_s = window_s
        self._t0: Optional[float] = None
        self._rows0 = self._wait0 = self._batches0 = 0.0
        self._steady: Deque[float] = deque(maxlen=2)  # rows/s of the last windows at ``active`` fetchers
        self._probe: Optional[int] = None          # the count being tried, ``active`` the one to return to
        self._confirming = False                   # a step up gained GAIN in one window: one more to go
        self._skip = True                          # skip the first window (start-up) and any window the
                                                   # count changed in (it mixes two counts)
        self._first = True                         # the current window is the first (see observe)
        self._cool = {1: 0, -1: 0}                 # windows before probing up (1) / down (-1) again
        self._cool_len = {1: COOLDOWN, -1: COOLDOWN}
        self.decisions: List[str] = []             # the last few, for logs and tests

    @property
    def current(self) -> int:
        """How many fetchers should run now."""
        return self._probe if self._probe is not None else self.active

    def observe(self, now: float, rows: float, wait_s: float, batches: Optional[float] = None) -> Optional[int]:
        """Feed cumulative ``rows`` delivered, consumer ``wait_s`` (waits still going on included)
        and, optionally, ``batches`` delivered at ``now`` (monotonic s); returns the new number of
        fetchers when it changes, else None.

        A window is at least ``window_s`` long and, when ``batches`` is given, holds at least
        MIN_BATCHES of them and one per fetcher running (the first window, which only has to
        exclude the start, one): a window with fewer is no evidence yet and goes on, up to
        MAX_WINDOW_S; then it counts if it holds MIN_BATCHES, or if consumers waited through it
        (starved: that is evidence too). A window in which consumers neither took a batch nor
        waited (they were busy elsewhere) starts afresh."""
        if self._t0 is None:
            self._restart(now, rows, wait_s, batches)
            return None
        dt = now - self._t0
        if dt < self.window_s:
            return None
        rate = (rows - self._rows0) / dt
        waiting = (wait_s - self._wait0) / dt
        least = 1 if self._first else MIN_BATCHES
        if batches is not None and batches - self._batches0 < max(least, self.current):
            idle = rows == self._rows0 and waiting <= 0.0
            if not idle and dt < MAX_WINDOW_S:
                return None  # too little data yet: the window goes on
            if idle or (batches - self._batches0 < least and waiting < 1.0 - WAITING):
                self._restart(now, rows, wait_s, batches)
                return None  # no evidence: start afresh
        self._restart(now, rows, wait_s, batches)
        self._first = False
        if self._skip:
            self._skip = False
            return None
        before = self.current
        self._decide(rate, waiting)
        return self.current if self.current != before else None

    def _restart(self, now: float, rows: float, wait_s: float, batches: Optional[float]) -> None:
        self._t0, self._rows0, self._wait0, self._batches0 = now, rows, wait_s, batches or 0.0

    def _decide(self, rate: float, waiting: float) -> None:
        for d in self._cool:
            self._cool[d] = max(0, self._cool[d] - 1)
        if self._probe is not None:
            up = self._probe > self.active
            base = sum(self._steady) / len(self._steady) if self._steady else 0.0
            kept = rate >= base * GAIN if up else rate >= base * HOLD
            direction = 1 if up else -1
            if up and kept and rate < base * FAST and not self._confirming:
                self._confirming = True  # a modest gain may be noise: the next window must show it too
                return
            self._confirming = False
            if kept:
                self._note(f"{self.active} -> {self._probe} fetchers kept ({base:,.0f} -> {rate:,.0f} rows/s)")
                self.active = self._probe
                self._steady.clear()
                self._steady.append(rate)
                self._cool_len[direction] = COOLDOWN
                # It just showed that this count beats the other: do not probe straight back. A step
                # up that paid off by FAST showed fetching bound by the fetchers (I/O, sleeps): a probe
                # down would only cost its two windows at a fraction of the rate, so it waits longer
                # (with 2 worker processes, probing 2 -> 1 every few windows cost 20% of the rows).
                if up and rate >= base * FAST:
                    self._cool_len[-1] = max(self._cool_len[-1], COOLDOWN_MAX // 2)
                self._cool[-direction] = max(self._cool[-direction], self._cool_len[-direction])
                if up and rate >= base * FAST and waiting >= WAITING and self.active < self.max_workers:
                    self._probe = self.active + 1
                    self._skip = True
                    return
            else:
                self._note(f"{self._probe} fetchers did not help ({base:,.0f} -> {rate:,.0f} rows/s); "
                           f"back to {self.active}")
                # A probe that cost a lot is retried less often: each probe costs its two windows.
                grow = 4 if rate < base * COSTLY else 2
                self._cool[direction] = self._cool_len[direction] * (grow // 2)
                self._cool_len[direction] = min(COOLDOWN_MAX, grow * self._cool_len[direction])
                self._skip = True
            self._probe = None
            return
        # Steady: the baseline is the mean of the last two windows (one is noisy), then maybe probe.
        self._steady.append(rate)
        if len(self._steady) < 2:
            return
        if waiting >= WAITING and self.active < self.max_workers and not self._cool[1]:
            self._probe = self.active + 1
        elif self.active > 1 and not self._cool[-1]:
            self._probe = self.active - 1
        if self._probe is not None:
            self._skip = True  # the next window straddles the change

    def _note(self, text: str) -> None:
        self.decisions = (self.decisions + [text])[-8:]


class Throttle:
    """Which fetchers may run: the first ``limit`` of those that have not ended (see module docstring)."""

    def __init__(self, worker_ids: Sequence[int], limit: int):
        self._order = list(worker_ids)
        self._ended: set[int] = set()
        self._cond = threading.Condition()
        self.limit = limit
        self.active: FrozenSet[int] = frozenset()
        with self._cond:
            self._recompute()

    def _recompute(self) -> None:
        live = [w for w in self._order if w not in self._ended]
        self.active = frozenset(live[:self.limit])  # replaced whole: fetchers read it without the lock
        self._cond.notify_all()

    def set_limit(self, limit: int) -> None:
        with self._cond:
            self.limit = max(1, limit)
            self._recompute()

    def ended(self, worker_id: int) -> None:
        """A fetcher raised StopIteration (or failed): a parked one takes its place."""
        with self._cond:
            self._ended.add(worker_id)
            self._recompute()

    def wait(self, worker_id: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``worker_id`` to be let run; True if it may."""
        with self._cond:
            if worker_id not in self.active:
                self._cond.wait(timeout)
            return worker_id in self.active

    def running(self) -> int:
        """Fetchers allowed to run now."""
        return len(self.active)
