"""What a feed reports about itself: metrics, the status in a FeedTimeout, ``diagnose()``, the
periodic log line, and the tuner's tick. A mixin of :class:`feeder.feed.Feed`, split off so that
``feed.py`` holds the data path (fetchers, enqueuer, consumer calls, ledger) and this module
the figures about it."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

from .diagnosis import StageTimes, verdict
from .metrics import ConsumerCounters, RateMeter, send_to_external_loggers
from .ready import ReadyQueue
from .rebatcher import BufferRing, Rebatcher
from .runtime import intra_op_threads
from .source import ChunkQueue
from .sources.base import describe_source
from .tuning import Throttle, Tuner

log = logging.getLogger("feeder")

# The keys of Feed.metrics(), in one place, so that what an external logger declares up front
# (PrometheusLogger's describe()) cannot drift from what feeds report; tests check it.
METRIC_KEYS: Tuple[str, ...] = (
    "inputs_per_sec", "batches_per_sec", "queue_size", "queue_capacity", "ready_batches", "batch_size",
    "batches", "rows", "chunks_fetched", "rows_fetched", "fetch_calls", "none_chunks", "empty_chunks",
    "fetch_errors", "rows_dropped", "consumer_wait_s", "live_workers", "active_workers", "uptime_s",
    "source_rows_fetched", "source_rows_delivered", "source_rows_dropped", "source_rows_discarded",
    "source_rows_buffered", "source_bytes_held", "buffer_allocations", "bytes_delivered", "bytes_copied",
    "zero_copy_batches",
    # stage times (feeder.diagnosis)
    "consumer_run_s", "consumer_between_s", "fetch_s", "fetch_blocked_s", "fetch_wall_s", "fetch_cpu_s",
    "fetch_cpu_wall_s",
)
# What external loggers get: the metrics and the rate over the last interval.
REPORT_KEYS: Tuple[str, ...] = METRIC_KEYS + ("inputs_per_sec_interval",)
# Totals: they only grow while a feed lives (counts and stage times). The rest are values of
# the moment (rates, queue depths, worker counts, the feed's age).
TOTALS: FrozenSet[str] = frozenset({
    "batches", "rows", "chunks_fetched", "rows_fetched", "fetch_calls", "none_chunks", "empty_chunks",
    "fetch_errors", "rows_dropped", "consumer_wait_s", "source_rows_fetched", "source_rows_delivered",
    "source_rows_dropped", "source_rows_discarded", "buffer_allocations", "bytes_delivered", "bytes_copied",
    "zero_copy_batches", "consumer_run_s", "consumer_between_s", "fetch_s", "fetch_blocked_s", "fetch_wall_s",
    "fetch_cpu_s", "fetch_cpu_wall_s",
})
# Figures of the source as a whole (its queue and ledger): every replica of a source reports the same.
SOURCE_KEYS: FrozenSet[str] = frozenset(
    [k for k in METRIC_KEYS if k.startswith("source_")]
    + ["queue_size", "queue_capacity", "live_workers", "batch_size", "uptime_s"])


class FeedReports:
    """Metrics, diagnosis and reports of a feed (mixed into ``Feed``, which sets these attributes)."""

    source: ChunkQueue
    session: Any
    input_source_name: str
    external_loggers: List[Any]
    log_interval: float
    counters: ConsumerCounters
    _batch_size: int
    _fetch_fun: Callable[[int, int], Any]
    _fetchers: Any
    _workers: List[Any]
    _ready: ReadyQueue
    _ring: BufferRing
    _rebatcher: Rebatcher
    _meter: RateMeter
    _tuner: Optional[Tuner]
    _throttle: Optional[Throttle]
    _enqueuer_thread: Optional[threading.Thread]
    _started: bool
    _stopped: bool
    _ended: bool
    _rows_dropped: int
    _next_report: float
    _frozen_at: float

    def _status_line(self) -> str:
        live = self.source.live_workers()
        return (f"queue {self.source.qsize()}/{self.source.maxsize} chunks ({self.source.queued_rows} rows), "
                f"{len(self._ready)} ready batches, {self._rebatcher.pending_rows} rows pending a batch, "
                f"live fetchers {live}")

    def _diagnose(self, waited: float) -> str:
        now = time.monotonic()
        lines = [f"source {self.input_source_name!r}: no batch within {waited:.2f} s: {self._status_line()}"]
        what = describe_source(self._fetch_fun)
        if what:
            lines.append(f"  fetch_fun: {what}")
        for line in self._fetchers.describe(now, stack_after_s=min(1.0, waited / 2)):
            lines.append("  " + line)
        enq = self._enqueuer_thread
        if enq is not None and not enq.is_alive():
            lines.append("  the enqueuer thread has exited")
        return "\n".join(lines)

    def describe_workers(self) -> List[str]:
        return list(self._fetchers.live_descriptions())

    def _now(self) -> float:
        """The moment figures are taken at: now while the feed works; once it stopped or handed out
        its end of data, that moment, so that rates and shares do not decay afterwards."""
        return self._frozen_at or time.monotonic()

    def metrics(self) -> Dict[str, float]:
        """A snapshot of counters: rows are rows along the batch axis, times are seconds."""
        return self._metrics(self._now())

    def _metrics(self, now: float) -> Dict[str, float]:
        c = self.counters.snapshot()
        src = self.source
        ledger = src.ledger()
        m: Dict[str, float] = {
            "inputs_per_sec": self._meter.overall(c["rows"], now) if self._started else 0.0,
            "batches_per_sec": self._meter.overall(c["batches"], now) if self._started else 0.0,
            "queue_size": float(src.qsize()),
            "queue_capacity": float(src.maxsize),
            "ready_batches": float(len(self._ready)),
            "batch_size": float(self._batch_size),
            "batches": c["batches"],
            "rows": c["rows"],
            "chunks_fetched": float(sum(w.chunks for w in self._workers)),
            "rows_fetched": float(sum(w.rows for w in self._workers)),
            "fetch_calls": float(sum(w.calls for w in self._workers)),
            "none_chunks": float(sum(w.none_chunks for w in self._workers)),
            "empty_chunks": float(sum(w.empty_chunks for w in self._workers)),
            "fetch_errors": float(sum(w.fetch_errors for w in self._workers)),
            "rows_dropped": float(self._rows_dropped),
            "consumer_wait_s": c["wait_s"],
            "live_workers": float(len(src.live_workers())),
            "active_workers": float(self._active_workers()),
            "uptime_s": now - self._meter.start if self._started else 0.0,
            "source_rows_fetched": float(ledger["rows_fetched"]),
            "source_rows_delivered": float(ledger["rows_delivered"]),
            "source_rows_dropped": float(ledger["rows_dropped"]),
            "source_rows_discarded": float(ledger["rows_discarded"]),
            "source_rows_buffered": float(ledger["rows_fetched"] - ledger["rows_delivered"] - ledger["rows_dropped"]
                                          - ledger["rows_discarded"]),
            "source_bytes_held": float(src.bytes_held),
            "buffer_allocations": float(self._ring.allocations),
            "bytes_delivered": c["bytes"],
            "bytes_copied": float(self._rebatcher.copied_bytes + sum(w.copied_bytes for w in self._workers)),
            "zero_copy_batches": float(self._rebatcher.zero_copy_batches),
        }
        m.update(self._stage_metrics(now, c))
        return {k: float(v) for k, v in m.items()}  # the contract: dict[str, float]

    def _stage_metrics(self, now: float, c: Dict[str, float]) -> Dict[str, float]:
        w = self._workers
        return {
            "consumer_run_s": c["run_s"], "consumer_between_s": c["between_s"],
            "fetch_s": sum(s.fetch_s for s in w), "fetch_blocked_s": sum(s.blocked_s for s in w),
            # running time: a fetcher parked by num_worker_threads="auto" is not a fetcher at work
            "fetch_wall_s": sum(s.running_s(now) for s in w), "fetch_cpu_s": sum(s.cpu_s for s in w),
            "fetch_cpu_wall_s": sum(s.cpu_wall_s for s in w),
        }

    def stage_times(self) -> StageTimes:
        """The stage times behind :meth:`diagnose` (seconds; see ``feeder.diagnosis``): the
        fetchers that ran, for the time they ran (parked ones are left out)."""
        now = self._now()
        m = self._metrics(now)
        running = [s.running_s(now) for s in self._workers]
        return StageTimes(
            elapsed_s=m["uptime_s"], batches=m["batches"], rows=m["rows"], consumer_wait_s=m["consumer_wait_s"],
            consumer_run_s=m["consumer_run_s"], consumer_between_s=m["consumer_between_s"],
            workers=sum(1 for r in running if r > 0), mode=self._fetchers.mode,
            fetch_s=m["fetch_s"],
            fetch_blocked_s=m["fetch_blocked_s"], fetch_wall_s=m["fetch_wall_s"], fetch_cpu_s=m["fetch_cpu_s"],
            fetch_cpu_wall_s=m["fetch_cpu_wall_s"], rows_fetched=m["rows_fetched"],
            queue_capacity=m["queue_capacity"],
            intra_op_threads=intra_op_threads(self.session) if self.session is not None else None,
            fetch_longest_s=max(running, default=0.0), auto=self._tuner is not None)

    def diagnose(self) -> str:
        """Plain sentences: which stage bounds throughput (input, model or the consumer's own code),
        by how much, what to change, and the figures behind it (cumulative since start)."""
        text = verdict(self.stage_times())
        what = describe_source(self._fetch_fun)
        return f"{text}\nSource: {what}." if what else text

    def _report(self, final: bool = False) -> None:
        now = self._now()
        m = self._metrics(now)
        rate = self._meter.rate(m["rows"], now)
        m["inputs_per_sec_interval"] = rate
        log.info("feeder source %r%s: %.1f inputs/s (%.1f overall), %d batches, queue %d/%d chunks, "
                 "%d ready, %d live fetchers, %d active%s", self.input_source_name, " (final)" if final else "", rate,
                 m["inputs_per_sec"], m["batches"], m["queue_size"], m["queue_capacity"], m["ready_batches"],
                 m["live_workers"], m["active_workers"], " (auto)" if self._tuner is not None else "")
        if final and self._started:
            log.info("feeder source %r: %s", self.input_source_name, self.diagnose())
        send_to_external_loggers(self.external_loggers, m, self.input_source_name, feed=self)

    def _active_workers(self) -> int:
        """This feed's fetchers that may call fetch_fun now (not parked, not ended)."""
        live = sum(1 for s in self._workers if s.thread is not None and s.thread.is_alive()
                   and not s.state.startswith(("ended", "failed")))
        if self._throttle is not None:
            return min(live, self._throttle.running()) if self._started else self._throttle.running()
        return live if self._started else len(self._workers)

    def _tune(self, now: float) -> None:
        """Let the tuner see the last window (called by the coordinator's monitor thread)."""
        tuner = self._tuner
        if tuner is None or not self._started or self._stopped or self._ended:
            return
        rows, batches, wait_s = self.counters.so_far(now)  # with the waits still going on
        new = tuner.observe(now, rows, wait_s, batches)
        if new is not None and self._throttle is not None:
            self._throttle.set_limit(new)
            log.debug("source %r: %d fetchers run now (%s)", self.input_source_name, new,
                      tuner.decisions[-1] if tuner.decisions else "probing")

    def _due_report(self, now: float) -> bool:
        if self._started and not self._stopped and now >= self._next_report:
            self._next_report = now + self.log_interval
            return True
        return False
