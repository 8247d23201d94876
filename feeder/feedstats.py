"""What a feed reports about itself: metrics, the status in a FeedTimeout, ``diagnose()``, the
periodic log line, and the tuner's tick. :class:`FeedStats` reads a feed's counters and never
touches its data path, so that ``feed.py`` holds the data path (fetchers, enqueuer, consumer
calls, ledger) and this module the figures about it."""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, FrozenSet, List, Tuple

from .diagnosis import StageTimes, verdict
from .metrics import send_to_external_loggers
from .pacing import NONE_PAUSE_MAX_S
from .runtime import intra_op_threads
from .sources.base import describe_source

log = logging.getLogger("feeder")

# The keys of Feed.metrics(), in one place, so that what an external logger declares up front
# (PrometheusLogger's describe()) cannot drift from what feeds report; tests check it.
METRIC_KEYS: Tuple[str, ...] = (
    "inputs_per_sec", "batches_per_sec", "queue_size", "queue_capacity", "ready_batches", "batch_size",
    "batches", "rows", "chunks_fetched", "rows_fetched", "fetch_calls", "none_chunks", "empty_chunks",
    "fetch_errors", "rows_dropped", "consumer_wait_s", "live_workers", "active_workers", "uptime_s",
    "source_rows_fetched", "source_rows_delivered", "source_rows_dropped", "source_rows_discarded",
    "source_rows_buffered", "source_bytes_held", "buffer_allocations", "bytes_delivered", "bytes_copied",
    "zero_copy_batches", "padded_elements", "row_elements",
    # stage times (feeder.diagnosis)
    "consumer_run_s", "consumer_between_s", "fetch_s", "fetch_blocked_s", "fetch_wall_s", "fetch_cpu_s",
    "fetch_cpu_wall_s",
    # a source's map and filter steps (feeder.sources.transform): rows this feed's workers filtered
    # and seconds they spent in the steps (part of fetch_s), and the source's filtered rows
    "rows_filtered", "transform_s", "source_rows_filtered",
    # writing batches on the host, copying them to the device (feeder.assembly, feeder.device):
    # seconds, device memory held now, device buffers allocated so far
    "assemble_s", "copy_s", "device_bytes", "device_allocations",
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
    "fetch_cpu_s", "fetch_cpu_wall_s", "padded_elements", "row_elements", "rows_filtered", "transform_s",
    "source_rows_filtered", "assemble_s", "copy_s", "device_allocations",
})
# Figures of the source as a whole (its queue and ledger): every replica of a source reports the same.
SOURCE_KEYS: FrozenSet[str] = frozenset(
    [k for k in METRIC_KEYS if k.startswith("source_")]
    + ["queue_size", "queue_capacity", "live_workers", "batch_size", "uptime_s"])


class FeedStats:
    """The figures of one feed: its metrics, the status a FeedTimeout gives, ``diagnose()``, the
    periodic report and the tuner's tick. It reads the feed's counters and never changes the data
    path; ``Feed`` holds one (``feed.stats``) and its public ``metrics()``, ``diagnose()`` and
    ``stage_times()`` are this object's."""

    def __init__(self, feed: Any):
        self.feed = feed

    def status_line(self) -> str:
        feed, source = self.feed, self.feed.source
        return (f"queue {source.qsize()}/{source.maxsize} chunks ({source.queued_rows} rows), "
                f"{len(feed._ready)} ready batches, {feed._rebatcher.pending_rows} rows pending a batch, "
                f"live fetchers {source.live_workers()}")

    def timeout_message(self, waited: float) -> str:
        now = time.monotonic()
        lines = [f"source {self.feed.input_source_name!r}: no batch within {waited:.2f} s: {self.status_line()}"]
        calls = sum(w.calls for w in self.feed._workers)
        nones = sum(w.none_chunks for w in self.feed._workers)
        if nones:  # a fetch function that finds nothing: say so first, not only its latest call's number
            if nones >= calls:
                lines.append(f"  every fetch_fun call ({calls}) returned None (nothing this time); the fetchers "
                             f"pause up to {NONE_PAUSE_MAX_S * 1e3:.0f} ms between such calls")
            else:
                lines.append(f"  {nones} of the {calls} fetch_fun calls returned None (nothing this time)")
        waiting_on = self.feed.source.waiting_on()
        if waiting_on is not None and self.feed.source.qsize():
            # A None takes no turn (the batches stay the same whatever the timing), so a worker that
            # keeps returning None holds up the others' queued chunks: say whose turn it is, and
            # what to return instead only to a worker that did return None (a slow one just is slow).
            line = (f"  ordered=True: the round-robin waits for worker {waiting_on}'s next chunk (its turn), with "
                    f"the other workers' chunks queued behind it")
            if any(w.worker_id == waiting_on and w.none_chunks for w in self.feed._workers):
                line += (f"; worker {waiting_on} returned None, which takes no turn: a worker with nothing more "
                         f"raises StopIteration, and one with nothing this time on purpose returns "
                         f"feeder.sources.SKIP, which passes its turn")
            lines.append(line)
        what = describe_source(self.feed._fetch_fun)
        if what:
            lines.append(f"  fetch_fun: {what}")
        for line in self.feed._fetchers.describe(now, stack_after_s=min(1.0, waited / 2)):
            lines.append("  " + line)
        enq = self.feed._enqueuer_thread
        if enq is not None and not enq.is_alive():
            lines.append("  the enqueuer thread has exited")
        return "\n".join(lines)

    def live_descriptions(self) -> List[str]:
        return list(self.feed._fetchers.live_descriptions())

    def now(self) -> float:
        """The moment figures are taken at: now while the feed works; once it stopped or handed out
        its end of data, that moment, so that rates and shares do not decay afterwards."""
        return self.feed._frozen_at or time.monotonic()

    def metrics(self) -> Dict[str, float]:
        """A snapshot of counters: rows are rows along the batch axis, times are seconds."""
        return self.metrics_at(self.now())

    def metrics_at(self, now: float) -> Dict[str, float]:
        c = self.feed.counters.snapshot()
        src = self.feed.source
        ledger = src.ledger()
        m: Dict[str, float] = {
            "inputs_per_sec": self.feed._meter.overall(c["rows"], now) if self.feed._started else 0.0,
            "batches_per_sec": self.feed._meter.overall(c["batches"], now) if self.feed._started else 0.0,
            "queue_size": float(src.qsize()),
            "queue_capacity": float(src.maxsize),
            "ready_batches": float(len(self.feed._ready)),
            "batch_size": float(self.feed._batch_size),
            "batches": c["batches"],
            "rows": c["rows"],
            "chunks_fetched": float(sum(w.chunks for w in self.feed._workers)),
            "rows_fetched": float(sum(w.rows for w in self.feed._workers)),
            "fetch_calls": float(sum(w.calls for w in self.feed._workers)),
            "none_chunks": float(sum(w.none_chunks for w in self.feed._workers)),
            "empty_chunks": float(sum(w.empty_chunks for w in self.feed._workers)),
            "fetch_errors": float(sum(w.fetch_errors for w in self.feed._workers)),
            "rows_dropped": float(self.feed._rows_dropped),
            "consumer_wait_s": c["wait_s"],
            "live_workers": float(len(src.live_workers())),
            "active_workers": float(self.active_workers()),
            "uptime_s": now - self.feed._meter.start if self.feed._started else 0.0,
            "source_rows_fetched": float(ledger["rows_fetched"]),
            "source_rows_delivered": float(ledger["rows_delivered"]),
            "source_rows_dropped": float(ledger["rows_dropped"]),
            "source_rows_discarded": float(ledger["rows_discarded"]),
            "source_rows_filtered": float(ledger["rows_filtered"]),
            "source_rows_buffered": float(ledger["rows_fetched"] - ledger["rows_delivered"] - ledger["rows_dropped"]
                                          - ledger["rows_discarded"]),
            "source_bytes_held": float(src.bytes_held),
            "buffer_allocations": float(self.feed._ring.allocations),
            "bytes_delivered": c["bytes"],
            "bytes_copied": float(self.feed._rebatcher.copied_bytes + sum(w.copied_bytes for w in self.feed._workers)),
            "zero_copy_batches": float(self.feed._rebatcher.zero_copy_batches),
            # pad=: elements of padded inputs in batches made that hold the pad value, and a row's value
            "padded_elements": float(getattr(self.feed._rebatcher, "padded_elements", 0)),
            "row_elements": float(getattr(self.feed._rebatcher, "real_elements", 0)),
        }
        m.update(self._stage_metrics(now, c))
        # Whatever the source counts (feeder_counters: rows filtered, seconds in its map and filter
        # steps, retries), from the fetcher threads or as the worker processes last reported it.
        m["rows_filtered"] = m["transform_s"] = 0.0
        for k, v in self.feed._fetchers.counters().items():
            if k in ("rows_filtered", "transform_s") or k not in m:  # never over feeder's own figures
                m[k] = v
        return {k: float(v) for k, v in m.items()}  # the contract: dict[str, float]

    def _stage_metrics(self, now: float, c: Dict[str, float]) -> Dict[str, float]:
        w = self.feed._workers
        runner = self.feed._runner
        device = runner.device_figures() if runner is not None else {"device_bytes": 0.0, "device_allocations": 0.0,
                                                                      "copy_s": 0.0}
        return {
            # (batches the feed wrote, and those its fetcher threads wrote while coalescing small chunks)
            "assemble_s": self.feed._assemble_s + sum(getattr(s, "assemble_s", 0.0) for s in w), **device,
            "consumer_run_s": c["run_s"], "consumer_between_s": c["between_s"],
            "fetch_s": sum(s.fetch_s for s in w), "fetch_blocked_s": sum(s.blocked_s for s in w),
            # running time: a fetcher parked by num_worker_threads="auto" is not a fetcher at work
            "fetch_wall_s": sum(s.running_s(now) for s in w), "fetch_cpu_s": sum(s.cpu_s for s in w),
            "fetch_cpu_wall_s": sum(s.cpu_wall_s for s in w),
        }

    def stage_times(self) -> StageTimes:
        """The stage times behind :meth:`diagnose` (seconds; see ``feeder.diagnosis``): the
        fetchers that ran, for the time they ran (parked ones are left out)."""
        now = self.now()
        m = self.metrics_at(now)
        running = [s.running_s(now) for s in self.feed._workers]
        return StageTimes(
            elapsed_s=m["uptime_s"], batches=m["batches"], rows=m["rows"], consumer_wait_s=m["consumer_wait_s"],
            consumer_run_s=m["consumer_run_s"], consumer_between_s=m["consumer_between_s"],
            workers=sum(1 for r in running if r > 0), mode=self.feed._fetchers.mode,
            fetch_s=m["fetch_s"],
            fetch_blocked_s=m["fetch_blocked_s"], fetch_wall_s=m["fetch_wall_s"], fetch_cpu_s=m["fetch_cpu_s"],
            fetch_cpu_wall_s=m["fetch_cpu_wall_s"], rows_fetched=m["rows_fetched"],
            queue_capacity=m["queue_capacity"],
            intra_op_threads=intra_op_threads(self.feed.session) if self.feed.session is not None else None,
            fetch_longest_s=max(running, default=0.0), auto=self.feed._tuner is not None,
            transform_s=m["transform_s"], rows_filtered=m["rows_filtered"],
            assemble_s=m["assemble_s"], assemble_threads=self.feed._asm.threads, copy_s=m["copy_s"],
            device=self.feed._on_device)

    def diagnose(self) -> str:
        """Plain sentences: which stage bounds throughput (input, model or the consumer's own code),
        by how much, what to change, and the figures behind it (cumulative since start)."""
        text = verdict(self.stage_times())
        what = describe_source(self.feed._fetch_fun)
        return f"{text}\nSource: {what}." if what else text

    def report(self, final: bool = False) -> None:
        now = self.now()
        m = self.metrics_at(now)
        rate = self.feed._meter.rate(m["rows"], now)
        m["inputs_per_sec_interval"] = rate
        log.info("feeder source %r%s: %.1f rows/s (%.1f overall), %d batches, queue %d/%d chunks, "
                 "%d ready, %d live fetchers, %d active%s", self.feed.input_source_name, " (final)" if final else "",
                 rate,
                 m["inputs_per_sec"], m["batches"], m["queue_size"], m["queue_capacity"], m["ready_batches"],
                 m["live_workers"], m["active_workers"], " (auto)" if self.feed._tuner is not None else "")
        if final and self.feed._started:
            log.info("feeder source %r: %s", self.feed.input_source_name, self.diagnose())
        send_to_external_loggers(self.feed.external_loggers, m, self.feed.input_source_name, feed=self.feed)

    def active_workers(self) -> int:
        """This feed's fetchers that may call fetch_fun now (not parked, not ended)."""
        live = sum(1 for s in self.feed._workers if s.thread is not None and s.thread.is_alive()
                   and not s.state.startswith(("ended", "failed")))
        throttle = self.feed._throttle
        if throttle is not None:
            running: int = throttle.running()
            return min(live, running) if self.feed._started else running
        return live if self.feed._started else len(self.feed._workers)

    def tune(self, now: float) -> None:
        """Let the tuner see the last window (called by the coordinator's monitor thread)."""
        tuner = self.feed._tuner
        if tuner is None or not self.feed._started or self.feed._stopped or self.feed._ended:
            return
        rows, batches, wait_s = self.feed.counters.so_far(now)  # with the waits still going on
        new = tuner.observe(now, rows, wait_s, batches)
        if new is not None and self.feed._throttle is not None:
            self.feed._throttle.set_limit(new)
            log.debug("source %r: %d fetchers run now (%s)", self.feed.input_source_name, new,
                      tuner.decisions[-1] if tuner.decisions else "probing")

    def due_report(self, now: float) -> bool:
        if self.feed._started and not self.feed._stopped and now >= self.feed._next_report:
            self.feed._next_report = now + self.feed.log_interval
            return True
        return False
