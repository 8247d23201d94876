"""What an ordered run with a shuffle window pays to resume exactly: the first batch's wait.

With ``ordered=True`` and ``shuffle_window``, a resumed run replays every worker's window from the
run's start with row indices and keys alone (feeder/sources/windowreplay.py), so that it delivers
exactly the batches of the uninterrupted run. This measures the time from ``start()`` to the
first batch of a resumed run, against a fresh run's, for states taken after more and more rows,
and checks that the resumed batches are those of the uninterrupted run.

    python benchmarks/window_resume.py [--rows 1000000] [--json results/window_resume.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

import feeder
from feeder.sources import ArraySource

HERE = os.path.dirname(os.path.abspath(__file__))
BATCH, WORKERS, UNIT, WINDOW = 1024, 4, 256, 65536


def source(rows: int) -> ArraySource:
    return ArraySource({"x": np.zeros((rows, 4), np.float32), "id": np.arange(rows)}, shuffle=True, seed=1,
                       epochs=3, block_rows=UNIT, shuffle_window=WINDOW)


def run(rows: int, take: int, resume: Optional[Dict[str, Any]] = None) -> Tuple[float, List[List[int]], Dict[str, Any]]:
    """(seconds from start() to the first batch, the ids of ``take`` batches, the state after them)."""
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(None, ["x", "id"], source(rows), BATCH, coordinator=coord, ordered=True,
                                   num_worker_threads=WORKERS, resume_from=resume, timeout=600)
    t = time.perf_counter()
    with coord:
        feed = coord.feed("train")
        got = [feed.next_batch()["id"].tolist()]
        first = time.perf_counter() - t
        while len(got) < take:
            got.append(feed.next_batch()["id"].tolist())
        return first, got, coord.state_dict("train")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows per epoch (3 epochs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = args.rows
    check = 3
    results = []
    for fraction in (0.25, 1.0, 2.5):
        take = int(fraction * n) // BATCH
        fresh, whole, state = run(n, take + check)
        _, _, state = run(n, take)
        resumed, after, _ = run(n, check, state)
        exact = after == whole[take:take + check]
        results.append({"rows_delivered": state["rows_delivered"], "fresh_first_batch_s": round(fresh, 3),
                        "resumed_first_batch_s": round(resumed, 3), "same_batches": exact})
        print(f"after {state['rows_delivered']:,} rows: first batch {resumed:.2f} s resumed, {fresh:.2f} s fresh; "
              f"the uninterrupted run's batches: {exact}", flush=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    out = {"meta": {"date": datetime.date.today().isoformat(), "machine": machine,
                    "numpy": np.__version__, "rows_per_epoch": n, "unit_rows": UNIT, "window": WINDOW,
                    "workers": WORKERS, "batch": BATCH},
           "runs": results}
    if args.json:
        path = args.json if os.path.isabs(args.json) else os.path.join(HERE, args.json)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print("written to", path)


if __name__ == "__main__":
    main()
