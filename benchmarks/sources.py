"""ParquetSource through feeder against reading the same Parquet file other ways (issue 11).

One zstd-compressed file of at least 200 MB (written once, then reused), two columns (``x``: a
fixed-size list of DIM float32, ``y``: int64), batches of 256 rows, no model. Contenders:

* limit: pyarrow's own ``ParquetFile.iter_batches(256)`` -> numpy loop (its default threading);
* feeder: ``ParquetSource`` with N fetcher threads (``--threads``), batches from ``next_batch``;
* Ray Data: ``ray.data.read_parquet(...).iter_batches(batch_size=256, batch_format="numpy")``;
* torch: a ``DataLoader`` (batch 256, 2 workers) over an ``IterableDataset`` yielding the rows
  of the row groups its worker owns (the usual per-sample idiom, default collate).

Each contender reads for at most ``--seconds`` seconds (from the file's start) and reports
rows/s; the table gives feeder / contender. Peers that are not installed are skipped.

    python benchmarks/sources.py [--mb 200] [--seconds 15] [--threads 1 2]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Dict, Iterator, List

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import feeder  # noqa: E402

DIM = 64
BATCH = 256
ROW_GROUP = 65536


def write_file(path: str, mb: int) -> int:
    """Random float32 rows (incompressible, so the file is as big as its data) in zstd."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = int(mb * 2**20 * 1.08) // (DIM * 4 + 8) + 1  # zstd still saves a few % on random floats
    rng = np.random.default_rng(0)
    with pq.ParquetWriter(path, pa.schema([("x", pa.list_(pa.float32(), DIM)), ("y", pa.int64())]),
                          compression="zstd") as w:
        for start in range(0, rows, ROW_GROUP):
            n = min(ROW_GROUP, rows - start)
            x = rng.standard_normal(n * DIM, dtype=np.float32)
            w.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x), DIM),
                                    "y": pa.array(np.arange(start, start + n))}), row_group_size=ROW_GROUP)
    return rows


def timed(batches: Iterator, seconds: float, rows_of: Callable[[object], int]) -> float:
    """Rows/s over the batches until exhausted or ``seconds`` passed (first batch included: a
    reader's start-up is part of reading a file)."""
    t0 = time.perf_counter()
    rows = 0
    for b in batches:
        rows += rows_of(b)
        if time.perf_counter() - t0 > seconds:
            break
    return rows / (time.perf_counter() - t0)


def limit_pyarrow(path: str, seconds: float) -> float:
    import pyarrow.parquet as pq

    def batches():
        pf = pq.ParquetFile(path)
        for rb in pf.iter_batches(batch_size=BATCH, columns=["x", "y"]):
            x = rb.column(0).flatten().to_numpy().reshape(-1, DIM)
            y = rb.column(1).to_numpy()
            yield x, y

    return timed(batches(), seconds, lambda b: len(b[1]))


def run_feeder(path: str, seconds: float, threads: int) -> float:
    from feeder.sources import ParquetSource
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(None, ["x", "y"], ParquetSource(path), BATCH, num_worker_threads=threads,
                                   coordinator=coord, max_buffered_bytes=512 * 2**20)
    try:
        coord.start()
        return timed(iter(coord.feed("train")), seconds, lambda b: len(b["y"]))
    finally:
        coord.stop()


def run_ray(path: str, seconds: float) -> float:
    import ray
    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
    ds = ray.data.read_parquet(path, columns=["x", "y"])
    return timed(ds.iter_batches(batch_size=BATCH, batch_format="numpy"), seconds, lambda b: len(b["y"]))


def run_torch(path: str, seconds: float) -> float:
    import pyarrow.parquet as pq
    import torch
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    class Rows(IterableDataset):
        def __iter__(self):
            info = get_worker_info()
            wid, n = (info.id, info.num_workers) if info is not None else (0, 1)
            pf = pq.ParquetFile(path)
            for rg in range(wid, pf.num_row_groups, n):
                t = pf.read_row_group(rg, columns=["x", "y"])
                x = t.column("x").combine_chunks().flatten().to_numpy().reshape(-1, DIM)
                y = t.column("y").to_numpy()
                for i in range(len(y)):
                    yield x[i], y[i]

    torch.set_num_threads(1)
    loader = DataLoader(Rows(), batch_size=BATCH, num_workers=2)
    return timed(iter(loader), seconds, lambda b: len(b[1]))


def run(path: str, seconds: float, threads: List[int]) -> Dict[str, float]:
    r: Dict[str, float] = {}
    r["pyarrow iter_batches (limit)"] = limit_pyarrow(path, seconds)
    for t in threads:
        r[f"feeder ParquetSource, {t} thread(s)"] = run_feeder(path, seconds, t)
    for name, fn in (("Ray Data read_parquet", run_ray), ("torch DataLoader (2 workers)", run_torch)):
        try:
            r[name] = fn(path, seconds)
        except ImportError as e:
            print(f"{name}: skipped ({e})", file=sys.stderr)
    return r


def report(r: Dict[str, float]) -> str:
    best = max(v for k, v in r.items() if k.startswith("feeder"))
    lines = ["| reader | rows/s | best feeder / reader |", "|---|---|---|"]
    for k, v in r.items():
        lines.append(f"| {k} | {v:,.0f} | {best / v:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=200, help="size of the Parquet file, MB")
    p.add_argument("--seconds", type=float, default=15.0, help="most seconds each reader runs")
    p.add_argument("--threads", type=int, nargs="*", default=[1, 2], help="feeder fetcher threads to try")
    p.add_argument("--dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "feeder-bench"))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"bench-{args.mb}mb.parquet")
    if not os.path.exists(path):
        t0 = time.perf_counter()
        rows = write_file(path, args.mb)
        print(f"wrote {path}: {rows:,} rows, {os.path.getsize(path) / 2**20:.0f} MB in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    r = run(path, args.seconds, args.threads)
    print(f"{os.path.getsize(path) / 2**20:.0f} MB zstd Parquet, x: {DIM} float32 + y: int64 per row, batch {BATCH}, "
          f"at most {args.seconds:.0f} s per reader, {os.cpu_count()} cores")
    print(report(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"file_mb": os.path.getsize(path) / 2**20, "rows_per_s": r}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
