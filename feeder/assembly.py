"""Batches written by several threads at once, handed on in the order they were planned.

The feed plans a batch under its lock (``feeder.rebatcher.Plan``: which rows of which chunks land
where) and gives it its place in the order there (:meth:`Assembly.reserve`). Writing it (the host
copy, the OrtValues, the copy to a device) is then the work of whoever comes by:

* a small batch (or one without a copy) is written at once by the thread that planned it, still
  under the lock: handing it to another thread would cost more than the copy;
* a big one is left here (:meth:`defer`) and written outside the lock by the threads that pass by
  (:meth:`work`): the one that planned it, a fetcher or receiver that has just put a chunk, the
  enqueuer, a consumer with nothing ready. At most ``threads`` write at once.

A batch written early waits here for those planned before it (:meth:`complete`): batches are
handed on (``push``, the ready queue) in their planned order, so the order of rows, ``ordered=True``
and the row keys recorded when a batch is popped stay exact. A place reserved takes room in the
ready queue from the moment it is reserved, so handing a batch on never waits.

At stop (:meth:`discard`) what waits here is discarded at once; a batch being written is discarded
by its writer when it is done (a copy cannot be interrupted, and stop does not wait for it), and
:meth:`when_idle` runs what must follow the discard (the ledger's audit) once the last writer is out.

Pure coordination: no threads of its own; every wait is bounded by its caller.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

_FAILED = object()  # a place whose batch could not be written: skipped, its rows discarded


class Assembly:
    """The order of a feed's batches between planning and the ready queue (see the module docstring).

    Args:
        threads: How many threads may write deferred batches at once.
        push: Hands an item on, in order, called under this object's lock; returns False when the
            item was not handed on (its rows are then booked as discarded).
        discarded: Books rows as discarded (stop, failures).
    """

    def __init__(self, threads: int, push: Callable[[Any], bool], discarded: Callable[[int], None]):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._push = push
        self._discarded = discarded
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._next = 0   # the next place to give
        self._out = 0    # the next place to hand on
        self._rows: Dict[int, int] = {}       # rows of each place not handed on yet
        self._done: Dict[int, Any] = {}       # batches written before their predecessors
        self._todo: Deque[Tuple[int, Any]] = deque()  # deferred: (place, work)
        self.working = 0        # threads writing a deferred batch now
        self.inflight = 0       # places given and not handed on: the room they take in the ready queue
        self.inflight_rows = 0  # their rows (still held, for the ledger)
        self.deferred = 0       # batches ever deferred (for tests and figures)
        self._discarding = False
        self._idle: List[Callable[[], None]] = []

    def reserve(self, rows: int) -> int:
        """A place in the order for a batch of ``rows`` rows (under the feed's lock, in plan order)."""
        with self._lock:
            place = self._next
            self._next += 1
            self._rows[place] = rows
            self.inflight += 1
            self.inflight_rows += rows
            return place

    def defer(self, place: int, work: Any) -> None:
        """Leave ``work`` (a plan) for :meth:`work` to write."""
        with self._lock:
            if self._discarding:  # (nothing is planned after a stop; be safe all the same)
                self._drop(place)
                return
            self._todo.append((place, work))
            self.deferred += 1
            # A writer waiting for room (the enqueuer in wait()) takes it on: otherwise the thread
            # that planned it writes every deferred batch alone, one after the other.
            self._changed.notify_all()

    def pending(self) -> int:
        """Deferred batches nobody writes yet (lock-free read)."""
        return len(self._todo)

    def work(self, write: Callable[[int, Any], Any], enough: Optional[Callable[[], bool]] = None) -> int:
        """Write deferred batches in this thread while there are any and fewer than ``threads`` threads
        write, and (if given) until ``enough()`` says this thread has what it came for;
        ``write(place, work)`` must call :meth:`complete` or :meth:`fail` for its place and never
        raise. Returns how many it wrote."""
        n = 0
        while True:
            if n and enough is not None and enough():
                return n
            with self._lock:
                if not self._todo or self.working >= self.threads or self._discarding:
                    return n
                place, work = self._todo.popleft()
                self.working += 1
            try:
                write(place, work)
            finally:
                with self._lock:
                    self.working -= 1
                    idle = self._take_idle()
                for fn in idle:
                    fn()
            n += 1

    def complete(self, place: int, item: Any) -> None:
        """``item`` is written: hand it on, with every batch after it that waited for it."""
        with self._lock:
            if self._discarding:
                self._drop(place)
                return
            self._done[place] = item
            self._hand_on()

    def fail(self, place: int) -> None:
        """The batch of ``place`` could not be written: its rows are discarded, the order goes on."""
        with self._lock:
            if self._discarding:
                self._drop(place)
                return
            self._done[place] = _FAILED
            self._hand_on()

    def _hand_on(self) -> None:  # (under the lock)
        done, rows = self._done, self._rows
        while self._out in done:
            place = self._out
            item = done.pop(place)
            n = rows.pop(place)
            self._out += 1
            if item is _FAILED or not self._push(item):
                self._discarded(n)
            self.inflight -= 1
            self.inflight_rows -= n
        self._changed.notify_all()

    def _drop(self, place: int) -> None:  # (under the lock) a place discarded at stop
        n = self._rows.pop(place, 0)
        self.inflight -= 1
        self.inflight_rows -= n
        self._discarded(n)
        self._changed.notify_all()

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a batch to be handed on (or discarded)."""
        with self._lock:
            if self.inflight:
                self._changed.wait(timeout)

    def discard(self, clear: Callable[[], int]) -> int:
        """At stop: nothing is handed on any more. Discards the batches that wait here (deferred, or
        written early) and, in the same step, what ``clear()`` clears (the ready queue: no batch can
        be handed on between the two); returns those rows. Batches being written are discarded by
        their writers (:meth:`complete`)."""
        with self._lock:
            self._discarding = True
            rows = 0
            for place, _ in self._todo:
                rows += self._rows.pop(place)
            for place in self._done:
                rows += self._rows.pop(place)
            self.inflight -= len(self._todo) + len(self._done)
            self.inflight_rows -= rows
            self._todo.clear()
            self._done.clear()
            rows += clear()
            self._changed.notify_all()
            return rows

    def when_idle(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once no thread writes a deferred batch: now, or in the last writer's thread."""
        with self._lock:
            if self.working:
                self._idle.append(fn)
                return
        fn()

    def _take_idle(self) -> List[Callable[[], None]]:  # (under the lock)
        if self.working or not self._idle:
            return []
        idle, self._idle = self._idle, []
        return idle

    def writers_left(self) -> Optional[int]:
        """Threads writing now, or None when none (for a stop's log)."""
        return self.working or None
