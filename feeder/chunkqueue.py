"""A named input source: the bounded chunk queue shared by every registration of one name.

The queue carries :class:`Chunk` envelopes from fetcher threads to enqueuer threads and
knows the three facts every consumer of the source must agree on:

* whether the source has ended (every registered worker raised ``StopIteration`` and
  no chunk is left),
* whether it has failed (sticky: the first failure is re-raised by every later call),
* the row ledger: rows fetched = rows delivered + rows buffered + rows dropped + rows discarded.
  Rows delivered are not counted here but derived from the feeds (rows that went into a feed's
  ready queue minus rows still in it), so a batch a consumer pops is delivered by the pop itself.
  Rows a source filtered out (``source.filter``) never become chunks: they are counted apart
  (``rows_filtered``), and for a source with row keys the key ledger must hold exactly the keys
  of this run's delivered and filtered rows (checked with the rest).

Two orders are supported. Unordered (default): one FIFO, whichever worker is first.
Ordered: one sub-queue per worker, drained in a fixed round-robin of worker ids, so the
same fetch functions give the same chunk sequence whatever the thread timing.

Every wait is bounded by the caller's timeout; ``close()`` wakes all waiters at once.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from .errors import Failure

log = logging.getLogger("feeder")


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


EMPTY = _Marker("EMPTY")    # nothing arrived within the timeout
END = _Marker("END")        # the source is finite and fully drained
CLOSED = _Marker("CLOSED")  # the queue was closed by stop()

# Without max_buffered_bytes the queue still stops taking chunks once it holds this many bytes
# (a chunk always goes in when the queue is empty). Buffering past the last-level cache buys
# nothing and costs: two fetchers of 3 MB chunks filled the 800-chunk queue with 915 MB, every
# chunk was evicted before the enqueuer copied it and its pages were faulted in afresh, and
# feeding ran at 0.55x of one fetcher (benchmarks/README.md, "Why more fetchers were slower").
DEFAULT_QUEUE_BYTES = 64 << 20


class Chunk:
    """One validated chunk in flight: arrays in input order, their row count and bytes.

    ``slots`` is how many of ``fetch_fun``'s chunks it stands for (a fetcher may coalesce
    several into one batch); the queue's bound counts those, so coalescing never lets a
    source buffer more than ``max_buffered_batches`` of the chunks the user returns.

    ``pieces``, instead of ``arrays``: the (rows, arrays) of several chunks a fetcher held and
    puts together, uncopied (``feeder.coalescing``: no more of them than the queue's bound).
    """

    __slots__ = ("worker_id", "arrays", "rows", "nbytes", "slots", "pieces")

    def __init__(self, worker_id: int, arrays: Tuple[np.ndarray, ...], rows: int, slots: int = 1,
                 pieces: Optional[List[Tuple[int, Tuple[np.ndarray, ...]]]] = None):
        self.worker_id = worker_id
        self.arrays = arrays
        self.rows = rows
        self.pieces = pieces
        self.nbytes = sum(a.nbytes for a in arrays) if pieces is None else \
            sum(a.nbytes for _, piece in pieces for a in piece)
        self.slots = slots


class ChunkQueue:
    """The named bounded chunk queue of one source (see module docstring).

    ``maxsize`` bounds the queue in chunks (in ordered mode the last free slot is kept for
    the worker whose turn it is, so the round-robin never waits on a full queue);
    ``max_bytes`` optionally bounds the bytes held by the source, counted from the moment a
    chunk is put until its rows are delivered to a consumer or dropped, so it covers the
    queue, the feeds' leftovers and their ready batches. Over that bound a chunk is let in
    only when a consumer waits on a feed that has nothing ready and nothing is queued for it
    (leftover rows may be all it needs to finish a batch) or when the source holds nothing
    (a chunk larger than the bound goes through alone).
    """

    def __init__(self, name: str, maxsize: int, *, ordered: bool = False, max_bytes: Optional[int] = None):
        if maxsize < 1:
            raise ValueError(f"max_buffered_batches must be >= 1, got {maxsize}")
        self.name = name
        self.maxsize = int(maxsize)
        self.ordered = ordered
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._items: Deque[Chunk] = deque()
        self._per_worker: Dict[int, Deque[Chunk]] = {}
        self._rotation: List[int] = []
        self._pos = 0
        self._workers: Set[int] = set()
        self._ended: Set[int] = set()
        self._closed = False
        self._wakes = 0  # wake_getters calls so far
        self.failure: Optional[Failure] = None
        self.fetch_errors = 0
        # Ledger, in rows; guarded by _lock.
        self.rows_fetched = 0
        self.rows_dropped = 0
        self.rows_discarded = 0  # rows thrown away by stop(): queued, held by feeds or by fetchers
        self.rows_filtered = 0   # rows the source dropped on purpose (never fetched as chunks)
        self.queued_rows = 0
        self.queued_chunks = 0
        self.queued_bytes = 0
        self.max_bytes_seen = 0
        self._rows_delivered = 0  # delivered outside any registered feed (see delivered())
        self._bytes_in = 0        # bytes put, ...
        self._bytes_out = 0       # ... and bytes that left other than through a feed's ready queue
        self._holders: List[Callable[[], int]] = []  # each feed's "rows I hold" counter
        self._deliveries: List[Callable[[], Tuple[int, int]]] = []  # each feed's (rows, bytes) delivered
        self._starved: List[Callable[[], bool]] = []  # each feed's "a consumer waits, nothing is ready"
        self._flushers: List[Callable[[float], None]] = []  # coalescing fetchers' flush_if_stale
        self._feeds_ended = 0
        self.validator: Optional[Any] = None  # the source's ChunkValidator, set by the first registration
        self.row_keys: Optional[Any] = None  # the source's feeder.rowkeys.KeyLedger, if its chunks carry keys
        self.turns: Optional[Any] = None     # feeder.fetchers.Turns: whose turn it is to make short calls

    # ---- configuration -------------------------------------------------------------
    def configure(self, *, ordered: bool, max_bytes: Optional[int]) -> None:
        """Set the order and byte bound; allowed only while no worker is registered."""
        with self._lock:
            if self._workers and (ordered != self.ordered or max_bytes != self.max_bytes):
                raise ValueError(
                    f"source {self.name!r} already has registrations with ordered={self.ordered}, "
                    f"max_buffered_bytes={self.max_bytes}; a replica must use the same")
            self.ordered = ordered
            self.max_bytes = max_bytes

    def register_workers(self, worker_ids: Sequence[int]) -> None:
        """Add a registration's worker ids to the source: the source ends once every registered
        worker has ended, and an ordered source takes chunks in a round-robin of them, sorted."""
        with self._lock:
            for w in worker_ids:
                self._workers.add(w)
                self._per_worker.setdefault(w, deque())
            self._rotation = sorted(self._workers)

    # ---- producer side -------------------------------------------------------------
    def put(self, chunk: Chunk, timeout: float, notify: bool = True) -> object:
        """Put a chunk; True when queued, EMPTY if no room came within ``timeout`` s, CLOSED.
        ``notify=False``: wake no getter (the caller takes the chunk on at once, see Feed.pump_put)."""
        deadline = time.monotonic() + timeout
        with self._not_full:
            while True:
                if self._closed:
                    return CLOSED
                if self._has_room(chunk):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return EMPTY
                self._not_full.wait(remaining)
            if self.ordered:
                self._per_worker[chunk.worker_id].append(chunk)
                if notify:
                    self._not_empty.notify_all()
            else:
                self._items.append(chunk)
                if notify:
                    self._not_empty.notify()
            self.queued_chunks += chunk.slots
            self.queued_rows += chunk.rows
            self.queued_bytes += chunk.nbytes
            self.rows_fetched += chunk.rows
            self._bytes_in += chunk.nbytes
            if self.max_bytes is not None:
                held = self._bytes_held()
                if held > self.max_bytes_seen:
                    self.max_bytes_seen = held
            return True

    def _has_room(self, chunk: Chunk) -> bool:
        if self.max_bytes is not None:
            held = self._bytes_held()
            if held and held + chunk.nbytes > self.max_bytes:
                # Over the byte bound. The bytes held include the feeds' leftover rows, which only
                # move on when more rows come, so refusing every chunk could deadlock a consumer
                # that waits for them: for such a consumer (and only when nothing is queued that it
                # could use; in ordered mode, for the chunk whose turn it is) one chunk is let in.
                if not any(starved() for starved in self._starved):
                    return False
                if self.ordered:
                    return chunk.worker_id == self._turn() and not self._per_worker[chunk.worker_id]
                return not self._items
        elif self.queued_bytes and self.queued_bytes + chunk.nbytes > DEFAULT_QUEUE_BYTES:
            # The default working-set bound; the chunk whose turn it is always has room.
            if not (self.ordered and chunk.worker_id == self._turn() and not self._per_worker[chunk.worker_id]):
                return False
        if self.ordered:
            fits = self.queued_chunks + chunk.slots <= self.maxsize
            turn = self._turn()
            if turn is None or chunk.worker_id == turn or self._per_worker[turn]:
                return fits or not self.queued_chunks
            # Keep the last free slot for the worker whose turn it is: the queue never holds more
            # than maxsize chunks, and the round-robin never waits on a queue full of later turns.
            return self.queued_chunks + chunk.slots <= self.maxsize - 1
        # A chunk standing for more slots than the whole queue has still goes through alone.
        return not self._items or self.queued_chunks + chunk.slots <= self.maxsize

    def _turn(self) -> Optional[int]:
        """The worker whose chunk the ordered round-robin takes next (ended, drained workers skipped)."""
        n = len(self._rotation)
        for i in range(n):
            w = self._rotation[(self._pos + i) % n]
            if self._per_worker[w] or w not in self._ended:
                return w
        return None

    def _bytes_held(self) -> int:
        """Bytes put and not yet delivered, dropped or discarded (the feeds are read lock-free: a
        batch being pushed into a ready queue may count as held a moment longer, never shorter)."""
        out = self._bytes_out
        for delivered in self._deliveries:
            out += delivered()[1]
        return max(0, self._bytes_in - out)

    @property
    def bytes_held(self) -> int:
        """Bytes held by the source: queued chunks, the feeds' leftover rows and ready batches."""
        with self._lock:
            return self._bytes_held()

    def notify_room(self) -> None:
        """Wake producers waiting for room (a consumer started waiting, or bytes were released)."""
        if self.max_bytes is not None:
            with self._lock:
                self._not_full.notify_all()

    def wait_available(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until a ``get`` would not wait (a chunk, the end, the queue
        closed or failed, or ``wake_getters``), without taking anything; False on timeout.

        For a getter that must take and handle a chunk in one step under a lock of its own (the
        enqueuer and the producers' pump, which share a feed's rebatcher: the chunks' order is
        the order they are taken in)."""
        deadline = time.monotonic() + timeout
        with self._not_empty:
            wakes = self._wakes
            while True:
                if self._closed or self.failure is not None or self._wakes != wakes:
                    return True
                if (self._next_peek_ordered() if self.ordered else bool(self._items) or self._all_ended()):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._not_empty.wait(remaining)

    def _next_peek_ordered(self) -> bool:
        """Whether ``_next_ordered`` would return something now (a chunk whose turn it is, or END)."""
        turn = self._turn()
        return (turn is not None and bool(self._per_worker[turn])) or self._all_ended()

    def wake_getters(self) -> None:
        """Make the threads waiting in ``get`` return (EMPTY if nothing came): there is work for them
        that no put announced (batches a producer's pump left in a feed, see Feed.pump_put)."""
        with self._lock:
            self._wakes += 1
            self._not_empty.notify_all()

    def worker_ended(self, worker_id: int) -> None:
        """Record that a worker raised StopIteration (after its last put)."""
        with self._lock:
            self._ended.add(worker_id)
            self._not_empty.notify_all()

    def note_fetch_error(self) -> int:
        """Count one fetch exception against the source; returns the count so far."""
        with self._lock:
            self.fetch_errors += 1
            return self.fetch_errors

    def fail(self, failure: Failure) -> None:
        """Record the source's failure; the first one wins and is sticky."""
        with self._lock:
            if self.failure is None:
                self.failure = failure
            self._not_empty.notify_all()
            self._not_full.notify_all()

    # ---- consumer side -------------------------------------------------------------
    def get(self, timeout: float) -> object:
        """The next Chunk, END when the source is finite and drained, EMPTY, or CLOSED."""
        deadline = time.monotonic() + timeout
        with self._not_empty:
            wakes = self._wakes
            while True:
                if self._closed:
                    return CLOSED
                item = self._next_ordered() if self.ordered else self._next_fifo()
                if item is not EMPTY:
                    if isinstance(item, Chunk):
                        self.queued_chunks -= item.slots
                        self.queued_rows -= item.rows
                        self.queued_bytes -= item.nbytes
                        if self.ordered:
                            self._not_full.notify_all()
                        else:
                            self._not_full.notify()
                    return item
                if self.failure is not None or self._wakes != wakes:
                    return EMPTY  # the caller raises the failure, or has work: do not sit out the timeout
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return EMPTY
                self._not_empty.wait(remaining)

    def _all_ended(self) -> bool:
        return bool(self._workers) and self._ended >= self._workers

    def _next_fifo(self) -> object:
        if self._items:
            return self._items.popleft()
        return END if self._all_ended() else EMPTY

    def _next_ordered(self) -> object:
        n = len(self._rotation)
        for _ in range(n):
            w = self._rotation[self._pos]
            q = self._per_worker[w]
            if q:
                self._pos = (self._pos + 1) % n
                return q.popleft()
            if w not in self._ended:
                return EMPTY  # it is this worker's turn: wait for it
            self._pos = (self._pos + 1) % n
        return END if self._all_ended() else EMPTY

    # ---- ledger --------------------------------------------------------------------
    @property
    def rows_delivered(self) -> int:
        """Rows of this source delivered to consumers so far, every feed's included."""
        with self._lock:
            return self._delivered()[0]

    def _delivered(self) -> Tuple[int, int]:
        rows, nbytes = self._rows_delivered, 0
        for delivered in self._deliveries:
            r, b = delivered()
            rows += r
            nbytes += b
        return rows, nbytes

    def delivered(self, rows: int, nbytes: int) -> None:
        """Rows that left the source to a consumer other than through a registered feed's ready
        queue (the feeds' deliveries are read from the feeds themselves, see ``add_holder``)."""
        with self._lock:
            self._rows_delivered += rows
            self._release(nbytes)

    def record_filtered(self, rows: int, keys: Optional[np.ndarray] = None) -> None:
        """Rows the source dropped on purpose (``filter``), with their row keys when it has them:
        the keys go to the key ledger as filtered (see ``feeder.rowkeys``).

        Args:
            rows: How many rows were dropped.
            keys: Their row keys (int64), or None for a source without row keys.
        """
        ledger = self.row_keys
        if keys is not None and ledger is not None:
            ledger.record_filtered(keys)  # before taking this queue's lock: never both at once
        with self._lock:
            self.rows_filtered += rows

    def dropped(self, rows: int, nbytes: int) -> None:
        """Rows discarded by policy (``last_batch='drop'``)."""
        with self._lock:
            self.rows_dropped += rows
            self._release(nbytes)

    def discarded(self, rows: int, *, fetched: bool) -> None:
        """Rows thrown away by stop() outside the queue: held by a feed (``fetched=False``: already
        counted as fetched) or by a fetcher that never put them (``fetched=True``: counted now)."""
        if rows:
            with self._lock:
                if fetched:
                    self.rows_fetched += rows
                self.rows_discarded += rows

    def _release(self, nbytes: int) -> None:
        self._bytes_out += nbytes
        if self.max_bytes is not None:
            self._not_full.notify_all()

    def add_holder(self, held_rows: Callable[[], int], delivered: Optional[Callable[[], Tuple[int, int]]] = None,
                   starved: Optional[Callable[[], bool]] = None) -> None:
        """Register a feed: its count of the rows it holds (leftover, in flight, ready), of the rows
        and bytes it delivered, and whether a consumer waits on it with nothing ready."""
        with self._lock:
            self._holders.append(held_rows)
            if delivered is not None:
                self._deliveries.append(delivered)
            if starved is not None:
                self._starved.append(starved)

    def detach(self) -> None:
        """At stop, once every thread of the source has ended: forget the feeds' callbacks, keeping
        what they delivered (so the ledger and metrics still read right). The callbacks are bound
        methods of the feeds, which hold this queue: a reference cycle that would keep both, and
        all they hold, until the garbage collector runs."""
        with self._lock:
            rows, nbytes = self._delivered()
            self._rows_delivered = rows
            self._bytes_out += nbytes
            self._holders, self._deliveries, self._starved, self._flushers = [], [], [], []

    def add_flusher(self, flush_if_stale: Callable[[float], None]) -> None:
        """Register a coalescing fetcher's ``flush_if_stale(now)`` (now: monotonic seconds), which
        :meth:`flush_held` calls so that rows held for coalescing never wait on a blocked fetch."""
        with self._lock:
            self._flushers.append(flush_if_stale)

    def flush_held(self) -> None:
        """Ask coalescing fetchers to put rows they have held too long (called by an enqueuer
        that found the queue empty: those rows may be all it is waiting for)."""
        now = time.monotonic()
        for flush in list(self._flushers):
            flush(now)

    def single_stream(self) -> bool:
        """One worker and one feed: that feed sees exactly that worker's chunks, in order."""
        with self._lock:
            return len(self._workers) == 1 and len(self._holders) == 1

    def feed_reached_end(self) -> bool:
        """A feed handed out its end of data; True when it was the last feed of the source to do so."""
        with self._lock:
            self._feeds_ended += 1
            return self._feeds_ended == len(self._holders)

    def check_ledger(self, when: str) -> bool:
        """At a quiescent point (end of data, or stop after the threads ended): rows fetched must
        equal rows delivered + dropped + discarded + buffered, buffered counted where the rows are.
        A mismatch is a bug; it is logged as an error naming the source."""
        with self._lock:
            # A consumer's pop moves a batch from a feed's held rows to its delivered rows in one
            # step, so held + delivered of each feed is exact even while consumers run.
            held = sum(h() for h in self._holders)
            delivered = self._delivered()[0]
            buffered = self.queued_rows + held
            accounted = delivered + self.rows_dropped + self.rows_discarded + buffered
            ok = self.rows_fetched == accounted
            if not ok:
                log.error("source %r: row ledger does not balance at %s: fetched %d != delivered %d + dropped %d "
                          "+ discarded %d + buffered %d", self.name, when, self.rows_fetched, delivered,
                          self.rows_dropped, self.rows_discarded, buffered)
            filtered = self.rows_filtered
        keys = self.row_keys
        if keys is not None:
            # The keys this run recorded are those of the rows delivered (recorded at each pop) and
            # filtered (recorded as fetched): a key missing or counted twice is a bug. At the end
            # of the data the filtered keys still loose (feeder.rowkeys) join the ranges: nothing is
            # left in flight for them to wait for.
            if when == "end of data":
                keys.settle()
            ranges, key_filtered = keys.snapshot(loose=True)
            recorded = int((ranges[:, 1] - ranges[:, 0]).sum()) - keys.start_covered
            new_filtered = key_filtered - keys.start_filtered
            if recorded != delivered + new_filtered or new_filtered > filtered:
                ok = False
                log.error("source %r: row ledger does not balance at %s: the row keys recorded cover %d rows, the "
                          "rows delivered %d + filtered %d (%d of them with keys)", self.name, when, recorded,
                          delivered, filtered, new_filtered)
        return ok

    # ---- lifecycle / introspection -------------------------------------------------
    def close(self) -> Tuple[int, int]:
        """Wake every waiter, refuse further puts and gets; returns (chunks, rows) discarded."""
        with self._lock:
            self._closed = True
            chunks, rows = self.queued_chunks, self.queued_rows
            self.rows_discarded += rows
            self.queued_chunks = self.queued_rows = self.queued_bytes = 0
            self._items.clear()
            for q in self._per_worker.values():
                q.clear()
            self._not_empty.notify_all()
            self._not_full.notify_all()
            return chunks, rows

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (``stop()``): puts and gets return ``CLOSED`` from then on."""
        return self._closed

    def waiting_on(self) -> Optional[int]:
        """For an ordered source: the worker whose turn it is when it has no chunk queued (the
        round-robin waits for it, whatever the others hold); None otherwise."""
        if not self.ordered:
            return None
        with self._lock:
            turn = self._turn()
            return turn if turn is not None and not self._per_worker.get(turn) else None

    def live_workers(self) -> List[int]:
        """The registered worker ids that have not ended (raised ``StopIteration``), sorted."""
        with self._lock:
            return sorted(self._workers - self._ended)

    def qsize(self) -> int:
        """Chunks waiting in the queue, counted as fetch_fun returned them."""
        return self.queued_chunks

    def empty(self) -> bool:
        """True when no chunk waits in the queue."""
        return self.queued_chunks == 0

    def full(self) -> bool:
        """True when the queue holds ``maxsize`` chunks or more (counted as ``fetch_fun`` returned them)."""
        return self.queued_chunks >= self.maxsize

    def ledger(self) -> Dict[str, int]:
        """The source's row ledger, in rows: ``rows_fetched``, ``rows_delivered``, ``rows_dropped``,
        ``rows_discarded`` and ``rows_queued`` (rows held by the feeds are in none of the last four),
        and ``rows_filtered`` (dropped on purpose by the source, never fetched as chunks)."""
        with self._lock:
            return {
                "rows_fetched": self.rows_fetched,
                "rows_delivered": self._delivered()[0],
                "rows_dropped": self.rows_dropped,
                "rows_discarded": self.rows_discarded,
                "rows_queued": self.queued_rows,
                "rows_filtered": self.rows_filtered,
            }

    def __repr__(self) -> str:
        return (f"ChunkQueue({self.name!r}, maxsize={self.maxsize}, qsize={self.queued_chunks}, "
                f"ordered={self.ordered})")
