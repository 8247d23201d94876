"""Chunks of more than a quarter of a batch that the fetch made (issue 33: large rows on 2 cores).

When other fetchers share the source and a call took at least as long as copying its chunk would,
the fetcher cuts its chunks into whole batches itself (the rows are still in its core's cache, and
the copies run beside the other fetchers' instead of all falling to the thread that plans
batches): the feed then hands those batches on without a copy. A chunk returned as a view at once
keeps the old way (the feed copies it). Either way every row comes once."""
import threading
import time

import numpy as np

import feeder

BATCH = 64
ROWS = 40          # more than a quarter of a batch, less than one
WIDTH = 2048       # 8 KiB rows: 320 KiB chunks
ROWS4, WIDTH4 = 40, 16384  # 64 KiB rows: 2.5 MiB chunks


def _feed(coord, fetch, workers=2, batches=60):
    feeder.init_data_input_workers(None, ["x", "i"], fetch, BATCH, coordinator=coord, num_worker_threads=workers,
                                   timeout=30)
    coord.start()
    feed = coord.feed("train")
    seen = []
    for _ in range(batches):
        b = feed.next_batch()
        assert b["x"].shape == (BATCH, WIDTH)
        assert np.array_equal(b["x"][:, 0], b["i"].astype(np.float32))  # each row kept with its id
        assert np.array_equal(b["x"][:, -1], b["i"].astype(np.float32))
        seen.append(b["i"].copy())
    m = feed.metrics()
    coord.stop()
    ids = np.concatenate(seen)
    assert len(np.unique(ids)) == len(ids)  # nothing duplicated
    return m


class Made:
    """Fresh arrays written by the call (a decode would), with ids that never repeat."""

    def __init__(self, pause_s):
        self.pause_s = pause_s
        self.next = [0, 1 << 30]

    def __call__(self, wid, bs):
        start = self.next[wid]
        self.next[wid] += ROWS
        i = np.arange(start, start + ROWS, dtype=np.int64)
        if self.pause_s:
            time.sleep(self.pause_s)  # the call's own work: longer than copying its chunk takes
        x = np.empty((ROWS, WIDTH), np.float32)
        x[:] = i[:, None]
        return [x, i]


def test_chunks_the_call_made_are_cut_into_batches_by_their_fetchers(coord):
    m = _feed(coord, Made(pause_s=0.0005))
    # (a call slowed past COALESCE_SLOW_CALL_S by a loaded machine puts its rows as they come)
    assert m["zero_copy_batches"] >= 0.5 * m["batches"], m


def test_views_returned_at_once_are_still_copied_by_the_feed(coord):
    pool = np.repeat(np.arange(1 << 14, dtype=np.float32)[:, None], WIDTH, axis=1)
    ids = np.arange(1 << 14, dtype=np.int64)
    nxt = [0, 1 << 13]

    def view(wid, bs):
        s = nxt[wid]
        nxt[wid] += ROWS
        return [pool[s:s + ROWS], ids[s:s + ROWS]]

    m = _feed(coord, view)
    assert m["zero_copy_batches"] < 0.5 * m["batches"], m


def test_one_fetcher_leaves_the_copy_to_the_feed(coord):
    m = _feed(coord, Made(pause_s=0.0005), workers=1)
    assert m["zero_copy_batches"] < 0.5 * m["batches"], m


def test_fetchers_making_big_chunks_fast_call_side_by_side(coord):
    """A call that makes a big chunk in less than SHORT_CALL_S spends its time in a copy that
    releases the GIL (here a sleep stands for it): the fetchers must not take turns for it, as
    they do for tiny chunks, or two fetchers copy no faster than one (measured: 3 MB chunks
    copied in 0.12 ms, 0.96-1.0x the serial loop in turn, 1.3x side by side). Measured here:
    about 45% of the calls begin while the other fetcher's is under way, 0-2% in turn."""
    lock = threading.Lock()
    active = [0]
    calls = [0, 0]  # calls counted, calls begun while the other fetcher's call was under way
    nxt = [0, 1 << 30]

    def fetch(wid, bs):
        with lock:
            calls[0] += 1
            calls[1] += active[0] > 0
            active[0] += 1
        start = nxt[wid]
        nxt[wid] += ROWS4
        time.sleep(0.00005)  # the copy (2.5 MB in about 0.1 ms: a view would take microseconds)
        x = np.empty((ROWS4, WIDTH4), np.float32)
        i = np.arange(start, start + ROWS4, dtype=np.int64)
        x[:, 0] = i
        x[:, -1] = i
        with lock:
            active[0] -= 1
        return [x, i]

    feeder.init_data_input_workers(None, ["x", "i"], fetch, 2 * ROWS4, coordinator=coord, num_worker_threads=2,
                                   timeout=30)
    seen = []
    with coord:
        feed = coord.feed("train")
        for n in range(300):
            b = feed.next_batch()
            assert np.array_equal(b["x"][:, 0], b["i"].astype(np.float32))
            assert np.array_equal(b["x"][:, -1], b["i"].astype(np.float32))
            seen.append(b["i"].copy())
            if n == 20:
                with lock:  # (the first calls of both fetchers overlap in any case: none is known short yet)
                    calls[:] = [0, 0]
    ids = np.concatenate(seen)
    assert len(np.unique(ids)) == len(ids)
    assert calls[1] > 0.15 * calls[0], f"{calls[1]} of {calls[0]} calls overlapped another: the fetchers took turns"
