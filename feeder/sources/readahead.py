"""Reading units of work ahead of the fetch calls that will ask for them, to hide storage latency.

Reading one Parquet row group from an object store costs a request or two of 50-100 ms, most
of it waiting: a few fetcher threads, each waiting for its own row group, cannot keep a model
busy. A :class:`Readahead` is a small pool of daemon threads (named
``feeder:<source>:readahead-<k>``) that runs the reads of the units a source has already taken
from its sequence, so that many requests are in flight while the fetch calls consume what came
back. Memory is bounded in bytes: the units read or being read and not yet taken (by their
decoded size) stay under ``max_bytes``, with at least one always allowed.

A waiting fetch call waits in short slices; once the pool is closed (the source released at
``stop()``), a read not yet started is run by the caller itself, so that nobody waits on a pool
that is gone. :meth:`Readahead.close` ends every thread within its join budget.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Hashable, List, Optional

SLICE_S = 0.1   # longest single wait of a pool thread or a waiting caller
JOIN_S = 2.0    # close(): how long it waits for the threads in all


class _Slot:
    __slots__ = ("fn", "nbytes", "state", "value", "error", "done")

    def __init__(self, fn: Callable[[], Any], nbytes: int):
        self.fn = fn
        self.nbytes = nbytes
        self.state = "pending"   # -> "running" -> "done"; or "taken" by a caller that runs it itself
        self.value: Any = None
        self.error: Optional[BaseException] = None
        self.done = threading.Event()


class Readahead:
    """Reads submitted under a key run on ``threads`` daemon threads; :meth:`take` gets the
    oldest one of a key back. ``max_bytes`` bounds what is read and not yet taken."""

    def __init__(self, name: str, threads: int, max_bytes: int):
        self.name = name
        self.max_bytes = int(max_bytes)
        self._cond = threading.Condition()
        self._queue: Deque[_Slot] = deque()
        self._by_key: Dict[Hashable, Deque[_Slot]] = {}
        self._reserved = 0
        self._closed = False
        self._threads: List[threading.Thread] = [
            threading.Thread(target=self._loop, name=f"{name}-{k}", daemon=True) for k in range(max(1, threads))]
        for t in self._threads:
            t.start()

    @property
    def reserved(self) -> int:
        """Bytes of the reads submitted and not yet taken."""
        return self._reserved

    def room(self, nbytes: int) -> bool:
        """Whether a read of ``nbytes`` fits the bound now (one always does when none is held)."""
        with self._cond:
            return not self._closed and (self._reserved == 0 or self._reserved + nbytes <= self.max_bytes)

    def submit(self, key: Hashable, fn: Callable[[], Any], nbytes: int) -> None:
        """Run ``fn`` on a pool thread; its result is kept for the next :meth:`take` of ``key``."""
        slot = _Slot(fn, int(nbytes))
        with self._cond:
            if self._closed:
                return
            self._reserved += slot.nbytes
            self._by_key.setdefault(key, deque()).append(slot)
            self._queue.append(slot)
            self._cond.notify()

    def pending(self, key: Hashable) -> int:
        with self._cond:
            return len(self._by_key.get(key, ()))

    def take(self, key: Hashable) -> Optional[Callable[[], Any]]:
        """The oldest read submitted under ``key`` as a callable that returns its result (waiting
        for it, or running it in the caller if no thread has started it), or None if none is."""
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
            with self._cond:
                if slot.state == "pending" and self._closed:
                    slot.state = "taken"  # no thread will start it now: run it here
                    try:
                        self._queue.remove(slot)
                    except ValueError:
                        pass
                    break
        else:
            if slot.error is not None:
                raise slot.error
            return slot.value
        return slot.fn()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait(SLICE_S)
                if self._closed:
                    return
                slot = self._queue.popleft()
                slot.state = "running"
            try:
                slot.value = slot.fn()
            except BaseException as e:  # handed to the caller that takes it
                slot.error = e
            slot.state = "done"
            slot.done.set()
            slot.fn = _done  # let go of what the read referred to

    def close(self) -> bool:
        """Stop the threads (reads under way finish on their own) and forget what was read;
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


def _done() -> Any:
    raise RuntimeError("a readahead slot was run twice")
