"""feeder.sources: the binding protocol, ready-made sources, checkpoint and resume."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import feeder
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
    rec = Recorder()
    feeder.init_data_input_workers(None, ["x"], rec, 4, coordinator=coord, resume_from={"a": 1})
    with pytest.raises(ValueError, match="same resume_from"):
        feeder.init_data_input_workers(None, ["x"], rec, 4, coordinator=coord, resume_from={"a": 2})
    with pytest.raises(TypeError, match="resume_from"):
        feeder.init_data_input_workers(None, ["x"], rec, 4, coordinator=coord, resume_from=[1])


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
