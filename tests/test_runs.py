"""feed.runs(): run() on every batch until a finite source ends, an iterator from which no
StopIteration escapes into a generator (issue 35, item 4)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from utils import workers

import feeder

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from models import linear_model  # noqa: E402  (needs onnx)

DIM = 4


class FailAt:
    """Chunks of 3 rows numbered from 0 in each worker (thread or process), until row ``at``'s
    chunk, which raises ValueError."""

    def __init__(self, at: int):
        self.at = at
        self.next = {}

    def __call__(self, worker_id, batch_size):
        start = self.next.get(worker_id, 0)
        self.next[worker_id] = start + 3
        if start <= self.at < start + 3:
            raise ValueError(f"bad record {self.at}")
        return [np.ones((3, DIM), np.float32)]


class Ids:
    """``n`` rows in chunks of 3 from one cursor (a finite source, for fetcher threads): x[i] =
    [i, i, i, i], so the model's second output, s = sum(x), says which row an output row is (4 i)."""

    def __init__(self, n: int):
        self.n = n
        self._next = 0
        self._lock = threading.Lock()

    def __call__(self, worker_id, batch_size):
        with self._lock:
            start = self._next
            if start >= self.n:
                raise StopIteration
            self._next = min(self.n, start + 3)
        ids = np.arange(start, min(self.n, start + 3))
        return [np.repeat(ids[:, None], DIM, axis=1).astype(np.float32)]


def session():
    return ort.InferenceSession(linear_model(in_dim=DIM), providers=["CPUExecutionProvider"])


def rows_of(s: np.ndarray) -> list:
    return (s / DIM).round().astype(int).tolist()


def test_runs_ends_at_the_end_of_a_finite_source_inside_a_generator(coord):
    # A generator over run() got "RuntimeError: generator raised StopIteration" (PEP 479).
    feeder.init_data_input_workers(session(), ["x"], Ids(50), 8, coordinator=coord)

    def row_ids(feed):
        for y, s in feed.runs():
            assert y.shape == (len(s), 3)
            yield from rows_of(s)

    with coord:
        got = list(row_ids(coord.feed("train")))
    assert sorted(got) == list(range(50))


def test_runs_gives_what_run_gives_output_names_and_with_batch(coord):
    feeder.init_data_input_workers(session(), ["x"], Ids(20), 8, coordinator=coord)
    with coord:
        items = list(coord.feed("train").runs(["s"], with_batch=True))
    assert [len(batch["x"]) for _, batch in items] == [8, 8, 4]  # last_batch="keep"
    for (s,), batch in items:
        assert set(batch) == {"x"}
        np.testing.assert_allclose(s, batch["x"].sum(axis=1))


def test_runs_of_replicas_deliver_every_row_once(coord, mode):
    from feeder.sources import ArraySource

    ids = np.arange(90)
    source = ArraySource({"x": np.repeat(ids[:, None], DIM, axis=1).astype(np.float32)}, block_rows=5)
    for _ in range(2):
        feeder.init_data_input_workers(session(), ["x"], source, 4, coordinator=coord, replica=True,
                                       **workers(mode, 1))
    got = [[], []]

    def consume(i, feed):
        for _, s in feed.runs():
            got[i] += rows_of(s)

    with coord:
        threads = [threading.Thread(target=consume, args=(i, f)) for i, f in enumerate(coord.feeds("train"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
    assert sorted(got[0] + got[1]) == list(range(90))


def test_a_fetch_failure_comes_out_of_the_loop(coord, mode):
    feeder.init_data_input_workers(session(), ["x"], FailAt(31), 4, coordinator=coord, **workers(mode, 1))
    with coord:
        with pytest.raises(feeder.FetchError) as raised:
            for _ in coord.feed("train").runs():
                pass
    assert isinstance(raised.value.__cause__, ValueError) and "bad record 31" in str(raised.value.__cause__)


def test_runs_after_stop_raises_feed_stopped(coord):
    feeder.init_data_input_workers(session(), ["x"], Ids(10**6), 4, coordinator=coord)
    coord.start()
    feed = coord.feed("train")
    loop = feed.runs()
    next(loop)
    coord.stop()
    with pytest.raises(feeder.FeedStopped):
        next(loop)
    with pytest.raises(feeder.FeedStopped):
        next(feed.runs())


def test_bad_arguments_are_refused_when_runs_is_called(coord):
    feeder.init_data_input_workers(None, ["x"], Ids(10), 4, coordinator=coord, input_source_name="plain")
    feeder.init_data_input_workers(session(), ["x"], Ids(10), 4, coordinator=coord)
    with pytest.raises(feeder.FeederError, match="no session"):
        coord.feed("plain").runs()  # before start() even: nothing was run
    feed = coord.feed("train")
    with pytest.raises(ValueError, match="outputs"):
        feed.runs(outputs="gpu")
    with pytest.raises(TypeError, match="with_batch"):
        feed.runs(with_batch="yes")
    with coord:
        with pytest.raises(TypeError, match="with_batch"):
            feed.run(with_batch=1)


def test_an_unknown_output_name_is_refused_before_a_batch_is_taken(coord):
    # ONNX Runtime's RuntimeError came after the batch was popped: its rows were lost.
    feeder.init_data_input_workers(session(), ["x"], Ids(40), 4, coordinator=coord, num_worker_threads=1)
    with coord:
        feed = coord.feed("train")
        for names in (["nope"], ["s", "nope"]):
            with pytest.raises(ValueError, match=r"output_names names \['nope'\], which the session does not "
                                                 r"output; its outputs are \["):
                feed.run(names)
        with pytest.raises(TypeError, match="list of output names"):
            feed.run("s")
        names = ["s"]
        (first,) = feed.run(names)
        names.append("nope")  # the same list, changed: checked again
        with pytest.raises(ValueError, match=r"\['nope'\]"):
            feed.run(names)
        seen = rows_of(first) + [r for (s,) in feed.runs(["s"]) for r in rows_of(s)]
    assert sorted(seen) == list(range(40))
