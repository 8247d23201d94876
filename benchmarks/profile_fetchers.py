"""Why a second fetcher thread can make feeding slower (issue 14): a profile, not a race.

For the two workloads where more fetchers were slower (no model, ``feed.next_batch()`` in a
loop, the fetch function copies a slice of a preallocated pool):

    a: tiny chunks, 1-8 rows of 256 float32, batch 256
    b: large chunks, 64 rows of 3x64x64 float32 (3 MB), batch 128

it runs 1, 2 and 3 fetcher threads (and "auto") and the serial loop, and reports per batch
what the process spent: CPU seconds (user and system), minor page faults, voluntary and
involuntary context switches (``getrusage``), and how often the interpreter switched threads
(``sys.getswitchinterval`` is the lever; a GIL hand-off shows as a voluntary switch). These
counts, unlike wall time, barely depend on what else the machine runs.

    python benchmarks/profile_fetchers.py [--seconds 2] [--scenarios a b]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from typing import Callable, Dict, List, Union

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import feeder  # noqa: E402


class CopyFetch:
    """Returns a copy of ``min_rows..max_rows`` consecutive rows of a preallocated pool."""

    def __init__(self, row_shape, min_rows: int, max_rows: int, pool_rows: int = 4096):
        self.pool = np.random.default_rng(0).standard_normal((pool_rows,) + tuple(row_shape), dtype=np.float32)
        self.min_rows, self.max_rows = min_rows, max_rows
        self._rng = np.random.default_rng(1)

    def __call__(self, worker_id: int, batch_size: int):
        n = int(self._rng.integers(self.min_rows, self.max_rows + 1))
        start = int(self._rng.integers(0, len(self.pool) - n))
        return [self.pool[start:start + n].copy()]


SCENARIOS = {
    "a": (lambda: CopyFetch((256,), 1, 8), 256),
    "b": (lambda: CopyFetch((3, 64, 64), 64, 64, pool_rows=1024), 128),
}


def usage() -> Dict[str, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"user_s": r.ru_utime, "sys_s": r.ru_stime, "minflt": r.ru_minflt, "nvcsw": r.ru_nvcsw,
            "nivcsw": r.ru_nivcsw, "t": time.monotonic()}


def measure(consume: Callable[[], int], seconds: float) -> Dict[str, float]:
    for _ in range(20):  # warm up: first buffers, first page faults
        consume()
    before = usage()
    rows = batches = 0
    while time.monotonic() - before["t"] < seconds:
        rows += consume()
        batches += 1
    after = usage()
    wall = after["t"] - before["t"]
    out = {"rows/s": rows / wall, "batches": batches}
    for k in ("user_s", "sys_s", "minflt", "nvcsw", "nivcsw"):
        out[k + "/batch"] = (after[k] - before[k]) / batches
    out["cpu cores"] = (after["user_s"] - before["user_s"] + after["sys_s"] - before["sys_s"]) / wall
    return out


def run_feeder(make_fetch, batch: int, workers: Union[int, str], seconds: float) -> Dict[str, float]:
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(None, ["x"], make_fetch(), batch, num_worker_threads=workers, coordinator=coord)
    with coord:
        feed = coord.feed("train")
        res = measure(lambda: feed.next_batch()["x"].shape[0], seconds)
        res["active"] = feed.metrics()["active_workers"]
        return res


def run_serial(make_fetch, batch: int, seconds: float) -> Dict[str, float]:
    fetch = make_fetch()
    pending: List[np.ndarray] = []
    have = 0

    def one() -> int:
        nonlocal have, pending
        while have < batch:
            (x,) = fetch(0, batch)
            pending.append(x)
            have += len(x)
        allrows = np.concatenate(pending)
        out, rest = allrows[:batch], allrows[batch:]
        pending, have = ([rest] if len(rest) else []), len(rest)
        return len(out)

    return measure(one, seconds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--scenarios", nargs="*", default=list(SCENARIOS))
    p.add_argument("--workers", nargs="*", default=["1", "2", "3", "auto"])
    args = p.parse_args()
    cols = ["rows/s", "cpu cores", "user_s/batch", "sys_s/batch", "minflt/batch", "nvcsw/batch", "nivcsw/batch"]
    print("| scenario | config | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 2) + "|")
    for key in args.scenarios:
        make_fetch, batch = SCENARIOS[key]
        rows = [("serial", run_serial(make_fetch, batch, args.seconds))]
        for w in args.workers:
            workers: Union[int, str] = w if w == "auto" else int(w)
            res = run_feeder(make_fetch, batch, workers, args.seconds)
            rows.append((f"{w} fetcher(s)" + (f" ({res['active']:.0f} active)" if w == "auto" else ""), res))
        for name, res in rows:
            cells = [f"{res['rows/s']:,.0f}", f"{res['cpu cores']:.2f}",
                     f"{res['user_s/batch'] * 1e6:,.0f} us", f"{res['sys_s/batch'] * 1e6:,.0f} us",
                     f"{res['minflt/batch']:.1f}", f"{res['nvcsw/batch']:.1f}", f"{res['nivcsw/batch']:.1f}"]
            print(f"| {key} | {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
