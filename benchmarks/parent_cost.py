"""What each batch costs the main process, per thread, with fetcher threads or worker processes (issue 33).

On large rows worker processes share the machine's cores with the main process, so every
microsecond the main process spends per batch is taken from the copies the workers make. This
feeds small batches (128 rows of ``--width`` float32, so that copies cost nothing) from a fetch
function that returns a whole batch, in two regimes:

- *back to back*: the fetch returns at once; batches queue up and the main process handles
  them one after the other;
- *one at a time*: each call sleeps ``--sleep`` seconds first, so each batch arrives alone and
  the threads that handle it wake up for it (the case of a feed whose workers are busy copying).

For each it reports the main process's CPU time per batch (microseconds, from
``/proc/self/task``), split by thread (the consumer, process receivers, fetcher threads, the
enqueuer, the rest), and the voluntary context switches per batch (each a wake-up). With fetcher
threads the fetchers' own time is shown apart: it is the fetch's cost, which worker processes pay
in their own process.

Measured on 2 cores (2026-12-05, results/parent_cost.json): with 1 or 2 worker processes a batch
costs the main process 38-47 us back to back and 130-134 us one at a time, with 3.3-3.4 wake-ups
per batch: the receiver's poll (1), and the consumer's 2.2, its wait for the batch and, about once
a batch, for the GIL the receiver still holds after handing the batch on (``perf`` on
``sched_switch``). The receivers take 91-99 us of it. With 2 fetcher threads: 10 and 21 us, the
consumer waking 1.1 times a batch, the fetch apart. The difference between the two regimes is the
price of waking the threads that receive a batch and hand it on, and that is what worker
processes pay per batch on large rows.

    python benchmarks/parent_cost.py [--seconds 3] [--sleep 0.001] [--json results/parent_cost.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import feeder  # noqa: E402

BATCH = 128
TICK = os.sysconf("SC_CLK_TCK")


class WholeBatch:
    """A fetch function returning the same whole batch, after ``sleep_s`` seconds."""

    def __init__(self, width: int, sleep_s: float):
        self.rows = np.ones((BATCH, width), np.float32)
        self.sleep_s = sleep_s

    def __call__(self, worker_id: int, batch_size: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return [self.rows]


def _role(name: str) -> str:
    if name == "MainThread":
        return "consumer"
    for part, role in ((":recv-", "receivers"), (":fetch", "fetchers"), (":enqueue", "enqueuer")):
        if part in name:
            return role
    return "other"


def _threads() -> Dict[str, Tuple[float, int]]:
    """CPU seconds and voluntary context switches so far, per role, of this process's threads."""
    out: Dict[str, Tuple[float, int]] = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{t.native_id}/status") as f:
                vol = next(int(line.split(":")[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration):
            continue  # the thread ended meanwhile
        cpu = (int(fields[11]) + int(fields[12])) / TICK
        role = _role(t.name)
        c, v = out.get(role, (0.0, 0))
        out[role] = (c + cpu, v + vol)
    return out


def measure(processes: int, threads: int, width: int, sleep_s: float, seconds: float) -> Dict[str, float]:
    coord = feeder.GlobalCoordinator()
    kind = {"num_worker_processes": processes} if processes else {"num_worker_threads": threads}
    feeder.init_data_input_workers(None, ["x"], WholeBatch(width, sleep_s), BATCH, coordinator=coord,
                                   timeout=60, **kind)
    with coord:
        feed = coord.feed("train")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:  # warm-up (processes start, the tuner settles)
            feed.next_batch()
        before = _threads()
        n = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            feed.next_batch()
            n += 1
        dt = time.monotonic() - t0
        after = _threads()
    out: Dict[str, float] = {"batches_per_s": n / dt}
    total = 0.0
    wakeups = 0
    for role in sorted(after):
        c0, v0 = before.get(role, (0.0, 0))
        c1, v1 = after[role]
        out[f"{role} us/batch"] = (c1 - c0) / n * 1e6
        out[f"{role} wake-ups/batch"] = (v1 - v0) / n
        if role != "fetchers":
            total += c1 - c0
            wakeups += v1 - v0
    out["main process us/batch (fetchers apart)"] = total / n * 1e6
    out["wake-ups/batch (fetchers apart)"] = wakeups / n
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--sleep", type=float, default=0.001, help="seconds each call sleeps, one-at-a-time regime")
    p.add_argument("--width", type=int, default=16, help="float32 values per row")
    p.add_argument("--json", default=os.path.join(HERE, "results", "parent_cost.json"))
    args = p.parse_args(argv)
    configs = [("2 threads", 0, 2), ("1 process", 1, 0), ("2 processes", 2, 0)]
    results: Dict[str, Dict[str, float]] = {}
    for regime, sleep_s in (("back to back", 0.0), ("one at a time", args.sleep)):
        for label, procs, thr in configs:
            r = measure(procs, thr, args.width, sleep_s, args.seconds)
            results[f"{label}, {regime}"] = r
            print(f"{label:12s} {regime:13s} {r['batches_per_s']:9,.0f} batches/s  main process "
                  f"{r['main process us/batch (fetchers apart)']:5.0f} us/batch, "
                  f"{r['wake-ups/batch (fetchers apart)']:.1f} wake-ups/batch  ("
                  + ", ".join(f"{k.split(' us')[0]} {v:.0f}" for k, v in r.items() if k.endswith("us/batch")
                              and not k.startswith("main")) + " us)", flush=True)
    meta = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "numpy": np.__version__, "seconds": args.seconds, "sleep_s": args.sleep, "width": args.width,
            "batch": BATCH, "command": "python benchmarks/parent_cost.py " + " ".join(argv or sys.argv[1:])}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
