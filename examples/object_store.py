"""Read Parquet from an S3 bucket, checkpoint and resume exactly, and score it into the bucket.

The bucket lives on a local S3 server that this script starts (moto, from the ``examples`` extra:
``pip install -e '.[examples]'``), so it runs without an account or the internet. Against real
S3, MinIO or another S3-compatible store, only the filesystem changes (see "Data in object
stores" in the documentation): credentials come from the environment, as for any AWS tool.

Run:  python examples/object_store.py [--rows 200000] [--latency-ms 0]

1. writes a table of ``--rows`` rows (an id and 8 float32 features) as 8 Parquet objects;
2. reads a third of it with ``ParquetSource("s3://...")``, takes a checkpoint (a JSON state),
   then resumes from that state in a new coordinator: every row exactly once across both;
3. scores every row with a small model into ``s3://.../scores/`` with ``feeder.predict``: parts
   under unique names, committed by ``_manifest.json``, ``_SUCCESS`` once complete;
4. prints what was read and written, and the source's retry counters.

``--latency-ms`` makes the server answer every request that much later (a cloud store's 50-100 ms):
reading stays fast because feeder keeps many requests in flight.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time

import numpy as np
import onnx
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from onnx import TensorProto, helper

import feeder
from feeder.sources import ParquetSource

DIM = 8


def start_server(latency_s: float):
    """moto's S3 on 127.0.0.1 (a free port) in this process, answering each request after
    ``latency_s`` seconds. Returns (server, thread, "host:port")."""
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import WSGIRequestHandler, make_server

    class Quiet(WSGIRequestHandler):
        def log_request(self, *args, **kwargs):  # no line per request on stderr
            pass

    app = DomainDispatcherApplication(create_backend_app)

    def slow(environ, start_response):
        if latency_s:
            time.sleep(latency_s)
        return app(environ, start_response)

    server = make_server("127.0.0.1", 0, slow, threaded=True, request_handler=Quiet)
    thread = threading.Thread(target=server.serve_forever, name="s3-server", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    return server, thread, f"{host}:{port}"


def model_file(path: str) -> str:
    """A linear model scores = x @ W (x float32 [N, 8] -> [N, 2]), saved to ``path``."""
    w = helper.make_tensor("W", TensorProto.FLOAT, [DIM, 2], np.random.default_rng(0).standard_normal(DIM * 2))
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["scores"])], "linear",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", DIM])],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 2])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)
    return path


def read(source: ParquetSource, resume=None, batches=None):
    """Batches of ids from ``source`` (all of them, or the first ``batches``), and the state."""
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(None, ["id", "x"], source, 512, num_worker_threads=2, coordinator=coord,
                                   resume_from=resume)
    ids = []
    with coord:
        feed = coord.feed("train")
        for batch in feed:
            ids.append(batch["id"].copy())
            if batches is not None and len(ids) == batches:
                break
        state = coord.state_dict("train")
    return ids, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    args = parser.parse_args()
    server, thread, endpoint = start_server(args.latency_ms / 1000)
    try:
        # Any pyarrow or fsspec filesystem works the same; for AWS itself, pafs.S3FileSystem() (or
        # the URI "s3://bucket/prefix" alone) takes region and credentials from the environment.
        s3 = pafs.S3FileSystem(access_key="example", secret_key="example", endpoint_override=endpoint,
                               scheme="http", region="us-east-1", allow_bucket_creation=True)
        s3.create_dir("example-bucket")
        rng = np.random.default_rng(1)
        per = -(-args.rows // 8)
        for i in range(8):
            ids = np.arange(i * per, min(args.rows, (i + 1) * per))
            x = rng.standard_normal((len(ids), DIM), dtype=np.float32)
            pq.write_table(pa.table({"id": ids, "x": pa.FixedSizeListArray.from_arrays(x.ravel(), DIM)}),
                           f"example-bucket/table/part-{i}.parquet", filesystem=s3, row_group_size=5_000)

        def source() -> ParquetSource:  # the same definition each time (a state must match it)
            return ParquetSource("example-bucket/table", filesystem=s3, shuffle=True, seed=0)

        t0 = time.perf_counter()
        first, state = read(source(), batches=args.rows // 512 // 3)
        checkpoint = json.dumps(state)  # save it beside the model's weights
        rest, end = read(source(), resume=json.loads(checkpoint))
        seconds = time.perf_counter() - t0
        ids = np.concatenate(first + rest)
        assert np.array_equal(np.sort(ids), np.arange(args.rows)), "every row exactly once"
        print(f"read {len(ids):,} rows from s3://example-bucket/table in {seconds:.2f} s: "
              f"{sum(map(len, first)):,} before the checkpoint, {sum(map(len, rest)):,} after it")

        src = source()
        result = feeder.predict(model_file("example-model.onnx"), src, "example-bucket/scores", filesystem=s3,
                                keep=["id"], progress=False)
        manifest = json.loads(s3.open_input_stream("example-bucket/scores/_manifest.json").read())
        assert manifest["complete"] and s3.get_file_info("example-bucket/scores/_SUCCESS").is_file
        written = pq.read_table([f.removeprefix("s3://") for f in result.files], filesystem=s3)
        assert sorted(written["id"].to_pylist()) == list(range(args.rows))
        print(f"scored {result.rows:,} rows into {len(result.files)} part(s) in {result.seconds:.2f} s; "
              f"_manifest.json lists {len(manifest['parts'])} committed part(s): {result.files[0]}, ...")
        print("retries:", src.feeder_counters())
        os.remove("example-model.onnx")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


if __name__ == "__main__":
    main()
