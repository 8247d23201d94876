"""Thread-safe counters, throughput reports and the monitor thread that emits them.

Every counter has one writer thread (fetchers count in their own WorkerState, the enqueuer
in the feed) or, for consumers, a lock (Caffe2's unlocked ``+=`` lost counts). Reports go to the ``"feeder"`` logger at
INFO and, as a flat ``dict[str, float]``, to each external logger's ``log(metrics)``; a
logger that raises is logged and kept.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Tuple

log = logging.getLogger("feeder")


class ConsumerCounters:
    """What consumers took from a feed. Several consumer threads may share a feed, so updates
    take a lock (Caffe2's unlocked ``+=`` lost counts); the fields are plain attributes so that
    the per-batch update is cheap."""

    __slots__ = ("_lock", "batches", "rows", "bytes", "wait_s", "run_s", "between_s", "_last_end", "_waits")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batches = self.rows = self.bytes = 0
        # Stage times, seconds: waiting for a batch, inside run(), and the consumer's own code
        # between the end of one call and the start of the next (see feeder.diagnosis).
        self.wait_s = self.run_s = self.between_s = 0.0
        self._last_end = 0.0
        # Waits going on now: consumer thread id -> when its wait began (monotonic s). wait_s
        # counts a wait when it ends; the tuner must see one that lasts longer than its window.
        self._waits: Dict[int, float] = {}

    def wait_began(self, start: float) -> None:
        """The calling consumer thread has been waiting for a batch since ``start``; the wait is
        over at its next ``took``, ``waited`` or ``wait_ended``."""
        with self._lock:
            self._waits[threading.get_ident()] = start

    def wait_ended(self) -> None:
        """The calling thread's wait ended without a batch nor a timeout (end of data, stop)."""
        with self._lock:
            self._waits.pop(threading.get_ident(), None)

    def so_far(self, now: float) -> Tuple[float, float, float]:
        """(rows, batches, seconds waited) up to ``now``, waits still going on included."""
        with self._lock:
            ongoing = sum(max(0.0, now - since) for since in self._waits.values())
            return float(self.rows), float(self.batches), self.wait_s + ongoing

    def took(self, rows: int, nbytes: int, wait_s: float, start: float, now: float) -> None:
        """A consumer call that started at ``start`` took a batch at ``now`` (monotonic seconds)."""
        with self._lock:
            if self._waits:
                self._waits.pop(threading.get_ident(), None)  # counted in wait_s from now on
            self.batches += 1
            self.rows += rows
            self.bytes += nbytes
            self.wait_s += wait_s
            if self._last_end and start > self._last_end:
                self.between_s += start - self._last_end
            self._last_end = now

    def took_and_ran(self, rows: int, nbytes: int, start: float, popped: float, now: float) -> None:
        """A ``run()`` call that started at ``start`` got its batch at ``popped`` and returned at
        ``now`` (monotonic seconds): ``took`` and the time in the session, under one lock."""
        with self._lock:
            if self._waits:
                self._waits.pop(threading.get_ident(), None)
            self.batches += 1
            self.rows += rows
            self.bytes += nbytes
            self.wait_s += popped - start
            if self._last_end and start > self._last_end:
                self.between_s += start - self._last_end
            self.run_s += now - popped
            self._last_end = now

    def waited(self, wait_s: float) -> None:
        """The calling thread waited ``wait_s`` seconds and got no batch (a timeout)."""
        with self._lock:
            self._waits.pop(threading.get_ident(), None)
            self.wait_s += wait_s

    def snapshot(self) -> Dict[str, float]:
        with self._lock:
            return {"batches": self.batches, "rows": self.rows, "bytes": self.bytes, "wait_s": self.wait_s,
                    "run_s": self.run_s, "between_s": self.between_s}


class RateMeter:
    """Rows per second over the last interval and since the start, on a monotonic clock."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self._last_t = self.start
        self._last_rows = 0.0
        self.last_rate = 0.0

    def rate(self, rows: float, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        dt = now - self._last_t
        if dt > 0:
            self.last_rate = (rows - self._last_rows) / dt
            self._last_t, self._last_rows = now, rows
        return self.last_rate

    def overall(self, rows: float, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        dt = now - self.start
        return rows / dt if dt > 0 else 0.0


def send_to_external_loggers(loggers: Iterable[Any], metrics: Dict[str, float], source: str,
                             feed: Any = None) -> None:
    """Hand ``metrics`` to each logger; a failing logger is logged (with traceback) and kept.

    A logger whose ``log_with_feed`` attribute is True is called ``log(metrics, feed=feed)``, so
    that it can tell sources and replicas apart (``feed.input_source_name``); others ``log(metrics)``.
    """
    for logger in loggers:
        try:
            if getattr(logger, "log_with_feed", False) is True:
                logger.log(dict(metrics), feed=feed)
            else:
                logger.log(dict(metrics))
        except BaseException:  # noqa: B902 - a logger calling sys.exit() must not end the reports either
            log.exception("external logger %r failed for source %r; it stays registered", logger, source)


class Monitor:
    """Two daemon threads per coordinator: one runs the feeds' throughput reports, the other
    ticks their tuners (``num_worker_threads="auto"``).

    Reports run apart from the enqueuers so that a slow external logger delays only reports,
    never data, and apart from the tuners' tick, which no report may hold up (a logger taking
    seconds per call froze "auto" at one fetcher). The tick runs only feeder's own code. Final
    reports (at stop) are queued to the report thread too, so a logger that hangs makes it a
    straggler of ``stop()`` instead of hanging ``stop()`` itself.
    """

    def __init__(self, name: str, due_reports: Callable[[float], List[Callable[[], None]]], tick: float = 0.1,
                 tune: Optional[Callable[[float], None]] = None, tuner_name: str = "feeder:tuner"):
        self._due = due_reports
        self._tick = tick
        self._tune = tune
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._finals: Deque[Callable[[], None]] = deque()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.tuner_thread = (threading.Thread(target=self._tune_loop, name=tuner_name, daemon=True)
                             if tune is not None else None)

    def start(self) -> None:
        self.thread.start()
        if self.tuner_thread is not None:
            self.tuner_thread.start()

    def threads(self) -> List[threading.Thread]:
        return [t for t in (self.thread, self.tuner_thread) if t is not None]

    def final(self, reports: Iterable[Callable[[], None]]) -> threading.Event:
        """Run these reports soon, before anything else; the event is set once they have run."""
        done = threading.Event()
        self._finals.extend(list(reports) + [done.set])
        self._wake.set()
        return done

    def stop(self) -> None:
        """Exit after the final reports queued so far."""
        self._stop.set()
        self._wake.set()

    def _run(self, report: Callable[[], None]) -> None:
        try:
            report()
        except BaseException:  # noqa: B902 - nothing a report raises may kill the monitor
            log.exception("feeder throughput report failed")

    def _tune_loop(self) -> None:
        tune = self._tune
        assert tune is not None
        while not self._stop.wait(self._tick):
            try:
                tune(time.monotonic())
            except BaseException:  # noqa: B902 - nothing may end the tuners' tick
                log.exception("feeder tuner tick failed")

    def _loop(self) -> None:
        while True:
            self._wake.wait(self._tick)
            self._wake.clear()
            while self._finals:
                self._run(self._finals.popleft())
            if self._stop.is_set():
                return
            for report in self._due(time.monotonic()):
                if self._stop.is_set() or self._finals:
                    break
                self._run(report)
