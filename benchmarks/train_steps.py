"""Steps/s of a train-step graph fed by feeder versus the same steps fed by a serial loop (issue 6).

The model is examples/train_and_eval.py's MLP train step. fetch_fun costs ``--fetch-ms`` of
I/O-like waiting per chunk of 32 rows (reading records), so that feeding takes real time.
Peers, all running the same steps on the same kind of batches:
  serial-numpy   fetch, concatenate, session.run with the state passed in and out as numpy
  serial-state   fetch, concatenate, StatefulSession step (state stays in OrtValues)
  feeder         feeder with N fetcher threads into the same StatefulSession

    python benchmarks/train_steps.py [--steps 300] [--fetch-ms 2] [--workers 4] [--json PATH]

``--json PATH`` also writes the figures, the date and the command to PATH (the docs' figures
come from benchmarks/results/train_steps*.json).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
import train_and_eval as te  # noqa: E402

import feeder  # noqa: E402
from feeder.runtime import PreparedBatch  # noqa: E402


class SlowBlobs(te.Blobs):
    def __init__(self, seed, fetch_s):
        super().__init__(seed)
        self.fetch_s = fetch_s

    def fetch(self, worker_id, batch_size):
        if self.fetch_s:
            time.sleep(self.fetch_s)
        x, y = self.sample(32)
        return {"x": x, "y": y}


def serial_batches(fetch, batch_size):
    xs, ys, rows = [], [], 0
    while True:
        while rows < batch_size:
            c = fetch(0, batch_size)
            xs.append(c["x"]), ys.append(c["y"])
            rows += len(c["x"])
        x, y = np.concatenate(xs), np.concatenate(ys)
        yield x[:batch_size], y[:batch_size]
        xs, ys, rows = [x[batch_size:]], [y[batch_size:]], rows - batch_size


def serial_numpy(steps, batch_size, fetch_s):
    sess = te.session(te.train_step_model())
    state = te.initial_state()
    outs = ["loss"] + list(te.STATE)
    batches = serial_batches(SlowBlobs(1, fetch_s).fetch, batch_size)
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = next(batches)
        res = sess.run(outs, {"x": x, "y": y, **state})
        state = {te.STATE[name]: v for name, v in zip(outs[1:], res[1:])}
    return steps / (time.perf_counter() - t0)


def serial_state(steps, batch_size, fetch_s):
    adapter = feeder.StatefulSession(te.session(te.train_step_model()), te.STATE, te.initial_state())
    batches = serial_batches(SlowBlobs(1, fetch_s).fetch, batch_size)
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = next(batches)
        adapter.run_batch(PreparedBatch(["x", "y"], [x, y], len(x)), ["loss"], None)
    return steps / (time.perf_counter() - t0)


def with_feeder(steps, batch_size, fetch_s, workers):
    adapter = feeder.StatefulSession(te.session(te.train_step_model()), te.STATE, te.initial_state())
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(adapter, None, SlowBlobs(1, fetch_s).fetch, batch_size,
                                   num_worker_threads=workers, coordinator=coord)
    with coord:
        feed = coord.feed("train")
        feed.run(["loss"])  # threads started, first batch ready
        t0 = time.perf_counter()
        for _ in range(steps):
            feed.run(["loss"])
        return steps / (time.perf_counter() - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--fetch-ms", type=float, default=2.0, help="I/O-like wait per 32-row chunk, ms")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args()
    fetch_s = args.fetch_ms / 1000
    capacity = args.workers * 32 / fetch_s / args.batch_size if fetch_s else float("inf")
    r = {"serial-numpy": serial_numpy(args.steps, args.batch_size, fetch_s),
         "serial-state": serial_state(args.steps, args.batch_size, fetch_s),
         "feeder": with_feeder(args.steps, args.batch_size, fetch_s, args.workers)}
    print(f"train steps/s, batch {args.batch_size}, fetch {args.fetch_ms} ms per 32 rows, "
          f"{args.workers} fetcher threads (their capacity: {capacity:,.0f} steps/s)")
    for k, v in r.items():
        print(f"  {k:13s} {v:9,.1f} steps/s   feeder / this = {r['feeder'] / v:5.2f}x")
    if args.json:
        out = {"date": datetime.date.today().isoformat(),
               "command": "python benchmarks/train_steps.py " + " ".join(sys.argv[1:]),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version(),
               "batch_size": args.batch_size, "fetch_ms": args.fetch_ms, "workers": args.workers,
               "steps": args.steps, "fetcher_capacity_steps_per_s": capacity if fetch_s else None, "steps_per_s": r,
               "feeder_over": {k: r["feeder"] / v for k, v in r.items() if k != "feeder"}}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
