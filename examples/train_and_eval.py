"""Train and evaluate on one coordinator: "train" feeds a train-step graph, "test" an eval graph.

Run:  python examples/train_and_eval.py [--steps 400] [--batch-size 64] [--data DIR]
      python examples/train_and_eval.py --resume      # continue from the last checkpoint: 400 more steps
      python examples/train_and_eval.py --resume --steps 1000      # ... or up to step 1000

The data are Parquet files (written under --data on the first run): the "train" source is a
feeder.sources.ParquetSource, shuffled and endless, the "test" source an ArraySource read from
its own file. Every --checkpoint-every steps the weights (with the optimizer's momenta) and the
train source's state (coord.state_dict) are saved together, atomically, so --resume continues
with exactly the batches the interrupted run had not yet trained on.

The model is a one-hidden-layer MLP classifier (tanh, softmax cross-entropy) whose train step,
gradients written by hand, is an ordinary ONNX graph: inputs are the batch (x, y one-hot) and
the state (weights and SGD momenta), outputs the loss and the new state. feeder.StatefulSession
keeps the state in OrtValues between steps (no numpy round trip); every 50 steps the current
weights are loaded into the eval graph's adapter and the "test" source is scored. Progress is a
tqdm bar (quiet when stderr is not a terminal); the evaluation lines are printed in any case.
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import threading
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import feeder
from feeder.sources import ArraySource, ParquetSource

DIM, HIDDEN, CLASSES = 16, 32, 3
F = TensorProto.FLOAT
MORE_STEPS = 400  # steps a run trains without --steps: from 0, or from the checkpoint with --resume


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10  # onnxruntime 1.31 accepts IR <= 13; onnx 1.23 would stamp 14
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _vi(name, shape):
    return helper.make_tensor_value_info(name, F, shape)


def forward_nodes():
    return [helper.make_node("MatMul", ["x", "W1"], ["a0"]), helper.make_node("Add", ["a0", "b1"], ["a"]),
            helper.make_node("Tanh", ["a"], ["h"]), helper.make_node("MatMul", ["h", "W2"], ["o0"]),
            helper.make_node("Add", ["o0", "b2"], ["logits"]), helper.make_node("Softmax", ["logits"], ["p"])]


PARAMS = [("W1", [DIM, HIDDEN]), ("b1", [HIDDEN]), ("W2", [HIDDEN, CLASSES]), ("b2", [CLASSES])]


def train_step_model(lr: float = 0.01, momentum: float = 0.9) -> bytes:
    """Forward, softmax cross-entropy, backward by hand, SGD with momentum, in one graph."""
    n = helper.make_node
    nodes = forward_nodes() + [
        n("Log", ["p"], ["logp"]), n("Mul", ["y", "logp"], ["ylogp"]),
        n("ReduceSum", ["ylogp", "ax1"], ["rowll"], keepdims=0), n("ReduceMean", ["rowll"], ["mll"], keepdims=0),
        n("Neg", ["mll"], ["loss"]),
        # d loss / d logits = (p - y) / N ; N from the batch
        n("Shape", ["x"], ["xs"]), n("Gather", ["xs", "zero"], ["N"], axis=0), n("Cast", ["N"], ["Nf"], to=F),
        n("Sub", ["p", "y"], ["pm"]), n("Div", ["pm", "Nf"], ["dlog"]),
        n("Transpose", ["h"], ["hT"]), n("MatMul", ["hT", "dlog"], ["gW2"]),
        n("ReduceSum", ["dlog", "ax0"], ["gb2"], keepdims=0),
        n("Transpose", ["W2"], ["W2T"]), n("MatMul", ["dlog", "W2T"], ["dh"]),
        n("Mul", ["h", "h"], ["h2"]), n("Sub", ["one", "h2"], ["dtanh"]), n("Mul", ["dh", "dtanh"], ["da"]),
        n("Transpose", ["x"], ["xT"]), n("MatMul", ["xT", "da"], ["gW1"]),
        n("ReduceSum", ["da", "ax0"], ["gb1"], keepdims=0),
    ]
    outputs = [_vi("loss", [])]
    for name, shape in PARAMS:
        nodes += [n("Mul", ["mu", "v" + name], ["mv" + name]),
                  n("Add", ["mv" + name, "g" + name], ["v" + name + "_new"]),
                  n("Mul", ["lr", "v" + name + "_new"], ["s" + name]), n("Sub", [name, "s" + name], [name + "_new"])]
        outputs += [_vi(name + "_new", shape), _vi("v" + name + "_new", shape)]
    consts = [numpy_helper.from_array(np.array(v, dtype), k) for k, v, dtype in
              (("lr", lr, np.float32), ("mu", momentum, np.float32), ("one", 1.0, np.float32),
               ("zero", 0, np.int64), ("ax0", [0], np.int64), ("ax1", [1], np.int64))]
    inputs = [_vi("x", ["N", DIM]), _vi("y", ["N", CLASSES])]
    inputs += [_vi(name, shape) for name, shape in PARAMS] + [_vi("v" + name, shape) for name, shape in PARAMS]
    return _model(nodes, inputs, outputs, consts)


def eval_model() -> bytes:
    """Class probabilities from the same weights, which are inputs held by the adapter."""
    inputs = [_vi("x", ["N", DIM])] + [_vi(name, shape) for name, shape in PARAMS]
    return _model(forward_nodes(), inputs, [_vi("p", ["N", CLASSES])])


STATE = {**{name + "_new": name for name, _ in PARAMS}, **{"v" + name + "_new": "v" + name for name, _ in PARAMS}}


def initial_state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in PARAMS:
        scale = 1.0 / np.sqrt(shape[0]) if len(shape) == 2 else 0.0
        state[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
        state["v" + name] = np.zeros(shape, np.float32)
    return state


class Blobs:
    """Three Gaussian blobs in DIM dimensions; fetch_fun draws chunks of random rows."""

    def __init__(self, seed: int):
        rng = np.random.default_rng(100)
        self.centers = rng.standard_normal((CLASSES, DIM)).astype(np.float32) * 0.6
        self.rng = np.random.default_rng(seed)
        self.lock = threading.Lock()

    def sample(self, n: int):
        with self.lock:
            labels = self.rng.integers(0, CLASSES, n)
            x = self.centers[labels] + self.rng.standard_normal((n, DIM)).astype(np.float32)
        return x.astype(np.float32), np.eye(CLASSES, dtype=np.float32)[labels]

    def fetch(self, worker_id: int, batch_size: int):
        x, y = self.sample(int(self.rng.integers(8, 48)))
        return {"x": x, "y": y}


def session(model: bytes) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def write_data(data_dir: str, train_files: int = 4, rows_per_file: int = 5000) -> None:
    """The blobs as Parquet: train/part-*.parquet (row groups of 1000 rows) and test.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def table(x: np.ndarray, y: np.ndarray) -> "pa.Table":
        return pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), DIM),
                         "y": pa.FixedSizeListArray.from_arrays(pa.array(y.ravel()), CLASSES)})

    os.makedirs(os.path.join(data_dir, "train"), exist_ok=True)
    blobs = Blobs(seed=1)
    for i in range(train_files):
        pq.write_table(table(*blobs.sample(rows_per_file)), os.path.join(data_dir, "train", f"part-{i}.parquet"),
                       row_group_size=1000, compression="zstd")
    pq.write_table(table(*Blobs(seed=2).sample(2000)), os.path.join(data_dir, "test.parquet"))


def save_checkpoint(path: str, step: int, weights: dict, source_state: dict) -> None:
    """Weights and source state in one file, replaced atomically: a kill never leaves half of one."""
    buf = io.BytesIO()
    np.savez(buf, **weights, __step__=np.int64(step), __source__=np.array(json.dumps(source_state)))
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str) -> tuple:
    with np.load(path) as z:
        weights = {k: z[k] for k in z.files if not k.startswith("__")}
        return int(z["__step__"]), weights, json.loads(str(z["__source__"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None,
                   help=f"train until this step (default: step {MORE_STEPS}, or {MORE_STEPS} steps more with --resume)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--data", default="train_and_eval_data", help="folder of the Parquet files and the checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="continue from DATA/checkpoint.npz")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    if not os.path.exists(os.path.join(args.data, "test.parquet")):
        write_data(args.data)
        print(f"wrote the data to {args.data}/")
    ckpt = os.path.join(args.data, "checkpoint.npz")
    first_step, weights, source_state = 0, initial_state(), None
    if args.resume:
        first_step, weights, source_state = load_checkpoint(ckpt)
        print(f"resumed from step {first_step} ({source_state['rows_delivered']} rows trained on)")
    last_step = args.steps if args.steps is not None else first_step + MORE_STEPS
    if last_step <= first_step:
        print(f"the checkpoint is at step {first_step} already, past --steps {last_step}: nothing to train; "
              f"pass a larger --steps, or leave it out to train {MORE_STEPS} steps more")
        return

    train = feeder.StatefulSession(session(train_step_model()), STATE, weights)
    evaluate = feeder.StatefulSession(session(eval_model()), {}, {n: v for n, v in weights.items()
                                                                  if not n.startswith("v")})
    import pyarrow.parquet as pq
    test_table = pq.read_table(os.path.join(args.data, "test.parquet"))
    x_test = test_table.column("x").combine_chunks().flatten().to_numpy().reshape(-1, DIM)
    y_test = test_table.column("y").combine_chunks().flatten().to_numpy().reshape(-1, CLASSES)

    coord = feeder.GlobalCoordinator()
    train_source = ParquetSource(os.path.join(args.data, "train"), shuffle=True, seed=0, epochs=None)
    feeder.init_data_input_workers(train, None, train_source, args.batch_size, num_worker_threads=2,
                                   input_source_name="train", coordinator=coord, log_interval=0.2,
                                   resume_from=source_state)
    # one ordered worker cycling through the test set: batch k holds rows (k*500 .. k*500+499) % 2000
    feeder.init_data_input_workers(evaluate, ["x"], ArraySource([x_test], epochs=None, block_rows=250), 500,
                                   num_worker_threads=1, ordered=True, max_buffered_batches=8,
                                   input_source_name="test", coordinator=coord, log_interval=0.2)
    t0 = time.perf_counter()
    test_batches = 0
    with coord, logging_redirect_tqdm():  # feeder's log lines are printed above the bar, not through it
        train_feed, test_feed = coord.feed("train"), coord.feed("test")
        for step in tqdm(range(first_step + 1, last_step + 1), unit="step", disable=None):
            (loss,) = train_feed.run(["loss"])
            if step % args.checkpoint_every == 0 or step == last_step:
                # In the consumer's thread between steps: the state covers exactly the batches trained on.
                save_checkpoint(ckpt, step, train.state(), coord.state_dict("train"))
            if step % 50 == 0:
                evaluate.load_state({k: v for k, v in train.state().items() if not k.startswith("v")})
                correct = 0
                for _ in range(len(x_test) // 500):  # one pass over the test set
                    (probs,) = test_feed.run()
                    start = (test_batches * 500) % len(x_test)
                    correct += int(np.sum(probs.argmax(1) == y_test[start:start + 500].argmax(1)))
                    test_batches += 1
                tqdm.write(f"step {step:4d}  loss {float(loss):.4f}  test accuracy {correct / len(x_test):.3f}")
    elapsed = time.perf_counter() - t0
    steps = last_step - first_step
    print(f"{steps} train steps of {args.batch_size} rows in {elapsed:.2f} s: {steps / max(elapsed, 1e-9):,.0f} "
          f"steps/s; checkpoint: {ckpt}")


if __name__ == "__main__":
    main()
