"""ParquetSource reading from an object store with 50 ms per request, against the same read from
the local disk, pyarrow.dataset and Ray Data on the same server (issue 28).

The store is moto's S3 (``moto[server]``, the test extra) served on 127.0.0.1 in a child process
of its own (so that its Python does not share this process's GIL), behind a WSGI layer that
sleeps ``--latency-ms`` before answering each request: every HEAD, GET, LIST costs that much
more, as a request to a cloud object store does (50-100 ms to first byte). The dataset: ``--files``
Parquet files of ``--groups`` row groups of ``--group-rows`` rows each (``x``: DIM float32 as a
fixed-size list, ``id``: int64), written both to a local folder and to the server.

Contenders (each reads every row once, batches of 256 rows, no model; rows/s from the first
request to the last batch, creation included):

* feeder ``ParquetSource`` on the local disk (2 fetcher threads): the rate to reach;
* feeder ``ParquetSource("s3://...")`` with the added latency: readahead off (2 fetchers, one
  request each in flight) and on (the default for a store, 16 units ahead), pyarrow's
  pre-buffering on (the default) and off;
* feeder on the server without added latency (what the server itself costs);
* ``pyarrow.dataset.dataset("s3://...").to_batches(batch_size=256)`` (its own readahead of
  fragments and batches, pre-buffering, its I/O thread pool), each batch's columns to numpy;
* Ray Data ``read_parquet("s3://...", filesystem=...).iter_batches(batch_size=256)`` with
  ``ray.init(num_cpus=2)`` (start-up not counted).

Then ``feeder.predict`` from and to the server (a MatMul, reading bound), killed with SIGKILL once
it has committed a part, and run again: the rows the second run computes are the rows no commit
covered (none re-read).

    python benchmarks/remote.py [--latency-ms 50] [--files 16] [--groups 32] [--group-rows 4096]
                                [--json benchmarks/results/remote.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, ROOT)

import feeder  # noqa: E402

DIM = 8
BATCH = 256
KEY, SECRET, REGION = "bench", "bench", "us-east-1"

SERVER = r'''
import sys, threading, time
from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

delay = float(sys.argv[1])
app = DomainDispatcherApplication(create_backend_app)
requests = [0]


def slow(environ, start_response):
    requests[0] += 1
    if delay:
        time.sleep(delay)
    return app(environ, start_response)


class Quiet(WSGIRequestHandler):
    def log_request(self, *a, **k):
        pass


class Server(ThreadedWSGIServer):
    daemon_threads = True
    request_queue_size = 256


server = Server("127.0.0.1", 0, slow, handler=Quiet)
print(server.server_address[1], flush=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
for line in sys.stdin:  # "delay <s>" changes the latency, "count" prints the requests served; EOF ends
    words = line.split()
    if words and words[0] == "delay":
        delay = float(words[1])
    elif words and words[0] == "count":
        print(requests[0], flush=True)
'''


class SlowFile:
    """A local file whose every read (a request to a store) waits ``delay`` seconds first."""

    def __init__(self, f: Any, delay: float):
        self._f, self._delay = f, delay

    def read(self, n: int = -1) -> bytes:
        time.sleep(self._delay)
        return self._f.read(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def slow_local_filesystem(delay: float) -> Any:
    """A pyarrow filesystem over the local disk that adds ``delay`` seconds to every request:
    opening a file (a HEAD), each read of it (a GET) and each listing."""
    import fsspec
    import pyarrow.fs as pafs

    class SlowHandler(pafs.FSSpecHandler):
        def get_file_info(self, paths: Any) -> Any:
            time.sleep(delay)
            return super().get_file_info(paths)

        def get_file_info_selector(self, selector: Any) -> Any:
            time.sleep(delay)
            return super().get_file_info_selector(selector)

        def open_input_file(self, path: str) -> Any:
            import pyarrow as pa
            time.sleep(delay)
            return pa.PythonFile(SlowFile(open(path, "rb"), delay), mode="r")

        def open_input_stream(self, path: str) -> Any:
            return self.open_input_file(path)

    return pafs.PyFileSystem(SlowHandler(fsspec.filesystem("file")))


class Server:
    """moto's S3 in a child process, with a latency it can be told to change."""

    def __init__(self, latency_s: float):
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(latency_s)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.endpoint = f"127.0.0.1:{self.port}"

    def delay(self, seconds: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"delay {seconds}\n")
        self.proc.stdin.flush()

    def requests(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def env(self) -> Dict[str, str]:
        return {"AWS_ENDPOINT_URL": f"http://{self.endpoint}", "AWS_ACCESS_KEY_ID": KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}

    def filesystem(self) -> Any:
        import pyarrow.fs as pafs
        return pafs.S3FileSystem(access_key=KEY, secret_key=SECRET, endpoint_override=self.endpoint, scheme="http",
                                 region=REGION, allow_bucket_creation=True)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


def write_dataset(local: str, fs: Any, bucket: str, files: int, groups: int, group_rows: int) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = np.random.default_rng(0)
    os.makedirs(local, exist_ok=True)
    fs.create_dir(bucket)
    at = 0
    for f in range(files):
        n = groups * group_rows
        x = rng.standard_normal(n * DIM, dtype=np.float32)
        table = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x), DIM),
                          "id": pa.array(np.arange(at, at + n))})
        pq.write_table(table, os.path.join(local, f"part-{f:03d}.parquet"), row_group_size=group_rows)
        pq.write_table(table, f"{bucket}/data/part-{f:03d}.parquet", filesystem=fs, row_group_size=group_rows)
        at += n
    return at


def rate(batches: Callable[[], Iterator[int]], expected: int) -> Dict[str, float]:
    """rows/s from the start (creation, listing and footers included), the seconds to the first
    batch, and rows/s from the first batch on (streaming)."""
    t0 = time.perf_counter()
    rows, first = 0, None
    for n in batches():
        if first is None:
            first = time.perf_counter()
        rows += n
    end = time.perf_counter()
    assert rows == expected, (rows, expected)
    assert first is not None
    return {"rows_per_s": rows / (end - t0), "first_batch_s": first - t0, "streaming_rows_per_s": rows / (end - first)}


def feeder_rows(make_source: Callable[[], Any], threads: int = 2) -> Iterator[int]:
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(None, ["x", "id"], make_source(), BATCH, num_worker_threads=threads,
                                   coordinator=coord, log_interval=3600.0)
    with coord:
        for batch in coord.feed("train"):
            yield len(batch["id"])


def dataset_rows(uri: str, fs: Any) -> Iterator[int]:
    import pyarrow.dataset as ds
    for b in ds.dataset(uri, filesystem=fs, format="parquet").to_batches(columns=["x", "id"], batch_size=BATCH):
        x = b.column(0).flatten().to_numpy().reshape(-1, DIM)
        ids = b.column(1).to_numpy()
        assert len(x) == len(ids)
        yield len(ids)


def ray_rows(uri: str, fs: Any) -> Iterator[int]:
    import ray
    for b in ray.data.read_parquet(uri, filesystem=fs).select_columns(["x", "id"]).iter_batches(batch_size=BATCH,
                                                                                               batch_format="numpy"):
        yield len(b["id"])


KILLED = r'''
import sys, numpy as np, feeder
from feeder.sources import ParquetSource
r = feeder.predict(sys.argv[1], ParquetSource(sys.argv[2], columns={"x": "x", "id": "id"}), sys.argv[3], keep=["id"],
                   batch_size=256, rows_per_file=int(sys.argv[4]), progress=False)
print("RESULT", r.rows, r.rows_computed, f"{r.seconds:.3f}", flush=True)
'''


def predict_killed(server: Server, fs: Any, bucket: str, workdir: str, rows: int, group_rows: int) -> Dict[str, Any]:
    """predict s3 -> s3, SIGKILL once a part is committed, then run again: what the second run computes."""
    import onnx
    from onnx import TensorProto, helper
    w = helper.make_tensor("W", TensorProto.FLOAT, [DIM, 4], np.random.default_rng(1).standard_normal(DIM * 4))
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "mm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", DIM])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], [w])
    model = os.path.join(workdir, "mm.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), model)
    env = dict(os.environ, **server.env(), PYTHONPATH=ROOT)
    out = f"s3://{bucket}/scores"
    per_file = 262_144  # predict's default
    cmd = [sys.executable, "-c", KILLED, model, f"s3://{bucket}/data", out, str(per_file)]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    committed = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.poll() is None:
        try:
            with fs.open_input_stream(f"{bucket}/scores/_manifest.json") as f:
                committed = json.loads(f.read().decode())["rows"]
        except (OSError, ValueError):
            committed = 0
        if committed >= per_file:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    with fs.open_input_stream(f"{bucket}/scores/_manifest.json") as f:
        committed = json.loads(f.read().decode())["rows"]
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    total, computed, seconds = again.stdout.split("RESULT")[1].split()
    return {"rows": int(total), "committed_before_the_kill": committed, "computed_after_resume": int(computed),
            "recomputed_committed_rows": int(computed) - (int(total) - committed),
            "resume_rows_per_s": int(computed) / float(seconds)}


def ratios_of(r: Dict[str, Dict[str, float]], tag: str) -> Dict[str, float]:
    """The ratios of one round (``r``: contender -> rate's figures)."""
    total = {k: v["rows_per_s"] for k, v in r.items()}
    streaming = {k: v["streaming_rows_per_s"] for k, v in r.items()}
    s3, wrapped = f"feeder, S3 {tag}", f"local disk {tag} a request (filesystem wrapper)"
    out = {
        "feeder S3 +latency / feeder local disk": total[s3] / total["feeder, local disk"],
        "feeder S3 +latency / feeder S3 no added latency": total[s3] / total["feeder, S3 without added latency"],
        "feeder S3 +latency / readahead=0": total[s3] / total[f"feeder, S3 {tag}, readahead=0"],
        "feeder S3 +latency / pyarrow.dataset S3 +latency": total[s3] / total[f"pyarrow.dataset, S3 {tag}"],
        "feeder wrapper +latency / feeder local disk": total[f"feeder, {wrapped}"] / total["feeder, local disk"],
        "feeder wrapper +latency / feeder wrapper no added latency":
            total[f"feeder, {wrapped}"] / total["feeder, local disk through the wrapper, no added latency"],
        "feeder wrapper +latency / pyarrow.dataset wrapper +latency":
            total[f"feeder, {wrapped}"] / total[f"pyarrow.dataset, {wrapped}"],
        "streaming: feeder S3 +latency / feeder local disk": streaming[s3] / streaming["feeder, local disk"],
        "streaming: feeder S3 +latency / feeder S3 no added latency":
            streaming[s3] / streaming["feeder, S3 without added latency"],
        "streaming: feeder wrapper +latency / feeder local disk":
            streaming[f"feeder, {wrapped}"] / streaming["feeder, local disk"],
    }
    if f"Ray Data read_parquet, S3 {tag}" in total:
        out["feeder S3 +latency / Ray Data S3 +latency"] = total[s3] / total[f"Ray Data read_parquet, S3 {tag}"]
        out["feeder wrapper +latency / Ray Data wrapper +latency"] = (
            total[f"feeder, {wrapped}"] / total[f"Ray Data read_parquet, {wrapped}"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--latency-ms", type=float, default=50.0)
    p.add_argument("--files", type=int, default=16)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--group-rows", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=2, help="every contender this many times, side by side")
    p.add_argument("--no-ray", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from feeder.sources import ParquetSource
    from feeder.sources import parquetstore as parquet_module

    latency = args.latency_ms / 1000.0
    tag = f"+{args.latency_ms:.0f} ms"
    server = Server(0.0)
    rounds: List[Dict[str, Dict[str, float]]] = []
    try:
        fs = server.filesystem()
        bucket = "bench"
        with tempfile.TemporaryDirectory() as workdir:
            local = os.path.join(workdir, "data")
            rows = write_dataset(local, fs, bucket, args.files, args.groups, args.group_rows)
            uri = f"s3://{bucket}/data"
            cols = {"x": "x", "id": "id"}
            print(f"{rows} rows in {args.files * args.groups} row groups of {args.group_rows} rows", flush=True)
            if not args.no_ray:
                import ray
                ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
                ray.data.DataContext.get_current().enable_progress_bars = False
            slow = slow_local_filesystem(latency)
            try:
                for k in range(args.rounds):
                    got: Dict[str, Dict[str, float]] = {}
                    rounds.append(got)

                    def run(name: str, fn: Callable[[], Iterator[int]], got: Dict[str, Dict[str, float]] = got,
                            k: int = k) -> None:
                        got[name] = rate(fn, rows)
                        print(f"round {k + 1}: {name:70s} {got[name]['rows_per_s']:12,.0f} rows/s, first batch "
                              f"{got[name]['first_batch_s']:5.2f} s, then {got[name]['streaming_rows_per_s']:12,.0f}"
                              f" rows/s", flush=True)

                    server.delay(0.0)
                    run("feeder, local disk", lambda: feeder_rows(lambda: ParquetSource(local, columns=cols)))
                    run("feeder, S3 without added latency", lambda: feeder_rows(
                        lambda: ParquetSource(uri, columns=cols, filesystem=fs)))
                    run("feeder, local disk through the wrapper, no added latency", lambda: feeder_rows(
                        lambda: ParquetSource(local, columns=cols, filesystem=slow_local_filesystem(0.0))))
                    server.delay(latency)
                    run(f"feeder, S3 {tag}", lambda: feeder_rows(
                        lambda: ParquetSource(uri, columns=cols, filesystem=fs)))
                    run(f"pyarrow.dataset, S3 {tag}", lambda: dataset_rows(f"{bucket}/data", fs))
                    run(f"feeder, S3 {tag}, readahead=0", lambda: feeder_rows(
                        lambda: ParquetSource(uri, columns=cols, filesystem=fs, readahead=0)))
                    run(f"feeder, S3 {tag}, readahead=0, 16 fetcher threads", lambda: feeder_rows(
                        lambda: ParquetSource(uri, columns=cols, filesystem=fs, readahead=0), threads=16))
                    parquet_module.PRE_BUFFER = False
                    try:
                        run(f"feeder, S3 {tag}, no pre-buffering", lambda: feeder_rows(
                            lambda: ParquetSource(uri, columns=cols, filesystem=fs)))
                    finally:
                        parquet_module.PRE_BUFFER = True
                    run(f"feeder, local disk {tag} a request (filesystem wrapper)", lambda: feeder_rows(
                        lambda: ParquetSource(local, columns=cols, filesystem=slow)))
                    run(f"pyarrow.dataset, local disk {tag} a request (filesystem wrapper)",
                        lambda: dataset_rows(local, slow))
                    if not args.no_ray:
                        run(f"Ray Data read_parquet, S3 {tag}", lambda: ray_rows(f"{bucket}/data", fs))
                        run(f"Ray Data read_parquet, local disk {tag} a request (filesystem wrapper)",
                            lambda: ray_rows(local, slow))
            finally:
                if not args.no_ray:
                    ray.shutdown()
            killed = predict_killed(server, fs, bucket, workdir, rows, args.group_rows)
            print("predict s3 -> s3, killed and resumed:", killed, flush=True)
    finally:
        server.close()
    per_round = [ratios_of(r, tag) for r in rounds]
    ratios = {k: [round(r[k], 3) for r in per_round] for k in per_round[0]}
    for k, v in ratios.items():
        print(f"{k:70s} " + "  ".join(f"{x:6.2f}x" for x in v))
    if args.json:
        out = {"date": datetime.date.today().isoformat(),
               "command": "python benchmarks/remote.py " + " ".join(sys.argv[1:]),
               "machine": f"{os.cpu_count()} cores, shared with other jobs", "latency_ms": args.latency_ms,
               "rows": rows, "row_groups": args.files * args.groups, "group_rows": args.group_rows,
               "rounds": rounds, "ratios_per_round": ratios, "predict_killed_and_resumed": killed}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
