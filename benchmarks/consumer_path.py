"""Where a model-bound consumer's time goes, batch by batch (issue 19).

A cheap numpy fetch feeds an MLP (1024-512-10, one intra-op thread) at batch 128: the model is
the bottleneck, so every microsecond the consumer spends outside ONNX Runtime is feeder's cost.
The session handed to feeder is a thin proxy that stamps each ``run_with_iobinding`` call, so
per batch the script splits ``feed.run()`` into:

- *before ORT*: from ``run()`` being called to ORT starting (the pop of the next batch,
  binding its OrtValues and the outputs);
- *in ORT*: the call itself, wall time, and the consumer thread's CPU time inside it (the
  difference is time the thread was not running: waiting to get the GIL back, or preempted);
- *after ORT*: from ORT returning to ``run()`` returning (outputs to numpy, bookkeeping).

The limit is the model alone on *rotating* inputs (a new batch buffer each call, as feeder
hands over; one hot buffer would sit in the cache and flatter the model), with the same
IOBinding calls feeder makes. Ratios, not absolute times, carry over between machines.

    python benchmarks/consumer_path.py                     # threads 1, 2 and processes 2
    python benchmarks/consumer_path.py --configs t1 p2 --seconds 5 --chunk 32
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any, Dict, List

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import feeder  # noqa: E402

BATCH = 128


class PoolFetch:
    """``rows`` consecutive rows of a pool, copied (a fresh array per chunk, as a real fetch makes)."""

    def __init__(self, rows: int, width: int = 1024, pool_rows: int = 8192):
        self.rows, self.width, self.pool_rows = rows, width, pool_rows
        self.pool = None

    def __call__(self, worker_id: int, batch_size: int):
        if self.pool is None:  # made in the process that calls it
            self.pool = np.random.default_rng(worker_id).standard_normal((self.pool_rows, self.width),
                                                                        dtype=np.float32)
        start = np.random.randint(0, self.pool_rows - self.rows)
        return [self.pool[start:start + self.rows].copy()]

    def __getstate__(self):
        return {"rows": self.rows, "width": self.width, "pool_rows": self.pool_rows, "pool": None}


def mlp(in_dim: int = 1024, hidden: int = 512, out_dim: int = 10) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((in_dim, hidden)).astype(np.float32) * 0.05, "W1"),
             numpy_helper.from_array(np.zeros(hidden, np.float32), "b1"),
             numpy_helper.from_array(rng.standard_normal((hidden, out_dim)).astype(np.float32) * 0.05, "W2"),
             numpy_helper.from_array(np.zeros(out_dim, np.float32), "b2")]
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "W2", "b2"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", in_dim])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", out_dim])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model.SerializeToString()


def session(model: bytes) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


class StampedSession:
    """Forwards everything to a real InferenceSession; stamps each run_with_iobinding call
    (wall clock before and after, and the calling thread's CPU time inside it)."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.stamps: List[tuple] = []
        self.record = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def run_with_iobinding(self, binding: Any, run_options: Any = None) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        self._inner.run_with_iobinding(binding, run_options)
        t1, c1 = time.perf_counter(), time.thread_time()
        if self.record:
            self.stamps.append((t0, t1, c1 - c0))


def model_alone(sess: Any, seconds: float, rotate: int = 16) -> Dict[str, float]:
    """The model on ``rotate`` different input buffers in turn, bound as feeder binds them."""
    import onnxruntime as ort

    pool = np.random.default_rng(1).standard_normal((rotate * BATCH, 1024), dtype=np.float32)
    ovs = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(pool[i * BATCH:(i + 1) * BATCH]))
           for i in range(rotate)]
    binding = sess.io_binding()
    name, out = sess.get_inputs()[0].name, sess.get_outputs()[0].name
    walls, cpus = [], []
    t_end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < t_end:
        binding.bind_ortvalue_input(name, ovs[i % rotate])
        binding.clear_binding_outputs()
        binding.bind_output(out)
        t0, c0 = time.perf_counter(), time.thread_time()
        sess.run_with_iobinding(binding)
        t1, c1 = time.perf_counter(), time.thread_time()
        binding.copy_outputs_to_cpu()
        if i >= 20:
            walls.append(t1 - t0)
            cpus.append(c1 - c0)
        i += 1
    return {"ort_wall_us": 1e6 * float(np.mean(walls)), "ort_cpu_us": 1e6 * float(np.mean(cpus)),
            "batches": float(len(walls))}


def switches() -> Dict[str, int]:
    """This thread's voluntary (it blocked: a lock, the GIL, a wait) and involuntary (it was
    preempted) context switches so far (Linux; zeros elsewhere)."""
    out = {"voluntary": 0, "involuntary": 0}
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    out["voluntary"] = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    out["involuntary"] = int(line.split()[1])
    except OSError:
        pass
    return out


def interrupts() -> Dict[str, int]:
    """Machine-wide TLB shootdowns and rescheduling interrupts so far, all CPUs (Linux; zeros
    elsewhere). Freeing a large array unmaps its pages, and every other CPU running this process
    must then flush its TLB: an interrupt in the middle of ONNX Runtime's work."""
    out = {"TLB": 0, "RES": 0}
    try:
        with open("/proc/interrupts") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in out:
                    out[key] = sum(int(x) for x in line.split(":", 1)[1].split() if x.isdigit())
    except OSError:
        pass
    return out


def fed(model: bytes, seconds: float, chunk: int, threads: int = 0, processes: int = 0) -> Dict[str, float]:
    sess = StampedSession(session(model))
    coord = feeder.GlobalCoordinator()
    kind = {"num_worker_processes": processes} if processes else {"num_worker_threads": threads}
    feeder.init_data_input_workers(sess, ["x"], PoolFetch(chunk), BATCH, coordinator=coord, log_interval=3600.0,
                                   timeout=60.0, **kind)
    calls: List[tuple] = []
    with coord:
        feed = coord.feed("train")
        t_warm = time.perf_counter() + 1.0
        while time.perf_counter() < t_warm:
            feed.run()
        sess.record = True
        sw0, irq0 = switches(), interrupts()
        t_end = time.perf_counter() + seconds
        while True:
            t0 = time.perf_counter()
            feed.run()
            t1 = time.perf_counter()
            calls.append((t0, t1))
            if t1 >= t_end:
                break
        sess.record = False
        sw1, irq1 = switches(), interrupts()
        diagnosis = feed.diagnose()
    stamps = sess.stamps
    n = min(len(calls), len(stamps))
    c, s = np.array(calls[:n]), np.array(stamps[:n])
    total = (c[-1, 1] - c[0, 0]) / n  # per batch, including the consumer's own loop
    return {
        "batches": float(n),
        "per_batch_us": 1e6 * total,
        "before_ort_us": 1e6 * float(np.mean(s[:, 0] - c[:, 0])),
        "ort_wall_us": 1e6 * float(np.mean(s[:, 1] - s[:, 0])),
        "ort_cpu_us": 1e6 * float(np.mean(s[:, 2])),
        "after_ort_us": 1e6 * float(np.mean(c[:, 1] - s[:, 1])),
        "between_calls_us": 1e6 * float(np.mean(c[1:, 0] - c[:-1, 1])) if n > 1 else 0.0,
        "before_ort_p99_us": 1e6 * float(np.percentile(s[:, 0] - c[:, 0], 99)),
        "after_ort_p99_us": 1e6 * float(np.percentile(c[:, 1] - s[:, 1], 99)),
        "voluntary_switches": (sw1["voluntary"] - sw0["voluntary"]) / max(1, len(calls)),
        "involuntary_switches": (sw1["involuntary"] - sw0["involuntary"]) / max(1, len(calls)),
        "tlb_shootdowns": (irq1["TLB"] - irq0["TLB"]) / max(1, len(calls)),
        "reschedule_irqs": (irq1["RES"] - irq0["RES"]) / max(1, len(calls)),
        "diagnosis": diagnosis,  # type: ignore[dict-item]
    }


CONFIGS = {"t1": {"threads": 1}, "t2": {"threads": 2}, "p1": {"processes": 1}, "p2": {"processes": 2}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["t1", "t2", "p2"], choices=sorted(CONFIGS))
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--chunk", type=int, default=BATCH, help="rows per fetched chunk (default: one batch)")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "consumer_path.json"))
    args = ap.parse_args()
    model = mlp()
    limit = model_alone(session(model), args.seconds)
    rows: Dict[str, Dict[str, float]] = {}
    for name in args.configs:
        rows[name] = fed(model, args.seconds, args.chunk, **CONFIGS[name])
    limit2 = model_alone(session(model), args.seconds)  # again: the machine may have changed meanwhile
    ort = min(limit["ort_wall_us"], limit2["ort_wall_us"])
    print(f"model alone, rotating inputs: {limit['ort_wall_us']:.1f} / {limit2['ort_wall_us']:.1f} us per batch "
          f"(cpu {limit['ort_cpu_us']:.1f})")
    print(f"{'config':<8} {'per batch':>10} {'before ORT':>11} {'ORT wall':>9} {'ORT cpu':>8} {'after ORT':>10} "
          f"{'between':>8} {'overhead':>9} {'vs model':>9} {'vol/b':>6} {'invol/b':>8} {'TLB/b':>6}")
    for name, r in rows.items():
        overhead = r["per_batch_us"] - ort
        print(f"{name:<8} {r['per_batch_us']:>10.1f} {r['before_ort_us']:>11.1f} {r['ort_wall_us']:>9.1f} "
              f"{r['ort_cpu_us']:>8.1f} {r['after_ort_us']:>10.1f} {r['between_calls_us']:>8.1f} "
              f"{overhead:>9.1f} {ort / r['per_batch_us']:>8.3f}x {r['voluntary_switches']:>6.2f} "
              f"{r['involuntary_switches']:>8.2f} {r['tlb_shootdowns']:>6.2f}")
    for name, r in rows.items():
        print(f"\n{name}: {r['diagnosis']}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "chunk": args.chunk, "batch": BATCH,
                   "model_alone": [limit, limit2], "feeder": rows}, f, indent=2)


if __name__ == "__main__":
    main()
