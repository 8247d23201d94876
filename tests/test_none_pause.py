"""fetch_fun returning None ("nothing this time"): the fetcher pauses before its next call, the
warning is logged once in a while with a count, and a FeedTimeout says that the calls returned
None (issue 35, item 3). Threads and worker processes alike."""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from utils import workers

import feeder
from feeder.pacing import NONE_PAUSE_FIRST_S, NONE_PAUSE_MAX_S, NoneReport, none_pause


def nothing(worker_id, batch_size):
    return None


class NoneThenRows:
    """Alternates None and a chunk of 4 rows, ``chunks`` chunks in all (per worker), then ends."""

    def __init__(self, chunks: int):
        self.chunks = chunks
        self.calls = {}

    def __call__(self, worker_id, batch_size):
        k = self.calls.get(worker_id, 0)
        self.calls[worker_id] = k + 1
        if k // 2 >= self.chunks:
            raise StopIteration
        if k % 2 == 0:
            return None
        return [np.full((4, 2), k // 2, np.float32)]


def test_the_pause_doubles_from_a_millisecond_up_to_its_cap():
    pauses = [0.0]
    for _ in range(12):
        pauses.append(none_pause(pauses[-1]))
    assert pauses[1] == NONE_PAUSE_FIRST_S and pauses[2] == 2 * NONE_PAUSE_FIRST_S
    assert max(pauses) == NONE_PAUSE_MAX_S == pauses[-1]
    assert none_pause(0.0) == NONE_PAUSE_FIRST_S  # a call that returned data starts it afresh


def test_the_report_logs_the_first_none_then_a_count_once_per_interval(caplog):
    report = NoneReport("src", interval_s=3600.0)
    with caplog.at_level(logging.WARNING, logger="feeder"):
        for i in range(1000):
            report.note(i % 3)
    lines = [r.getMessage() for r in caplog.records if "returned None" in r.getMessage()]
    assert len(lines) == 1 and "worker 0" in lines[0] and report.total == 1000
    report._next = 0.0  # the interval is over
    with caplog.at_level(logging.WARNING, logger="feeder"):
        report.note(2)
    assert "returned None 1000 times" in caplog.records[-1].getMessage()  # 999 meanwhile and this one
    assert "workers [0, 1, 2]" in caplog.records[-1].getMessage()


def test_a_fetch_that_always_returns_none_is_called_a_bounded_number_of_times(coord, mode, caplog):
    # Before: 284,327 warning lines in 5 s, one per call, and a FeedTimeout that said only "call #171143".
    feeder.init_data_input_workers(None, ["x"], nothing, 4, coordinator=coord, timeout=1.5, **workers(mode, 2))
    with caplog.at_level(logging.WARNING, logger="feeder"):
        coord.start()
        feed = coord.feed("train")
        with pytest.raises(feeder.FeedTimeout) as raised:
            feed.next_batch()
        calls = feed.metrics()["fetch_calls"]
    message = str(raised.value)
    assert "every fetch_fun call" in message and "returned None" in message, message
    assert "pausing after fetch_fun returned None" in message, message  # what each worker is doing
    # 2 workers for 1.5 s, pausing up to 50 ms: about 70 calls; without pauses, hundreds of thousands
    assert 1 <= calls <= 400, calls
    assert feed.metrics()["none_chunks"] == calls
    lines = [r for r in caplog.records if "returned None" in r.getMessage()]
    assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]


def empty(worker_id, batch_size):
    return [np.zeros((0, 2), np.float32)]


def test_a_fetch_that_returns_only_empty_chunks_is_logged_once_in_a_while(coord, mode, caplog):
    # Before: one WARNING per call, about 100,000 lines a second from one fetcher.
    feeder.init_data_input_workers(None, ["x"], empty, 4, coordinator=coord, timeout=1.0, **workers(mode, 2))
    with caplog.at_level(logging.WARNING, logger="feeder"):
        coord.start()
        feed = coord.feed("train")
        with pytest.raises(feeder.FeedTimeout):
            feed.next_batch()
        chunks = feed.metrics()["empty_chunks"]
    lines = [r.getMessage() for r in caplog.records if "0 rows" in r.getMessage()]
    assert chunks > 10 and 1 <= len(lines) <= 2, (chunks, lines)
    assert "source 'train' worker" in lines[0] and "logged at most every" in lines[0]


def test_none_between_chunks_costs_a_millisecond_not_the_longest_pause(coord, mode):
    # The pause starts afresh after every call that returned data: 200 chunks each after one None
    # take ~0.2 s of pauses; had it kept growing, 200 x 50 ms = 10 s.
    fetch = NoneThenRows(200)
    feeder.init_data_input_workers(None, ["x"], fetch, 8, coordinator=coord, timeout=30, **workers(mode, 1))
    coord.start()
    feed = coord.feed("train")
    t0 = time.monotonic()
    first = feed.next_batch()
    rows = len(first["x"]) + sum(len(b["x"]) for b in feed)
    elapsed = time.monotonic() - t0
    assert rows == 800
    assert elapsed < 5.0, f"{elapsed:.2f} s for 200 chunks each after a None"
    assert feed.metrics()["none_chunks"] == 200
