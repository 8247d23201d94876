"""Batch inference from a Ray Data pipeline: feeder replicas vs Ray Data's own actor pool.

A Ray Data pipeline generates rows (``range``) and preprocesses them in ``map_batches`` (numpy
feature synthesis and standardisation, standing in for decoding). The same pipeline, the same
ONNX model (a 3-layer MLP built with onnx.helper) and the same batch size are then run two ways:

* feeder: ``RayDataSource`` feeds 2 replicas (one ``streaming_split`` shard and one
  single-threaded InferenceSession each) in this process; two consumer threads call
  ``feed.run()``.
* Ray Data: ``map_batches`` with a callable class that runs the same ONNX session, in an actor
  pool of the same size (2), outputs iterated in this process.

Both check the same result (the sum of all probabilities of class 0, and the row count) and
print rows/s.

Run:  pip install -e '.[ray,examples]' && python examples/ray_batch_inference.py [--rows 200000]
"""
from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from typing import Dict, List, Tuple

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import feeder
from feeder.sources import RayDataSource

IN_DIM, HIDDEN, CLASSES = 64, 256, 10
REPLICAS = 2


def build_model() -> bytes:
    """x float32 [N, 64] -> probs float32 [N, 10]: MatMul+Add+Relu twice, then a classifier and Softmax."""
    rng = np.random.default_rng(0)
    shapes = (("W1", (IN_DIM, HIDDEN)), ("b1", (HIDDEN,)), ("W2", (HIDDEN, HIDDEN)), ("b2", (HIDDEN,)),
              ("W3", (HIDDEN, CLASSES)), ("b3", (CLASSES,)))
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.1).astype(np.float32), n) for n, s in shapes]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["a1"]), helper.make_node("Add", ["a1", "b1"], ["z1"]),
             helper.make_node("Relu", ["z1"], ["h1"]),
             helper.make_node("MatMul", ["h1", "W2"], ["a2"]), helper.make_node("Add", ["a2", "b2"], ["z2"]),
             helper.make_node("Relu", ["z2"], ["h2"]),
             helper.make_node("MatMul", ["h2", "W3"], ["a3"]), helper.make_node("Add", ["a3", "b3"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probs"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", IN_DIM])],
                              [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", CLASSES])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10  # onnxruntime 1.31 accepts IR <= 13; onnx 1.23 would stamp 14
    onnx.checker.check_model(model)
    return model.SerializeToString()


def make_session(model: bytes) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # one core per replica / actor: scale with replicas, not intra-op threads
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def preprocess(batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Synthesise 64 features per row id and standardise them per row (the 'decode' step)."""
    ids = batch["id"].astype(np.float64)
    freqs = np.linspace(0.001, 0.5, IN_DIM)
    x = np.sin(ids[:, None] * freqs[None, :]) + 0.1 * np.cos(ids[:, None] * freqs[None, ::-1] * 3.0)
    x = (x - x.mean(axis=1, keepdims=True)) / (x.std(axis=1, keepdims=True) + 1e-6)
    return {"x": x.astype(np.float32)}


def pipeline(ray, rows: int, blocks: int):
    return ray.data.range(rows, override_num_blocks=blocks).map_batches(preprocess, batch_size=4096)


def run_feeder(ray, model: bytes, rows: int, blocks: int, batch_size: int) -> Tuple[float, int, float]:
    """2 feeder replicas of the model, fed by one streaming_split shard each."""
    source = RayDataSource(pipeline(ray, rows, blocks), columns={"x": "x"})
    coord = feeder.GlobalCoordinator()
    for _ in range(REPLICAS):
        feeder.init_data_input_workers(make_session(model), ["x"], source, batch_size, num_worker_threads=1,
                                       input_source_name="ray", coordinator=coord, max_buffered_batches=16,
                                       timeout=300.0, replica=True)
    done: List[Tuple[int, float]] = [(0, 0.0)] * REPLICAS

    def consume(i: int) -> None:
        feed = coord.feeds("ray")[i]
        n, s = 0, 0.0
        while True:
            try:
                (probs,) = feed.run()
            except StopIteration:
                break
            n += len(probs)
            s += float(probs[:, 0].sum(dtype=np.float64))
        done[i] = (n, s)

    start = time.perf_counter()
    with coord:
        threads = [threading.Thread(target=consume, args=(i,)) for i in range(REPLICAS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        print("feeder diagnosis (replica 0):", coord.feeds("ray")[0].diagnose().split(" Figures:")[0])
    return elapsed, sum(n for n, _ in done), sum(s for _, s in done)


class OnnxPredictor:
    """Ray Data's way: a callable class, one ONNX session per actor."""

    def __init__(self, model: bytes):
        self.session = make_session(model)

    def __call__(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        (probs,) = self.session.run(None, {"x": batch["x"]})
        return {"p0": probs[:, 0]}


def run_ray_actors(ray, model: bytes, rows: int, blocks: int, batch_size: int) -> Tuple[float, int, float]:
    """map_batches with the callable class in an actor pool of REPLICAS actors."""
    ds = pipeline(ray, rows, blocks).map_batches(OnnxPredictor, fn_constructor_args=(model,), batch_size=batch_size,
                                                 concurrency=REPLICAS, num_cpus=1)
    n, s = 0, 0.0
    start = time.perf_counter()
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        n += len(batch["p0"])
        s += float(batch["p0"].sum(dtype=np.float64))
    return time.perf_counter() - start, n, s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--blocks", type=int, default=50, help="Ray Data read blocks (tasks of the pipeline)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-cpus", type=int, default=4,
                        help="Ray's logical CPUs: the pipeline's tasks and the 2 actors (1 CPU each) share them")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import ray

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    model = build_model()
    print(f"{args.rows} rows, batch size {args.batch_size}, {REPLICAS} replicas / actors, "
          f"{os.cpu_count()} cores, ray {ray.__version__}, onnxruntime {ort.__version__}")
    # Warm-up: start Ray's worker processes once, so neither way pays for it.
    pipeline(ray, 20_000, 4).materialize()

    results = {}
    for name, way in (("feeder (RayDataSource, 2 replicas)", run_feeder),
                      ("Ray Data (map_batches, actor pool of 2)", run_ray_actors)):
        elapsed, n, s = way(ray, model, args.rows, args.blocks, args.batch_size)
        results[name] = (elapsed, n, s)
        print(f"{name:42s} {n / elapsed:>10,.0f} rows/s  ({n} rows in {elapsed:.2f} s; sum p0 = {s:.3f})")
    (_, n1, s1), (_, n2, s2) = results.values()
    same = n1 == n2 == args.rows and abs(s1 - s2) <= 1e-6 * max(1.0, abs(s1))
    print("same rows and results:", same)
    (e1, _, _), (e2, _, _) = results.values()
    print(f"feeder / Ray Data: {e2 / e1:.2f}x the rows/s")
    ray.shutdown()


if __name__ == "__main__":
    main()
