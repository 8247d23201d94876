"""What ``source.map(fn)`` costs beyond the user's function (issue 29): a source against the same
source with a ``map`` that returns its input unchanged, in fetcher threads and in worker processes.

Workload: an ``ArraySource`` of in-memory rows (``x``: DIM float32, ``id``: int64) in units of
``--block-rows`` rows, read for ``--epochs`` epochs into batches of ``--batch-size`` rows, no model:
the consumer only takes batches, so that the fetch path (where a map runs) is all there is to
measure. Contenders, run alternately (round after round, in the same order each round, so that
load from other processes on the machine falls on every contender alike):

* ``source``: the ``ArraySource`` itself;
* ``map(identity)``: ``source.map(lambda d: d)``, a map returning its input (the target: >= 0.97x);
* ``map(new dict)``: ``source.map(lambda d: dict(d))``, a new dict of the same arrays, which goes
  through the checks of what a map returns (names, arrays, row counts);
* ``filter(all)``: ``source.filter(lambda d: np.ones(len(d["id"]), bool))``, keeping every row.

Each round runs every contender once, starting with a different one each round (so that no
contender always follows the same one), and reports rows/s per contender; the summary gives, per
contender, the median over rounds of its rows/s and of its ratio to ``source`` in the same round,
and the ratio of its best round to ``source``'s best (on a machine shared with other work, the
best round of each is the one least disturbed).

Besides, ``--calls`` measures what a fetch call costs (microseconds, best of 5 runs of 20,000
calls, the source bound by hand and called in this thread), for the source and each contender:
the difference is what the wrapper adds per unit of work, free of the noise of the pipeline. And
each run also counts the CPU seconds of the whole pipeline (this process and, in process mode, its
worker processes, from /proc): rows per CPU second are compared too, a figure much less disturbed
by other work on the machine than rows/s.

    python benchmarks/transform.py [--rounds 7] [--mode threads processes] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import feeder  # noqa: E402
from feeder.sources import ArraySource  # noqa: E402


def identity(d: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    return d


def new_dict(d: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    return dict(d)


def keep_all(d: Dict[str, np.ndarray]) -> np.ndarray:
    return np.ones(len(d["id"]), dtype=bool)


CONTENDERS: Dict[str, Callable[[ArraySource], Any]] = {
    "source": lambda s: s,
    "map(identity)": lambda s: s.map(identity),
    "map(new dict)": lambda s: s.map(new_dict),
    "filter(all)": lambda s: s.filter(keep_all),
}


CPU = [0.0]  # rows per CPU second of the pipeline (this process and its worker processes) in the last run


def children_cpu_s(feed: Any) -> float:
    """CPU seconds (user + system) the feed's worker processes have used so far (Linux /proc)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for w in getattr(feed._fetchers, "_workers", []):
        try:
            with open(f"/proc/{w.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, TypeError, IndexError, ValueError):
            pass
    return total


def rows_per_s(make: Callable[[ArraySource], Any], arrays: Dict[str, np.ndarray], args: argparse.Namespace,
               mode: str) -> float:
    """Rows/s of a contender over ``args.epochs`` passes of an endless source (so that the worker
    processes are alive when their CPU time is read at the end); sets CPU[0]."""
    src = make(ArraySource(arrays, epochs=None, block_rows=args.block_rows))
    coord = feeder.GlobalCoordinator()
    kw = {"num_worker_processes": args.workers} if mode == "processes" else {"num_worker_threads": args.workers}
    feeder.init_data_input_workers(None, ["x", "id"], src, args.batch_size, coordinator=coord, **kw)
    want = args.epochs * len(arrays["id"])
    try:
        coord.start()
        feed = coord.feed("train")
        feed.next_batch(timeout=60)  # start-up (processes) is not what is measured
        rows = 0
        t0, c0, k0 = time.perf_counter(), time.process_time(), children_cpu_s(feed)
        while rows < want:
            rows += len(feed.next_batch(timeout=60)["id"])
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0 + children_cpu_s(feed) - k0
        CPU[0] = rows / cpu if cpu > 0 else 0.0
        return rows / wall
    finally:
        coord.stop()


def call_us(make: Callable[[ArraySource], Any], arrays: Dict[str, np.ndarray], args: argparse.Namespace,
            calls: int = 20_000, repeats: int = 5) -> float:
    """Microseconds per fetch call of a contender, bound by hand to one worker (best of ``repeats``)."""
    from feeder.sources.base import SourceBinding

    src = make(ArraySource(arrays, epochs=None, block_rows=args.block_rows))
    src.feeder_validate(("x", "id"), None)
    src.feeder_bind(SourceBinding("bench", ((0,),), ("x", "id"), False))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            src(0, args.batch_size)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=16, help="float32 values per row of x")
    p.add_argument("--block-rows", type=int, default=1024, help="rows per unit (one fetch)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--workers", type=int, default=2, help="fetcher threads or worker processes")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--mode", nargs="*", default=["threads", "processes"], choices=["threads", "processes"])
    p.add_argument("--calls", action="store_true", help="also measure the cost of one fetch call")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    arrays = {"x": np.random.default_rng(0).standard_normal((args.rows, args.dim), dtype=np.float32),
              "id": np.arange(args.rows, dtype=np.int64)}
    out: Dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/transform.py "
                           + " ".join(argv if argv is not None else sys.argv[1:]),
                           "cores": os.cpu_count(), "workload": {k: v for k, v in vars(args).items() if k != "json"},
                           "modes": {}}
    if args.calls:
        costs = {name: call_us(make, arrays, args) for name, make in CONTENDERS.items()}
        out["call_us"] = costs
        print(f"one fetch call ({args.block_rows} rows): " + ", ".join(
            f"{k} {v:.2f} us (+{v - costs['source']:.2f})" for k, v in costs.items()))
    names = list(CONTENDERS)
    for mode in args.mode:
        rounds: List[Dict[str, float]] = []
        cpu_rounds: List[Dict[str, float]] = []
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            got, cpu = {}, {}
            for name in order:
                got[name] = rows_per_s(CONTENDERS[name], arrays, args, mode)
                cpu[name] = CPU[0]
            got = {name: got[name] for name in names}
            rounds.append(got)
            cpu_rounds.append(cpu)
            print(f"{mode} round {r + 1}: " + ", ".join(f"{k} {v:,.0f}" for k, v in got.items()), file=sys.stderr)
        best_source = max(r["source"] for r in rounds)
        summary = {name: {"median_rows_per_s": statistics.median(r[name] for r in rounds),
                          "median_ratio_to_source": statistics.median(r[name] / r["source"] for r in rounds),
                          "best_ratio_to_source": max(r[name] for r in rounds) / best_source}
                   for name in CONTENDERS}
        for name in CONTENDERS:  # rows per CPU second of the whole pipeline: steadier under load
            summary[name]["median_cpu_ratio_to_source"] = statistics.median(c[name] / c["source"] for c in cpu_rounds)
        out["modes"][mode] = {"rounds": rounds, "summary": summary}
        print(f"\n{mode}: {args.workers} {mode}, {args.rows:,} rows x {args.epochs} epochs, units of "
              f"{args.block_rows} rows, batch {args.batch_size}, {args.rounds} rounds")
        print("| contender | rows/s (median) | / source (median of rounds) | best / source's best |\n|---|---|---|---|")
        for name, s in summary.items():
            print(f"| {name} | {s['median_rows_per_s']:,.0f} | {s['median_ratio_to_source']:.3f}x | "
                  f"{s['best_ratio_to_source']:.3f}x |"
                  + (f" rows per CPU second / source's: {s['median_cpu_ratio_to_source']:.3f}x"
                     if "median_cpu_ratio_to_source" in s else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
