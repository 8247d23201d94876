"""Faults and shutdown: failing, hanging and exiting fetch functions, loggers, stop at any moment (issue 4)."""
from __future__ import annotations

import contextlib
import logging
import threading
import time

import numpy as np
import pytest
from utils import Dataset, FailAt, ListLogger, Sharded, UnprintableError, ones4, until, wait_until, workers

import feeder
import feeder.feed


def rows(n=4):
    return [np.zeros((n, 2), np.float32)]


def fail_on_call(n, exc, worker=None):
    """Fails at the n-th call (of worker ``worker`` if given), returns chunks otherwise."""
    calls = {}
    lock = threading.Lock()

    def fetch(worker_id, batch_size):
        with lock:
            calls[worker_id] = calls.get(worker_id, 0) + 1
            k = calls[worker_id]
        if k == n and (worker is None or worker_id == worker):
            raise exc
        return rows()

    return fetch


def same_exception(got, expected, mode):
    """The original object in a thread; from a worker process, a rebuilt copy of it."""
    if mode == "threads":
        return got is expected and got.__traceback__ is not None
    return type(got) is type(expected) and got.args == expected.args


def test_fetch_error_on_one_worker_reaches_the_consumer_with_its_cause(coord, mode):
    boom = ValueError("corrupt record 17")
    fetch = fail_on_call(3, boom, worker=1) if mode == "threads" else FailAt(3, boom, worker=1)
    feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord, timeout=10, **workers(mode, 2))
    coord.start()
    feed = coord.feed("train")
    with pytest.raises(feeder.FetchError) as info:
        for _ in until(20):  # a worker process may start later than the others
            feed.next_batch()
    err = info.value
    assert same_exception(err.__cause__, boom, mode)
    assert "source 'train'" in str(err) and "worker 1" in str(err) and "corrupt record 17" in str(err)
    with pytest.raises(feeder.FetchError) as again:  # sticky
        feed.next_batch()
    assert again.value.__cause__ is err.__cause__


def test_an_exception_whose_str_raises_is_still_a_fetch_error_with_it_as_the_cause(coord, mode):
    # It was a FeederError "fetcher thread failed: RuntimeError: str is broken" in threads, the
    # user's exception lost, because the message about it called str() on it.
    boom = UnprintableError("x")
    feeder.init_data_input_workers(None, ["x"], FailAt(2, boom), 4, coordinator=coord, timeout=10,
                                   **workers(mode, 1))
    coord.start()
    feed = coord.feed("train")
    with pytest.raises(feeder.FetchError, match=r"fetch_fun raised UnprintableError: <UnprintableError: str\(\) "
                                                r"failed>") as info:
        for _ in until(20):
            feed.next_batch()
    assert same_exception(info.value.__cause__, boom, mode)


def test_fetch_error_is_sticky_for_every_replica(coord, mode):
    boom = RuntimeError("disk gone")
    fetch = fail_on_call(2, boom) if mode == "threads" else FailAt(2, boom)
    feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord, timeout=10, **workers(mode, 2))
    feeder.init_data_input_workers(None, ["x"], ones4, 4, coordinator=coord, timeout=10, **workers(mode, 2))
    coord.start()
    a, b = coord.feeds("train")
    with pytest.raises(feeder.FetchError):
        for _ in until(20):  # a worker process may start later than the others
            a.next_batch()
    with pytest.raises(feeder.FetchError) as info:
        b.next_batch()
    assert same_exception(info.value.__cause__, boom, mode)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3)], ids=["KeyboardInterrupt", "SystemExit"])
def test_base_exceptions_from_fetchers_become_fetch_errors(coord, exc, mode):
    fetch = fail_on_call(1, exc) if mode == "threads" else FailAt(1, exc)
    feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord, timeout=10, **workers(mode, 2))
    coord.start()
    with pytest.raises(feeder.FetchError) as info:
        coord.feed("train").next_batch()
    assert same_exception(info.value.__cause__, exc, mode)
    assert type(exc).__name__ in str(info.value)


def test_max_fetch_errors_tolerates_logs_and_counts_then_fails(coord, caplog):
    calls = iter(range(10**6))
    lock = threading.Lock()
    consumed = threading.Event()

    def fetch(worker_id, batch_size):
        with lock:
            k = next(calls)
        if k in (2, 5):
            raise OSError(f"bad file {k}")
        if k >= 8:
            consumed.wait(10)  # fail only once the good rows are consumed (failures are raised at once)
            raise OSError("third strike")
        return [np.arange(k * 10, k * 10 + 10)]

    feeder.init_data_input_workers(None, ["id"], fetch, 10, num_worker_threads=1, max_fetch_errors=2,
                                   coordinator=coord, timeout=10)
    coord.start()
    feed = coord.feed("train")
    got = []
    with caplog.at_level(logging.WARNING, logger="feeder"):
        with pytest.raises(feeder.FetchError, match="third strike") as info:
            for _ in range(100):
                got.append(feed.next_batch()["id"][0])
                if len(got) == 6:
                    consumed.set()
    assert got == [0, 10, 30, 40, 60, 70]  # the failed calls' rows are simply absent
    assert isinstance(info.value.__cause__, OSError)
    assert "max_fetch_errors=2" in str(info.value)
    assert feed.metrics()["fetch_errors"] == 3
    tolerated = [r for r in caplog.records if "tolerated" in r.getMessage()]
    assert len(tolerated) == 2 and all(r.exc_info for r in tolerated)


def hung_fetcher(release, entered=None, hang_workers=None):
    def fetch(worker_id, batch_size):
        if hang_workers is None or worker_id in hang_workers:
            if entered is not None:
                entered.set()
            release.wait(30)  # stuck in "I/O"
            raise StopIteration
        return rows()
    return fetch


def test_all_fetchers_hung_timeout_names_them_with_stacks_and_stop_reports_stragglers(caplog):
    release = threading.Event()
    coord = feeder.GlobalCoordinator(join_timeout=0.5)
    try:
        feeder.init_data_input_workers(None, ["x"], hung_fetcher(release), 4, num_worker_threads=4,
                                       coordinator=coord)
        coord.start()
        feed = coord.feed("train")
        with pytest.raises(feeder.FeedTimeout) as info:
            feed.next_batch(timeout=1.2)
        msg = str(info.value)
        assert isinstance(info.value, TimeoutError)
        assert "source 'train'" in msg and "queue 0/800" in msg and "live fetchers [0, 1, 2, 3]" in msg
        for w in range(4):
            assert f"worker {w} in fetch_fun for" in msg
        assert "in fetch" in msg and "release.wait(30)" in msg  # the top frames of the stuck stack
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="feeder"):
            assert coord.stop() is False
        took = time.monotonic() - t0
        assert took < 1.5, f"one total budget, not one per thread: {took:.2f} s"
        report = "\n".join(r.getMessage() for r in caplog.records)
        assert "feeder:train:fetch-0" in report and "feeder:train:fetch-3" in report
        assert "release.wait(30)" in report
    finally:
        release.set()
        coord.stop()


def test_one_of_two_fetchers_hung_batches_keep_flowing(coord):
    release, entered = threading.Event(), threading.Event()
    feeder.init_data_input_workers(None, ["x"], hung_fetcher(release, entered, hang_workers={0}), 4,
                                   coordinator=coord, timeout=10)
    coord.start()
    try:
        assert entered.wait(5)
        for _ in range(50):
            assert coord.feed("train").next_batch()["x"].shape == (4, 2)
    finally:
        release.set()


def test_stop_while_producers_are_blocked_on_a_full_queue(coord, mode):
    feeder.init_data_input_workers(None, ["x"], ones4, 4, max_buffered_batches=2, coordinator=coord,
                                   **workers(mode, 3))
    coord.start()
    feed = coord.feed("train")
    wait_until(lambda: feed.source.full() and feed.metrics()["ready_batches"] == feed._ready.maxsize,
               what="a full pipeline")
    t0 = time.monotonic()
    assert coord.stop() is True
    assert time.monotonic() - t0 < 0.5


def test_stop_twice_and_before_start():
    c = feeder.GlobalCoordinator()
    assert c.stop() is True and c.stop() is True
    feeder.init_data_input_workers(None, ["x"], lambda w, b: rows(), 4, coordinator=c)
    assert c.stop() is True and c.stop() is True


def test_twenty_cycles_leave_no_thread_and_no_rows(coord, mode):
    base = threading.active_count()
    for _ in range(20 if mode == "threads" else 5):
        data = Dataset(10**9, sizes=(3, 7)) if mode == "threads" else Sharded(10**9, 2, sizes=(3, 7))
        feeder.init_data_input_workers(None, ["id", "x"], data, 8, coordinator=coord, **workers(mode, 2))
        coord.start()
        feed = coord.feed("train")
        for _ in range(5):
            feed.next_batch(timeout=10)
        assert coord.stop() is True
        assert coord.sources == [] and coord.feeds("train") == []
        assert feed.source.qsize() == 0 and feed.source.closed
    assert threading.active_count() == base


def test_enqueuer_failure_reaches_the_consumer(coord):
    feeder.init_data_input_workers(None, ["x"], lambda w, b: rows(), 4, coordinator=coord, timeout=10)
    feed = coord.feed("train")
    oom = MemoryError("cannot allocate batch")

    def broken_add(arrays, rows=None):
        raise oom

    feed._rebatcher.add = broken_add
    coord.start()
    # Batches are made by the enqueuer or, without a hand-over, by a producer's or consumer's pump:
    # whichever thread meets the failure, the feed fails with it.
    with pytest.raises(feeder.FeederError, match=r"(enqueuer thread failed|making a batch failed in thread).*"
                                                 r"MemoryError") as info:
        feed.next_batch()
    assert info.value.__cause__ is oom
    with pytest.raises(feeder.FeederError):
        feed.next_batch()  # never "active" with nobody feeding it


@contextlib.contextmanager
def gated_source(coord):
    """A started source whose fetchers wait on a gate; the gate opens at exit so threads can end."""
    gate = threading.Event()

    def slow(worker_id, batch_size):
        gate.wait(5)
        return rows()

    feeder.init_data_input_workers(None, ["x"], slow, 4, coordinator=coord)
    coord.start()
    try:
        yield coord.feed("train")
    finally:
        gate.set()


def test_feed_timeout_with_a_slow_source_and_negative_timeout(coord):
    with gated_source(coord) as feed:
        t0 = time.monotonic()
        with pytest.raises(feeder.FeedTimeout):
            feed.next_batch(timeout=0.2)
        assert 0.2 <= time.monotonic() - t0 < 1.0
        with pytest.raises(ValueError):
            feed.next_batch(timeout=-1)
        with pytest.raises(ValueError):
            feed.next_batch(timeout=float("nan"))  # would wait forever


def test_starved_consumer_warns_that_data_input_is_slow(coord, caplog, monkeypatch):
    monkeypatch.setattr(feeder.feed, "SLOW_INPUT_WARN_S", 0.2)
    with gated_source(coord) as feed:
        with caplog.at_level(logging.WARNING, logger="feeder"):
            with pytest.raises(feeder.FeedTimeout):
                feed.next_batch(timeout=0.5)
        assert any("data input is slow" in r.getMessage() for r in caplog.records)


class RaisingLogger:
    def __init__(self):
        self.calls = 0
        self.twice = threading.Event()

    def log(self, metrics):
        self.calls += 1
        if self.calls >= 2:
            self.twice.set()
        raise RuntimeError("metrics backend down")


def test_external_logger_raising_is_logged_and_kept(coord, caplog):
    bad, good = RaisingLogger(), ListLogger()
    feeder.init_data_input_workers(None, ["x"], lambda w, b: rows(), 4, external_loggers=[bad, good],
                                   log_interval=0.05, coordinator=coord)
    with caplog.at_level(logging.ERROR, logger="feeder"):
        coord.start()
        assert bad.twice.wait(5)  # called again after raising: kept
        coord.feed("train").next_batch(timeout=10)
    assert any("metrics backend down" in (r.exc_text or "") or r.exc_info for r in caplog.records)
    assert good.records and "inputs_per_sec" in good.records[0]


def test_slow_external_logger_never_stalls_data(coord):
    inside, release = threading.Event(), threading.Event()

    class Slow:
        def log(self, metrics):
            inside.set()
            release.wait(10)

    feeder.init_data_input_workers(None, ["x"], lambda w, b: rows(), 4, external_loggers=[Slow()],
                                   log_interval=0.05, coordinator=coord)
    coord.start()
    try:
        assert inside.wait(5)
        for _ in range(200):
            coord.feed("train").next_batch(timeout=5)
    finally:
        release.set()


def test_hanging_external_logger_cannot_hang_stop():
    inside, release = threading.Event(), threading.Event()

    class Hangs:
        def log(self, metrics):
            inside.set()
            release.wait(30)

    c = feeder.GlobalCoordinator(join_timeout=0.3)
    feeder.init_data_input_workers(None, ["x"], lambda w, b: rows(), 4, external_loggers=[Hangs()],
                                   log_interval=0.05, coordinator=c)
    c.start()
    try:
        assert inside.wait(5)
        t0 = time.monotonic()
        assert c.stop() is False  # the monitor is reported as a straggler
        assert time.monotonic() - t0 < 1.5
    finally:
        release.set()


@pytest.mark.parametrize("where", ["producer", "consumer"])
def test_a_failure_making_a_batch_in_a_pump_fails_the_feed_and_books_its_rows(coord, where):
    """A pump (a producer's or a consumer's, doing the enqueuer's work in its own thread) that
    meets a failure fails the feed, sticky, like the enqueuer; the rows it held are discarded at
    stop, never lost from the books (the autouse ledger check)."""
    from feeder.chunkqueue import Chunk

    gate = threading.Event()  # the producer under test is this thread: the fetcher waits

    def fetch(worker_id, batch_size):
        gate.wait(5)
        return rows()

    feeder.init_data_input_workers(None, ["x"], fetch, 4, num_worker_threads=1, coordinator=coord, timeout=10)
    feed = coord.feed("train")
    boom = RuntimeError("rebatcher broke")

    def add(arrays, n=None):
        raise boom

    feed._rebatcher.add = add
    feed._enqueue = lambda: None      # only the pump under test makes batches:
    feed._fetchers._pump = None       # the fetchers put their chunks on the source the usual way
    if where == "producer":
        feed._pump = lambda: None     # and the consumer waits; a producer's pump_put takes a chunk on
    coord.start()
    try:
        if where == "producer":
            assert feed.pump_put(Chunk(99, (np.zeros((4, 1), np.float32),), 4)) is True
        else:
            assert feed.source.put(Chunk(99, (np.zeros((4, 1), np.float32),), 4), 1.0) is True
        with pytest.raises(feeder.FeederError, match="making a batch failed in thread.*RuntimeError") as info:
            feed.next_batch()
        assert info.value.__cause__ is boom
        with pytest.raises(feeder.FeederError):
            feed.next_batch()
    finally:
        gate.set()
