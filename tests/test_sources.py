"""feeder.sources: the binding protocol, ready-made sources, checkpoint and resume."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from utils import workers

import feeder
from feeder.sources import ArraySource
from feeder.sources.base import ROW_KEY, SourceBinding


class Recorder:
    """A fetch function that records the protocol calls it gets."""

    def __init__(self, rows=4, chunks=3, describe="waiting on the recorder"):
        self.calls = []
        self.bound = None
        self.rows = rows
        self.left = {}
        self.chunks = chunks
        self._describe = describe

    def feeder_bind(self, binding):
        self.calls.append(("bind", binding))
        self.bound = binding

    def feeder_release(self):
        self.calls.append(("release",))

    def feeder_describe(self):
        return self._describe

    def __call__(self, worker_id, batch_size):
        assert self.bound is not None, "called before feeder_bind"
        n = self.left.setdefault(worker_id, self.chunks)
        if n == 0:
            raise StopIteration
        self.left[worker_id] = n - 1
        return [np.full((self.rows, 1), worker_id, np.float32)]


def test_bind_once_per_source_and_fetch_fun_before_any_fetch_and_release_at_stop(coord):
    rec, other = Recorder(), Recorder()
    feeder.init_data_input_workers(None, ["x"], rec, 4, num_worker_threads=2, coordinator=coord, ordered=True)
    feeder.init_data_input_workers(None, ["x"], rec, 4, num_worker_threads=1, coordinator=coord, ordered=True)
    feeder.init_data_input_workers(None, ["x"], other, 4, num_worker_threads=1, input_source_name="test",
                                   coordinator=coord)
    coord.start()
    assert [c[0] for c in rec.calls] == ["bind"]
    b = rec.calls[0][1]
    assert isinstance(b, SourceBinding)
    assert b == SourceBinding("train", ((0, 1), (2,)), ("x",), True, None)
    assert b.worker_ids == (0, 1, 2)
    assert other.bound == SourceBinding("test", ((3,),), ("x",), False, None)
    rows = sum(len(x["x"]) for f in coord.feeds("train") for x in _drain(f))
    assert rows == 3 * 3 * 4
    coord.stop_coordinator("test")
    assert [c[0] for c in other.calls] == ["bind", "release"]
    assert [c[0] for c in rec.calls] == ["bind"]
    coord.stop()
    assert [c[0] for c in rec.calls] == ["bind", "release"]


def _drain(feed):
    out = []
    while True:
        try:
            out.append(feed.next_batch(timeout=10))
        except StopIteration:
            return out


def test_bind_again_on_a_start_after_stop(coord):
    rec = Recorder()
    for _ in range(2):
        feeder.init_data_input_workers(None, ["x"], rec, 4, num_worker_threads=1, coordinator=coord)
        coord.start()
        coord.stop()
    assert [c[0] for c in rec.calls] == ["bind", "release", "bind", "release"]


def test_a_replica_added_while_a_bound_source_runs_is_refused(coord):
    rec = Recorder(chunks=1000)
    feeder.init_data_input_workers(None, ["x"], rec, 4, num_worker_threads=1, coordinator=coord)
    coord.start()
    feeder.init_data_input_workers(None, ["x"], rec, 4, num_worker_threads=1, coordinator=coord)
    with pytest.raises(feeder.FeederError, match="register every replica before start"):
        coord.start()


def test_timeout_and_diagnose_include_the_sources_description(coord):
    class Slow(Recorder):
        def __call__(self, worker_id, batch_size):
            import time
            time.sleep(0.05)
            return None

    rec = Slow(describe="waiting on shard 7")
    feeder.init_data_input_workers(None, ["x"], rec, 4, num_worker_threads=1, coordinator=coord)
    coord.start()
    with pytest.raises(feeder.FeedTimeout, match="waiting on shard 7"):
        coord.feed("train").next_batch(timeout=0.2)
    assert "waiting on shard 7" in coord.feed("train").diagnose()


def test_resume_from_must_be_the_same_for_every_replica(coord):
    data = np.arange(100)
    _, first = run_source(ArraySource({"x": data}), take=1)
    _, second = run_source(ArraySource({"x": data}), take=3)
    src = ArraySource({"x": data})
    feeder.init_data_input_workers(None, ["x"], src, 4, coordinator=coord, resume_from=first)
    with pytest.raises(ValueError, match="same resume_from"):
        feeder.init_data_input_workers(None, ["x"], src, 4, coordinator=coord, resume_from=second)
    with pytest.raises(TypeError, match="resume_from"):
        feeder.init_data_input_workers(None, ["x"], src, 4, coordinator=coord, resume_from=[1])


def test_importing_feeder_or_its_sources_imports_neither_pyarrow_nor_ray():
    code = ("import sys, feeder\n"
            "from feeder.sources import ArraySource, ParquetSource, ROW_KEY\n"
            "bad = [m for m in ('pyarrow', 'ray') if m in sys.modules]\n"
            "assert not bad, bad\n")
    code_import_only = ("import sys, feeder, feeder.sources\n"
                        "bad = [m for m in ('pyarrow', 'ray') if m in sys.modules]\n"
                        "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code_import_only], check=True)
    if _has_sources_modules():
        subprocess.run([sys.executable, "-c", code], check=True)
    assert ROW_KEY.startswith("__")


def _has_sources_modules():
    import importlib.util
    return importlib.util.find_spec("feeder.sources.arrays") is not None


# ---- ready-made sources: sharding, epochs, checkpoint and resume ---------------------------------


def run_source(source, *, workers=2, replicas=1, ordered=False, batch_size=8, take=None, resume=None,
               procs=0, timeout=20.0):
    """Consume a source with a private coordinator; returns (batches as arrays of x, state).
    ``take``: stop after this many batches and checkpoint; None: until the source ends."""
    coord = feeder.GlobalCoordinator(join_timeout=3.0)
    try:
        for _ in range(replicas):
            kw = dict(num_worker_processes=procs) if procs else {}
            feeder.init_data_input_workers(None, ["x"], source, batch_size, num_worker_threads=workers,
                                           coordinator=coord, ordered=ordered, resume_from=resume, **kw)
        coord.start()
        feeds = coord.feeds("train")
        got, live, i = [], list(feeds), 0
        while live and (take is None or len(got) < take):
            f = live[i % len(live)]
            try:
                got.append(f.next_batch(timeout=timeout)["x"].copy())
                i += 1
            except StopIteration:
                live.remove(f)
        state = coord.state_dict("train")
        json.dumps(state)  # JSON-serializable
        return got, state
    finally:
        coord.stop()


def rows_of(batches):
    return [int(v) for b in batches for v in b.reshape(len(b), -1)[:, 0]] if batches else []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 120), block=st.integers(1, 40), bs=st.integers(1, 24), workers=st.integers(1, 4),
       replicas=st.integers(1, 2), shuffle=st.booleans(), epochs=st.integers(1, 3), ordered=st.booleans(),
       cut=st.floats(0, 1), resume_workers=st.integers(1, 4), seed=st.integers(0, 3))
def test_checkpoint_then_resume_delivers_every_row_exactly_once(n, block, bs, workers, replicas, shuffle, epochs,
                                                                ordered, cut, resume_workers, seed):
    def make():
        return ArraySource({"x": np.arange(n, dtype=np.int64)}, shuffle=shuffle, seed=seed, epochs=epochs,
                           block_rows=block)

    full, full_state = run_source(make(), workers=workers, replicas=replicas, ordered=ordered, batch_size=bs)
    assert Counter(rows_of(full)) == Counter({r: epochs for r in range(n)})
    assert full_state["rows_delivered"] == n * epochs
    take = int(cut * len(full))
    before, state = run_source(make(), workers=workers, replicas=replicas, ordered=ordered, batch_size=bs, take=take)
    assert state["rows_delivered"] == sum(len(b) for b in before)
    # the resumed run may have other workers; an ordered one with one replica keeps the batches too
    after, end_state = run_source(make(), workers=resume_workers, replicas=replicas, ordered=ordered, batch_size=bs,
                                  resume=state)
    assert Counter(rows_of(before + after)) == Counter({r: epochs for r in range(n)})
    assert end_state["rows_delivered"] == n * epochs
    if ordered and replicas == 1:
        assert [b.tolist() for b in before + after] == [b.tolist() for b in full]


def test_shuffle_is_reproducible_from_the_seed_and_differs_per_epoch():
    def order(seed):
        src = ArraySource({"x": np.arange(200)}, shuffle=True, seed=seed, epochs=2, block_rows=16)
        return rows_of(run_source(src, workers=3, ordered=True, batch_size=10)[0])

    a, b, c = order(1), order(1), order(2)
    assert a == b and a != c
    assert a[:200] != a[200:] and sorted(a[:200]) == list(range(200)) == sorted(a[200:])
    assert a[:200] != list(range(200))


def test_endless_epochs_keep_going_and_resume_in_the_right_epoch():
    src = ArraySource({"x": np.arange(30)}, epochs=None, block_rows=7)
    got, state = run_source(src, workers=2, ordered=True, batch_size=8, take=20)  # 160 rows: 5 epochs and 10 rows
    assert rows_of(got) == [i % 30 for i in range(160)]
    assert state["delivered"] == [[0, 160]]
    more, _ = run_source(src, workers=3, ordered=True, batch_size=8, take=5, resume=state)
    assert rows_of(more) == [i % 30 for i in range(160, 200)]


def test_fetched_but_undelivered_rows_come_after_the_resume():
    src = ArraySource({"x": np.arange(1000)}, block_rows=50)
    got, state = run_source(src, workers=2, batch_size=10, take=3)
    assert len(rows_of(got)) == 30 and state["rows_delivered"] == 30
    rest, _ = run_source(src, workers=2, batch_size=10, resume=state)
    assert sorted(rows_of(got) + rows_of(rest)) == list(range(1000))


def test_state_is_small_and_checkpoint_while_consumers_run_is_consistent(coord):
    import threading

    def make():
        return ArraySource({"x": np.arange(20000)}, shuffle=True, seed=5, block_rows=1000)

    src = make()
    feeder.init_data_input_workers(None, ["x"], src, 32, num_worker_threads=3, coordinator=coord)
    feeder.init_data_input_workers(None, ["x"], src, 32, num_worker_threads=1, coordinator=coord)
    coord.start()
    seen = [[], []]
    stop = threading.Event()

    def consume(i, f):
        for b in f:
            seen[i].append(b["x"].copy())
            if stop.is_set():
                return

    threads = [threading.Thread(target=consume, args=(i, f)) for i, f in enumerate(coord.feeds("train"))]
    for t in threads:
        t.start()
    states = [coord.state_dict("train") for _ in range(20)]  # while consumers run
    stop.set()
    for t in threads:
        t.join(10)
    final = coord.state_dict("train")
    coord.stop()
    delivered = rows_of(seen[0]) + rows_of(seen[1])
    assert final["rows_delivered"] == len(delivered)
    counts = [s["rows_delivered"] for s in states]
    assert counts == sorted(counts)
    # a batch is in the state iff a consumer got it: resuming from it gives exactly the others
    rest, _ = run_source(make(), workers=2, batch_size=32, resume=final)
    assert sorted(delivered + rows_of(rest)) == list(range(20000))
    # shuffled rows, yet a partly delivered unit is a few ranges: keys follow the delivery order
    assert len(final["delivered"]) <= 2 * 20, final["delivered"]


def test_a_state_of_another_source_definition_is_refused_saying_what_differs(coord):
    src = ArraySource({"x": np.arange(100)}, shuffle=True, seed=1)
    _, state = run_source(src, take=2)
    cases = [(ArraySource({"x": np.arange(101)}, shuffle=True, seed=1), "rows"),
             (ArraySource({"x": np.arange(100)}, shuffle=True, seed=2), "seed"),
             (ArraySource({"x": np.arange(100)}, seed=1), "shuffle"),
             (ArraySource({"x": np.arange(100, dtype=np.float32)}, shuffle=True, seed=1), "arrays"),
             (ArraySource({"x": np.arange(100)[::-1].copy()}, shuffle=True, seed=1), "sample"),
             # one value in the middle differs: still other data
             (ArraySource({"x": np.where(np.arange(100) == 50, -1, np.arange(100))}, shuffle=True, seed=1), "sample"),
             # the same values under another input name
             (ArraySource({"w": np.arange(100)}, shuffle=True, seed=1), "names")]
    for other, what in cases:
        inputs = list(other.names)
        with pytest.raises(ValueError, match=what):
            feeder.init_data_input_workers(None, inputs, other, 8, coordinator=coord, resume_from=state)
    with pytest.raises(ValueError, match="state_dict"):
        feeder.init_data_input_workers(None, ["x"], src, 8, coordinator=coord, resume_from={"delivered": []})


def test_state_dict_of_a_plain_fetch_function_says_it_cannot_checkpoint(coord):
    feeder.init_data_input_workers(None, ["x"], Recorder(), 4, coordinator=coord)
    with pytest.raises(ValueError, match="cannot be checkpointed"):
        coord.state_dict("train")
    with pytest.raises(KeyError):
        coord.state_dict("nope")


def test_array_source_inputs_by_name_or_order_and_memory_mapped(tmp_path):
    x = np.arange(50, dtype=np.float32).reshape(25, 2)
    np.save(tmp_path / "x.npy", x)
    mm = np.load(tmp_path / "x.npy", mmap_mode="r")
    y = np.arange(25)
    coord = feeder.GlobalCoordinator()
    try:
        # dict order differs from the input order: arrays follow the names
        src = ArraySource({"y": y, "x": mm}, shuffle=True, block_rows=4)
        feeder.init_data_input_workers(None, ["x", "y"], src, 5, coordinator=coord)
        coord.start()
        batches = list(coord.feed("train"))
        xs = np.concatenate([b["x"] for b in batches])
        ys = np.concatenate([b["y"] for b in batches])
        assert ROW_KEY not in batches[0]
        np.testing.assert_array_equal(xs, x[ys])
        assert sorted(ys.tolist()) == list(range(25))
    finally:
        coord.stop()
    with pytest.raises(ValueError, match="same number of rows"):
        ArraySource([x, y[:3]])
    with pytest.raises(ValueError, match=r"no array for input\(s\) \['z'\]"):
        feeder.init_data_input_workers(None, ["x", "z"], ArraySource({"x": x, "y": y}), 5,
                                       coordinator=feeder.GlobalCoordinator())
    with pytest.raises(ValueError, match="2 arrays for 1 inputs"):
        feeder.init_data_input_workers(None, ["x"], ArraySource([x, y]), 5, coordinator=feeder.GlobalCoordinator())
    with pytest.raises(ValueError, match="epochs"):
        ArraySource([x], epochs=0)


@pytest.mark.parametrize("mode,n", [("threads", 1), ("threads", 2), ("processes", 1)])
@pytest.mark.parametrize("batch_size", [4, 5])  # batches inside one block (views), or across two (assembled)
def test_a_consumer_writing_into_its_batches_never_changes_the_users_arrays(mode, n, batch_size, tmp_path):
    # An unshuffled ArraySource's batches are views of the user's arrays where a batch lies in one
    # block (no copy is made). A consumer that writes into a batch in place must not change the data
    # that later epochs read: such views are read-only, and the write is numpy's error at once.
    x = np.arange(80, dtype=np.float32).reshape(40, 2)
    np.save(tmp_path / "y.npy", np.arange(40))
    y = np.load(tmp_path / "y.npy", mmap_mode="r+")  # a writable memory-mapped file: writes would reach it
    kept = x.copy()
    coord = feeder.GlobalCoordinator(join_timeout=3.0)
    refused = 0
    try:
        feeder.init_data_input_workers(None, ["x", "y"], ArraySource({"x": x, "y": y}, block_rows=8, epochs=2),
                                       batch_size, coordinator=coord, **workers(mode, n))
        coord.start()
        seen = []
        for b in coord.feed("train"):
            seen.append(b["y"].copy())
            np.testing.assert_array_equal(b["x"], kept[b["y"]])  # what the source holds, never what we wrote
            for name in ("x", "y"):
                if np.shares_memory(b[name], x) or np.shares_memory(b[name], y):
                    assert not b[name].flags.writeable, f"a writable view of the user's {name!r}"
                try:
                    b[name][...] = -7
                except ValueError as e:
                    assert "read-only" in str(e)
                    refused += 1
    finally:
        coord.stop()
    np.testing.assert_array_equal(x, kept)
    assert np.load(tmp_path / "y.npy").tolist() == list(range(40))
    assert sorted(np.concatenate(seen).tolist()) == sorted(list(range(40)) * 2)
    if mode == "threads":
        assert refused, "no batch was a view: the test no longer tests what it says"


def test_array_source_refuses_names_that_are_not_strings_and_masked_values():
    with pytest.raises(TypeError, match=r"input name \(str\).*1 is a int"):
        ArraySource({1: np.arange(4)})
    masked = np.ma.masked_array(np.arange(10.0), mask=[0] * 5 + [1] + [0] * 4)
    with pytest.raises(feeder.InputValidationError, match=r"array 'x' is a masked array with 1 masked value\(s\) "
                                                          r"\(nulls\), the first in row 5"):
        ArraySource({"x": masked})
    src = ArraySource({"x": np.ma.masked_array(np.arange(4.0))})  # nothing masked: its values
    coord = feeder.GlobalCoordinator(join_timeout=3.0)
    try:
        feeder.init_data_input_workers(None, ["x"], src, 4, coordinator=coord)
        coord.start()
        (b,) = list(coord.feed("train"))
        assert type(b["x"]) is np.ndarray and b["x"].tolist() == [0, 1, 2, 3]
    finally:
        coord.stop()


def test_a_source_is_picklable_once_bound_and_shards_by_worker_id():
    import pickle
    src = ArraySource({"x": np.arange(10)}, block_rows=2)
    src.feeder_bind(SourceBinding("train", ((0, 1),), ("x",), True, None))
    copies = [pickle.loads(pickle.dumps(src)) for _ in range(2)]  # one per worker process
    got = []
    for wid, c in zip((0, 1), copies):
        while True:
            try:
                x, keys = c(wid, 4)
            except StopIteration:
                break
            got.append((wid, x.tolist(), keys.tolist()))
    assert got == [(0, [0, 1], [0, 1]), (0, [4, 5], [4, 5]), (0, [8, 9], [8, 9]),
                   (1, [2, 3], [2, 3]), (1, [6, 7], [6, 7])]


KILLED_TRAINER = r'''
import json, os, sys, time
import numpy as np
import feeder
from feeder.sources import ArraySource

out_dir, resume = sys.argv[1], sys.argv[2] == "resume"
n = 20000
src = ArraySource({"x": np.arange(n)}, shuffle=True, seed=7, block_rows=100)
state = None
if resume:
    with open(os.path.join(out_dir, "ckpt.json")) as f:
        state = json.load(f)["source"]
coord = feeder.GlobalCoordinator()
feeder.init_data_input_workers(None, ["x"], src, 32, num_worker_threads=3, coordinator=coord, resume_from=state)
coord.start()
log = open(os.path.join(out_dir, "resumed.log" if resume else "first.log"), "a")
written = 0
for step, batch in enumerate(coord.feed("train"), 1):
    rows = batch["x"].tolist()
    log.write("".join(f"{r}\n" for r in rows))
    written += len(rows)
    if step % 10 == 0:  # checkpoint: the source's state and how much of the log it covers
        log.flush()
        tmp = os.path.join(out_dir, "ckpt.tmp")
        with open(tmp, "w") as f:
            json.dump({"source": coord.state_dict("train"), "logged": written}, f)
        os.replace(tmp, os.path.join(out_dir, "ckpt.json"))
    if not resume:
        time.sleep(0.001)
log.close()
coord.stop()
'''


@pytest.mark.slow
def test_a_killed_trainer_resumes_from_its_last_checkpoint_with_every_row_accounted_for(tmp_path):
    import os
    import signal
    import time
    script = tmp_path / "trainer.py"
    script.write_text(KILLED_TRAINER)
    first = subprocess.Popen([sys.executable, str(script), str(tmp_path), "first"])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ckpt = tmp_path / "ckpt.json"
            if ckpt.exists() and json.loads(ckpt.read_text())["logged"] >= 3200:
                break
            assert first.poll() is None, "the first trainer ended before it was killed"
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)
    finally:
        first.wait(10)
    assert first.returncode == -signal.SIGKILL
    ckpt = json.loads((tmp_path / "ckpt.json").read_text())
    second = subprocess.run([sys.executable, str(script), str(tmp_path), "resume"], timeout=120)
    assert second.returncode == 0
    logged = (tmp_path / "first.log").read_text().split()
    assert len(logged) >= ckpt["logged"]  # it went on after its last checkpoint: those rows come again
    before = [int(r) for r in logged[:ckpt["logged"]]]
    after = [int(r) for r in (tmp_path / "resumed.log").read_text().split()]
    assert sorted(before + after) == list(range(20000))


HAS_PROCESSES = "num_worker_processes" in __import__("inspect").signature(feeder.init_data_input_workers).parameters


@pytest.mark.skipif(not HAS_PROCESSES, reason="worker processes (issue 10) are not on this branch")
@pytest.mark.parametrize("ordered,replicas", [(True, 1), (False, 2)])
def test_worker_processes_shard_checkpoint_and_resume_exactly(ordered, replicas):
    def make():
        return ArraySource({"x": np.arange(500)}, shuffle=True, seed=3, epochs=2, block_rows=16)

    every = Counter({r: 2 for r in range(500)})
    full, _ = run_source(make(), procs=3, replicas=replicas, ordered=ordered, batch_size=10)
    assert Counter(rows_of(full)) == every
    before, state = run_source(make(), procs=3, replicas=replicas, ordered=ordered, batch_size=10, take=37)
    after, _ = run_source(make(), procs=2, replicas=replicas, ordered=ordered, batch_size=10, resume=state)
    assert Counter(rows_of(before + after)) == every
    if ordered:
        assert [b.tolist() for b in before + after] == [b.tolist() for b in full]


def test_one_source_object_feeds_one_source_name():
    """Different names never share data: a second name would take the source's shards and
    ledger from the first, so it is refused at registration."""
    coord = feeder.GlobalCoordinator()
    src = ArraySource({"x": np.arange(100).reshape(-1, 1)})
    feeder.init_data_input_workers(None, ["x"], src, 10, coordinator=coord, input_source_name="train")
    with pytest.raises(ValueError, match="already feeds source 'train'.*'eval'"):
        feeder.init_data_input_workers(None, ["x"], src, 10, coordinator=coord, input_source_name="eval")
    feeder.init_data_input_workers(None, ["x"], ArraySource({"x": np.arange(100).reshape(-1, 1)}), 10,
                                   coordinator=coord, input_source_name="eval")
    with coord:
        train = np.concatenate([b["x"] for b in coord.feed("train")])
        evals = np.concatenate([b["x"] for b in coord.feed("eval")])
    assert sorted(train.ravel()) == sorted(evals.ravel()) == list(range(100))


# ---- "auto" concurrency, planning a resume, arguments ---------------------------------------------


@pytest.fixture
def tuner_parks_all_but_one(monkeypatch):
    """The tuner never changes its mind: one fetcher of an "auto" registration runs, the rest stay
    parked for good (the worst case for a source that dealt units to every worker id)."""
    import feeder.api
    import feeder.tuning
    monkeypatch.setattr(feeder.tuning.Tuner, "observe", lambda self, now, rows, wait_s, batches=None: None)
    monkeypatch.setattr(feeder.api, "AUTO_MAX_PROCESSES", 4)  # parked processes whatever the core count


def auto(mode):
    return dict(workers="auto") if mode == "threads" else dict(procs="auto")


def test_auto_concurrency_serves_parked_workers_shares_of_finite_epochs_in_order(tuner_parks_all_but_one, mode):
    src = ArraySource({"x": np.arange(64)}, shuffle=True, seed=2, epochs=5, block_rows=8)
    got, state = run_source(src, batch_size=8, **auto(mode))
    rows = rows_of(got)
    assert Counter(rows) == Counter({r: 5 for r in range(64)})
    # Epochs follow each other: the t-th time a row comes is within epoch t's 64 rows, give or
    # take the units in flight (one worker runs; 2 units of slack for one fetched at start-up).
    seen = Counter()
    for i, r in enumerate(rows):
        t = seen[r]
        assert t * 64 - 16 <= i < (t + 1) * 64 + 16, (i, r, t)
        seen[r] += 1
    assert state["delivered"] == [[0, 320]]


def test_auto_concurrency_serves_parked_workers_shares_of_an_endless_source_and_the_state_stays_small(
        tuner_parks_all_but_one, mode):
    src = ArraySource({"x": np.arange(64)}, shuffle=True, seed=2, epochs=None, block_rows=8)
    got, state = run_source(src, batch_size=8, take=400, **auto(mode))  # 3,200 rows: 50 epochs
    assert Counter(rows_of(got)) == Counter({r: 50 for r in range(64)})
    assert state["delivered"] == [[0, 3200]]
    # and a resume goes on from there, parked workers or not
    more, state = run_source(src, batch_size=8, take=40, resume=state, **auto(mode))
    assert Counter(rows_of(more)) == Counter({r: 5 for r in range(64)})
    assert state["delivered"] == [[0, 3520]]


def test_units_are_dealt_from_one_counter_shared_by_replicas_whatever_runs(tuner_parks_all_but_one):
    """Two "auto" replicas (16 worker ids, 2 running) of a 3-epoch source: every row 3 times; of an
    endless one: every epoch served in turn, and what was delivered is a prefix of the sequence
    but for the units in flight (dealt to the 2 running workers of 16 ids in turn, it would be
    an eighth of the units, one range each)."""
    src = ArraySource({"x": np.arange(200)}, shuffle=True, seed=1, epochs=3, block_rows=10)
    got, state = run_source(src, workers="auto", replicas=2, batch_size=16)
    assert Counter(rows_of(got)) == Counter({r: 3 for r in range(200)})
    assert state["delivered"] == [[0, 600]]
    src = ArraySource({"x": np.arange(200)}, epochs=None, block_rows=10)
    got, state = run_source(src, workers="auto", replicas=2, batch_size=16, take=60)  # 960 rows: 4.8 epochs
    assert set(Counter(rows_of(got)).values()) <= {4, 5, 6}
    assert state["rows_delivered"] == 960 and len(state["delivered"]) <= 6, state["delivered"]


def test_planning_a_resume_after_a_gap_and_many_epochs_does_not_visit_each_epoch():
    """An endless source that skipped a unit (max_fetch_errors) and went on for 100,000 epochs:
    the resume plans from the gaps, not epoch by epoch, and serves the gap first."""
    import time

    src = ArraySource({"x": np.arange(64)}, shuffle=True, seed=3, epochs=None, block_rows=8)
    n, gap = 64, (3 * 64 + 16, 3 * 64 + 24)  # one unit of epoch 3 never delivered
    state = {"format": "feeder.source-state/1", "definition": src.feeder_definition(),
             "delivered": [[0, gap[0]], [gap[1], 100_003 * n]]}
    src.feeder_validate(("x",), state)
    t0 = time.perf_counter()
    src.feeder_bind(SourceBinding("train", ((0,),), ("x",), True, state))
    assert time.perf_counter() - t0 < 0.2  # ~1 ms; visiting each epoch took seconds (8 s on a loaded 2-core box)
    x, keys = src(0, 8)
    assert keys.tolist() == list(range(*gap))
    x, keys = src(0, 8)
    assert keys.min() >= 100_003 * n and keys.max() < 100_004 * n  # then the epoch after the last one
    # A gap of whole epochs between two delivered stretches: those epochs come whole, in order.
    state["delivered"] = [[0, 2 * n], [40 * n + 5, 1_000_000 * n]]
    src.feeder_bind(SourceBinding("train", ((0,),), ("x",), False, state))
    keys = [src(0, 8)[1] for _ in range(38 * 8 + 1 + 8)]
    assert [int(k.min()) // n for k in keys] == [e for e in range(2, 40) for _ in range(8)] + [40] + [1_000_000] * 8
    assert sorted(np.concatenate(keys).tolist()) == list(range(2 * n, 40 * n + 5)) + list(
        range(1_000_000 * n, 1_000_001 * n))


def test_a_negative_seed_is_refused_when_the_source_is_created():
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        ArraySource({"x": np.arange(10)}, shuffle=True, seed=-1)
    with pytest.raises(TypeError, match="seed"):
        ArraySource({"x": np.arange(10)}, seed=1.5)


def test_resume_from_on_a_plain_fetch_function_is_refused_at_registration(coord):
    with pytest.raises(ValueError, match="resume_from needs a source that can resume"):
        feeder.init_data_input_workers(None, ["x"], Recorder(), 4, coordinator=coord,
                                       resume_from={"format": "feeder.source-state/1"})


@pytest.mark.ledger_may_fail  # keys recorded twice on purpose: the ledger logs each
@settings(max_examples=200, deadline=None)
@given(keys=st.lists(st.integers(0, 60), max_size=120), cuts=st.lists(st.integers(1, 12), min_size=1, max_size=20),
       sort_some=st.booleans())
def test_the_key_ledger_records_runs_and_keys_alike(keys, cuts, sort_some):
    """Batches of consecutive keys are kept as ranges, others as keys: either way the ledger holds
    exactly the keys recorded, and counts every key recorded twice."""
    from collections import Counter as C

    from feeder.rowkeys import KeyLedger

    class Batch:
        def __init__(self, k):
            self.keys = np.asarray(k, dtype=np.int64)

    if sort_some:
        keys = sorted(keys)
    ledger = KeyLedger("t")
    at, i = 0, 0
    while at < len(keys):
        n = cuts[i % len(cuts)]
        ledger.record(Batch(keys[at:at + n]))
        at, i = at + n, i + 1
    got = {k for a, b in ledger.ranges().tolist() for k in range(a, b)}
    assert got == set(keys)
    assert ledger.duplicates == sum(c - 1 for c in C(keys).values())
