"""Coordinator lifecycle: start/stop, init_funs, lookup, context manager, queues, the default instance."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import feeder


def zeros(worker_id, batch_size):
    return [np.zeros((batch_size, 2), np.float32)]


def test_init_funs_run_serially_before_any_thread(coord):
    calls = []

    def init(tag):
        def f(feed, c):
            assert c is coord and isinstance(feed, feeder.Feed)
            assert not [t for t in threading.enumerate() if t.name.startswith("feeder:")]
            calls.append(tag)
        return f

    feeder.init_data_input_workers(None, ["x"], zeros, 2, input_source_name="a", init_fun=init("a"),
                                   coordinator=coord)
    feeder.init_data_input_workers(None, ["x"], zeros, 2, input_source_name="b", init_fun=init("b"),
                                   coordinator=coord)
    coord.start()
    assert calls == ["a", "b"]
    coord.start()  # again: nothing pending, nothing re-run
    assert calls == ["a", "b"]


def test_init_fun_exception_propagates_unchanged_and_nothing_starts(coord):
    boom = RuntimeError("init failed")

    def bad_init(feed, c):
        raise boom

    feeder.init_data_input_workers(None, ["x"], zeros, 2, input_source_name="a", coordinator=coord)
    feeder.init_data_input_workers(None, ["x"], zeros, 2, input_source_name="b", init_fun=bad_init,
                                   coordinator=coord)
    with pytest.raises(RuntimeError) as info:
        coord.start()
    assert info.value is boom
    assert not [t for t in threading.enumerate() if t.name.startswith("feeder:")]
    with pytest.raises(feeder.FeederError, match="not been started"):
        coord.feed("a").next_batch(timeout=0.1)


def test_consumer_before_start_raises_feeder_error(coord):
    feeder.init_data_input_workers(None, ["x"], zeros, 2, coordinator=coord)
    with pytest.raises(feeder.FeederError):
        coord.feed("train").next_batch()


def test_feed_lookup(coord):
    with pytest.raises(KeyError):
        coord.feed("train")
    feeder.init_data_input_workers(None, ["x"], zeros, 2, coordinator=coord)
    feeder.init_data_input_workers(None, ["x"], zeros, 2, coordinator=coord)
    feeder.init_data_input_workers(None, ["x"], zeros, 2, input_source_name="test", coordinator=coord)
    with pytest.raises(ValueError, match="2 feeds"):
        coord.feed("train")
    assert len(coord.feeds("train")) == 2 and coord.feeds("nope") == []
    assert coord.feed("test").input_source_name == "test"
    assert coord.feed("test").input_names == ["x"] and coord.feed("test").batch_size == 2


def test_replicas_must_feed_the_same_inputs(coord):
    feeder.init_data_input_workers(None, ["x"], zeros, 2, coordinator=coord)
    with pytest.raises(ValueError, match="inputs=.*must use the same"):
        feeder.init_data_input_workers(None, ["y"], zeros, 2, coordinator=coord)


def test_get_queue_is_named_bounded_and_shared(coord):
    q = coord.get_queue("train", 7)
    assert q.maxsize == 7 and q.qsize() == 0 and q.empty()
    assert coord.get_queue("train", 99) is q  # the first use sizes it
    feeder.init_data_input_workers(None, ["x"], zeros, 2, coordinator=coord)
    assert coord.feed("train").source is q
    assert coord.get_queue("other", 3) is not q


def test_sources_never_mix(coord):
    feeder.init_data_input_workers(None, ["x"], lambda w, b: [np.full((3, 1), 1.0)], 4,
                                   input_source_name="train", coordinator=coord)
    feeder.init_data_input_workers(None, ["x"], lambda w, b: [np.full((3, 1), 2.0)], 4,
                                   input_source_name="test", coordinator=coord)
    with coord:
        for _ in range(50):
            assert (coord.feed("train").next_batch(timeout=10)["x"] == 1.0).all()
            assert (coord.feed("test").next_batch(timeout=10)["x"] == 2.0).all()


def test_context_manager_and_feed_stopped_after(coord):
    feeder.init_data_input_workers(None, ["x"], zeros, 2, coordinator=coord)
    with coord as c:
        assert c is coord
        feed = coord.feed("train")
        feed.next_batch(timeout=10)
    with pytest.raises(feeder.FeedStopped):
        feed.next_batch(timeout=1)
    with pytest.raises(feeder.FeedStopped):
        next(iter(feed))
    assert coord.feeds("train") == []


def test_stop_is_idempotent_and_fine_before_start(coord):
    assert coord.stop() is True
    feeder.init_data_input_workers(None, ["x"], zeros, 2, coordinator=coord)
    assert coord.stop() is True
    assert coord.stop() is True


def test_register_after_stop_and_start_again(coord):
    for _ in range(3):
        feeder.init_data_input_workers(None, ["x"], zeros, 2, coordinator=coord)
        coord.start()
        assert coord.feed("train").next_batch(timeout=10)["x"].shape == (2, 2)
        assert coord.stop() is True


def test_stop_coordinator_stops_one_source(coord):
    feeder.init_data_input_workers(None, ["x"], zeros, 2, input_source_name="a", coordinator=coord)
    feeder.init_data_input_workers(None, ["x"], zeros, 2, input_source_name="b", coordinator=coord)
    coord.start()
    a, b = coord.feed("a"), coord.feed("b")
    assert coord.stop_coordinator("a") is True
    with pytest.raises(feeder.FeedStopped):
        a.next_batch(timeout=1)
    assert b.next_batch(timeout=10)["x"].shape == (2, 2)
    assert coord.feeds("a") == [] and "a" not in coord.sources


def test_stop_wakes_a_blocked_consumer_within_a_fraction_of_a_second(coord):
    release = threading.Event()
    entered = threading.Event()

    def stuck(worker_id, batch_size):
        entered.set()
        release.wait(10)
        raise StopIteration

    feeder.init_data_input_workers(None, ["x"], stuck, 2, coordinator=coord)
    coord.start()
    feed = coord.feed("train")
    outcome = []
    waiting = threading.Event()

    def consume():
        waiting.set()
        try:
            feed.next_batch(timeout=30)
        except BaseException as e:  # noqa: B902
            outcome.append((e, time.monotonic()))

    t = threading.Thread(target=consume)
    t.start()
    assert waiting.wait(5) and entered.wait(5)
    t0 = time.monotonic()
    try:
        assert coord.stop(timeout=0.3) is False  # the fetchers are stuck in fetch_fun: reported, not awaited
    finally:
        release.set()
    t.join(5)
    assert not t.is_alive()
    (err, woke), = outcome
    assert isinstance(err, feeder.FeedStopped)
    assert woke - t0 < 0.3


def test_global_coordinator_is_the_default():
    assert isinstance(feeder.global_coordinator, feeder.GlobalCoordinator)
    c = feeder.init_data_input_workers(None, ["x"], zeros, 2, input_source_name="default-test")
    try:
        assert c is feeder.global_coordinator
        c.start()
        assert c.feed("default-test").next_batch(timeout=10)["x"].shape == (2, 2)
    finally:
        assert feeder.global_coordinator.stop() is True


def test_init_fun_calling_start_is_an_error_not_a_recursion(coord):
    def init(feed, c):
        c.start()

    feeder.init_data_input_workers(None, ["x"], zeros, 2, init_fun=init, coordinator=coord)
    with pytest.raises(feeder.FeederError, match="init_fun"):
        coord.start()
    assert not [t for t in threading.enumerate() if t.name.startswith("feeder:")]


def test_replicas_must_agree_on_batch_columns_and_dont_rebatch(coord):
    feeder.init_data_input_workers(None, ["x"], zeros, 2, coordinator=coord)
    with pytest.raises(ValueError, match="batch_columns"):
        feeder.init_data_input_workers(None, ["x"], zeros, 2, batch_columns=[1], coordinator=coord)
    with pytest.raises(ValueError, match="dont_rebatch"):
        feeder.init_data_input_workers(None, ["x"], zeros, 2, dont_rebatch=True, coordinator=coord)


def test_stop_coordinator_hands_the_final_report_over_before_returning(coord):
    from utils import ListLogger

    a, b = ListLogger(), ListLogger()
    feeder.init_data_input_workers(None, ["x"], zeros, 2, input_source_name="a", external_loggers=[a],
                                   coordinator=coord)
    feeder.init_data_input_workers(None, ["x"], zeros, 2, input_source_name="b", external_loggers=[b],
                                   coordinator=coord)
    coord.start()
    coord.feed("a").next_batch(timeout=10)
    assert coord.stop_coordinator("a") is True
    assert len(a.records) == 1 and a.records[0]["batches"] == 1.0  # the final report, already delivered
    assert b.records == []
