"""Object stores under faults (issue 34, items 13-21): a local S3 server (moto, tests/s3server.py)
answering chosen requests with 5xx, 403, 404, delays or hangs, and counting every request.

What is checked: a refused predict call changes nothing; a takeover leaves nothing beside
``_SUCCESS`` but the manifest's rows; a replaced object is an InputValidationError whatever the
filesystem (pyarrow's or s3fs) and whatever its size; one bounded retry layer (requests and seconds
counted), its first failure said at once; Ctrl-C ends a call whose store hangs; a list of objects
starts like a prefix; a finished output is not HEADed part by part; messages and exit codes say
what happened in plain words."""
from __future__ import annotations

import json
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import feeder
from feeder.errors import FetchError, InputValidationError
from feeder.storage import Retry, SharedCheck, plain_error, resolve, retrying

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pafs = pytest.importorskip("pyarrow.fs")
pytest.importorskip("onnx")

from models import linear_model, session  # noqa: E402
from s3server import S3Server, moto_available, s3fs_available  # noqa: E402

from feeder.scoring import cli  # noqa: E402
from feeder.scoring.storeout import LEASE_NAME, MANIFEST_NAME, OutputTakenOver, StoreOutput  # noqa: E402
from feeder.sources import ArraySource, ParquetSource  # noqa: E402
from feeder.storage import store_of  # noqa: E402

pytestmark = pytest.mark.skipif(not moto_available(), reason="needs moto[server] (the test extra)")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
WRITES = {"PUT", "POST", "DELETE"}


@pytest.fixture(scope="module")
def server():
    s = S3Server().start()
    yield s
    s.stop()


@pytest.fixture
def s3(server, monkeypatch):
    """The server without faults, its log empty, the environment pointing ``s3://`` URIs at it, a
    filesystem that does not retry by itself (every fault reaches feeder) and a fresh bucket."""
    server.clear()
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    fs = server.filesystem(retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
    bucket = "b" + uuid.uuid4().hex[:12]
    fs.create_dir(bucket)
    server.reset_log()
    yield server, fs, bucket
    server.clear()


def features(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)


def write_features(fs, path, x, ids, row_group_size=100):
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 4),
                             "id": pa.array(ids)}), path, filesystem=fs, row_group_size=row_group_size)


def objects(fs, prefix):
    return sorted(i.path.rsplit("/", 1)[-1] for i in fs.get_file_info(pafs.FileSelector(prefix, allow_not_found=True)))


def manifest(fs, prefix):
    """The manifest, read again while a call replaces it (a HEAD then a GET may read it short)."""
    for _attempt in range(20):
        try:
            with fs.open_input_stream(f"{prefix}/{MANIFEST_NAME}") as f:
                return json.loads(f.read().decode())
        except (ValueError, FileNotFoundError):
            time.sleep(0.01)
    raise AssertionError(f"{prefix}/{MANIFEST_NAME} never parsed")


class SlowArrays(ArraySource):
    """An ArraySource whose reads take ``unit_s`` seconds each (module-level: picklable)."""

    def __init__(self, *args, unit_s=0.05, **kw):
        super().__init__(*args, **kw)
        self.unit_s = unit_s

    def _read(self, unit, rows, worker_id):
        time.sleep(self.unit_s)
        return super()._read(unit, rows, worker_id)


def env_for_children(server):
    env = dict(os.environ, **server.env())
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])
    return env


def run_first(fs, prefix, arrays, errors, model=None, **kw):
    """feeder.predict in a thread (slowly: 0.05 s a unit of 100 rows), failures into ``errors``."""
    def first():
        try:
            feeder.predict(model or session(linear_model()), SlowArrays(arrays, block_rows=100, unit_s=0.05),
                           prefix, filesystem=fs, keep=["id"], rows_per_file=200, replicas=1,
                           num_worker_threads=1, progress=False, **kw)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    return t


def wait_for(condition, timeout=30.0, what="a condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def committed(fs, prefix):
    return MANIFEST_NAME in objects(fs, prefix) and bool(manifest(fs, prefix)["parts"])


# ---- 13: a refused call changes nothing ------------------------------------------------------------
def test_a_refused_second_call_changes_nothing_and_the_running_call_finishes(s3):
    server, fs, bucket = s3
    n, prefix = 3000, f"{bucket}/out"
    arrays = {"x": features(n), "id": np.arange(n)}
    errors = []
    t = run_first(fs, prefix, arrays, errors)
    wait_for(lambda: committed(fs, prefix), what="the first call's first commit")
    server.reset_log()
    other = session(linear_model(seed=1))  # another model: refused, by name
    with pytest.raises(ValueError, match="written from another source definition or model"):
        feeder.predict(other, ArraySource(arrays, block_rows=100), prefix, filesystem=fs, keep=["id"],
                       rows_per_file=200, progress=False)
    lease_writes = server.log(WRITES, key=re.escape(LEASE_NAME))
    t.join(60)
    assert not t.is_alive() and not errors, errors  # the first call finished, not stopped
    assert not lease_writes, [(r.method, r.path) for r in lease_writes]  # the refused call put and deleted nothing
    m = manifest(fs, prefix)
    assert m["complete"] and m["rows"] == n and LEASE_NAME not in objects(fs, prefix)


def test_a_call_deletes_only_its_own_lease(s3):
    _, fs, bucket = s3
    store = store_of(fs)
    a, b = StoreOutput(store, f"{bucket}/out"), StoreOutput(store, f"{bucket}/out")
    a.open()
    a.acquire()
    b.open()
    b.acquire()  # b takes the output over
    a.close()    # a's lease is not there any more: b's is left alone
    assert json.loads(fs.open_input_stream(f"{bucket}/out/{LEASE_NAME}").read())["run"] == b.run
    with pytest.raises(OutputTakenOver):
        a._leased = True
        a.check_lease()
    b.close()
    assert LEASE_NAME not in objects(fs, f"{bucket}/out")


# ---- 14: a takeover leaves nothing but the manifest's rows -----------------------------------------
def test_a_takeover_leaves_exactly_the_manifests_rows_beside_success(s3, server):
    _, _, bucket = s3
    # The first call's filesystem waits a minute for an answer: its part's upload is held, not failed.
    slow_fs = server.filesystem(retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1), request_timeout=60)
    n, prefix = 3000, f"{bucket}/out"
    arrays = {"x": features(n), "id": np.arange(n)}
    errors = []
    # The first call's third part completes its upload only once released: the second call takes
    # the output over and finishes meanwhile, then the part lands beside its _SUCCESS.
    held = server.fault({"POST"}, key=r"/out/part-", query="uploadId", hang=True, times=1, after=2)
    t = run_first(slow_fs, prefix, arrays, errors)
    assert held.hit.wait(60), "the first call never completed its third part"
    second = feeder.predict(session(linear_model()), SlowArrays(arrays, block_rows=100, unit_s=0.0), prefix,
                            filesystem=s3[1],
                            keep=["id"], rows_per_file=200, progress=False)
    assert second.rows == n and "_SUCCESS" in objects(s3[1], prefix)
    held.release()
    t.join(60)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], OutputTakenOver), errors
    m = manifest(s3[1], prefix)
    table = pq.read_table(prefix, filesystem=s3[1])  # as the docs let a reader read it once _SUCCESS is there
    assert table.num_rows == m["rows"] == n, (table.num_rows, m["rows"])
    assert sorted(table["id"].to_numpy().tolist()) == list(range(n))
    # ... and the stopped call's message (on the command line) says what happened, once
    status = cli._exit_status(errors[0])
    line = cli._message(errors[0], status)
    assert status == 1 and line.count("feeder predict") == 1 and line.startswith("feeder predict: stopped: "), line
    assert "took over" in line and "run the same command again" not in line, line


# ---- 20: a finished output is not HEADed part by part ----------------------------------------------
def test_a_finished_output_returns_with_a_listing_not_a_head_per_part(s3):
    server, fs, bucket = s3
    n = 3000
    arrays = {"x": features(n), "id": np.arange(n)}
    sess = session(linear_model())
    first = feeder.predict(sess, ArraySource(arrays, block_rows=100), f"{bucket}/out", filesystem=fs, keep=["id"],
                           rows_per_file=100, progress=False)
    assert len(first.files) == 30
    server.reset_log()
    server.delay_s = 0.02
    t0 = time.monotonic()
    again = feeder.predict(sess, ArraySource(arrays, block_rows=100), f"{bucket}/out", filesystem=fs, keep=["id"],
                           rows_per_file=100, progress=False)
    took = time.monotonic() - t0
    assert (again.rows, again.rows_computed, again.files) == (n, 0, first.files)
    assert server.count("HEAD", key=r"/part-") == 0 and server.count() <= 8, \
        [(r.method, r.path) for r in server.requests]
    assert server.count(WRITES) == 0
    assert took < 30 * 0.02 + 2.0, took


def test_a_damaged_finished_output_is_still_found_damaged(s3):
    _, fs, bucket = s3
    n = 600
    arrays = {"x": features(n), "id": np.arange(n)}
    sess = session(linear_model())
    first = feeder.predict(sess, ArraySource(arrays, block_rows=100), f"{bucket}/out", filesystem=fs, keep=["id"],
                           rows_per_file=200, progress=False)
    fs.delete_file(first.files[1].split("://", 1)[1])
    with pytest.raises(ValueError, match=r"is damaged: its committed part part-00001-\w+\.parquet is missing"):
        feeder.predict(sess, ArraySource(arrays, block_rows=100), f"{bucket}/out", filesystem=fs, keep=["id"],
                       rows_per_file=200, progress=False)


# ---- 15, 16: a replaced object is an InputValidationError ------------------------------------------
def write_rows(fs, path, lo, hi, row_group_size=50, value=0.0):
    """A Parquet object of ids lo..hi and ``x = id / 2 + value``, whose size does not depend on the
    values (plain encoding, no compression, no statistics): replaced by one of the same size."""
    ids = np.arange(lo, hi, dtype=np.int64)
    pq.write_table(pa.table({"id": ids, "x": ids.astype(np.float64) / 2 + value}), path, filesystem=fs,
                   row_group_size=row_group_size, compression="none", use_dictionary=False, write_statistics=False)


def read_all(src, max_fetch_errors=0, workers=1, after=None):
    """Every batch of ``src`` until it ends or fails; ``after(batches)`` runs once, after the first."""
    coord = feeder.GlobalCoordinator(join_timeout=3.0)
    got = []
    try:
        feeder.init_data_input_workers(None, ["id", "x"], src, 50, num_worker_threads=workers, coordinator=coord,
                                       max_fetch_errors=max_fetch_errors)
        coord.start()
        feed = coord.feed("train")
        while True:
            try:
                got.append({k: v.copy() for k, v in feed.next_batch(timeout=30).items()})
            except StopIteration:
                return got, None
            except Exception as e:
                return got, e
            if after is not None and len(got) == 1:
                after(got)
    finally:
        coord.stop()


@pytest.mark.parametrize("readahead", [0, None])
def test_an_object_replaced_by_one_of_the_same_size_during_a_pass_is_refused(s3, readahead):
    server, fs, bucket = s3
    path = f"{bucket}/d/a.parquet"
    write_rows(fs, path, 0, 1000)
    size = fs.get_file_info(path).size
    src = ParquetSource(f"{bucket}/d", filesystem=fs, readahead=readahead, readahead_bytes=1)

    def replace(_):
        write_rows(fs, path, 0, 1000, value=1000.0)  # other values, the same size: another ETag
        assert fs.get_file_info(path).size == size

    got, err = read_all(src, max_fetch_errors=50, after=replace)
    assert isinstance(err, InputValidationError), err
    assert re.search(rf"'s3://{bucket}/d/a\.parquet' changed since the ParquetSource was created", str(err)), err
    for b in got:  # nothing of the new object was delivered
        np.testing.assert_array_equal(b["x"], b["id"] / 2)
    assert len(got) < 20


@pytest.mark.skipif(not s3fs_available(), reason="needs s3fs (the test extra)")
def test_with_s3fs_an_object_replaced_after_creation_is_refused_not_skipped(s3, server):
    _, fs, bucket = s3
    path = f"{bucket}/d/a.parquet"
    write_rows(fs, path, 0, 1000)
    write_rows(fs, f"{bucket}/d/b.parquet", 1000, 2000)
    s3fs_fs = server.s3fs()
    src = ParquetSource(f"{bucket}/d", filesystem=s3fs_fs)  # s3fs caches the listing, ETags included
    write_rows(fs, path, 0, 1200)  # replaced: another size and ETag
    got, err = read_all(src, max_fetch_errors=50)
    assert isinstance(err, InputValidationError), (err, sum(len(b["id"]) for b in got))
    assert f"'s3://{bucket}/d/a.parquet' changed since the ParquetSource was created" in str(err), err


@pytest.mark.skipif(not s3fs_available(), reason="needs s3fs (the test extra)")
def test_with_s3fs_an_object_replaced_during_a_pass_fails_its_if_match(s3, server):
    _, fs, bucket = s3
    path = f"{bucket}/d/a.parquet"
    write_rows(fs, path, 0, 1000)
    # small blocks: s3fs reads the object in many ranged GETs (not all of it at the first read)
    src = ParquetSource(f"{bucket}/d", filesystem=server.s3fs(default_block_size=2048), readahead=0)
    server.reset_log()
    got, err = read_all(src, max_fetch_errors=50, after=lambda _: write_rows(fs, path, 0, 1000, value=1000.0))
    assert isinstance(err, InputValidationError), err
    assert f"'s3://{bucket}/d/a.parquet' changed" in str(err), err
    for b in got:
        np.testing.assert_array_equal(b["x"], b["id"] / 2)
    # s3fs checks each ranged GET itself (If-Match on the ETag): no HEAD after each read
    assert server.count("HEAD", key="a.parquet") <= 3, server.count("HEAD", key="a.parquet")


def test_reading_an_unchanged_object_costs_one_check_per_read_at_most(s3):
    server, fs, bucket = s3
    for i in range(2):
        write_rows(fs, f"{bucket}/d/f{i}.parquet", i * 1000, (i + 1) * 1000, row_group_size=25)
    src = ParquetSource(f"{bucket}/d", filesystem=fs)  # readahead: 16 threads reading 80 row groups
    server.reset_log()
    got, err = read_all(src, workers=2)
    assert err is None and sorted(np.concatenate([b["id"] for b in got]).tolist()) == list(range(2000))
    gets, heads = server.count("GET", key=r"\.parquet"), server.count("HEAD", key=r"\.parquet")
    assert heads <= gets + 2, (heads, gets)  # at most one check per read (and one HEAD opening each object)


def test_a_shared_check_begins_after_each_caller_asked():
    checks = SharedCheck()
    calls, started = [], threading.Event()
    release = threading.Event()

    def slow():
        calls.append(time.monotonic())
        started.set()
        release.wait(5)
        return len(calls)

    results = []
    first = threading.Thread(target=lambda: results.append(checks.check("k", slow)))
    first.start()
    assert started.wait(5)
    asked_at = time.monotonic()
    later = [threading.Thread(target=lambda: results.append(checks.check("k", slow))) for _ in range(5)]
    for t in later:
        t.start()
    time.sleep(0.2)
    release.set()
    for t in [first] + later:
        t.join(5)
    assert len(calls) == 2 and calls[1] > asked_at  # the five asked during the first: one check, begun after
    assert sorted(results) == [1, 2, 2, 2, 2, 2]


# ---- 17: one retry layer, bounded, its first failure said at once ----------------------------------
def test_an_s3_uri_makes_one_attempt_per_request_and_feeder_retries_within_its_budget(s3, caplog):
    server, fs, bucket = s3
    write_rows(fs, f"{bucket}/d/a.parquet", 0, 100)
    server.reset_log()
    server.fault(status=503)  # every request
    caplog.set_level(logging.WARNING, logger="feeder")
    t0, wall0 = time.monotonic(), time.time()
    with pytest.raises(OSError, match="503") as info:
        ParquetSource(f"s3://{bucket}/d/")  # the default budget: 5 retries, about 3 s of waits at most
    took = time.monotonic() - t0
    assert server.count() == 6, [(r.method, r.path) for r in server.requests]  # 1 + 5, none by the SDK
    assert took < 3.1 + 3.0, took
    first = [r for r in caplog.records if r.levelno == logging.WARNING and "retrying" in r.getMessage()]
    assert len(first) == 1 and f"s3://{bucket}/d" in first[0].getMessage() and "503" in first[0].getMessage()
    assert first[0].created - wall0 < 1.0  # said at once, not after the retries
    assert info.value is not None


def test_a_read_while_every_request_fails_gives_up_after_feeders_retries_alone(s3):
    server, fs, bucket = s3
    write_rows(fs, f"{bucket}/d/a.parquet", 0, 200)
    src = ParquetSource(f"s3://{bucket}/d/", readahead=0)
    server.reset_log()
    server.fault(status=503)
    t0 = time.monotonic()
    got, err = read_all(src)
    took = time.monotonic() - t0
    assert isinstance(err, FetchError) and not got and "503" in str(err.__cause__), err
    assert server.count() == 6 and took < 3.1 + 3.0, (server.count(), took)  # 1 + 5 tries of one request


def test_a_hung_request_ends_at_its_time_out_and_is_retried_a_bounded_number_of_times(s3):
    server, fs, bucket = s3
    write_rows(fs, f"{bucket}/d/a.parquet", 0, 200)
    src = ParquetSource(f"s3://{bucket}/d/?request_timeout=0.5", retries=2, readahead=0)
    server.reset_log()
    server.fault({"GET"}, key=r"a\.parquet", hang=True)  # every read of a row group hangs
    t0 = time.monotonic()
    got, err = read_all(src)
    took = time.monotonic() - t0
    assert isinstance(err, FetchError) and not got, err
    assert "Timeout" in str(err.__cause__) or "timed out" in str(err.__cause__).lower(), err.__cause__
    assert took < 3 * 0.5 + 0.6 + 3.0, took  # three tries of 0.5 s, the waits between them
    assert server.count("GET", key=r"a\.parquet") == 3


def test_retries_stop_at_the_budget_whatever_the_attempts_left():
    calls = []

    def slow_failure():
        calls.append(time.monotonic())
        time.sleep(0.2)
        raise OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 28, Timeout was reached")

    t0 = time.monotonic()
    with pytest.raises(OSError, match="Timeout"):
        retrying(slow_failure, "a test", Retry(attempts=100, backoff_s=0.01, budget_s=1.0))
    assert 2 <= len(calls) <= 6 and time.monotonic() - t0 < 2.5, (len(calls), time.monotonic() - t0)
    assert Retry().about_s() == pytest.approx(3.1)


def test_the_filesystem_made_from_a_uri_keeps_its_retry_strategy_when_pickled(s3):
    server, fs, bucket = s3
    write_rows(fs, f"{bucket}/d/a.parquet", 0, 100)
    store, path = resolve(f"s3://{bucket}/d/a.parquet")
    copy = pickle.loads(pickle.dumps(store))  # as a worker process gets it
    server.reset_log()
    server.fault(status=503)
    with pytest.raises(OSError, match="503"):
        copy.fs.get_file_info(path)
    assert server.count() == 1  # one attempt: feeder's retries are the only ones


def test_a_mistyped_endpoint_is_said_within_seconds(tmp_path):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (tmp_path / "m.onnx").write_bytes(linear_model())
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1",
               AWS_EC2_METADATA_DISABLED="true",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "feeder", "predict", str(tmp_path / "m.onnx"), "s3://bkt/in",
                           str(tmp_path / "out"), "--s3-endpoint", f"http://127.0.0.1:{port}", "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=120)
    took = time.monotonic() - t0
    assert done.returncode == 1, done.stderr
    assert "retrying up to 5 times" in done.stderr and "s3://bkt/in" in done.stderr, done.stderr  # said at once
    assert "feeder predict: failed: cannot reach the store of 's3://bkt/in': is the endpoint right" in done.stderr, \
        done.stderr
    assert took < 20, took  # the budget (about 3 s of waits) and the start of Python and onnxruntime


# ---- 19: a list of objects starts up as a prefix does ----------------------------------------------
def test_a_list_of_object_uris_starts_like_the_prefix_holding_them(s3):
    server, fs, bucket = s3
    n = 60
    for i in range(n):
        pq.write_table(pa.table({"id": np.arange(i * 10, (i + 1) * 10)}), f"{bucket}/d/f{i:03d}.parquet",
                       filesystem=fs)
    uris = [f"s3://{bucket}/d/f{i:03d}.parquet" for i in range(n)]
    server.delay_s = 0.02  # each request 20 ms late, as a store's would be
    timings = {}
    for what, paths in (("prefix", f"s3://{bucket}/d/"), ("list", uris)):
        server.reset_log()
        t0 = time.monotonic()
        src = ParquetSource(paths)
        timings[what] = (time.monotonic() - t0, server.count())
        assert [f for f, _ in src.files] == uris and len(src) == n * 10
        assert len({id(s.fs) for s in src._stores}) == 1  # one client for every object
    (prefix_s, prefix_requests), (list_s, list_requests) = timings["prefix"], timings["list"]
    assert list_requests <= prefix_requests, timings  # a HEAD and a GET per object either way
    assert list_s < 2 * prefix_s + 0.5, timings  # listed concurrently: 60 requests one after another take 1.2 s+


# ---- 21: messages and exit codes -----------------------------------------------------------------
def cli_run(capsys, *args):
    """``feeder predict ARGS`` in this process: (exit status, stderr)."""
    status = cli.main([str(a) for a in args] + ["--no-progress"])
    return status, capsys.readouterr().err


@pytest.fixture
def scored(s3, tmp_path):
    """Input data in the bucket, and a model file."""
    _, fs, bucket = s3
    write_features(fs, f"{bucket}/in/a.parquet", features(600), np.arange(600))
    (tmp_path / "m.onnx").write_bytes(linear_model())
    return tmp_path / "m.onnx"


def test_a_transient_write_outage_exits_1_and_says_it_was_transient(s3, scored, capsys):
    server, fs, bucket = s3
    # every write to the output fails with 500 once the first part is committed
    outage = server.fault(WRITES - {"DELETE"}, key=f"/{bucket}/out/", status=500, after=9)
    t0 = time.monotonic()
    status, err = cli_run(capsys, scored, f"s3://{bucket}/in", f"s3://{bucket}/out", "--keep", "id",
                          "--rows-per-file", "100", "--replicas", "1")
    took = time.monotonic() - t0
    assert outage.applied >= 1
    assert status == 1, err
    assert err.startswith("feeder predict: failed: ") and "the store failed transiently" in err, err
    assert "run the same command again to continue" in err and err.count("feeder predict") == 1, err
    assert took < 3.1 + 10, took  # feeder's retries of one request, not the SDK's on top
    server.clear()
    status, err = cli_run(capsys, scored, f"s3://{bucket}/in", f"s3://{bucket}/out", "--keep", "id",
                          "--rows-per-file", "100", "--replicas", "1")
    assert status == 0, err
    assert manifest(fs, f"{bucket}/out")["rows"] == 600


@pytest.mark.parametrize("code", ["AccessDenied", "InvalidAccessKeyId"])
def test_access_denied_says_credentials_or_permissions_and_keeps_the_stores_error(s3, scored, capsys, code):
    server, fs, bucket = s3
    server.reset_log()
    server.fault(key=f"/{bucket}/in", status=403, code=code)
    status, err = cli_run(capsys, scored, f"s3://{bucket}/in", f"s3://{bucket}/out", "--keep", "id")
    assert status == 2, err
    assert f"feeder predict: error: access denied to 's3://{bucket}/in'" in err, err
    assert "credentials" in err and "permission" in err and "AWS_ACCESS_KEY_ID" in err, err
    with pytest.raises(PermissionError, match="access denied") as info:
        ParquetSource(f"s3://{bucket}/in")
    assert "ACCESS_DENIED" in str(info.value.__cause__) or "403" in str(info.value.__cause__)
    assert server.count(WRITES) == 0


def test_a_missing_output_bucket_is_named(s3, scored, capsys):
    server, fs, bucket = s3
    status, err = cli_run(capsys, scored, f"s3://{bucket}/in", "s3://no-such-bucket-here/out", "--keep", "id")
    assert status == 2, err
    assert "feeder predict: error: output 's3://no-such-bucket-here/out': the bucket 'no-such-bucket-here' does " \
           "not exist" in err, err
    with pytest.raises(FileNotFoundError, match="the bucket 'no-such-bucket-here' does not exist"):
        ParquetSource("s3://no-such-bucket-here/in")


def test_plain_errors_name_what_to_do():
    denied = OSError("When getting information for key 'k' in bucket 'b': AWS Error ACCESS_DENIED during HeadObject "
                     "operation: No response body.")
    got = plain_error(denied, "s3://b/k")
    assert isinstance(got, PermissionError) and "credentials" in str(got) and "permission" in str(got)
    gone = OSError("When initiating multiple part upload for key 'out/_feeder_predict.lease' in bucket 'nob': AWS "
                   "Error NO_SUCH_BUCKET during CreateMultipartUpload operation: The specified bucket does not exist")
    assert str(plain_error(gone, "s3://nob/out/x")).startswith("the bucket 'nob' does not exist")
    refused = OSError("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 7, Could not connect to "
                      "server")
    assert isinstance(plain_error(refused, "s3://b/k"), ConnectionError)
    assert plain_error(OSError("AWS Error UNKNOWN (HTTP status 503)"), "s3://b/k") is None
    assert plain_error(ValueError("not a store's"), "s3://b/k") is None


def test_schemes_are_case_insensitive(s3):
    _, fs, bucket = s3
    write_rows(fs, f"{bucket}/d/a.parquet", 0, 100)
    src = ParquetSource(f"S3://{bucket}/d/")
    assert src.files[0][0] == f"s3://{bucket}/d/a.parquet" and len(src) == 100
    store, path = resolve(f"S3://{bucket}/d/a.parquet", fs)
    assert path == f"{bucket}/d/a.parquet"


# ---- 18: Ctrl-C while the store stops answering writes ---------------------------------------------
def start_cli_then_hang_writes(server, fs, bucket, tmp_path):
    """``feeder predict`` in a child process writing to the server (its S3 client waiting up to a
    minute for a stalled request); once it has committed a part, every write to the output hangs.
    Returns the child, once one of its writes hangs."""
    n = 200_000
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(features(n).reshape(-1)), 4),
                             "id": pa.array(np.arange(n))}), tmp_path / "in.parquet", row_group_size=1000)
    (tmp_path / "m.onnx").write_bytes(linear_model())
    server.delay_s = 0.005
    child = subprocess.Popen([sys.executable, "-m", "feeder", "predict", str(tmp_path / "m.onnx"),
                              str(tmp_path / "in.parquet"), f"s3://{bucket}/out?request_timeout=60", "--keep", "id",
                              "--rows-per-file", "1000", "--replicas", "1", "--no-progress"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for_children(server))
    try:
        wait_for(lambda: child.poll() is not None or committed(fs, f"{bucket}/out"), 60, "the child's first commit")
        assert child.poll() is None, child.communicate()
        hang = server.fault(WRITES, key=f"/{bucket}/out/", hang=True)
        assert hang.hit.wait(30), "the child wrote nothing more"
    except BaseException:
        child.kill()
        child.communicate()
        raise
    return child


@pytest.mark.slow
def test_ctrl_c_ends_a_call_whose_store_hangs_within_its_cleanup_deadline(s3, tmp_path):
    server, fs, bucket = s3
    child = start_cli_then_hang_writes(server, fs, bucket, tmp_path)
    t0 = time.monotonic()
    child.send_signal(signal.SIGINT)
    try:
        _, err = child.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise AssertionError(f"still running {time.monotonic() - t0:.0f} s after Ctrl-C") from None
    took = time.monotonic() - t0
    assert child.returncode == 130, err
    assert "feeder predict: interrupted; run the same command again to continue" in err, err
    assert took < 20, took  # the part's upload given up after 5 s, the lease's deletion after 5 s


@pytest.mark.slow
def test_a_second_ctrl_c_ends_the_process_at_once(s3, tmp_path):
    server, fs, bucket = s3
    child = start_cli_then_hang_writes(server, fs, bucket, tmp_path)
    child.send_signal(signal.SIGINT)
    time.sleep(1.0)  # the cleanup is under way, waiting on the store
    t0 = time.monotonic()
    child.send_signal(signal.SIGINT)
    try:
        _, err = child.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise AssertionError("a second Ctrl-C did not end the process") from None
    assert child.returncode == 130, err
    assert time.monotonic() - t0 < 3.0
    assert "interrupted again; exiting without waiting for the cleanup" in err, err
