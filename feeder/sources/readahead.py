"""Reading units of work ahead of the fetch calls that will ask for them, to hide storage latency.

Reading one Parquet row group from an object store costs a request of 50-100 ms, most of it
waiting: a few fetcher threads, each waiting for its own row group, cannot keep a model busy. A
:class:`Readahead` is a small pool of daemon threads (named ``feeder:<source>:readahead-<k>``)
that runs the reads of the units a source has already taken from its sequence, so that many
requests are in flight while the fetch calls consume what came back. One job may read several
units at once (adjacent row groups of one file, fetched in one request); each unit's result is
taken on its own. Memory is bounded in bytes: the units read or being read and not yet taken (by
their decoded size) stay under ``max_bytes``, with at least one job always allowed.

A waiting fetch call waits in short slices; once the pool is closed (the source released at
``stop()``), a job not yet started is run by the caller itself, so that nobody waits on a pool
that is gone. :meth:`Readahead.close` ends every thread within its join budget.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Hashable, List, Optional, Sequence

SLICE_S = 0.1   # longest single wait of a pool thread or a waiting caller
JOIN_S = 2.0    # close(): how long it waits for the threads in all


class _Job:
    """One read on a pool thread, giving one result per unit it covers."""

    __slots__ = ("fn", "slots", "state", "lock")

    def __init__(self, fn: Callable[[], Sequence[Any]]):
        self.fn = fn
        self.slots: List[_Slot] = []
        self.state = "pending"   # -> "running" -> "done"
        self.lock = threading.Lock()

    def run(self) -> None:
        """Run it here (once: a second caller finds it running or done and returns)."""
        with self.lock:
            if self.state != "pending":
                return
            self.state = "running"
        try:
            values = list(self.fn())
        except BaseException as e:  # handed to every caller that takes one of its units
            for slot in self.slots:
                slot.error = e
        else:
            for slot, value in zip(self.slots, values):
                slot.value = value
        self.state = "done"
        self.fn = _done  # let go of what the read referred to
        for slot in self.slots:
            slot.done.set()


class _Slot:
    __slots__ = ("job", "nbytes", "value", "error", "done")

    def __init__(self, job: _Job, nbytes: int):
        self.job = job
        self.nbytes = nbytes
        self.value: Any = None
        self.error: Optional[BaseException] = None
        self.done = threading.Event()


class Readahead:
    """Jobs submitted under keys run on ``threads`` daemon threads; :meth:`take` gets the oldest
    result of a key back. ``max_bytes`` bounds what is read and not yet taken."""

    def __init__(self, name: str, threads: int, max_bytes: int):
        self.name = name
        self.max_bytes = int(max_bytes)
        self._cond = threading.Condition()
        self._queue: Deque[_Job] = deque()
        self._by_key: Dict[Hashable, Deque[_Slot]] = {}
        self._reserved = 0
        self._closed = False
        self._threads: List[threading.Thread] = [
            threading.Thread(target=self._loop, name=f"{name}-{k}", daemon=True) for k in range(max(1, threads))]
        for t in self._threads:
            t.start()

    @property
    def reserved(self) -> int:
        """Bytes of the units submitted and not yet taken."""
        return self._reserved

    def room(self, nbytes: int) -> bool:
        """Whether a job of ``nbytes`` fits the bound now (one always does when none is held)."""
        with self._cond:
            return not self._closed and (self._reserved == 0 or self._reserved + nbytes <= self.max_bytes)

    def submit(self, keys: Sequence[Hashable], fn: Callable[[], Sequence[Any]], nbytes: Sequence[int]) -> None:
        """Run ``fn`` on a pool thread; it returns one result per key, each kept for the next
        :meth:`take` of its key (``nbytes``: each one's size)."""
        job = _Job(fn)
        with self._cond:
            if self._closed:
                return
            for key, size in zip(keys, nbytes):
                slot = _Slot(job, int(size))
                job.slots.append(slot)
                self._reserved += slot.nbytes
                self._by_key.setdefault(key, deque()).append(slot)
            self._queue.append(job)
            self._cond.notify()

    def take(self, key: Hashable) -> Optional[Callable[[], Any]]:
        """The oldest result submitted under ``key`` as a callable that returns it (waiting for
        its job, or running the job in the caller if no thread has started it), or None."""
        with self._cond:
            slots = self._by_key.get(key)
            if not slots:
                return None
            slot = slots.popleft()
            if not slots:
                del self._by_key[key]
            self._reserved -= slot.nbytes
            self._cond.notify_all()
            return lambda: self._result(slot)

    def _result(self, slot: _Slot) -> Any:
        while not slot.done.wait(SLICE_S):
            if self._closed and slot.job.state == "pending":
                slot.job.run()  # no thread will start it now: run it here
        if slot.error is not None:
            raise slot.error
        value, slot.value = slot.value, None
        return value

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait(SLICE_S)
                if self._closed:
                    return
                job = self._queue.popleft()
            job.run()

    def close(self) -> bool:
        """Stop the threads (jobs under way finish on their own) and forget what was read;
        True if every thread ended within the join budget."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._by_key.clear()
            self._reserved = 0
            self._cond.notify_all()
        deadline = time.monotonic() + JOIN_S
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads if t is not threading.current_thread())


def _done() -> Sequence[Any]:
    raise RuntimeError("a readahead job was run twice")
