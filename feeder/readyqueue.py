"""A feed's queue of prepared batches, which also counts what left through it.

The enqueuer pushes batches; consumers pop them. Rows delivered are *derived*: rows pushed
minus rows still queued. So taking a batch and counting it as delivered is one step, the
``deque.popleft`` itself: an audit of the row ledger from another thread (end of data seen by
another consumer, ``stop()``) can never find a batch that is neither held nor delivered, and an
exception in the consumer right after the pop (a KeyboardInterrupt) cannot lose it from the count.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Deque, Optional, Tuple


class ReadyQueue:
    """Bounded FIFO of items with ``rows`` and ``nbytes`` attributes; every wait is bounded.

    ``maxsize`` may be changed while running (the feed sizes it from its first batch).
    """

    def __init__(self, maxsize: int = 1):
        self.maxsize = maxsize
        self._items: Deque[Any] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._pushed_rows = 0
        self._pushed_bytes = 0
        # Called with each popped item under the queue's lock, so what it records (the row keys of
        # feeder.rowkeys) is recorded exactly when the item counts as delivered. Must not raise.
        self.on_pop: Optional[Callable[[Any], None]] = None

    def put(self, item: Any, timeout: float) -> bool:
        """Append ``item``; False if no room came within ``timeout`` seconds."""
        with self._not_full:
            if len(self._items) >= self.maxsize:
                self._not_full.wait(timeout)
                if len(self._items) >= self.maxsize:
                    return False
            # Appended before it is counted as pushed: a lock-free reader may see the batch as
            # held a moment too long, never as delivered too early (see ChunkQueue's byte bound).
            self._items.append(item)
            self._pushed_rows += item.rows
            self._pushed_bytes += item.nbytes
            self._not_empty.notify()
            return True

    def get(self, timeout: float) -> Optional[Any]:
        """Pop the oldest item (which counts it as delivered), or None after ``timeout`` seconds."""
        with self._not_empty:
            if not self._items:
                if timeout <= 0:
                    return None
                self._not_empty.wait(timeout)
                if not self._items:
                    return None
            item = self._items.popleft()
            if self.on_pop is not None:
                self.on_pop(item)
            self._not_full.notify()
            return item

    def __len__(self) -> int:
        return len(self._items)

    def queued_rows(self) -> int:
        with self._lock:
            return sum(i.rows for i in self._items)

    def delivered(self) -> Tuple[int, int]:
        """(rows, bytes) popped so far. Lock-free: pushed is read before the items, so a batch
        being pushed meanwhile can only make this smaller, never larger."""
        rows, nbytes = self._pushed_rows, self._pushed_bytes
        for i in list(self._items):
            rows -= i.rows
            nbytes -= i.nbytes
        return rows, nbytes

    def held_and_delivered(self) -> Tuple[int, int]:
        """(rows queued, rows popped so far), read together."""
        with self._lock:
            queued = sum(i.rows for i in self._items)
            return queued, self._pushed_rows - queued

    def clear(self) -> int:
        """Discard every queued item (at stop); returns the rows discarded."""
        with self._lock:
            rows = sum(i.rows for i in self._items)
            self._pushed_rows -= rows
            self._pushed_bytes -= sum(i.nbytes for i in self._items)
            self._items.clear()
            self._not_full.notify_all()
            return int(rows)
