"""A feed's queue of prepared batches, which also counts what left through it.

The enqueuer pushes batches; consumers pop them. Rows delivered are *derived*: rows pushed
minus rows still queued. So taking a batch and counting it as delivered is one step, the
``deque.popleft`` itself: an audit of the row ledger from another thread (end of data seen by
another consumer, ``stop()``) can never find a batch that is neither held nor delivered, and an
exception in the consumer right after the pop (a KeyboardInterrupt) cannot lose it from the count.

The consumer's path is what the runtime waits on, so its pop takes no lock and wakes nobody
unless it must: ``deque.popleft`` is atomic; a full queue's producer waits until consumers have
taken it down to half (``low``), so it is woken once per few batches and then makes them in one
go; and that wake-up is one release of a plain lock, not a condition's notify. The producer says
that it waits (``_putter_waiting``) before it looks at the length again, so a pop that reaches the
mark either happens before that look (the producer sees the room) or sees the flag (and wakes it).
Only a source with row keys pops under the lock, because the keys of a popped batch must be
recorded in the same step as the pop (feeder.rowkeys). Consumers that wait for an item (the
queue is empty: the runtime idles anyway) wait on a condition, so that several may.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Deque, Optional, Tuple


class ReadyQueue:
    """Bounded FIFO of items with ``rows`` and ``nbytes`` attributes; every wait is bounded.

    ``maxsize`` may be changed while running (the feed sizes it from its first batch). One
    producer thread puts; any number of consumer threads pop.
    """

    def __init__(self, maxsize: int = 1):
        self.maxsize = maxsize
        self._items: Deque[Any] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._room = threading.Lock()  # released by a pop that wakes the producer (a binary semaphore)
        self._room.acquire()
        self._pushed_rows = 0
        self._pushed_bytes = 0
        self._putter_waiting = False  # the producer waits for room (set before it looks again)
        self._getters = 0             # consumers waiting for an item (under the lock)
        # Called with each popped item under the queue's lock, so what it records (the row keys of
        # feeder.rowkeys) is recorded exactly when the item counts as delivered. Must not raise.
        self.on_pop: Optional[Callable[[Any], None]] = None

    def wait_room(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for room; a full queue's producer waits until consumers
        took it down to half (see the module docstring). True if there is room."""
        items = self._items
        if len(items) < self.maxsize:
            return True
        self._putter_waiting = True  # before the look below: see the module docstring
        try:
            if len(items) > self.maxsize // 2:
                self._room.acquire(timeout=timeout)
        finally:
            self._putter_waiting = False
        return len(items) < self.maxsize

    def put(self, item: Any, timeout: float) -> bool:
        """Append ``item``; False if no room came within ``timeout`` seconds (see ``wait_room``)."""
        items = self._items
        if len(items) >= self.maxsize and not self.wait_room(timeout):
            return False
        with self._lock:
            # Appended before it is counted as pushed: a lock-free reader may see the batch as
            # held a moment too long, never as delivered too early (see ChunkQueue's byte bound).
            items.append(item)
            self._pushed_rows += item.rows
            self._pushed_bytes += item.nbytes
            if self._getters:
                self._not_empty.notify()
        return True

    def put_reserved(self, item: Any) -> None:
        """Append ``item`` without waiting: its room was reserved when it was planned (the feed counts
        batches being written against ``maxsize``, see ``feeder.assembly``). The only way items enter
        a feed's queue; one thread at a time (the order's lock)."""
        with self._lock:
            # Appended before it is counted as pushed: a lock-free reader may see the batch as
            # held a moment too long, never as delivered too early (see ChunkQueue's byte bound).
            self._items.append(item)
            self._pushed_rows += item.rows
            self._pushed_bytes += item.nbytes
            if self._getters:
                self._not_empty.notify()

    def _popped(self) -> None:
        """After a pop: wake the producer if it waits and the queue is down to half."""
        if self._putter_waiting and len(self._items) <= self.maxsize // 2:
            self._putter_waiting = False
            try:
                self._room.release()
            except RuntimeError:  # another consumer woke it already
                pass

    def pop(self) -> Optional[Any]:
        """The oldest item, or None at once if there is none (the consumer's common path)."""
        if self.on_pop is not None:
            return self.get(0.0)
        try:
            item = self._items.popleft()
        except IndexError:
            return None
        if self._putter_waiting:
            self._popped()
        return item

    def get(self, timeout: float) -> Optional[Any]:
        """Pop the oldest item (which counts it as delivered), or None after ``timeout`` seconds."""
        with self._not_empty:
            if not self._items:
                if timeout <= 0:
                    return None
                self._getters += 1
                try:
                    self._not_empty.wait(timeout)
                finally:
                    self._getters -= 1
                if not self._items:
                    return None
            item = self._items.popleft()
            if self.on_pop is not None:
                self.on_pop(item)
        self._popped()
        return item

    def __len__(self) -> int:
        return len(self._items)

    def queued_rows(self) -> int:
        # tuple(deque) is one step under the GIL; iterating the deque itself could meet a
        # consumer's lock-free pop half-way ("deque mutated during iteration")
        return sum(i.rows for i in tuple(self._items))

    def delivered(self) -> Tuple[int, int]:
        """(rows, bytes) popped so far. Lock-free: pushed is read before the items, so a batch
        being pushed meanwhile can only make this smaller, never larger."""
        rows, nbytes = self._pushed_rows, self._pushed_bytes
        for i in tuple(self._items):
            rows -= i.rows
            nbytes -= i.nbytes
        return rows, nbytes

    def held_and_delivered(self) -> Tuple[int, int]:
        """(rows queued, rows popped so far), read together (the producer is stopped or paused:
        pushes hold the lock; a consumer's pop moves a batch from one to the other in one step)."""
        with self._lock:
            pushed = self._pushed_rows
            queued = sum(i.rows for i in tuple(self._items))
            return queued, pushed - queued

    def clear(self) -> int:
        """Discard every queued item (at stop); returns the rows discarded. Items are taken one
        pop at a time, so each is either discarded here or delivered by a consumer popping at the
        same moment, never both."""
        rows = nbytes = 0
        with self._lock:
            items = self._items
            while True:
                try:
                    item = items.popleft()
                except IndexError:
                    break
                rows += item.rows
                nbytes += item.nbytes
            self._pushed_rows -= rows
            self._pushed_bytes -= nbytes
        self._putter_waiting = True
        self._popped()  # a producer waiting for room has it now
        return int(rows)
