"""Throughput logging and metrics: log lines, external loggers, metrics() contents."""
from __future__ import annotations

import logging
import threading

import numpy as np
from utils import ListLogger

import feeder


def test_metrics_are_floats_and_count_what_happened(coord):
    feeder.init_data_input_workers(None, ["x"], lambda w, b: [np.zeros((3, 2), np.float32)], 4, coordinator=coord)
    coord.start()
    feed = coord.feed("train")
    for _ in range(10):
        feed.next_batch(timeout=10)
    m = feed.metrics()
    assert all(isinstance(k, str) and isinstance(v, float) for k, v in m.items())
    assert m["batches"] == 10 and m["rows"] == 40 and m["batch_size"] == 4
    assert m["inputs_per_sec"] > 0 and m["queue_capacity"] == 800
    for key in ("queue_size", "ready_batches", "chunks_fetched", "fetch_errors", "source_rows_fetched",
                "source_rows_delivered", "source_rows_buffered", "consumer_wait_s", "live_workers"):
        assert key in m


def test_throughput_is_logged_every_interval_and_at_stop(coord, caplog):
    ext = ListLogger()
    feeder.init_data_input_workers(None, ["x"], lambda w, b: [np.zeros((3, 2), np.float32)], 4,
                                   external_loggers=[ext], log_interval=0.05, coordinator=coord)
    with caplog.at_level(logging.INFO, logger="feeder"):
        coord.start()
        assert ext.got.wait(5)
        coord.feed("train").next_batch(timeout=10)
        periodic = len(ext.records)
        coord.stop()
    # rows/s, the unit diagnose() uses too (the lines said "inputs/s")
    lines = [r.getMessage() for r in caplog.records if " rows/s (" in r.getMessage()]
    assert lines and all("'train'" in line and "queue" in line for line in lines)
    assert any("(final)" in line for line in lines)
    assert len(ext.records) > periodic >= 1  # the final report reached the external logger too
    assert all(isinstance(v, float) for v in ext.records[-1].values())


class _ExitingLogger:
    def __init__(self):
        self.calls = 0

    def log(self, metrics):
        self.calls += 1
        raise SystemExit(3)  # a logger calling sys.exit() must not kill the monitor thread


def test_external_logger_raising_a_base_exception_keeps_the_monitor_reporting(coord, caplog):
    """Issue 9, defect 9: only Exception was caught, so SystemExit killed the monitor thread and
    no feed of the coordinator reported again, the final report at stop included."""
    bad, good = _ExitingLogger(), ListLogger()
    feeder.init_data_input_workers(None, ["x"], lambda w, b: [np.zeros((3, 2), np.float32)], 4,
                                   external_loggers=[bad, good], log_interval=0.05, coordinator=coord)
    with caplog.at_level(logging.ERROR, logger="feeder"):
        coord.start()
        coord.feed("train").next_batch(timeout=10)
        assert good.got.wait(5)
        first = len(good.records)
        deadline = threading.Event()
        while len(good.records) < first + 2 and not deadline.wait(0.01):
            pass  # bounded below by the pytest timeout; reports come every 0.05 s
        assert coord._monitor.thread.is_alive()
        periodic = len(good.records)
        coord.stop()
    assert bad.calls >= 2
    assert len(good.records) > periodic  # the final report still ran
    assert any("SystemExit" in (r.exc_text or "") or "external logger" in r.getMessage() for r in caplog.records)


def test_an_external_logger_may_stop_the_coordinator_from_its_log_call(caplog):
    """stop() on the monitor thread (a logger's log() deciding the run is over) waited the whole
    join budget for itself, returned False and logged feeder:monitor as a thread still running."""
    import time

    coord = feeder.GlobalCoordinator(join_timeout=5.0)
    results, after = [], ListLogger()

    class Stopper:
        def log(self, metrics):
            if not results:
                t0 = time.monotonic()
                results.append((coord.stop(), time.monotonic() - t0, len(after.records)))

    feeder.init_data_input_workers(None, ["x"], lambda w, b: [np.zeros((3, 2), np.float32)], 4,
                                   external_loggers=[Stopper(), after], log_interval=0.05, coordinator=coord)
    with caplog.at_level(logging.WARNING, logger="feeder"):
        coord.start()
        deadline = time.monotonic() + 10
        while not results and time.monotonic() < deadline:
            time.sleep(0.01)
        ok, took, seen = results[0]
        assert ok is True and took < 2.0
        # the final report runs once log() has returned (after this report's), then the monitor ends
        monitor_threads = [t for t in threading.enumerate() if t.name.startswith("feeder:monitor")]
        for t in monitor_threads:
            t.join(5)
        assert not any(t.is_alive() for t in monitor_threads)
        assert len(after.records) >= seen + 2
    assert not [r for r in caplog.records if "still running" in r.getMessage()]
    assert not coord.feeds("train")


def test_consumer_counters_see_a_wait_while_it_lasts():
    """The tuner reads waits that are still going on: one longer than its window counted nothing."""
    from feeder.metrics import ConsumerCounters

    c = ConsumerCounters()
    c.wait_began(10.0)
    assert c.so_far(10.5) == (0.0, 0.0, 0.5)
    c.took(4, 16, 0.75, 10.0, 10.75)  # the wait ends in the total, not twice
    assert c.so_far(11.0) == (4.0, 1.0, 0.75)
    c.wait_began(11.0)
    c.wait_ended()  # end of data or stop: not a wait any more
    assert c.so_far(12.0)[2] == 0.75
