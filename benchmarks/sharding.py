"""What sharding across hosts and the shuffle window cost (issue 30), as ratios from one run.

One zstd Parquet dataset (``--mb``, row groups of 8,192 rows: x = 64 float32, y = int64), batches
of 256 rows, no model, 2 fetcher threads, every contender reading one whole epoch:

* sharding: rank 1 of ``--world`` reading the whole dataset (``shard=(1, world)``) against an
  unsharded ``ParquetSource`` over a dataset made of exactly that rank's share of rows (the same
  row-group size): rows/s of the rank / rows/s of the unsharded source on its share (target >= 0.97);
* window: ``shuffle=True, shuffle_window=4 row groups`` against ``shuffle=True`` (units shuffled,
  rows within each): rows/s ratio (target >= 0.9), and how many row groups a batch draws rows
  from (median), each way;
* the same two on an in-memory ``ArraySource`` (block_rows 8,192), where reading costs least and
  what feeder adds shows most.

* window draws (issue 34, item 6): what one draw from a shuffle window costs as the window grows,
  the window alone (rows drained per second from windows of 32k to 2M rows, in draws of 1,024, and
  in steady state: units of unequal sizes added, as many rows drawn) and through an ``ArraySource``
  (rows/s with a window of 32k rows against one of 1M). A draw costs what it draws: the ratios of
  the large windows to the small one should stay near 1 (before: 0.02-0.2x). ``--windows`` runs
  this part alone (no dataset written).

Contenders alternate, ``--repeats`` times each; the median of each is reported, in rows per
wall-clock second and in rows per CPU second of the whole process (the steadier of the two where
other work shares the machine). This machine has 2 cores shared with whatever else runs: read
ratios, not rows/s.

    python benchmarks/sharding.py [--mb 100] [--world 4] [--epochs 4] [--repeats 5] [--windows]
                                  [--json benchmarks/results/sharding.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import feeder  # noqa: E402
from feeder.sources import ArraySource, ParquetSource  # noqa: E402
from feeder.sources.window import ShuffleWindow  # noqa: E402

DIM = 64
BATCH = 256
GROUP = 8192


def write(path: str, rows: int, start: int = 0) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = np.random.default_rng(start)
    with pq.ParquetWriter(path, pa.schema([("x", pa.list_(pa.float32(), DIM)), ("y", pa.int64())]),
                          compression="zstd") as w:
        for lo in range(0, rows, GROUP):
            n = min(GROUP, rows - lo)
            x = rng.standard_normal(n * DIM, dtype=np.float32)
            w.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x), DIM),
                                    "y": pa.array(np.arange(start + lo, start + lo + n))}), row_group_size=GROUP)


def epoch(source: Any, threads: int = 2) -> Tuple[float, float, List[int]]:
    """(rows/s, rows per CPU second of the whole process, row groups per batch) of a source read
    to its end. CPU seconds are steadier than wall seconds on a shared machine: they say what the
    work costs, not what else ran meanwhile."""
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(None, ["x", "y"], source, BATCH, num_worker_threads=threads, coordinator=coord)
    groups = []
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        coord.start()
        rows = 0
        for b in coord.feed("train"):
            rows += len(b["y"])
            groups.append(len(np.unique(b["y"] // GROUP)))
        return rows / (time.perf_counter() - t0), rows / (time.process_time() - c0), groups
    finally:
        coord.stop()


def alternate(contenders: Dict[str, Callable[[], Any]], repeats: int) -> Dict[str, Tuple[float, float, float]]:
    """Median rows/s, median rows per CPU second and median row groups per batch of each
    contender, run in turn."""
    rates: Dict[str, List[float]] = {k: [] for k in contenders}
    cpu: Dict[str, List[float]] = {k: [] for k in contenders}
    spread: Dict[str, List[int]] = {k: [] for k in contenders}
    for _ in range(repeats):
        for name, make in contenders.items():
            rate, per_cpu, groups = epoch(make())
            rates[name].append(rate)
            cpu[name].append(per_cpu)
            spread[name] += groups
    return {k: (statistics.median(rates[k]), statistics.median(cpu[k]), float(np.median(spread[k])))
            for k in contenders}


WINDOWS = (32_768, 262_144, 1 << 20, 2 << 20)
DRAW = 1024


def drain_rate(rows: int, seed: int = 0) -> Tuple[float, float]:
    """(rows/s drained from a full window of ``rows`` in draws of DRAW, rows/s in steady state:
    units of 512-8,192 rows added to the full window, as many rows drawn after each) of a window
    holding two int64 columns (what an ArraySource's window holds: row indices and keys)."""
    rng = np.random.default_rng(seed)
    w = ShuffleWindow(rows, np.random.default_rng(seed))
    for lo in range(0, rows, 8192):
        idx = np.arange(lo, min(rows, lo + 8192), dtype=np.int64)
        w.add([idx, idx])
    moved, t0 = 0, time.perf_counter()
    for _ in range(200):
        n = int(rng.integers(512, 8193))
        w.add([np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)])
        moved += len(w.take(n)[0])
    steady = moved / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    drained = 0
    while w.rows:
        drained += len(w.take(DRAW)[0])
    return drained / (time.perf_counter() - t0), steady


def window_costs(repeats: int) -> Dict[str, Any]:
    """The window part (see the module docstring): medians over ``repeats`` rounds, alternated."""
    drain: Dict[int, List[float]] = {r: [] for r in WINDOWS}
    steady: Dict[int, List[float]] = {r: [] for r in WINDOWS}
    for i in range(repeats):
        for rows in WINDOWS:
            d, st = drain_rate(rows, seed=i)
            drain[rows].append(d)
            steady[rows].append(st)
    n = 2 << 20
    x = np.random.default_rng(0).standard_normal((n, DIM), dtype=np.float32)
    y = np.arange(n)
    source_rates = alternate({f"shuffle_window={k}": (lambda k=k: ArraySource(
        {"x": x, "y": y}, block_rows=GROUP, shuffle=True, shuffle_window=k)) for k in (32_768, 1 << 20)}, repeats)
    out = {"draw_rows": DRAW, "drain_rows_per_s": {r: statistics.median(v) for r, v in drain.items()},
           "steady_rows_per_s": {r: statistics.median(v) for r, v in steady.items()},
           "array_source_rows_per_s": {k: v[0] for k, v in source_rates.items()}}
    small = WINDOWS[0]
    print(f"window draws: two int64 columns, draws of {DRAW} rows, median of {repeats}")
    print("| window rows | drained rows/s | ratio to 32k | steady-state rows/s | ratio to 32k |")
    print("|---|---|---|---|---|")
    for r in WINDOWS:
        d, st = out["drain_rows_per_s"][r], out["steady_rows_per_s"][r]
        print(f"| {r:,} | {d:,.0f} | {d / out['drain_rows_per_s'][small]:.2f}x | {st:,.0f} | "
              f"{st / out['steady_rows_per_s'][small]:.2f}x |")
    rates = out["array_source_rows_per_s"]
    names = list(rates)
    print(f"ArraySource of {n:,} rows, one epoch, 2 fetcher threads: " + ", ".join(
        f"{k} {v:,.0f} rows/s" for k, v in rates.items()) + f" ({rates[names[1]] / rates[names[0]]:.2f}x)")
    return out


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=100, help="size of the dataset, MB")
    p.add_argument("--world", type=int, default=4, help="ranks the data is sharded between")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--epochs", type=int, default=4, help="epochs each contender reads (a run of a few seconds)")
    p.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "feeder-bench-sharding"))
    p.add_argument("--json", default=None)
    p.add_argument("--windows", action="store_true", help="only what a window's draws cost (no dataset written)")
    args = p.parse_args(argv)
    if args.windows:
        out = window_costs(args.repeats)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"date": datetime.date.today().isoformat(), "cores": os.cpu_count(), "window_draws": out},
                          f, indent=2)
        return 0
    os.makedirs(args.dir, exist_ok=True)
    rows = (args.mb * 2**20 // (DIM * 4 + 8)) // GROUP * GROUP
    full, part = os.path.join(args.dir, f"full-{rows}.parquet"), os.path.join(args.dir, f"part-{rows}-{args.world}")
    lo, hi = rows * 1 // args.world, rows * 2 // args.world  # rank 1's share of an unshuffled epoch
    if not os.path.exists(full):
        write(full, rows)
    if not os.path.exists(part):
        os.makedirs(part)
        write(os.path.join(part, "share.parquet"), hi - lo, start=lo)
    x = np.random.default_rng(0).standard_normal((rows, DIM), dtype=np.float32)
    y = np.arange(rows)
    share_x, share_y = x[lo:hi].copy(), y[lo:hi].copy()
    window = 4 * GROUP
    w, e = args.world, args.epochs
    cases = {
        "parquet sharding": {
            f"rank 1 of {w}": lambda: ParquetSource(full, shard=(1, w), epochs=e),
            "unsharded, its share": lambda: ParquetSource(part, epochs=e),
        },
        "parquet window": {
            "shuffle_window=4 units": lambda: ParquetSource(full, shuffle=True, shuffle_window=window, epochs=e),
            "unit shuffling": lambda: ParquetSource(full, shuffle=True, epochs=e),
        },
        "arrays sharding": {
            f"rank 1 of {w}": lambda: ArraySource({"x": x, "y": y}, block_rows=GROUP, shard=(1, w), epochs=e),
            "unsharded, its share": lambda: ArraySource({"x": share_x, "y": share_y}, block_rows=GROUP, epochs=e),
        },
        "arrays window": {
            "shuffle_window=4 units": lambda: ArraySource({"x": x, "y": y}, block_rows=GROUP, shuffle=True,
                                                          shuffle_window=window, epochs=e),
            "unit shuffling": lambda: ArraySource({"x": x, "y": y}, block_rows=GROUP, shuffle=True, epochs=e),
        },
    }
    results: Dict[str, Any] = {"date": datetime.date.today().isoformat(), "cores": os.cpu_count(), "rows": rows,
                               "world": w, "epochs": e, "batch": BATCH, "row_group": GROUP, "repeats": args.repeats,
                               "command": "python benchmarks/sharding.py " + " ".join(sys.argv[1:] if argv is None
                                                                                     else argv),
                               "cases": {}}
    print(f"{rows:,} rows of 64 float32 + int64, row groups of {GROUP}, {e} epochs, batch {BATCH}, 2 fetcher "
          f"threads, median of {args.repeats}, {os.cpu_count()} cores, {results['date']}")
    print("| case | contender | rows/s | ratio | rows per CPU s | ratio | row groups per batch (median) |")
    print("|---|---|---|---|---|---|---|")
    for case, contenders in cases.items():
        got = alternate(contenders, args.repeats)
        names = list(got)
        ratio = got[names[0]][0] / got[names[1]][0]
        cpu_ratio = got[names[0]][1] / got[names[1]][1]
        results["cases"][case] = {"rows_per_s": {k: v[0] for k, v in got.items()},
                                  "rows_per_cpu_s": {k: v[1] for k, v in got.items()},
                                  "groups_per_batch": {k: v[2] for k, v in got.items()}, "ratio": ratio,
                                  "cpu_ratio": cpu_ratio}
        for i, k in enumerate(names):
            r, c = (ratio, cpu_ratio) if i == 0 else (1.0, 1.0)
            print(f"| {case} | {k} | {got[k][0]:,.0f} | {r:.2f}x | {got[k][1]:,.0f} | {c:.2f}x | {got[k][2]:.0f} |")
    results["window_draws"] = window_costs(args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
