"""Soak test: run one feed for a while with random chunk sizes and occasional fetch errors.

Prints rows/s, RSS and thread count at start and end (and every --report seconds), and the
row ledger. Flat RSS, a flat thread count and a balanced ledger are the pass criteria.

    python benchmarks/soak.py --seconds 600
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import feeder  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class FlakyFetcher:
    """Random chunk sizes; raises an IOError with probability ``error_rate`` per call."""

    def __init__(self, width: int, max_rows: int, error_rate: float, seed: int = 0):
        self.width, self.max_rows, self.error_rate = width, max_rows, error_rate
        self.local = threading.local()
        self.seed = seed
        self.errors = 0
        self.lock = threading.Lock()

    def __call__(self, worker_id: int, batch_size: int):
        rng = getattr(self.local, "rng", None)
        if rng is None:
            rng = self.local.rng = random.Random(self.seed * 1000 + worker_id)
        if rng.random() < self.error_rate:
            with self.lock:
                self.errors += 1
            raise OSError(f"simulated corrupt record (worker {worker_id})")
        n = rng.randint(1, self.max_rows)
        x = np.full((n, self.width), worker_id, dtype=np.float32)
        return [x, np.arange(n, dtype=np.int64)]


class CountingLogger:
    def __init__(self):
        self.calls = 0

    def log(self, metrics):
        self.calls += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--width", type=int, default=256, help="float32 values per row")
    p.add_argument("--max-rows", type=int, default=300, help="largest chunk, rows")
    p.add_argument("--error-rate", type=float, default=0.002, help="probability a fetch call raises")
    p.add_argument("--report", type=float, default=60.0, help="seconds between progress lines")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    threads0, rss0 = threading.active_count(), rss_mib()
    fetch = FlakyFetcher(args.width, args.max_rows, args.error_rate)
    ext = CountingLogger()
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(None, ["x", "i"], fetch, args.batch_size, num_worker_threads=args.workers,
                                   max_buffered_batches=64, external_loggers=[ext], coordinator=coord,
                                   log_interval=5.0, max_fetch_errors=10**9, timeout=30)
    print(f"start: rss {rss0:.1f} MiB, threads {threads0}", flush=True)
    coord.start()
    feed = coord.feed("train")
    t0 = time.monotonic()
    next_report = t0 + args.report
    rows = 0
    samples = []
    while time.monotonic() - t0 < args.seconds:
        batch = feed.next_batch()
        rows += batch["x"].shape[0]
        now = time.monotonic()
        if now >= next_report:
            next_report += args.report
            samples.append(rss_mib())
            print(f"{now - t0:7.0f} s: {rows / (now - t0):12,.0f} rows/s, rss {samples[-1]:.1f} MiB, "
                  f"threads {threading.active_count()}, fetch errors {fetch.errors}", flush=True)
    elapsed = time.monotonic() - t0
    m = feed.metrics()
    threads_running, rss_running = threading.active_count(), rss_mib()
    ok = coord.stop()
    threads1, rss1 = threading.active_count(), rss_mib()
    balanced = m["source_rows_fetched"] == (m["source_rows_delivered"] + m["source_rows_dropped"]
                                            + m["source_rows_discarded"] + m["source_rows_buffered"])
    print(f"ran {elapsed:.0f} s: {rows / elapsed:,.0f} rows/s ({rows * args.width * 4 / elapsed / 2**20:,.0f} MiB/s), "
          f"{m['batches']:.0f} batches, {fetch.errors} fetch errors tolerated, {ext.calls} external log calls")
    print(f"rss: start {rss0:.1f} MiB, while running {rss_running:.1f} MiB, end {rss1:.1f} MiB; "
          f"progress samples {[round(s, 1) for s in samples]}")
    print(f"threads: start {threads0}, while running {threads_running}, after stop {threads1}; stop() -> {ok}")
    print("ledger (rows): fetched {:.0f} = delivered {:.0f} + dropped {:.0f} + discarded {:.0f} + buffered {:.0f}: {}"
          .format(m["source_rows_fetched"], m["source_rows_delivered"], m["source_rows_dropped"],
                  m["source_rows_discarded"], m["source_rows_buffered"], "balanced" if balanced else "UNBALANCED"))
    print(f"buffer sets allocated: {m['buffer_allocations']:.0f}")
    return 0 if ok and balanced and threads1 == threads0 else 1


if __name__ == "__main__":
    sys.exit(main())
