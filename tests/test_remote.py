"""Object stores (issue 28): ParquetSource and feeder.predict against a local S3 server (moto on
127.0.0.1, tests/s3server.py), fsspec's memory filesystem and file:// URIs. Every promise of the
local disk, kept in a store: every row once, exact resume, a changed object refused, transient
failures retried (and counted), predict to S3 exactly once across SIGKILL."""
from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import feeder
from feeder.sources.base import SourceBinding
from feeder.storage import Retry, is_transient, resolve, retrying

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pafs = pytest.importorskip("pyarrow.fs")

from s3server import S3Server, moto_available  # noqa: E402

from feeder.sources import ParquetSource  # noqa: E402

pytestmark = pytest.mark.skipif(not moto_available(), reason="needs moto[server] (the test extra)")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.fixture(scope="module")
def server():
    s = S3Server().start()
    yield s
    s.stop()


@pytest.fixture
def s3(server):
    """The server with no faults, a filesystem whose own (AWS SDK) retries are off, so that every
    fault reaches feeder, and a fresh bucket."""
    server.faults(every=0, next=0, methods={"GET", "HEAD", "PUT", "POST", "DELETE"})
    server.deny = set()
    server.delay_s = 0.0
    fs = server.filesystem(retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
    bucket = "b" + uuid.uuid4().hex[:12]
    fs.create_dir(bucket)
    yield server, fs, bucket
    server.faults(every=0, next=0)
    server.deny = set()
    server.delay_s = 0.0


def write(fs, path, lo, hi, row_group_size, **kw):
    ids = np.arange(lo, hi)
    pq.write_table(pa.table({"id": pa.array(ids, pa.int64()), "x": pa.array(ids.astype(np.float64) / 2),
                             "name": pa.array([f"row{i}" for i in ids])}), path, filesystem=fs,
                   row_group_size=row_group_size, **kw)


def dataset(fs, bucket, files=4, rows=60, row_group_size=10):
    for i in range(files):
        write(fs, f"{bucket}/data/f{i}.parquet", i * rows, (i + 1) * rows, row_group_size)
    return files * rows


def consume(source, inputs=("id", "x"), workers=2, ordered=False, batch_size=16, take=None, resume=None,
            replicas=1, processes=0, **options):
    coord = feeder.GlobalCoordinator(join_timeout=3.0)
    try:
        for _ in range(replicas):
            feeder.init_data_input_workers(None, list(inputs), source, batch_size, num_worker_threads=workers,
                                           coordinator=coord, ordered=ordered, resume_from=resume,
                                           **({"num_worker_processes": processes} if processes else {}), **options)
        coord.start()
        got, live, i = [], list(coord.feeds("train")), 0
        while live and (take is None or len(got) < take):
            f = live[i % len(live)]
            try:
                got.append({k: v.copy() for k, v in f.next_batch(timeout=30).items()})
                i += 1
            except StopIteration:
                live.remove(f)
        return got, coord.state_dict("train")
    finally:
        coord.stop()


def ids_of(batches, key="id"):
    return np.concatenate([b[key] for b in batches]) if batches else np.zeros(0, np.int64)


def readahead_threads():
    return [t for t in threading.enumerate() if t.name.startswith("feeder:") and "readahead" in t.name]


# ---- every row once, from a store --------------------------------------------------------------------
def test_every_row_once_per_epoch_from_s3_with_replicas_and_columns_intact(s3):
    _, fs, bucket = s3
    n = dataset(fs, bucket)
    src = ParquetSource(f"{bucket}/data", filesystem=fs, shuffle=True, seed=3, epochs=2)
    assert len(src) == n and [f[0] for f in src.files] == [f"s3://{bucket}/data/f{i}.parquet" for i in range(4)]
    got, state = consume(src, inputs=("id", "x", "name"), replicas=2)
    ids = ids_of(got)
    assert Counter(ids.tolist()) == Counter({i: 2 for i in range(n)})
    for b in got:
        np.testing.assert_array_equal(b["x"], b["id"] / 2)
        assert b["name"].tolist() == [f"row{i}" for i in b["id"]]
    assert state["rows_delivered"] == 2 * n and state["delivered"] == [[0, 2 * n]]
    record = state["definition"]["files"][0]
    assert record["name"] == f"s3://{bucket}/data/f0.parquet"
    assert re.fullmatch(r"etag:[0-9a-f]{32}(-\d+)?", record["version"]), record
    assert record["size"] == fs.get_file_info(f"{bucket}/data/f0.parquet").size
    assert not readahead_threads()  # stopped and joined at stop()


def test_s3_uris_from_the_environment_and_a_single_object(s3, monkeypatch):
    server, fs, bucket = s3
    n = dataset(fs, bucket, files=2)
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    src = ParquetSource(f"s3://{bucket}/data/")
    assert len(src) == n and src.roots == [f"s3://{bucket}/data"]
    assert sorted(ids_of(consume(src)[0]).tolist()) == list(range(n))
    one = ParquetSource([f"s3://{bucket}/data/f1.parquet"])
    assert sorted(ids_of(consume(one)[0]).tolist()) == list(range(60, 120))
    with pytest.raises(FileNotFoundError, match=f"s3://{bucket}/nope"):
        ParquetSource(f"s3://{bucket}/nope")
    fs.create_dir(f"{bucket}/empty")
    write_bytes(fs, f"{bucket}/empty/readme.txt", b"not parquet")
    with pytest.raises(ValueError, match="holds no .parquet files"):
        ParquetSource(f"s3://{bucket}/empty")


def write_bytes(fs, path, data):
    with fs.open_output_stream(path) as f:
        f.write(data)


def test_fsspec_memory_uris_and_filesystems_and_file_uris(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    mem = fsspec.filesystem("memory")
    root = f"/feeder-test-{uuid.uuid4().hex[:8]}"
    with mem.open(f"{root}/d/a.parquet", "wb") as f:
        pq.write_table(pa.table({"id": np.arange(50)}), f, row_group_size=7)
    try:
        by_uri = ParquetSource(f"memory://{root}/d", shuffle=True)
        assert by_uri.files[0][0] == f"memory://{root}/d/a.parquet"
        assert sorted(ids_of(consume(by_uri, inputs=("id",))[0]).tolist()) == list(range(50))
        by_fs = ParquetSource(f"{root}/d", filesystem=mem)
        got, state = consume(by_fs, inputs=("id",), ordered=True)
        assert ids_of(got).tolist() == list(range(50))
        assert state["definition"]["files"][0]["version"].startswith("mtime_ns:")  # memory: its creation time
        # a path on a pyarrow filesystem wrapping fsspec is the same
        wrapped = pafs.PyFileSystem(pafs.FSSpecHandler(mem))
        assert len(ParquetSource(f"{root}/d/a.parquet", filesystem=wrapped)) == 50
    finally:
        mem.rm(root, recursive=True)
    pq.write_table(pa.table({"id": np.arange(20)}), tmp_path / "l.parquet", row_group_size=5)
    local = ParquetSource(f"file://{tmp_path}/l.parquet")
    assert local.files == [(f"{tmp_path}/l.parquet", "l.parquet")]  # a local file, as a plain path reads it
    assert sorted(ids_of(consume(local, inputs=("id",))[0]).tolist()) == list(range(20))
    assert len(ParquetSource(str(tmp_path / "l.parquet"), filesystem=pafs.LocalFileSystem())) == 20
    with pytest.raises(ValueError, match="nosuchscheme"):
        ParquetSource("nosuchscheme://x/y")
    with pytest.raises(TypeError, match="filesystem must be"):
        ParquetSource(str(tmp_path), filesystem=object())
    with pytest.raises(ValueError, match="s3:// URI, but filesystem= is a"):
        ParquetSource("s3://bucket/x", filesystem=pafs.LocalFileSystem())


# ---- resume ---------------------------------------------------------------------------------------------
def test_ordered_resume_from_s3_gives_the_batches_of_an_uninterrupted_run(s3):
    _, fs, bucket = s3
    dataset(fs, bucket)

    def make():
        return ParquetSource(f"{bucket}/data", filesystem=fs, shuffle=True, seed=5, epochs=2)

    full, _ = consume(make(), ordered=True, batch_size=12)
    before, state = consume(make(), ordered=True, batch_size=12, take=9)
    after, _ = consume(make(), ordered=True, batch_size=12, workers=3, resume=json.loads(json.dumps(state)))
    assert [b["id"].tolist() for b in before + after] == [b["id"].tolist() for b in full]


@pytest.mark.parametrize("processes", [0, 2], ids=["threads", "processes"])
def test_shuffled_resume_from_s3_every_row_once(s3, processes):
    server, fs, bucket = s3
    n = dataset(fs, bucket)
    before, state = consume(ParquetSource(f"{bucket}/data", filesystem=fs, shuffle=True, seed=1), take=5,
                            processes=processes)
    rest, end = consume(ParquetSource(f"{bucket}/data", filesystem=fs, shuffle=True, seed=1), resume=state,
                        processes=processes)
    assert Counter(ids_of(before + rest).tolist()) == Counter(range(n))
    assert end["rows_delivered"] == n


def test_a_changed_object_is_refused_naming_it_at_resume_and_at_read(s3):
    _, fs, bucket = s3
    dataset(fs, bucket, files=2)
    _, state = consume(ParquetSource(f"{bucket}/data", filesystem=fs), take=1)
    write(fs, f"{bucket}/data/f1.parquet", 60, 120, 10)  # the same rows written again: a new ETag? same bytes
    write(fs, f"{bucket}/data/f1.parquet", 60, 120, 20)  # other row groups, other bytes
    uri = f"s3://{bucket}/data/f1.parquet"
    with pytest.raises(ValueError, match=rf"files: 1 file\(s\) changed \(.*version 'etag:.*' -> 'etag:.*'\): "
                                         rf"'{re.escape(uri)}'"):
        feeder.init_data_input_workers(None, ["id", "x"], ParquetSource(f"{bucket}/data", filesystem=fs), 8,
                                       coordinator=feeder.GlobalCoordinator(), resume_from=state)
    # changed between creation and start(): the worker that opens it says so, naming it (an
    # InputValidationError: bad data, never retried nor skipped, whatever max_fetch_errors says)
    src = ParquetSource(f"{bucket}/data", filesystem=fs)
    write(fs, f"{bucket}/data/f0.parquet", 0, 30, 10)
    with pytest.raises(feeder.InputValidationError, match=rf"'s3://{bucket}/data/f0\.parquet' changed since the "
                                                          rf"ParquetSource was created \(.*bytes, row groups of "
                                                          rf"\[10, 10, 10, 10, 10, 10\] -> \[10, 10, 10\] rows\)"):
        consume(src, inputs=("id",), max_fetch_errors=100)
    # ... and after start(): its first read says so (an InputValidationError: never retried, never skipped)
    src = ParquetSource(f"{bucket}/data/f0.parquet", filesystem=fs, readahead=0)
    src.feeder_validate(("id",), None)
    src.feeder_bind(SourceBinding("train", ((0,),), ("id",), True, None))
    try:
        write(fs, f"{bucket}/data/f0.parquet", 100, 130, 10)  # same row groups, other values: another ETag
        with pytest.raises(feeder.InputValidationError, match=r"f0\.parquet' changed since the ParquetSource was "
                                                              r"created \((\d+ -> \d+ bytes, )?other schema or "
                                                              r"column statistics"):
            src(0, 4)
        assert src.feeder_counters() == {"retries": 0.0, "retries_exhausted": 0.0}
    finally:
        src.feeder_release()


def test_identity_content_resumes_on_a_copy_with_another_etag_in_another_bucket_name(s3):
    _, fs, bucket = s3
    write(fs, f"{bucket}/a/v.parquet", 0, 40, 10)
    src = ParquetSource(f"{bucket}/a/v.parquet", filesystem=fs, identity="content")
    assert src._definition()["files"][0]["version"].startswith("sha256:")
    before, state = consume(src, take=1, batch_size=4)
    # the same bytes put again (a copy): another ETag here only if multipart; content identity resumes
    data = fs.open_input_stream(f"{bucket}/a/v.parquet").read()
    write_bytes(fs, f"{bucket}/a/v.parquet", data)
    rest, end = consume(ParquetSource(f"{bucket}/a/v.parquet", filesystem=fs, identity="content"), resume=state,
                        batch_size=4)
    assert sorted(ids_of(before + rest).tolist()) == list(range(40)) and end["rows_delivered"] == 40


# ---- retries --------------------------------------------------------------------------------------------
def test_one_request_in_ten_failing_is_survived_by_retries_and_counted(s3, caplog):
    server, fs, bucket = s3
    n = dataset(fs, bucket, files=4, rows=100, row_group_size=10)
    server.faults(every=10)
    caplog.set_level(logging.DEBUG, logger="feeder")
    src = ParquetSource(f"{bucket}/data", filesystem=fs, shuffle=True, seed=2, epochs=2)
    got, state = consume(src, workers=3)
    assert Counter(ids_of(got).tolist()) == Counter({i: 2 for i in range(n)})
    assert server.failed >= 5, server.failed
    counts = src.feeder_counters()
    assert counts["retries"] >= server.failed - 2 and counts["retries_exhausted"] == 0, counts
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "retry 1 of 5" in r.getMessage()]
    assert debug and all(re.search(r"SLOW_DOWN|SERVICE_UNAVAILABLE|HTTP status 503", m) for m in debug), debug
    assert any(f"s3://{bucket}/data/" in m and "row group" in m for m in debug), debug  # naming what was read
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "retried" in r.getMessage()]
    assert info and re.search(r"\d+ transient storage failure\(s\) retried", info[-1])
    # per worker: the fetchers' own (and the readahead's on their behalf), not the creation's
    workers = src.feeder_counters([0, 1, 2])["retries"]
    assert 0 < workers <= counts["retries"]


def test_failures_beyond_the_retries_are_fetch_errors_that_max_fetch_errors_may_tolerate(s3):
    server, fs, bucket = s3
    dataset(fs, bucket, files=1, rows=50)
    src = ParquetSource(f"{bucket}/data", filesystem=fs, retries=1, readahead=0)
    tolerant = ParquetSource(f"{bucket}/data", filesystem=fs, retries=0, readahead=0)
    server.faults(next=10**6, methods={"GET"})  # every GET fails from now on: footers were read already
    t0 = time.monotonic()
    with pytest.raises(feeder.FetchError) as info:
        consume(src, workers=1)
    assert time.monotonic() - t0 < 10
    cause = info.value.__cause__
    assert isinstance(cause, OSError) and "f0.parquet', row group" in str(cause), cause
    assert src.feeder_counters()["retries_exhausted"] >= 1
    # tolerated: every unit skipped, counted as fetch errors, the source ends
    server.faults(next=10**6, methods={"GET"})
    got, _ = consume(tolerant, workers=1, max_fetch_errors=10)
    assert got == [] and tolerant.feeder_counters()["retries_exhausted"] == 5


def test_permanent_failures_are_not_retried(s3):
    server, fs, bucket = s3
    dataset(fs, bucket, files=2)
    server.deny = {"/f1.parquet"}
    t0 = time.monotonic()
    with pytest.raises(OSError, match="ACCESS_DENIED|AccessDenied|Access Denied|403"):
        ParquetSource(f"{bucket}/data", filesystem=fs)
    assert time.monotonic() - t0 < 2.0  # no backoff: a denial is not retried
    server.deny = set()
    src = ParquetSource(f"{bucket}/data", filesystem=fs, readahead=0)
    src.feeder_validate(("id",), None)
    src.feeder_bind(SourceBinding("train", ((0,),), ("id",), True, None))
    try:
        fs.delete_file(f"{bucket}/data/f0.parquet")
        with pytest.raises(feeder.InputValidationError, match="cannot be read any more .*FileNotFoundError"):
            src(0, 4)
        assert src.feeder_counters()["retries"] == 0
    finally:
        src.feeder_release()


def test_transient_and_permanent_failures_are_told_apart():
    assert is_transient(OSError("When reading information for key 'a' in bucket 'b': AWS Error SLOW_DOWN "
                                "during HeadObject operation: Please reduce your request rate."))
    assert is_transient(OSError("AWS Error UNKNOWN (HTTP status 503) during GetObject operation"))
    assert is_transient(OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curl code 56, "
                                "Failure when receiving data from the peer"))
    assert is_transient(TimeoutError("timed out")) and is_transient(ConnectionResetError(104, "reset"))
    assert not is_transient(OSError("AWS Error ACCESS_DENIED during GetObject operation: Access Denied"))
    assert not is_transient(OSError("AWS Error UNKNOWN (HTTP status 403) during HeadObject operation"))
    assert not is_transient(FileNotFoundError(2, "Path does not exist"))
    assert not is_transient(ValueError("Parquet magic bytes not found in footer"))
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError("AWS Error SLOW_DOWN during GetObject operation")
        return "ok"

    seen = []
    assert retrying(flaky, "a test", Retry(attempts=3, backoff_s=0.001), lambda e, k, w: seen.append(k)) == "ok"
    assert seen == [0, 1]
    calls.clear()
    with pytest.raises(OSError, match="SLOW_DOWN"):
        retrying(flaky, "a test", Retry(attempts=1, backoff_s=0.001))
    assert len(calls) == 2
    waits = [Retry().wait_s(k) for k in range(8)]
    assert all(0.05 <= w <= 5.0 for w in waits) and waits[-1] >= 2.5


@pytest.mark.slow  # 24 requests of 0.1 s one at a time, to time against
# ---- latency hidden: readahead -----------------------------------------------------------------------------
def test_readahead_keeps_many_requests_in_flight_and_its_threads_end_at_stop(s3):
    server, fs, bucket = s3
    n = dataset(fs, bucket, files=2, rows=120, row_group_size=10)  # 24 row groups
    server.delay_s = 0.1

    def timed(readahead):
        src = ParquetSource(f"{bucket}/data", filesystem=fs, readahead=readahead)
        t0 = time.monotonic()
        got, _ = consume(src, workers=1)
        assert sorted(ids_of(got).tolist()) == list(range(n))
        return time.monotonic() - t0

    slow, fast = timed(0), timed(12)
    assert fast < slow / 2.5, (slow, fast)  # one request at a time, against about a dozen
    assert not readahead_threads()


def test_readahead_is_bounded_in_bytes_and_its_threads_are_named_for_the_source(s3):
    server, fs, bucket = s3
    n = dataset(fs, bucket, files=1, rows=100, row_group_size=10)
    src = ParquetSource(f"{bucket}/data", filesystem=fs, readahead=8, readahead_bytes=1)
    src.feeder_validate(("id", "x"), None)
    src.feeder_bind(SourceBinding("scores", ((0,),), ("id", "x"), False, None))
    try:
        got = [src(0, 4) for _ in range(3)]
        names = {t.name for t in readahead_threads()}
        assert names == {f"feeder:scores:readahead-{k}" for k in range(8)}, names
        assert src._pool is not None and src._pool.reserved <= max(src._unit_bytes)  # one unit held at most
        assert [g[0].tolist() for g in got] == [list(range(k * 10, k * 10 + 10)) for k in range(3)]
    finally:
        src.feeder_release()
    assert not readahead_threads()
    # a fetch still under way after stop() (the coordinator signals, then releases) starts no pool
    assert len(src(0, 4)[0]) == 10 and not readahead_threads()
    assert n == 100


def test_a_source_of_objects_in_worker_processes_reads_every_row_once(s3):
    _, fs, bucket = s3
    n = dataset(fs, bucket)
    got, _ = consume(ParquetSource(f"{bucket}/data", filesystem=fs, shuffle=True, epochs=2), processes=2,
                     inputs=("id", "name"))
    assert Counter(ids_of(got).tolist()) == Counter({i: 2 for i in range(n)})
    assert all(b["name"].tolist() == [f"row{i}" for i in b["id"]] for b in got)


def test_feeder_counters_before_anything_ran_and_bad_options(s3):
    _, fs, bucket = s3
    dataset(fs, bucket, files=1)
    src = ParquetSource(f"{bucket}/data", filesystem=fs)
    assert src.feeder_counters() == {"retries": 0.0, "retries_exhausted": 0.0}
    assert src.feeder_counters([0, 1]) == {"retries": 0.0, "retries_exhausted": 0.0}
    for bad, err in (({"retries": -1}, ValueError), ({"retries": 1.5}, TypeError), ({"readahead": -2}, ValueError),
                     ({"readahead_bytes": 0}, ValueError), ({"readahead": True}, TypeError)):
        with pytest.raises(err):
            ParquetSource(f"{bucket}/data", filesystem=fs, **bad)


def test_resolve_names_what_it_cannot_open(tmp_path):
    store, path = resolve(tmp_path)
    assert store.local and path == str(tmp_path)
    store, path = resolve(f"file://{tmp_path}")
    assert store.local and path == str(tmp_path)
    with pytest.raises(TypeError):
        resolve(3)


# ---- feeder.predict to an object store ------------------------------------------------------------------
onnx = pytest.importorskip("onnx")
from models import linear_model, session  # noqa: E402

from feeder.scoring.storeout import LEASE_NAME, MANIFEST_NAME  # noqa: E402


def features(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)


def write_features(fs, path, x, ids, row_group_size=100):
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 4),
                             "id": pa.array(ids)}), path, filesystem=fs, row_group_size=row_group_size)


def objects(fs, prefix):
    return sorted(i.path.rsplit("/", 1)[-1] for i in fs.get_file_info(pafs.FileSelector(prefix, allow_not_found=True)))


def manifest(fs, prefix):
    """The manifest, read as a reader must while a call may replace it: pyarrow reads an object with
    a HEAD and then a GET, so a manifest replaced between the two reads short; read it again."""
    for _attempt in range(20):
        with fs.open_input_stream(f"{prefix}/{MANIFEST_NAME}") as f:
            raw = f.read()
        try:
            return json.loads(raw.decode())
        except ValueError:
            time.sleep(0.01)
    raise AssertionError(f"{prefix}/{MANIFEST_NAME} never parsed: {raw[:200]!r}")


def committed_table(fs, prefix):
    """The output as a reader should read it: the parts the manifest lists."""
    m = manifest(fs, prefix)
    tables = [pq.read_table(f"{prefix}/{p['file']}", filesystem=fs) for p in m["parts"]]
    return pa.concat_tables(tables) if tables else None, m


def test_predict_from_and_to_s3_every_row_once_with_a_manifest_and_success(s3):
    _, fs, bucket = s3
    n = 1500
    x = features(n)
    write_features(fs, f"{bucket}/in/a.parquet", x[:700], np.arange(700))
    write_features(fs, f"{bucket}/in/b.parquet", x[700:], np.arange(700, n))
    sess = session(linear_model())
    src = ParquetSource(f"{bucket}/in", filesystem=fs, shuffle=True)
    result = feeder.predict(sess, src, f"{bucket}/out", filesystem=fs, keep=["id"], rows_per_file=400,
                            replicas=2, progress=False)
    assert (result.rows, result.rows_computed, len(result.files)) == (n, n, 4)
    assert all(re.fullmatch(rf"s3://{bucket}/out/part-0000\d-[0-9a-f]{{8}}\.parquet", f) for f in result.files)
    names = objects(fs, f"{bucket}/out")
    assert names == sorted([f.rsplit("/", 1)[-1] for f in result.files] + [MANIFEST_NAME, "_SUCCESS"]), names
    table, m = committed_table(fs, f"{bucket}/out")
    assert m["complete"] is True and m["rows"] == n and m["source"]["rows_delivered"] == n
    assert [f"s3://{bucket}/out/{p['file']}" for p in m["parts"]] == result.files
    order = np.argsort(table["id"].to_numpy())
    np.testing.assert_array_equal(table["id"].to_numpy()[order], np.arange(n))
    y = np.stack(table["y"].to_numpy(zero_copy_only=False))[order]
    np.testing.assert_allclose(y, sess.run(None, {"x": x})[0], rtol=1e-6, atol=1e-6)
    # finished: returns at once, touching nothing
    again = feeder.predict(sess, ParquetSource(f"{bucket}/in", filesystem=fs, shuffle=True), f"{bucket}/out",
                           filesystem=fs, keep=["id"], progress=False)
    assert (again.rows, again.rows_computed, again.files) == (n, 0, result.files)
    # the output is inside the input: refused, by URI
    with pytest.raises(ValueError, match=rf"output 's3://{bucket}/in/scores' is inside the input folder "
                                         rf"'s3://{bucket}/in'"):
        feeder.predict(sess, ParquetSource(f"{bucket}/in", filesystem=fs), f"{bucket}/in/scores", filesystem=fs,
                       keep=["id"], progress=False)


def test_predict_to_s3_refuses_other_data_and_foreign_objects_and_overwrite_starts_afresh(s3, monkeypatch):
    server, fs, bucket = s3
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    n = 600
    x = features(n)
    write_features(fs, f"{bucket}/in/a.parquet", x, np.arange(n))
    out = f"s3://{bucket}/out"
    sess = session(linear_model())
    first = feeder.predict(sess, ParquetSource(f"s3://{bucket}/in"), out, keep=["id"], rows_per_file=250,
                           progress=False)
    write_features(fs, f"{bucket}/in/a.parquet", x * 2, np.arange(n))  # other data: another ETag
    with pytest.raises(ValueError, match=rf"written from another source definition or model: source files: 1 "
                                         rf"file\(s\) changed \(.*\): 's3://{bucket}/in/a\.parquet'"):
        feeder.predict(sess, ParquetSource(f"s3://{bucket}/in"), out, keep=["id"], progress=False)
    again = feeder.predict(sess, ParquetSource(f"s3://{bucket}/in"), out, keep=["id"], overwrite=True,
                           progress=False)
    assert again.rows_computed == n and not set(again.files) & set(first.files)
    assert sorted(objects(fs, f"{bucket}/out")) == sorted([f.rsplit("/", 1)[-1] for f in again.files]
                                                          + [MANIFEST_NAME, "_SUCCESS"])
    write_bytes(fs, f"{bucket}/other/notes.txt", b"mine")
    with pytest.raises(ValueError, match=r"holds objects that feeder.predict did not write \(\['notes.txt'\]\)"):
        feeder.predict(sess, ParquetSource(f"s3://{bucket}/in"), f"s3://{bucket}/other", keep=["id"],
                       progress=False)
    assert objects(fs, f"{bucket}/other") == ["notes.txt"]


class SlowArrays(feeder.sources.ArraySource):
    """An ArraySource whose reads take ``unit_s`` seconds each (module-level: picklable)."""

    def __init__(self, *args, unit_s=0.05, **kw):
        super().__init__(*args, **kw)
        self.unit_s = unit_s

    def _read(self, unit, rows, worker_id):
        time.sleep(self.unit_s)
        return super()._read(unit, rows, worker_id)


def test_a_second_call_takes_an_s3_output_over_and_the_first_stops_at_its_next_commit(s3):
    _, fs, bucket = s3
    n = 3000
    arrays = {"x": features(n), "id": np.arange(n)}
    sess = session(linear_model())
    errors = []

    def first():
        try:
            feeder.predict(sess, SlowArrays(arrays, block_rows=100, unit_s=0.05), f"{bucket}/out", filesystem=fs,
                           keep=["id"], rows_per_file=200, replicas=1, num_worker_threads=1, progress=False)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and MANIFEST_NAME not in objects(fs, f"{bucket}/out") or \
            not manifest(fs, f"{bucket}/out")["parts"]:
        time.sleep(0.02)
    second = feeder.predict(sess, SlowArrays(arrays, block_rows=100, unit_s=0.0), f"{bucket}/out", filesystem=fs,
                            keep=["id"], rows_per_file=200, progress=False)
    t.join(60)
    assert not t.is_alive()
    assert errors and isinstance(errors[0], feeder.FeederError) and "took over" in str(errors[0]), errors
    table, m = committed_table(fs, f"{bucket}/out")
    assert m["complete"] and second.rows == n
    assert sorted(table["id"].to_numpy().tolist()) == list(range(n))
    assert LEASE_NAME not in objects(fs, f"{bucket}/out")


CHILD = r'''
import os, signal, sys, time
import numpy as np
import feeder
from feeder.sources import ArraySource

UNIT_S = float(sys.argv[4])


class SlowSource(ArraySource):
    def _read(self, unit, rows, worker_id):
        time.sleep(UNIT_S)
        return super()._read(unit, rows, worker_id)


out, model, die = sys.argv[1], sys.argv[2], sys.argv[3]
n = 6000
x = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)
src = SlowSource({"x": x, "id": np.arange(n)}, shuffle=True, seed=1, block_rows=97)
if die != "no":  # die at the k-th call of a method, before or after it: inside a commit
    import importlib
    where, k, when = die.split(":")
    module, cls, name = where.rsplit(".", 2)
    owner = getattr(importlib.import_module(module), cls)
    real = getattr(owner, name)
    k = int(k)
    calls = [0]

    def dying(*args, **kw):
        calls[0] += 1
        if calls[0] == k and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        got = real(*args, **kw)
        if calls[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return got

    setattr(owner, name, dying)
r = feeder.predict(model, src, out, batch_size=16, keep=["id"], rows_per_file=250, replicas=2, progress=False)
print("RESULT", r.rows, r.rows_computed, flush=True)
'''


@pytest.mark.slow
def test_predict_to_s3_killed_at_random_points_then_resumed_writes_every_row_once(s3, tmp_path):
    server, fs, bucket = s3
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "m.onnx").write_bytes(linear_model())
    prefix = f"{bucket}/out"
    env = dict(os.environ, **server.env())
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])
    rng = random.Random(20261126)

    def child(die="no", unit_s=0.05):
        return subprocess.Popen([sys.executable, str(tmp_path / "child.py"), f"s3://{prefix}", str(tmp_path / "m.onnx"),
                                 die, str(unit_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def check():
        """After a kill: the manifest reads, its parts exist whole, it is not complete, no _SUCCESS,
        and its source state covers exactly the rows of its parts."""
        m = manifest(fs, prefix)
        assert m["complete"] is False and "_SUCCESS" not in objects(fs, prefix)
        for p in m["parts"]:
            assert fs.get_file_info(f"{prefix}/{p['file']}").size == p["bytes"]
            assert pq.read_metadata(f"{prefix}/{p['file']}", filesystem=fs).num_rows == p["rows"]
        assert m["source"]["rows_delivered"] == m["rows"] == sum(p["rows"] for p in m["parts"])
        return m["rows"]

    committed = []
    store = "feeder.storage.FileSystemStore.write_bytes"  # the lease, manifests and the marker are put with it
    # inside commits: while a part uploads (it never appears), after a manifest is put, before one is
    # put (the part it would list is complete, and unlisted)
    for die in (f"feeder.scoring.storeout.StoreOutput.publish_part:{rng.randint(1, 4)}:before",
                f"{store}:{rng.randint(3, 6)}:after", f"{store}:{rng.randint(3, 6)}:before"):
        p = child(die)
        _, err = p.communicate(timeout=120)
        assert p.returncode == -signal.SIGKILL, err
        committed.append(check())
    # a part uploaded and never committed is there now, unlisted: a reader of the manifest never sees it
    listed = {p["file"] for p in manifest(fs, prefix)["parts"]}
    assert [o for o in objects(fs, prefix) if o.startswith("part-") and o not in listed]
    for _ in range(2):  # from outside, at random moments once a run is under way
        before = committed[-1]
        p = child(unit_s=0.2)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p.poll() is None and manifest(fs, prefix)["rows"] <= before:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))
        p.kill()
        _, err = p.communicate(timeout=30)
        assert p.returncode == -signal.SIGKILL, f"the run ended before it was killed: {err}"
        committed.append(check())
    assert committed[-1] > 0
    p = child()
    stdout, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    rows, computed = map(int, stdout.split("RESULT")[1].split())
    assert rows == 6000 and computed == 6000 - committed[-1] < 6000
    table, m = committed_table(fs, prefix)
    assert m["complete"] is True and "_SUCCESS" in objects(fs, prefix)
    assert sorted(table["id"].to_numpy().tolist()) == list(range(6000))  # every row exactly once
    parts = sorted(o for o in objects(fs, prefix) if o.startswith("part-"))
    assert parts == sorted(p["file"] for p in m["parts"])  # what no commit covered was deleted
    x = np.random.default_rng(0).standard_normal((6000, 4)).astype(np.float32)
    order = np.argsort(table["id"].to_numpy())
    y = np.stack(table["y"].to_numpy(zero_copy_only=False))[order]
    np.testing.assert_allclose(y, session(linear_model()).run(None, {"x": x})[0], rtol=1e-6, atol=1e-6)


def test_the_command_line_reads_and_writes_s3_with_an_endpoint(s3, tmp_path):
    server, fs, bucket = s3
    n = 500
    x = features(n)
    write_features(fs, f"{bucket}/in/a.parquet", x, np.arange(n))
    (tmp_path / "m.onnx").write_bytes(linear_model())
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({k: v for k, v in server.env().items() if k != "AWS_ENDPOINT_URL"})  # the endpoint: the option
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "feeder", "predict", str(tmp_path / "m.onnx"), f"s3://{bucket}/in",
           f"s3://{bucket}/out", "--keep", "id", "--s3-endpoint", f"http://{server.endpoint}", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{n} rows written, {n} computed, "), done.stdout
    table, m = committed_table(fs, f"{bucket}/out")
    assert m["complete"] and sorted(table["id"].to_numpy().tolist()) == list(range(n))
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0 and again.stdout.startswith(f"{n} rows written, 0 computed"), again.stderr
    bad = subprocess.run(cmd[:-3] + ["--s3-endpoint", "127.0.0.1:1", "--no-progress"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "an S3 endpoint is an http:// or https:// URL" in bad.stderr, bad.stderr


@pytest.mark.slow  # the example end to end
def test_the_object_store_example_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "object_store.py"), "--rows", "20000"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "read 20,000 rows from s3://example-bucket/table" in done.stdout, done.stdout
    assert "scored 20,000 rows into 1 part(s)" in done.stdout, done.stdout
    assert os.listdir(tmp_path) == []
