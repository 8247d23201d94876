"""max_buffered_bytes: with fast fetchers and a slow consumer, memory stays under the bound (issue 4)."""
from __future__ import annotations

import threading
import tracemalloc

import numpy as np
import pytest
from utils import Sharded, batch_of_64k, check_aligned, wait_until, workers

import feeder

ROW_BYTES = 1024 * 4  # 1024 float32 per row
CHUNK_ROWS = 64       # 256 KiB per chunk
BATCH = 32            # 128 KiB per batch


def test_bytes_held_by_a_source_stay_under_max_buffered_bytes(coord):
    bound = 4 * 2**20  # 4 MiB; without it, 800 chunks of 256 KiB would be 200 MiB
    seen = {"chunks": 0}
    lock = threading.Lock()

    def fetch(worker_id, batch_size):
        with lock:
            seen["chunks"] += 1
        return [np.ones((CHUNK_ROWS, 1024), np.float32)]

    tracemalloc.start()
    try:
        feeder.init_data_input_workers(None, ["x"], fetch, BATCH, num_worker_threads=3,
                                       max_buffered_bytes=bound, coordinator=coord, timeout=10)
        coord.start()
        feed = coord.feed("train")
        wait_until(lambda: feed.metrics()["source_bytes_held"] > bound - CHUNK_ROWS * ROW_BYTES,
                   what="the source to fill up to its bound")
        tracemalloc.reset_peak()
        for i in range(200):  # a slow consumer: producers keep hitting the bound
            batch = feed.next_batch()
            del batch
            if i % 20 == 0:
                threading.Event().wait(0.01)
        current, peak = tracemalloc.get_traced_memory()
        held_max = feed.source.max_bytes_seen
    finally:
        coord.stop()
        tracemalloc.stop()
    # What the source counts never exceeds the bound ...
    assert held_max <= bound
    # ... and what Python really allocated stays near it: the bound, plus one chunk that a
    # partially consumed view keeps alive, the reusable batch buffers, and one chunk per fetcher
    # waiting for room.
    slack = CHUNK_ROWS * ROW_BYTES * (1 + 3) + 6 * BATCH * ROW_BYTES + 2**20
    assert peak < bound + slack, f"peak {peak / 2**20:.1f} MiB for a bound of {bound / 2**20:.1f} MiB"
    assert seen["chunks"] < 800


def test_without_a_byte_bound_the_chunk_queue_bounds_memory_in_chunks(coord):
    feeder.init_data_input_workers(None, ["x"], lambda w, b: [np.ones((4, 8), np.float32)], 4,
                                   max_buffered_batches=5, coordinator=coord, timeout=10)
    coord.start()
    feed = coord.feed("train")
    wait_until(lambda: feed.source.full(), what="a full queue")
    assert feed.source.qsize() == 5


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_tight_byte_bound_never_deadlocks(ordered, replicas, mode):
    """Leftover rows count as held and only move on when more rows come: a bound near one batch
    must still let the source finish (found in review: it used to stall for good)."""
    coord = feeder.GlobalCoordinator()
    chunk_rows, batch = 6, 8  # chunks of 3/4 of a batch
    row_bytes = 8 * 8
    data = Sharded(400, 2 * replicas, sizes=(chunk_rows,), width=8)  # one dataset, shared by the replicas
    try:
        for _ in range(replicas):
            feeder.init_data_input_workers(None, ["id", "x"], data, batch,
                                           ordered=ordered, coordinator=coord, timeout=5, **workers(mode, 2),
                                           max_buffered_bytes=int(1.25 * batch * (row_bytes + 8)))
        coord.start()
        got = []
        threads = [threading.Thread(target=lambda f=f: got.extend(check_aligned(b) for b in f))
                   for f in coord.feeds("train")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert sorted(np.concatenate(got).tolist()) == list(range(400))
    finally:
        assert coord.stop() is True


@pytest.mark.parametrize("bound_batches", [1, 2, 4])
def test_byte_bound_below_six_batches_is_hard_when_the_consumer_stops_taking(coord, bound_batches, mode):
    """Issue 9, defect 2: 64 KiB chunks (one batch each), 2 workers, a consumer that stops
    taking: bounds of 64, 128 and 256 KiB all held 384 KiB."""
    chunk_bytes = 64 * 1024
    bound = bound_batches * chunk_bytes

    feeder.init_data_input_workers(None, ["x"], batch_of_64k, 16, max_buffered_bytes=bound,
                                   coordinator=coord, timeout=10, **workers(mode, 2))
    coord.start()
    feed = coord.feed("train")
    feed.next_batch()  # then stop taking
    wait_until(lambda: feed.metrics()["source_bytes_held"] >= bound, what="the source to fill to its bound")
    threading.Event().wait(0.3)  # give producers time to overshoot, as they used to
    assert feed.source.max_bytes_seen <= bound
    assert feed.metrics()["source_bytes_held"] <= bound


@pytest.mark.parametrize("ordered", [False, True])
def test_without_a_byte_bound_the_queue_stops_at_the_default_working_set(coord, ordered):
    """max_buffered_batches counts chunks: 800 chunks of 1 MiB would be 800 MiB, past every
    cache. The queue stops taking chunks at DEFAULT_QUEUE_BYTES (plus the one that crossed it)."""
    from feeder.chunkqueue import DEFAULT_QUEUE_BYTES

    chunk = np.ones((64, 4096), np.float32)  # 1 MiB

    def fetch(worker_id, batch_size):
        return [chunk.copy()]

    feeder.init_data_input_workers(None, ["x"], fetch, 64, num_worker_threads=3, coordinator=coord,
                                   ordered=ordered, timeout=10)
    coord.start()
    feed = coord.feed("train")
    queue = feed.source
    wait_until(lambda: queue.queued_bytes >= DEFAULT_QUEUE_BYTES - chunk.nbytes,
               what="the queue to fill up to the default bound")
    threading.Event().wait(0.3)  # the fetchers keep trying meanwhile
    assert queue.queued_bytes <= DEFAULT_QUEUE_BYTES + chunk.nbytes
    assert queue.qsize() < 800
    # and it still delivers, in order where asked
    batches = [feed.next_batch()["x"] for _ in range(100)]
    assert all(len(b) == 64 for b in batches)
