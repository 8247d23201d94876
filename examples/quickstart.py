"""Quickstart: feed a small ONNX model from two fetcher threads and print the throughput.

Run:  python examples/quickstart.py [--batches 3000] [--batch-size 64]
"""
from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import feeder

IN_DIM, HIDDEN, CLASSES = 64, 128, 10


def build_model() -> bytes:
    """A 2-layer MLP classifier, x float32 [N, 64] -> probs float32 [N, 10]."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.1, n)
             for n, s in (("W1", (IN_DIM, HIDDEN)), ("b1", (HIDDEN,)), ("W2", (HIDDEN, CLASSES)), ("b2", (CLASSES,)))]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h"]), helper.make_node("MatMul", ["h", "W2"], ["o0"]),
             helper.make_node("Add", ["o0", "b2"], ["logits"]), helper.make_node("Softmax", ["logits"], ["probs"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", IN_DIM])],
                              [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", CLASSES])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10  # onnxruntime 1.31 accepts IR <= 13; onnx 1.23 would stamp 14
    onnx.checker.check_model(model)
    return model.SerializeToString()


def fetch(worker_id: int, batch_size: int):
    """Pretend to load and decode some records: a chunk of 1..100 rows."""
    rng = np.random.default_rng()
    n = int(rng.integers(1, 101))
    return [rng.standard_normal((n, IN_DIM), dtype=np.float32)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # leave a core to the Python fetchers (see docs/concepts.md)
    session = ort.InferenceSession(build_model(), opts, providers=["CPUExecutionProvider"])

    coord = feeder.init_data_input_workers(session, ["x"], fetch, args.batch_size, num_worker_threads=2,
                                           input_source_name="train", log_interval=1.0)
    counts = np.zeros(CLASSES, dtype=np.int64)
    start = time.perf_counter()
    with coord:
        feed = coord.feed("train")
        for _ in range(args.batches):
            (probs,) = feed.run()
            counts += np.bincount(probs.argmax(axis=1), minlength=CLASSES)
        m = feed.metrics()
    elapsed = time.perf_counter() - start
    rows = args.batches * args.batch_size
    print(f"ran {args.batches} batches of {args.batch_size} rows in {elapsed:.2f} s: "
          f"{rows / elapsed:,.0f} rows/s, {args.batches / elapsed:,.0f} batches/s")
    print(f"consumer waited {m['consumer_wait_s']:.3f} s in total; buffers allocated: {m['buffer_allocations']:.0f}")
    print("predicted class histogram:", counts.tolist())


if __name__ == "__main__":
    main()
