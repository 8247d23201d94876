"""The ceiling of worker processes on large rows: what copying into shared memory costs (issue 33).

Worker processes hand their batches to the parent through shared-memory segments (memfd), and
the parent reads them in place; so on large rows each worker process does what the serial loop
does (make the chunks, copy them into a batch) except that its batches land in shared memory.
This runs exactly that work with no feeder at all, in 1 and 2 plain processes, with the batch
written into private heap memory (as the serial loop's) or into memfd mappings (as a worker
process's slots), into a ring of 1 or 8 buffers (a worker's slots rotate, since batches wait in
the queues). It records whether shared memory may use transparent huge pages
(``/sys/kernel/mm/transparent_hugepage/shmem_enabled``), which heap memory gets through numpy.

Measured on 2 cores (results/shm_bandwidth.json, best of 3): memfd costs 0.95-0.98x of heap
memory, a ring of 8 buffers 0.71-0.74x of one reused buffer (the serial loop's stays in cache), and
two processes into rings of 8 memfd buffers 1.39x the serial loop: the ceiling of 2 worker
processes on this workload, before anything feeder itself does.

    python benchmarks/shm_bandwidth.py [--seconds 3] [--json results/shm_bandwidth.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import mmap
import multiprocessing as mp
import os
import platform
import random
import time
from typing import Any, Dict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS, SHAPE, POOL = 64, (3, 64, 64), 1024  # scenario s-large of compare.py: 3 MB chunks, batch 128


def _work(q: Any, ring: int, shared: bool, seconds: float) -> None:
    pool = np.random.default_rng(os.getpid()).standard_normal((POOL,) + SHAPE, dtype=np.float32)
    nbytes = 2 * ROWS * int(np.prod(SHAPE)) * 4
    if shared:
        dsts = []
        for _ in range(ring):
            fd = os.memfd_create("shm-bandwidth")
            os.ftruncate(fd, nbytes)
            dsts.append(np.frombuffer(mmap.mmap(fd, nbytes), np.float32).reshape((2 * ROWS,) + SHAPE))
            os.close(fd)
    else:
        dsts = [np.empty((2 * ROWS,) + SHAPE, np.float32) for _ in range(ring)]
    for d in dsts:
        d[...] = 0  # faulted in before the clock starts, as a worker's reused slots are
    t = time.perf_counter()
    rows = i = 0
    while time.perf_counter() - t < seconds:
        s = random.randrange(0, POOL - ROWS)
        a = pool[s:s + ROWS].copy()  # the fetch function makes its chunk (compare.py's copy=True)
        s = random.randrange(0, POOL - ROWS)
        b = pool[s:s + ROWS].copy()
        np.concatenate([a, b], out=dsts[i % ring])
        i += 1
        rows += 2 * ROWS
    q.put(rows / (time.perf_counter() - t))


def _thp(kind: str) -> str:
    try:
        with open(f"/sys/kernel/mm/transparent_hugepage/{kind}") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--repeat", type=int, default=3, help="rounds, interleaved; the best of each is kept")
    p.add_argument("--json", default=os.path.join(HERE, "results", "shm_bandwidth.json"))
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    results: Dict[str, float] = {}
    for _ in range(args.repeat):
        for ring in (1, 8):
            for shared in (False, True):
                for procs in (1, 2):
                    q = ctx.Queue()
                    ps = [ctx.Process(target=_work, args=(q, ring, shared, args.seconds)) for _ in range(procs)]
                    for pr in ps:
                        pr.start()
                    total = sum(q.get() for _ in ps)
                    for pr in ps:
                        pr.join()
                    key = f"{'memfd' if shared else 'heap'}, ring {ring}, {procs} proc"
                    results[key] = max(results.get(key, 0), round(total))
                    print(f"{key}: {total:,.0f} rows/s", flush=True)
    serial = results["heap, ring 1, 1 proc"]
    ratios = {k: round(v / serial, 2) for k, v in results.items()}
    for k, r in ratios.items():
        print(f"{k}: {r}x one process into a reused heap buffer (the serial loop)")
    meta = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "numpy": np.__version__, "seconds": args.seconds, "repeat": args.repeat, "thp_enabled": _thp("enabled"),
            "thp_shmem_enabled": _thp("shmem_enabled")}
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows_per_s": results, "over_serial": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
