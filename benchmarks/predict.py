"""Batch inference to Parquet: ``feeder.predict`` against a hand-written loop and Ray Data.

    python benchmarks/predict.py                     # 1M rows, both scenarios, every way (minutes)
    python benchmarks/predict.py --rows 100000       # a quick check that everything runs
    python benchmarks/predict.py --no-ray            # without Ray Data

One generated Parquet table (``--rows`` rows: ``id`` int64 and ``x``, 64 float32 as a fixed-size
list, row groups of 65,536 rows, snappy) is scored with the same model by every way, batch 256,
into a fresh output folder each, and each way's rows/s is taken from one run (reading, running
and writing; Ray's start-up excluded, reported apart). Two models:

* ``model``: the runtime is the bottleneck: an MLP 64-512-512-16 (ReLU);
* ``read``: reading is the bottleneck: one MatMul 64-4.

The ways:

* ``hand loop``: ``ParquetFile.iter_batches(256)`` -> ``session.run`` -> ``ParquetWriter``, in one
  thread, with ONNX Runtime's default session options (an intra-op pool of one thread per core)
  and, as ``hand loop, 1 thread``, with one intra-op thread;
* ``feeder.predict``: one replica per core, each with its own thread on one shared session (one
  intra-op thread), 2 fetcher threads per replica, parts of 262,144 rows, committed exactly once;
* ``feeder.predict, no state``: the same call writing without the commit protocol (no fsync, no
  state per part: the internal ``_durable=False``), to measure what exactly-once costs;
* ``Ray Data``: ``read_parquet`` -> ``map_batches`` (an actor pool of one ONNX Runtime session,
  one intra-op thread, per core) -> ``write_parquet``; Ray gets twice the cores as logical CPUs
  so that its read and write tasks run beside the actors.

Prints rows/s per way and the ratios, and writes them to ``benchmarks/results/predict.json``
(``--json PATH`` elsewhere). Targets (issue): feeder.predict >= 1.3x the hand loop when the model
is the bottleneck, >= 1.0x when reading is; >= 1.2x Ray Data; commits < 3% of the run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import feeder  # noqa: E402

DIM = 64
ROW_GROUP = 65_536
BATCH = 256


# ---- data and models -----------------------------------------------------------------------------
def make_table(path: str, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    schema = pa.schema([("id", pa.int64()), ("x", pa.list_(pa.float32(), DIM))])
    with pq.ParquetWriter(path, schema, compression="snappy") as w:
        for start in range(0, rows, ROW_GROUP):
            n = min(ROW_GROUP, rows - start)
            x = rng.standard_normal(n * DIM, dtype=np.float32)
            w.write_table(pa.table({"id": pa.array(np.arange(start, start + n)),
                                    "x": pa.FixedSizeListArray.from_arrays(pa.array(x), DIM)}, schema=schema),
                          row_group_size=ROW_GROUP)


def _onnx(nodes: List[Any], inits: List[Any], out_dim: int) -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, "bench", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", DIM])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", out_dim])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10  # onnx 1.23 stamps IR 14, which onnxruntime 1.31 refuses
    return model.SerializeToString()


def mlp_model(hidden: int = 512, out_dim: int = 16) -> bytes:
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    shapes = (("W1", (DIM, hidden)), ("b1", (hidden,)), ("W2", (hidden, hidden)), ("b2", (hidden,)),
              ("W3", (hidden, out_dim)), ("b3", (out_dim,)))
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.05, n) for n, s in shapes]
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h1"]), helper.make_node("Relu", ["h1"], ["r1"]),
             helper.make_node("Gemm", ["r1", "W2", "b2"], ["h2"]), helper.make_node("Relu", ["h2"], ["r2"]),
             helper.make_node("Gemm", ["r2", "W3", "b3"], ["y"])]
    return _onnx(nodes, inits, out_dim)


def linear_model(out_dim: int = 4) -> bytes:
    from onnx import helper, numpy_helper

    w = np.random.default_rng(1).standard_normal((DIM, out_dim)).astype(np.float32)
    return _onnx([helper.make_node("MatMul", ["x", "W"], ["y"])], [numpy_helper.from_array(w, "W")], out_dim)


def session(model_path: str, one_thread: bool) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if one_thread:
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
    return ort.InferenceSession(model_path, opts, providers=["CPUExecutionProvider"])


# ---- the ways ------------------------------------------------------------------------------------
def hand_loop(data: str, model_path: str, out: str, one_thread: bool) -> int:
    """What a user writes first: read batches, run, write."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sess = session(model_path, one_thread)
    os.makedirs(out)
    writer = None
    rows = 0
    for rb in pq.ParquetFile(data).iter_batches(batch_size=BATCH, columns=["id", "x"]):
        x = rb.column("x").flatten().to_numpy().reshape(-1, DIM)
        (y,) = sess.run(None, {"x": x})
        table = pa.table({"id": rb.column("id"), "y": pa.FixedSizeListArray.from_arrays(pa.array(y.reshape(-1)),
                                                                                         y.shape[1])})
        if writer is None:
            writer = pq.ParquetWriter(os.path.join(out, "part-0.parquet"), table.schema)
        writer.write_table(table)
        rows += len(y)
    if writer is not None:
        writer.close()
    return rows


def with_predict(data: str, model_path: str, out: str, durable: bool) -> int:
    from feeder.sources import ParquetSource

    result = feeder.predict(model_path, ParquetSource(data), out, batch_size=BATCH, keep=["id"], progress=False,
                            _durable=durable)
    return result.rows_computed


class _RayInfer:
    """One ONNX Runtime session per actor, one intra-op thread (the actor pool gives the cores)."""

    def __init__(self, model_path: str):
        self.sess = session(model_path, one_thread=True)

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        x = batch.column("x").combine_chunks().flatten().to_numpy().reshape(-1, DIM)
        (y,) = self.sess.run(None, {"x": x})
        return pa.table({"id": batch.column("id"),
                         "y": pa.FixedSizeListArray.from_arrays(pa.array(y.reshape(-1)), y.shape[1])})


def with_ray(data: str, model_path: str, out: str, cores: int) -> int:
    import ray

    # One block per row group, so that every actor gets work (one file is otherwise one block).
    blocks = max(cores, int(_metadata(data).num_row_groups))
    ds = ray.data.read_parquet(data, override_num_blocks=blocks).select_columns(["id", "x"])
    ds = ds.map_batches(_RayInfer, fn_constructor_args=(model_path,), compute=ray.data.ActorPoolStrategy(size=cores),
                        num_cpus=1, batch_size=BATCH, batch_format="pyarrow")
    ds.write_parquet(out)
    return sum(_rows(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".parquet"))


def _metadata(path: str) -> Any:
    import pyarrow.parquet as pq

    return pq.read_metadata(path)


def _rows(path: str) -> int:
    return int(_metadata(path).num_rows)


class CommitClock:
    """Seconds spent in the commit protocol (renaming parts, replacing the state, their fsyncs),
    measured inside the call: a direct figure beside the difference of two whole runs."""

    def __init__(self) -> None:
        from feeder.scoring.outputdir import OutputDir

        self.seconds = 0.0
        self._cls = OutputDir
        self._saved = {name: getattr(OutputDir, name) for name in ("publish_part", "write_state")}

    def __enter__(self) -> "CommitClock":
        for name, real in self._saved.items():
            setattr(self._cls, name, self._timed(real))
        return self

    def _timed(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed

    def __exit__(self, *exc: Any) -> None:
        for name, real in self._saved.items():
            setattr(self._cls, name, real)


# ---- the run -------------------------------------------------------------------------------------
def timed(name: str, fn: Callable[[str], int], workdir: str, expected: int, commits: Dict[str, float]) -> float:
    out = os.path.join(workdir, "out-" + name.replace(" ", "-").replace(",", "").replace(".", ""))
    shutil.rmtree(out, ignore_errors=True)
    with CommitClock() as clock:
        t0 = time.perf_counter()
        rows = fn(out)
        seconds = time.perf_counter() - t0
    commits[name] = clock.seconds / seconds
    if rows != expected:
        raise AssertionError(f"{name}: wrote {rows} rows, expected {expected}")
    shutil.rmtree(out, ignore_errors=True)
    rate = rows / seconds
    print(f"  {name:<32} {rate:>12,.0f} rows/s  ({seconds:.2f} s)", flush=True)
    return rate


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the generated table (default 1M)")
    parser.add_argument("--scenarios", nargs="+", default=["model", "read"], choices=["model", "read"])
    parser.add_argument("--no-ray", action="store_true", help="leave Ray Data out")
    parser.add_argument("--workdir", default=None, help="folder for the table and the outputs (default: a temporary "
                                                        "one, removed at the end)")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "predict.json"), help="where to write results")
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workdir = args.workdir or tempfile.mkdtemp(prefix="feeder-predict-bench-")
    own = args.workdir is None
    os.makedirs(workdir, exist_ok=True)
    try:
        data = os.path.join(workdir, "table.parquet")
        t0 = time.perf_counter()
        make_table(data, args.rows)
        print(f"table: {args.rows:,} rows of {DIM} float32 + id, {os.path.getsize(data) / 2**20:.0f} MB "
              f"({time.perf_counter() - t0:.1f} s to make); {cores} cores; batch {BATCH}", flush=True)
        _rows(data)
        ray_start = None
        if not args.no_ray:
            import ray

            t0 = time.perf_counter()
            # Twice the cores as logical CPUs, as examples/ray_batch_inference.py: the actors take one
            # each, and Ray Data's read and write tasks need CPUs of their own or never get scheduled.
            ray.init(num_cpus=2 * cores, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.WARNING)
            ctx = ray.data.DataContext.get_current()
            ctx.enable_progress_bars = False
            ctx.print_on_execution_start = False
            ray_start = time.perf_counter() - t0
            print(f"ray.init: {ray_start:.1f} s (not counted)", flush=True)
        results: Dict[str, Dict[str, float]] = {}
        for scenario in args.scenarios:
            model_path = os.path.join(workdir, f"{scenario}.onnx")
            with open(model_path, "wb") as f:
                f.write(mlp_model() if scenario == "model" else linear_model())
            print(f"{scenario}-bound ({'MLP 64-512-512-16' if scenario == 'model' else 'MatMul 64-4'}):", flush=True)
            ways: Dict[str, Callable[[str], int]] = {
                "hand loop": lambda out, m=model_path: hand_loop(data, m, out, one_thread=False),
                "hand loop, 1 thread": lambda out, m=model_path: hand_loop(data, m, out, one_thread=True),
                "feeder.predict": lambda out, m=model_path: with_predict(data, m, out, durable=True),
                "feeder.predict, no state": lambda out, m=model_path: with_predict(data, m, out, durable=False),
            }
            if not args.no_ray:
                ways["Ray Data"] = lambda out, m=model_path: with_ray(data, m, out, cores)
            commits: Dict[str, float] = {}
            rates = {name: timed(name, fn, workdir, args.rows, commits) for name, fn in ways.items()}
            p = rates["feeder.predict"]
            ratios = {"hand loop": p / rates["hand loop"], "hand loop, 1 thread": p / rates["hand loop, 1 thread"],
                      "commit cost": 1.0 - p / rates["feeder.predict, no state"],
                      "commit share": commits["feeder.predict"]}
            if "Ray Data" in rates:
                ratios["Ray Data"] = p / rates["Ray Data"]
            print("  feeder.predict / " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()
                                                     if not k.startswith("commit"))
                  + f"; exactly-once costs {ratios['commit cost']:.1%} of the run against no state (the commits "
                  f"themselves took {ratios['commit share']:.1%} of its wall time, in the writer thread)", flush=True)
            results[scenario] = {"rows_per_s": rates, "ratios": ratios}  # type: ignore[dict-item]
        report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": args.rows, "batch": BATCH,
                  "cores": cores, "python": platform.python_version(), "machine": platform.machine(),
                  "ray_init_s": ray_start, "scenarios": results,
                  "versions": _versions()}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"results written to {args.json}")
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def _versions() -> Dict[str, str]:
    out = {}
    for name in ("numpy", "onnxruntime", "pyarrow", "ray"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    return out


if __name__ == "__main__":
    main()
