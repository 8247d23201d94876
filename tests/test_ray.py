"""RayDataSource: on a local Ray instance (one per test session) and on a simulated 2-node cluster.

The local instance is ``ray.init(num_cpus=2)``, started by the first test that needs it and shut
down at the end of the session. The cluster tests run ``tests/ray_cluster_run.py`` in a
subprocess (a process holds one Ray connection). Everything is skipped, with the reason, only
where ray cannot be imported; ``.ci/run`` installs it (the ``test`` extra).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import feeder

pytestmark = pytest.mark.ray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ray_or_skip():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        pytest.skip(f"ray[data] cannot be imported ({e}); pip install 'onnx-feeder[ray]'")
    return ray


@pytest.fixture(scope="session")
def ray_local():
    ray = ray_or_skip()
    import logging

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    yield ray
    ray.shutdown()


def pipeline(ray, rows=1000, blocks=10, fn=None, **remote_args):
    """range(rows) -> map_batches: x = id repeated 4 times (float32), k = id."""
    def prep(batch):
        ids = batch["id"]
        if fn is not None:
            fn(ids)
        return {"x": (ids[:, None] * np.ones(4)).astype(np.float32), "k": ids}
    return ray.data.range(rows, override_num_blocks=blocks).map_batches(prep, **remote_args)


def consume_all(feeds, timeout=60.0):
    """Drain every feed in its own thread until StopIteration; returns keys per feed and errors."""
    keys = [[] for _ in feeds]
    errors = [None] * len(feeds)

    def run(i):
        try:
            for batch in feeds[i]:
                assert np.array_equal(batch["x"][:, 0], batch["k"].astype(np.float32))
                keys[i].append(batch["k"].copy())
        except BaseException as e:
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(feeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a consumer hung"
    return [np.concatenate(k) if k else np.zeros(0, np.int64) for k in keys], errors


# ---- without Ray -------------------------------------------------------------------------------
def test_importing_feeder_and_its_sources_never_imports_ray():
    code = ("import sys, feeder, feeder.sources, feeder.sources.ray; from feeder.sources import RayDataSource; "
            "assert 'ray' not in sys.modules, 'ray was imported'; assert 'pyarrow' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_without_ray_creating_the_source_says_what_to_install():
    code = ("import sys; sys.modules['ray'] = None\n"
            "from feeder.sources import RayDataSource\n"
            "try:\n    RayDataSource(object())\nexcept ImportError as e:\n    print('MSG', e)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60, capture_output=True,
                         text=True).stdout
    assert "MSG" in out and "pip install 'onnx-feeder[ray]'" in out, out


# ---- local instance ----------------------------------------------------------------------------
def test_two_replicas_get_every_row_once(ray_local, coord):
    from feeder.sources import RayDataSource

    source = RayDataSource(pipeline(ray_local, rows=2000, blocks=16))
    for _ in range(2):
        feeder.init_data_input_workers(None, ["x", "k"], source, batch_size=64, num_worker_threads=2,
                                       input_source_name="ray", coordinator=coord, timeout=60)
    coord.start()
    keys, errors = consume_all(coord.feeds("ray"))
    assert errors == [None, None]
    every = np.concatenate(keys)
    assert np.array_equal(np.sort(every), np.arange(2000))  # every row once: none lost, none twice
    # each replica ends with at most one short batch
    assert all(len(k) > 0 for k in keys)


def test_map_and_filter_run_in_the_fetch_path_and_count_the_filtered(ray_local, coord):
    """No row keys here, but the functions run where the fetch runs, see every column of the
    dataset (columns=None), and the filtered rows are counted."""
    from feeder.sources import RayDataSource

    seen = []

    def fn(d):
        seen.append(sorted(d))
        return {"x": d["x"] * 2, "k": d["k"]}

    source = RayDataSource(pipeline(ray_local, rows=1000, blocks=8)).filter(lambda d: d["k"] % 4 != 0).map(fn)
    feeder.init_data_input_workers(None, ["x", "k"], source, batch_size=64, num_worker_threads=2,
                                   input_source_name="ray", coordinator=coord, timeout=60)
    with coord:
        feed = coord.feed("ray")
        got = [(b["x"].copy(), b["k"].copy()) for b in feed]
        m = feed.metrics()
    k = np.concatenate([g[1] for g in got])
    assert sorted(k.tolist()) == [i for i in range(1000) if i % 4]
    np.testing.assert_array_equal(np.concatenate([g[0] for g in got])[:, 0], 2 * k.astype(np.float32))
    assert seen and all(s == ["k", "x"] for s in seen)
    assert m["rows_filtered"] == 250 and m["source_rows_filtered"] == 250 and m["transform_s"] > 0


def test_a_ragged_column_feeds_a_padded_input(ray_local, coord):
    # The source is asked for the columns the fetch returns, not the mask padding makes (it was:
    # "column 'tokens_mask' ... is not in the dataset").
    from feeder.sources import RayDataSource

    ds = ray_local.data.from_items([{"tokens": np.arange(k % 5) + 1, "k": k} for k in range(200)]).repartition(4)
    feeder.init_data_input_workers(None, ["tokens", "k"], RayDataSource(ds), batch_size=16, input_source_name="ray",
                                   coordinator=coord, timeout=60, pad={"tokens": 0})
    seen = []
    with coord:
        for batch in coord.feed("ray"):
            assert (batch["tokens_mask"].sum(axis=1) == batch["k"] % 5).all()
            seen += batch["k"].tolist()
    assert sorted(seen) == list(range(200))


def test_a_column_named_like_a_mask_is_refused_at_registration(ray_local, coord):
    # As for the other sources: found when registering, not at the first chunk.
    from feeder.sources import RayDataSource

    ds = ray_local.data.from_items([{"tokens": np.arange(3), "tokens_mask": np.ones(3, bool), "k": k}
                                    for k in range(8)])
    with pytest.raises(ValueError, match=r"pad= makes a mask 'tokens_mask' for padded input 'tokens', and the "
                                         r"RayDataSource has a column 'tokens_mask'"):
        feeder.init_data_input_workers(None, ["tokens", "tokens_mask", "k"], RayDataSource(ds), 4,
                                       coordinator=coord, pad={"tokens": 0})
    with pytest.raises(ValueError, match=r"mask_names names a mask 'k' for padded input 'tokens', and the "
                                         r"RayDataSource has a column 'k'"):
        feeder.init_data_input_workers(None, ["tokens"], RayDataSource(ds, columns={"tokens": "tokens", "k": "k"}),
                                       4, coordinator=coord, pad={"tokens": 0}, mask_names={"tokens": "k"},
                                       keep=["k"])


def test_session_run_and_column_mapping(ray_local, coord):
    from models import linear_model, session

    from feeder.sources import RayDataSource

    sess = session(linear_model(in_dim=4, out_dim=3))
    source = RayDataSource(pipeline(ray_local, rows=640, blocks=4), columns={"x": "x"})
    feeder.init_data_input_workers(sess, ["x"], source, batch_size=32, num_worker_threads=1,
                                   input_source_name="ray", coordinator=coord, timeout=60)
    with coord:
        feed = coord.feed("ray")
        sums = []
        while True:
            try:
                y, s = feed.run()
            except StopIteration:
                break
            assert y.shape == (32, 3)
            sums.append(s)
    # s = sum over the 4 equal features of row id: 4 * id, for every id once
    assert np.array_equal(np.sort(np.concatenate(sums)), 4.0 * np.arange(640, dtype=np.float32))


def test_a_missing_column_is_a_value_error_naming_it(ray_local, coord):
    from feeder.sources import RayDataSource

    # Schema known without running (a read): at registration.
    with pytest.raises(ValueError, match="'nope'"):
        feeder.init_data_input_workers(None, ["x"], RayDataSource(ray_local.data.range(10), columns={"x": "nope"}),
                                       batch_size=4, coordinator=coord)
    with pytest.raises(ValueError, match="give no column for inputs \\['y'\\].*every array kept with keep="):
        feeder.init_data_input_workers(None, ["x", "y"], RayDataSource(ray_local.data.range(10),
                                       columns={"x": "id"}), batch_size=4, coordinator=coord)
    # Schema known only by running (map_batches): registration runs the first block to learn it.
    source = RayDataSource(pipeline(ray_local, rows=100, blocks=2))
    with pytest.raises(ValueError, match=r"column 'nope' \(input 'nope'\) is not in the dataset; its columns are "
                                         r"\['k', 'x'\]"):
        feeder.init_data_input_workers(None, ["x", "nope"], source, batch_size=4, coordinator=coord,
                                       input_source_name="ray", timeout=60)
    # the columns learned are kept: a good registration of the same source runs nothing more
    assert source._names == ["x", "k"]
    feeder.init_data_input_workers(None, ["x", "k"], source, batch_size=4, coordinator=coord,
                                   input_source_name="ray", timeout=60)
    with coord:
        keys, errors = consume_all(coord.feeds("ray"))
    assert errors == [None] and np.array_equal(np.sort(keys[0]), np.arange(100))


def test_learning_the_columns_at_registration_never_hangs(ray_local, coord):
    """A pipeline that cannot run its first block (a resource no node has): registration waits
    stall_timeout, then says why, and leaves no thread behind (the conftest checks)."""
    from feeder.sources import RayDataSource
    from feeder.sources.ray import RayStallError

    source = RayDataSource(pipeline(ray_local, rows=100, blocks=2, resources={"nowhere": 1}), stall_timeout=2.0)
    t0 = time.monotonic()
    with pytest.raises(RayStallError, match=r"columns could not be learned at registration: its first block did "
                                            r"not come within stall_timeout=2 s"):
        feeder.init_data_input_workers(None, ["x", "k"], source, batch_size=4, coordinator=coord)
    assert time.monotonic() - t0 < 10
    assert not coord.feeds("train")


def test_a_null_in_a_used_column_is_an_input_validation_error_naming_it(ray_local, coord):
    """Not a NaN: an int64 column with a null would come as float64 from Ray's numpy batches."""
    import pyarrow as pa

    from feeder.sources import RayDataSource

    ids = pa.array([float(i) if i % 50 != 49 else None for i in range(200)], pa.float64())
    table = pa.table({"id": pa.array(range(200), pa.int64()), "k": pa.array(range(200), pa.int64()), "v": ids,
                      "w": pa.array([i if i != 120 else None for i in range(200)], pa.int64())})
    ds = ray_local.data.from_arrow(table)
    for inputs, column in ((["id", "w"], "w"), (["v"], "v")):
        for budget in (0, 5):  # bad data is not a transient failure: max_fetch_errors does not skip it
            c = feeder.GlobalCoordinator(join_timeout=3.0)
            feeder.init_data_input_workers(None, inputs, RayDataSource(ds), batch_size=16, coordinator=c,
                                           max_fetch_errors=budget, timeout=60)
            try:
                with c, pytest.raises(feeder.InputValidationError, match=f"column '{column}'.*null"):
                    list(c.feed("train"))
            finally:
                c.stop()
    # columns without nulls keep their dtype (no float64 from an int64 column)
    feeder.init_data_input_workers(None, ["id", "k"], RayDataSource(ds), batch_size=16, coordinator=coord)
    with coord:
        batches = list(coord.feed("train"))
    assert batches[0]["id"].dtype == np.int64 and sum(len(b["id"]) for b in batches) == 200


def test_worker_processes_are_refused_at_registration(ray_local, coord):
    from feeder.sources import RayDataSource

    with pytest.raises(TypeError, match="fetcher threads only"):
        feeder.init_data_input_workers(None, ["id"], RayDataSource(ray_local.data.range(10)), 4,
                                       num_worker_processes=2, coordinator=coord)


def test_resume_is_refused_at_registration(ray_local, coord):
    from feeder.sources import RayDataSource

    with pytest.raises(ValueError, match="cannot resume"):
        feeder.init_data_input_workers(None, ["id"], RayDataSource(ray_local.data.range(10)), batch_size=4,
                                       coordinator=coord, resume_from={"format": "feeder.source-state/1"})


def test_an_error_in_a_ray_task_is_a_fetch_error_with_the_cause(ray_local, coord):
    from feeder.sources import RayDataSource

    def boom(ids):
        if ids[0] >= 300:
            raise ZeroDivisionError(f"bad block at {ids[0]}")

    source = RayDataSource(pipeline(ray_local, rows=600, blocks=6, fn=boom))
    feeder.init_data_input_workers(None, ["x", "k"], source, batch_size=50, num_worker_threads=2,
                                   input_source_name="ray", coordinator=coord, timeout=60)
    coord.start()
    keys, errors = consume_all(coord.feeds("ray"))
    err = errors[0]
    assert isinstance(err, feeder.FetchError), err
    assert "worker" in str(err) and "'ray'" in str(err)
    assert isinstance(err.__cause__, ray_local.exceptions.RayTaskError)
    assert "ZeroDivisionError" in str(err.__cause__) and "bad block at" in str(err.__cause__)
    assert len(np.unique(keys[0])) == len(keys[0])  # what came before the failure came once
    assert coord.stop()


def test_one_ray_failure_is_counted_once_and_the_dead_stream_fails_at_once(ray_local, coord):
    """With max_fetch_errors=5 the task error is one tolerated fetch error; the shard's stream is
    dead after it, so the next call fails the source (a FetchError caused by Ray's error), and no
    call counts it again."""
    from feeder.sources import RayDataSource

    def boom(ids):
        if ids[0] >= 300:
            raise ZeroDivisionError(f"bad block at {ids[0]}")

    source = RayDataSource(pipeline(ray_local, rows=600, blocks=6, fn=boom))
    feeder.init_data_input_workers(None, ["x", "k"], source, batch_size=50, num_worker_threads=3,
                                   input_source_name="ray", coordinator=coord, timeout=60, max_fetch_errors=5)
    coord.start()
    keys, errors = consume_all(coord.feeds("ray"))
    err = errors[0]
    assert isinstance(err, feeder.FetchError), err
    assert isinstance(err.__cause__, ray_local.exceptions.RayTaskError)
    assert "failed earlier" in str(err) and "cannot go on" in str(err) and "'ray'" in str(err)
    assert coord.feed("ray").metrics()["fetch_errors"] == 1.0


def test_stall_waiting_on_ray_times_out_with_diagnosis_then_fails(ray_local, coord, tmp_path):
    """A step that needs a resource no node has never runs: the consumer's timeout says the source
    waits on Ray, and after stall_timeout the source fails with FetchError: never a hang."""
    from feeder.sources import RayDataSource
    from feeder.sources.ray import RayStallError

    # A read whose tasks need what no node has: its schema is known without running (the files'
    # metadata), so registration runs nothing and the stall shows in the stream.
    ds = stalled_read(ray_local, tmp_path)
    source = RayDataSource(ds, stall_timeout=2.5)
    feeder.init_data_input_workers(None, ["id"], source, batch_size=10, num_worker_threads=2,
                                   input_source_name="ray", coordinator=coord, timeout=30)
    coord.start()
    feed = coord.feed("ray")
    with pytest.raises(feeder.FeedTimeout, match="waiting on Ray Data: Ray Data shard 0 waiting on Ray"):
        feed.next_batch(timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(feeder.FetchError) as info:
        feed.next_batch(timeout=20)
    assert isinstance(info.value.__cause__, RayStallError)
    assert time.monotonic() - t0 < 10
    t0 = time.monotonic()
    assert coord.stop()  # the pump stuck in Ray is released (the split actor is killed)
    assert time.monotonic() - t0 < 5


def stalled_read(ray, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "ids.parquet")
    pq.write_table(pa.table({"id": np.arange(100)}), path)
    return ray.data.read_parquet(path, resources={"nowhere": 1})


def test_a_stall_counts_once_per_stall_timeout(ray_local, coord, tmp_path):
    """max_fetch_errors=3 and a stream that never comes: one fetch error per stall_timeout of
    waiting, not one per fetch call (which would use the budget up at once)."""
    from feeder.sources import RayDataSource
    from feeder.sources.ray import RayStallError

    source = RayDataSource(stalled_read(ray_local, tmp_path), stall_timeout=1.0)
    feeder.init_data_input_workers(None, ["id"], source, batch_size=10, num_worker_threads=2,
                                   input_source_name="ray", coordinator=coord, timeout=30, max_fetch_errors=3)
    coord.start()
    feed = coord.feed("ray")
    t0 = time.monotonic()
    with pytest.raises(feeder.FetchError, match="more than max_fetch_errors=3") as info:
        feed.next_batch(timeout=20)
    assert isinstance(info.value.__cause__, RayStallError)
    assert time.monotonic() - t0 > 3.5  # the 4th stall, after 4 stall_timeouts
    assert feed.metrics()["fetch_errors"] == 4.0


def test_stop_mid_stream_releases_and_a_new_start_reads_again(ray_local, coord):
    from feeder.sources import RayDataSource

    source = RayDataSource(pipeline(ray_local, rows=20000, blocks=20), batch_size=100)
    feeder.init_data_input_workers(None, ["x", "k"], source, batch_size=100, num_worker_threads=2,
                                   input_source_name="ray", coordinator=coord, timeout=60, max_buffered_batches=4)
    coord.start()
    for _ in range(3):
        coord.feed("ray").next_batch()
    assert "shard 0" in source.feeder_describe()
    assert coord.stop()
    assert source.feeder_describe().startswith("Ray Data source not bound")
    assert not [t for t in threading.enumerate() if t.name.startswith("feeder:")]
    # The same source object, registered again: bound again, the dataset runs again from its start.
    feeder.init_data_input_workers(None, ["x", "k"], source, batch_size=1000, num_worker_threads=2,
                                   input_source_name="ray", coordinator=coord, timeout=60)
    coord.start()
    keys, errors = consume_all(coord.feeds("ray"))
    assert errors == [None]
    assert np.array_equal(np.sort(keys[0]), np.arange(20000))


def test_a_shard_made_elsewhere_is_shared_by_the_replicas(ray_local, coord):
    """Across hosts, a driver splits once and hands each host its DataIterator."""
    from feeder.sources import RayDataSource

    (shard,) = pipeline(ray_local, rows=500, blocks=5).streaming_split(1)
    source = RayDataSource(shard)
    for _ in range(2):
        feeder.init_data_input_workers(None, ["x", "k"], source, batch_size=32, num_worker_threads=1,
                                       input_source_name="ray", coordinator=coord, timeout=60)
    coord.start()
    keys, errors = consume_all(coord.feeds("ray"))
    assert errors == [None, None]
    assert np.array_equal(np.sort(np.concatenate(keys)), np.arange(500))


def test_bad_arguments(ray_local):
    from feeder.sources import RayDataSource

    with pytest.raises(TypeError, match="ray.data.Dataset"):
        RayDataSource([1, 2, 3])
    with pytest.raises(TypeError, match="columns"):
        RayDataSource(ray_local.data.range(3), columns=["id"])
    with pytest.raises(ValueError, match="stall_timeout"):
        RayDataSource(ray_local.data.range(3), stall_timeout=0)
    with pytest.raises(ValueError, match="batch_size"):
        RayDataSource(ray_local.data.range(3), batch_size=0)


# ---- simulated 2-node cluster ------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster_results():
    ray_or_skip()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "ray_cluster_run.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            results[r["scenario"]] = r
    assert proc.returncode == 0 and results, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for r in results.values():
        print("cluster:", json.dumps(r))
    return results


def check_clean(r):
    assert not r["hung"], r
    assert r["stopped_cleanly"] and not r["feeder_threads_left"], r
    assert r["duplicates"] == 0, r


def test_cluster_preprocessing_on_the_second_node_two_replicas_exact_ledger(cluster_results):
    r = cluster_results["placement"]
    check_clean(r)
    assert r["error"] is None, r
    assert r["exact"], r  # every row once across the 2 replicas
    assert r["all_on_worker"], r  # map_batches ran on the node with the custom resource
    assert all(n > 0 for n in r["rows_per_replica"]), r


@pytest.mark.parametrize("scenario", ["node_loss", "node_loss_retry"])
def test_cluster_worker_node_removed_mid_stream_survives_or_fails_never_hangs(cluster_results, scenario):
    r = cluster_results[scenario]
    check_clean(r)
    assert r["removed_at_s"] is not None, r
    # Either Ray retried the lost tasks elsewhere and every row came once, or a FetchError said why.
    if r["error"] is None:
        assert r["exact"], r
    else:
        assert r["error"] == "FetchError", r
        assert r["cause"] in ("RayStallError", "RayTaskError", "ObjectLostError", "RayActorError") \
            or r["cause"].startswith("RayTaskError"), r
    if scenario == "node_loss_retry":  # the step may run on the head: Ray retries there
        assert r["error"] is None and r["exact"], r


# ---- the example -------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_ray_batch_inference_example_runs_both_ways_on_the_same_rows():
    ray_or_skip()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "ray_batch_inference.py"),
                           "--rows", "6000", "--blocks", "4"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, f"{out[-2000:]}\n{proc.stderr[-3000:]}"
    assert "same rows and results: True" in out, out
    assert out.count(" rows/s ") == 2 and "6000 rows in" in out, out


def test_outside_its_threads_an_unbound_source_says_why(ray_local):
    """A copy (as a worker process would get) or a call before start() has no shard: a clear error."""
    import pickle

    from feeder.sources import RayDataSource

    source = pickle.loads(pickle.dumps(RayDataSource(ray_local.data.range(10))))
    with pytest.raises(RuntimeError, match="fetcher threads only"):
        source(0, 4)
    assert "not bound" in source.feeder_describe()
