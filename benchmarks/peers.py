"""What users would otherwise pick, reimplemented or wrapped for benchmarks/compare.py.

Every peer takes the same ``fetch(worker_id, batch_size)`` and yields batches (lists of
numpy arrays, or a torch tensor for the DataLoader) until ``stop`` is set.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator, List, Sequence

import numpy as np


# ---- 1. the serial loop a user writes first -----------------------------------------------
def serial_batches(fetch: Callable, batch_size: int) -> Iterator[List[np.ndarray]]:
    """Fetch, concatenate, hand on: no threads, leftover kept in a list."""
    pending: List[List[np.ndarray]] = []
    rows = 0
    while True:
        while rows < batch_size:
            chunk = fetch(0, batch_size)
            pending.append(chunk)
            rows += len(chunk[0])
        joined = [np.concatenate(parts) for parts in zip(*pending)]
        yield [a[:batch_size] for a in joined]
        rest = [a[batch_size:] for a in joined]
        rows = len(rest[0])
        pending = [rest] if rows else []


# ---- 2. the seed design (Caffe2 data_workers), reimplemented faithfully --------------------
class SeedFeeder:
    """Caffe2 ``data_workers`` as it was: fetcher threads put chunks on ``queue.Queue(800)``; one
    enqueuer grows each batch with ``np.append`` per chunk, ``np.split``s the overflow and
    re-queues it with ``put(block=False)`` (``except Full: pass`` drops it); batches go to a
    ready queue of 4. Stop is a flag checked between 0.5 s waits."""

    def __init__(self, fetch: Callable, batch_size: int, num_workers: int, batch_columns: Sequence[int] = (0,)):
        self.fetch = fetch
        self.batch_size = batch_size
        self.cols = list(batch_columns)
        self.internal = queue.Queue(800)
        self.ready = queue.Queue(4)
        self.active = True
        self.threads = [threading.Thread(target=self._fetcher, args=(w,), daemon=True) for w in range(num_workers)]
        self.threads.append(threading.Thread(target=self._enqueuer, daemon=True))

    def start(self) -> "SeedFeeder":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.active = False
        for t in self.threads:
            t.join(2.0)

    def _fetcher(self, worker_id: int) -> None:
        while self.active:
            chunk = self.fetch(worker_id, self.batch_size)
            while self.active:
                try:
                    self.internal.put(chunk, block=True, timeout=0.5)
                    break
                except queue.Full:
                    continue

    def _enqueuer(self) -> None:
        while self.active:
            batch = self._enqueue_batch()
            while self.active and batch is not None:
                try:
                    self.ready.put(batch, timeout=0.5)
                    break
                except queue.Full:
                    continue

    def _enqueue_batch(self):
        cur = [np.array([]) for _ in self.cols]
        col0 = self.cols[0]
        while (cur[0].shape[0] == 0 or cur[0].shape[col0] < self.batch_size) and self.active:
            try:
                chunk = self.internal.get(block=True, timeout=0.5)
            except queue.Empty:
                continue
            for j, elem in enumerate(chunk):
                if cur[j].shape[0] == 0:
                    cur[j] = elem.copy()
                else:
                    cur[j] = np.append(cur[j], elem, axis=self.cols[j])
        if not self.active:
            return None
        if cur[0].shape[col0] > self.batch_size:
            leftover, trimmed = [], []
            for j, b in enumerate(cur):
                c, rest = np.split(b, [self.batch_size], axis=self.cols[j])
                leftover.append(rest)
                trimmed.append(c)
            cur = trimmed
            try:
                self.internal.put(leftover, block=False)
            except queue.Full:
                pass  # the seed's bug: these rows are lost
        return cur

    def batches(self) -> Iterator[List[np.ndarray]]:
        while True:
            yield self.ready.get(timeout=60)


# ---- 3. PyTorch DataLoader over an IterableDataset of rows ---------------------------------
def torch_loader(fetch: Callable, batch_size: int, num_workers: int = 2):
    """``DataLoader(IterableDataset yielding rows, batch_size, num_workers)``: rows are collated
    (stacked) in the worker processes and sent through shared memory."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    class Rows(IterableDataset):
        def __iter__(self):
            info = get_worker_info()
            wid = info.id if info is not None else 0
            while True:
                chunk = fetch(wid, batch_size)
                arrays = chunk if len(chunk) > 1 else None
                if arrays is None:
                    for row in chunk[0]:
                        yield row
                else:
                    for row in zip(*arrays):
                        yield row

    torch.set_num_threads(1)
    return DataLoader(Rows(), batch_size=batch_size, num_workers=num_workers, persistent_workers=False,
                      prefetch_factor=4 if num_workers else None)
