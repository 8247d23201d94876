"""Small test doubles and waits shared by the test modules."""
from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Wait for a state that no Event announces (e.g. a queue filling up), bounded by ``timeout`` s."""
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        tick.wait(0.005)


class Dataset:
    """A finite dataset of ``n`` rows served in chunks: ids plus a float copy to check alignment.

    Thread-safe; chunk sizes come from ``sizes`` (cycled). Raises StopIteration when drained.
    """

    def __init__(self, n: int, sizes=(5,), width: int = 2, delay: Callable[[], float] = None):
        self.n = n
        self.sizes = list(sizes)
        self.width = width
        self._next = 0
        self._calls = 0
        self._lock = threading.Lock()
        self.delay = delay

    def __call__(self, worker_id: int, batch_size: int):
        if self.delay is not None:
            d = self.delay()
            if d:
                time.sleep(d)  # simulates I/O latency; not used to synchronise
        with self._lock:
            if self._next >= self.n:
                raise StopIteration
            size = self.sizes[self._calls % len(self.sizes)]
            self._calls += 1
            start, stop = self._next, min(self.n, self._next + size)
            self._next = stop
        ids = np.arange(start, stop, dtype=np.int64)
        return [ids, np.repeat(ids[:, None].astype(np.float32), self.width, axis=1)]


def check_aligned(batch) -> np.ndarray:
    ids = batch["id"]
    assert (batch["x"] == ids[:, None]).all(), "rows of the inputs are not aligned"
    return ids.copy()


class ListLogger:
    """An external logger recording every metrics dict it receives."""

    def __init__(self):
        self.records = []
        self.got = threading.Event()

    def log(self, metrics):
        self.records.append(metrics)
        self.got.set()


class Sharded:
    """``n`` rows (ids plus an aligned float copy) split into ``workers`` contiguous shards: worker
    ``w`` (``first_id + w`` is its worker id) serves its own shard in chunks of ``sizes`` (cycled),
    then raises StopIteration. Per-worker state only, so the same rows come out whether the workers
    are threads sharing this object or processes holding copies of it (module-level, picklable)."""

    def __init__(self, n: int, workers: int, sizes=(5,), width: int = 2, first_id: int = 0, delay: float = 0.0):
        self.n, self.workers, self.sizes, self.width = n, workers, list(sizes), width
        self.first_id, self.delay = first_id, delay
        self._pos = {}

    def shard(self, w: int):
        k = w - self.first_id
        return self.n * k // self.workers, self.n * (k + 1) // self.workers

    def __call__(self, worker_id: int, batch_size: int):
        if self.delay:
            time.sleep(self.delay)
        lo, hi = self.shard(worker_id)
        pos, calls = self._pos.get(worker_id, (lo, 0))
        if pos >= hi:
            raise StopIteration
        stop = min(hi, pos + self.sizes[calls % len(self.sizes)])
        self._pos[worker_id] = (stop, calls + 1)
        ids = np.arange(pos, stop, dtype=np.int64)
        return [ids, np.repeat(ids[:, None].astype(np.float32), self.width, axis=1)]
