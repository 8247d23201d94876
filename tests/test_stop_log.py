"""What a normal stop logs about the rows it discards (issue 35, item 10): the rows prefetched from
a source still being read are no news (DEBUG; they were logged at INFO after every job, which read
like an error), rows of a finite source that no consumer took are (INFO)."""
from __future__ import annotations

import logging

import numpy as np
from utils import wait_until

import feeder
from feeder.sources import ArraySource


def endless(worker_id, batch_size):
    return [np.zeros((8, 2), np.float32)]


class Finite:
    def __init__(self, chunks):
        self.left = chunks

    def __call__(self, worker_id, batch_size):
        if self.left <= 0:
            raise StopIteration
        self.left -= 1
        return [np.zeros((8, 2), np.float32)]


def discard_lines(caplog, level):
    return [r.getMessage() for r in caplog.records if "stop discarded" in r.getMessage() and r.levelno == level]


def run_then_stop(coord, fetch, caplog, settled):
    feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord, num_worker_threads=1,
                                   max_buffered_batches=8)
    with caplog.at_level(logging.DEBUG, logger="feeder"):
        coord.start()
        feed = coord.feed("train")
        feed.next_batch()
        wait_until(lambda: settled(feed), what="rows waiting in the source")
        coord.stop()


def test_prefetched_rows_of_a_source_being_read_are_logged_at_debug(coord, caplog):
    run_then_stop(coord, endless, caplog, lambda f: f.metrics()["queue_size"] > 0)
    assert not discard_lines(caplog, logging.INFO) and not discard_lines(caplog, logging.WARNING)
    (line,) = discard_lines(caplog, logging.DEBUG)
    assert "prefetched rows" in line and "'train'" in line


def test_an_endless_source_of_feeder_sources_is_debug_too(coord, caplog):
    source = ArraySource({"x": np.zeros((64, 2), np.float32)}, epochs=None, block_rows=8)
    run_then_stop(coord, source, caplog, lambda f: f.metrics()["queue_size"] > 0)
    assert not discard_lines(caplog, logging.INFO) and len(discard_lines(caplog, logging.DEBUG)) == 1


def test_rows_of_a_finite_source_that_no_consumer_took_are_logged_at_info(coord, caplog):
    source = ArraySource({"x": np.zeros((4096, 2), np.float32)}, epochs=1, block_rows=8)
    run_then_stop(coord, source, caplog, lambda f: f.metrics()["queue_size"] > 0)
    (line,) = discard_lines(caplog, logging.INFO)
    assert "finite source" in line and "no consumer had taken" in line


def test_a_source_read_to_the_end_says_so(coord, caplog):
    run_then_stop(coord, Finite(6), caplog, lambda f: f.metrics()["live_workers"] == 0)
    (line,) = discard_lines(caplog, logging.INFO)
    assert "read it to the end" in line
