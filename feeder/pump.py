"""The producer side of a feed: chunks from its source into planned batches, written and handed
on to its ready queue in order, whichever thread does it.

The enqueuer thread (``feeder:SRC:enqueue``) runs :meth:`Pump._enqueue`; a producer that has just
put a chunk (``Feed.pump_put``) and a consumer that found nothing ready (:meth:`Pump._pump`) do the
same work in their own thread when nobody is doing it, under the feed's pump lock
(:meth:`Pump._pump_ready`): taking a chunk and rebatching it are one step under that lock, so the
chunks keep their order. Under the lock a batch is only planned; the feed decides where it is
written (``Feed._emit``: at once, or outside the lock by the threads that pass by,
``feeder.assembly``), :meth:`Pump._write` writes it and :meth:`Pump._hand_on` puts it in the ready
queue, in its order. At the end of the data :meth:`Pump._finish` plans the last batches; at stop,
what the feed still holds is discarded (:meth:`Pump._discard_held`), and the row ledger
(:meth:`Pump._check_ledger`) balances throughout.

:class:`Pump` is a base class of ``feeder.feed.Feed``, in a module of its own so that the feed's
wiring and consumer calls and its producer side each read as one idea: it keeps the pump's own
state (:meth:`Pump._init_pump`) and works with the parts of the feed declared on it.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, List, Optional, Tuple, Union

import numpy as np

from .assembly import Assembly
from .chunkqueue import CLOSED, END, Chunk, ChunkQueue
from .errors import Failure, FeederError
from .fetchers import SLICE_S
from .padding import PadRebatcher
from .readyqueue import ReadyQueue
from .rebatcher import Plan, Rebatcher
from .runtime import PreparedBatch, Runner
from .sources.rowkeys import split_keys
from .trace import TraceHook

log = logging.getLogger("feeder")

# stop() waits at most this long (seconds) for a consumer in the middle of rebatching; past it,
# that consumer discards what the feed holds as it lets the lock go (Feed._discard_held).
DISCARD_LOCK_S = 0.25


class _EndOfData:
    rows = nbytes = 0  # it passes through the ready queue, which counts rows and bytes
    __repr__ = lambda self: "END_OF_DATA"  # noqa: E731


END_OF_DATA = _EndOfData()  # after a finite source's last batch, in the ready queue (Pump._finish)


class Pump:
    """The producer side of a :class:`feeder.feed.Feed` (see the module docstring): the enqueuer
    thread's loop, the same work done by producers and consumers, the writing and handing on of
    planned batches, the end of the data, the discard at stop and the row ledger."""

    # The feed's parts the pump works with, set by Feed.__init__ (feeder.feed):
    source: ChunkQueue
    session: Any
    input_source_name: str
    input_names: List[str]
    dont_rebatch: bool
    last_batch: str
    _axes: Tuple[int, ...]
    _keyed: bool                # batches carry row keys, stripped as they are written (feeder.rowkeys)
    _runner: Optional[Runner]
    _on_device: bool
    _rebatcher: Union[Rebatcher, PadRebatcher]
    _ready: ReadyQueue
    _asm: Assembly
    _trace: TraceHook
    _stop: threading.Event
    _failure: Optional[Failure]

    def _init_pump(self) -> None:
        """The pump's own state (called by Feed.__init__)."""
        self._pending_batch_size: Optional[int] = None  # set by reset_data_input, taken by the pump
        self._batch_size_lock = threading.Lock()
        # Who rebatches now: the enqueuer thread, or a producer in pump_put (one at a time). Every
        # holder lets it go through _release_pump, which completes a discard stop() left to it.
        self._pump_lock = threading.Lock()
        self._discard_pending = False  # stop() asked for the discard of what the feed holds (_discard_held)
        self._discard_made = False     # ... and the lock's side of it is made (writers may still finish theirs)
        self._discard_lock = threading.Lock()  # guards _discard_pending and _after_discard
        self._after_discard: List[Callable[[], None]] = []
        self._inflight_rows = 0
        self._books = threading.Lock()  # guards what several writers add up: rows discarded, seconds assembling
        self._assemble_s = 0.0
        # Written under the pump lock (and by stop() once it has ended), so plain ints suffice:
        self._rows_taken = 0
        self._rows_dropped = 0
        self._rows_discarded = 0
        self._batches_made = 0

    # ---- enqueuer and pumps --------------------------------------------------------------------
    def _enqueue_loop(self) -> None:
        try:
            self._enqueue()
        except BaseException as e:  # the feed must never stay "active" with nobody feeding it
            if self._failure is not None:  # a pump failed first: that is the failure to report
                return
            self._failure = Failure(FeederError(
                f"source {self.input_source_name!r}: the enqueuer thread failed: {type(e).__name__}: {e}"), e)
            log.error("source %r: enqueuer thread failed", self.input_source_name, exc_info=True)

    def _enqueue(self) -> None:
        source, stop, lock, ready, asm = self.source, self._stop, self._pump_lock, self._ready, self._asm
        while not stop.is_set() and self._failure is None:
            # In slices: a consumer may hold the lock for a long rebatch, and stop must not wait for it.
            if not lock.acquire(timeout=SLICE_S):
                continue
            try:
                got = self._pump_ready()
                if got is END:
                    self._finish()  # (it may wait for room holding the lock: nothing else is left to take)
            finally:
                self._release_pump()
            self._work()  # big batches it planned: written outside the lock (feeder.assembly)
            if got is CLOSED or got is END:
                return
            # Nothing to take, or no room: wait without the lock, so producers and consumers may pump.
            if len(ready) >= ready.maxsize:
                ready.wait_room(SLICE_S)
            elif len(ready) + asm.inflight >= ready.maxsize:
                asm.wait(SLICE_S)  # the room is taken by batches being written
            elif not source.wait_available(SLICE_S):
                if source.failure is not None:
                    return
                source.flush_held()
            elif source.failure is not None:
                return

    def _room(self) -> bool:
        """Whether the ready queue has room for one more batch, counting those being written."""
        return len(self._ready) + self._asm.inflight < self._ready.maxsize

    def _pump_ready(self) -> object:
        """Plan whole batches from the source while the ready queue has room (the caller holds
        ``_pump_lock``: the enqueuer, a producer in ``pump_put``, or a consumer that found nothing
        ready). Taking a chunk and rebatching it are one step under that lock, so the rebatcher gets
        the chunks in the order they were taken. Returns END when the source has ended (the enqueuer
        finishes it), CLOSED when it was closed or the feed stopped, else None. Never waits: every
        batch it plans takes room it saw; big ones are written after the lock is let go (``_work``)."""
        if self._stop.is_set() or self._failure is not None:
            return CLOSED  # what the feed holds is stop's to discard (_discard_held), under this lock
        rb, source = self._rebatcher, self.source
        new_size = self._take_new_batch_size()
        if new_size is not None:
            rb.set_batch_size(new_size)
        while self._room():
            if rb.has_batch():
                plan = rb.plan()
                if plan is not None and not self._emit(plan):
                    return CLOSED
                continue
            item = source.get(0.0)
            if isinstance(item, Chunk):
                if not self._take(item):
                    return CLOSED
                continue
            if item is END or item is CLOSED:
                return item
            return None
        return None

    def _take(self, item: Chunk) -> bool:
        """Rebatch one chunk from the source (the caller holds ``_pump_lock`` and saw room for one
        batch); whole batches beyond the room stay in the rebatcher. False if the feed stopped."""
        if not item.rows:
            return True  # an ordered source's turn without rows (feeder.sources.base.SKIP)
        self._rows_taken += item.rows
        self._inflight_rows = item.rows  # in this thread's hands: still counted as held
        if self.dont_rebatch:
            rb = self._rebatcher
            if isinstance(rb, PadRebatcher):
                return self._emit(rb.plan_whole(item.arrays, item.rows))
            return self._emit(Plan.whole(item.arrays, item.rows, self._axes))
        if item.pieces is not None:  # a fetcher's held chunks put together (feeder.coalescing): as they came
            rb = self._rebatcher
            assert isinstance(rb, Rebatcher)  # (padded inputs are never coalesced)
            rb.extend(item.pieces, item.rows)
        else:
            self._rebatcher.add(item.arrays, item.rows)
        self._inflight_rows = 0
        return self._emit_full_batches(block=False)

    def _take_new_batch_size(self) -> Optional[int]:
        """The batch size set since the enqueuer last looked, if any (each reset is seen once)."""
        if self._pending_batch_size is None:
            return None
        with self._batch_size_lock:
            n, self._pending_batch_size = self._pending_batch_size, None
            return n

    def _pump(self) -> None:
        """What a consumer that found nothing ready does before it waits: the enqueuer's work, if
        nobody is doing it (no hand-over: the chunks may be waiting in the source), and the big
        batches waiting to be written."""
        lock = self._pump_lock
        if lock.acquire(False):
            try:
                self._pump_ready()
            except Exception as e:
                self._pump_failed(e)
            finally:
                self._release_pump()
        # A consumer writes until a batch is ready for it, and leaves the batches after it to the
        # enqueuer and the producers, who write them beside it: if it wrote them all, the copies of
        # big batches would be made one after the other, by the one thread that waits for them.
        self._work(self._has_ready)

    def _has_ready(self) -> bool:
        return len(self._ready) > 0

    def _pump_failed(self, e: Exception) -> None:
        """Making batches raised in a consumer's or a producer's pump (what the enqueuer does, done
        in their thread): the feed fails, sticky, as when the enqueuer thread fails, so that the
        thread that happened to be pumping is not the only one to hear of it while the feed goes on
        without the rows it held. Nothing takes or rebatches after it (``_pump_ready``); what the
        rebatcher and the ready queue hold stays counted as held and is discarded at stop."""
        where = threading.current_thread().name
        # The rows in this thread's hands (a chunk being added, a batch being made) are in neither
        # the rebatcher nor the ready queue any more: discarded now, so that the books balance.
        rows, self._inflight_rows = self._inflight_rows, 0
        self._book_discarded(rows)
        self._fail(FeederError(f"source {self.input_source_name!r}: making a batch failed in thread {where!r} (a "
                               f"pump): {type(e).__name__}: {e}"), e)

    def _fail(self, error: FeederError, cause: BaseException) -> None:
        """The feed fails (sticky), once: the first failure is the one consumers hear of."""
        if self._failure is not None:
            return
        self._failure = Failure(error, cause)
        log.error("%s", error, exc_info=cause)
        self.source.wake_getters()

    def _book_discarded(self, rows: int) -> None:
        """Rows this feed held that will never be delivered (stop, failures), booked once."""
        if rows:
            with self._books:
                self._rows_discarded += rows
            self.source.discarded(rows, fetched=False)

    def _release_pump(self) -> None:
        """Let the pump lock go; if stop() could not wait for it meanwhile, discard what the feed
        holds first (see _discard_held). Every holder of the lock lets it go through here."""
        lock = self._pump_lock
        lock.release()
        if self._discard_pending and not self._discard_made and lock.acquire(False):  # else its next holder does
            try:
                self._discard_now()
            finally:
                lock.release()

    def _emit_full_batches(self, block: bool = True) -> bool:
        """Plan the whole batches the rebatcher holds while there is room (``block``: all of them,
        waiting for room, as at the end of the data). False if the feed stopped or failed."""
        rb = self._rebatcher
        while True:
            if not self._room():
                if not block or not self._wait_room():
                    return not block
            new_size = self._take_new_batch_size()
            if new_size is not None:
                rb.set_batch_size(new_size)
            plan = rb.plan()
            if plan is None:
                return True
            if not self._emit(plan):
                return False

    def _wait_room(self) -> bool:
        """Wait for room in the ready queue holding the pump lock (the end of the data: nothing else
        is left to take), writing waiting batches meanwhile. False if the feed stopped."""
        while not self._room():
            if self._stop.is_set() or self._failure is not None or self.source.failure is not None:
                return False
            if not self._work():
                if len(self._ready) >= self._ready.maxsize:
                    self._ready.wait_room(SLICE_S)
                else:
                    self._asm.wait(SLICE_S)
        return True

    def _emit(self, plan: Any) -> bool:
        """A batch planned (the caller holds ``_pump_lock``): written at once, or left for the threads
        that pass by. The feed's (``feeder.feed.Feed._emit``), next to the tunables it reads at
        call time (``PARALLEL_BYTES``). False if the feed stopped or failed."""
        raise NotImplementedError

    # ---- writing planned batches, handing them on, the end of the data ---------------------------
    def _stage(self, plan: Any) -> None:
        """Under the pump lock: the buffers a plan is written into (the rings are not thread-safe):
        a set of the feed's ring (staging memory on a device), fresh arrays for a short last batch.
        On a device, a batch whose rows lie in memory the device copies from fast (a worker
        process's registered shared memory, a fetcher's pinned buffer) gets none: its pieces go to
        the device as they are (``plan.direct``); one handed on as a view of pageable memory is
        copied into staging memory instead (a copy to the device from there is asynchronous)."""
        rb = self._rebatcher
        if self._on_device and plan.parts is not None:
            runner = self._runner
            assert runner is not None
            parts = plan.parts[:-1] if self._keyed else plan.parts
            if runner.direct(parts):
                plan.direct = True
                if plan.views is None:  # no host copy after all (the keys excepted: those stay on the host)
                    rb.copied_bytes -= plan.nbytes
                    rb.copied_batches -= 1
                    rb.zero_copy_batches += 1
                    plan.out = [None] * len(parts)
                    if self._keyed:
                        plan.out.append(np.empty(plan.shapes[-1], plan.dtypes[-1]))
                return
            if plan.views is not None and runner.stages(plan.views[:len(parts)]):
                plan.views = None
                rb.copied_bytes += plan.nbytes
                rb.copied_batches += 1
                if not self.dont_rebatch:  # (the rebatcher counted it as handed on without a copy)
                    rb.zero_copy_batches -= 1
        rb.buffers(plan, use_ring=plan.rows == rb.batch_size or self.dont_rebatch)

    def _work(self, enough: Optional[Callable[[], bool]] = None) -> bool:
        """Write big batches that wait to be written, in this thread (see ``feeder.assembly``), until
        ``enough()`` if given."""
        if not self._asm.pending():
            return False
        return self._asm.work(self._write, enough) > 0

    def _write(self, place: int, plan: Any) -> bool:
        """Write a planned batch (its host copy, its OrtValues, its copy to the device) and hand it
        to the order (``feeder.assembly``); in any thread, under the pump lock or not. Never raises:
        a failure fails the feed (or the source, for the session's preparation) and books the
        batch's rows as discarded. False if it failed."""
        t0 = time.monotonic()
        try:
            arrays = plan.execute()
            keys = None
            if self._keyed:
                arrays, keys = split_keys(arrays)
            # (the keys' bytes are in: the source counted them in, delivery must count them out; a padded
            # batch's are its chunks' bytes, what the source counted in)
            batch = PreparedBatch(self.input_names, arrays, plan.rows,
                                  nbytes=plan.nbytes if plan.source_nbytes is None else plan.source_nbytes)
            if keys is not None:
                batch.keys = keys
                batch.pad_varies = getattr(plan, "varies", None)  # (a padded plan's; the source's state keeps it)
            if plan.direct:  # its rows go to the device from where they lie (see _stage)
                n = len(arrays)
                batch.pieces = [tuple(p) for p in plan.parts[:n]]
                batch.meta = list(zip(plan.dtypes[:n], plan.shapes[:n]))
        except BaseException as e:  # noqa: B902 - the order must go on: this place is failed, never left open
            self._asm.fail(place)
            where = threading.current_thread().name
            self._fail(FeederError(f"source {self.input_source_name!r}: writing a batch failed in thread {where!r}: "
                                   f"{type(e).__name__}: {e}"), e)
            return False
        copied = time.monotonic()
        runner = self._runner
        if runner is not None and not runner.prepares_in_order:
            try:
                runner.prepare(batch)
            except BaseException as e:  # noqa: B902
                self._asm.fail(place)
                self._prepare_failed(batch, e)
                return False
        if plan.copy_nbytes:
            with self._books:
                self._assemble_s += copied - t0
            tracer = self._trace.tracer
            if tracer is not None:
                tracer.span("assemble", t0, copied, rows=plan.rows, bytes=plan.copy_nbytes)
        self._asm.complete(place, batch)
        return True

    def _hand_on(self, item: Any) -> bool:
        """Called by the order (``feeder.assembly``, under its lock), batch after batch in their
        order: into the ready queue. A session adapter's own ``prepare_batch`` runs here, so that it
        sees the batches one at a time, in order. False if the batch was not handed on."""
        if isinstance(item, PreparedBatch):
            runner = self._runner
            if runner is not None and runner.prepares_in_order:
                try:
                    runner.prepare(item)
                except BaseException as e:  # noqa: B902
                    self._prepare_failed(item, e)
                    return False
            self._batches_made += 1
        self._ready.put_reserved(item)
        return True

    def _prepare_failed(self, batch: PreparedBatch, e: BaseException) -> None:
        """The session's preparation of a batch raised (a custom adapter's ``prepare_batch``, or
        binding it for the runtime). Whichever thread was moving batches on (the enqueuer, a
        producer's or a consumer's pump) must not be the only one to hear of it while the feed goes
        on without the batch: the source fails, sticky, like any failure; the batch's rows are
        booked as discarded by the order (``feeder.assembly``), so the ledger still balances."""
        rows = batch.rows
        what = "prepare_batch" if callable(getattr(self.session, "prepare_batch", None)) else "preparing a batch"
        self.source.fail(Failure(FeederError(
            f"source {self.input_source_name!r}: the session's {what} raised {type(e).__name__}: {e} "
            f"(on a batch of {rows} rows, in thread {threading.current_thread().name!r}); the source has failed"), e))
        log.error("source %r: the session's %s raised; the source has failed", self.input_source_name, what,
                  exc_info=e)

    def _finish(self) -> None:
        """End of data: plan the whole batches left (a producer's pump may have left some), then the
        short last batch or drop it, then the end marker, after every batch in the order."""
        rb = self._rebatcher
        rb.end_of_data()  # a length window is cut whatever it holds
        if not self._emit_full_batches():
            return
        if rb.pending_rows:
            if self.last_batch == "keep":
                if not self._wait_room():
                    return
                plan = rb.plan_flush()
                if plan is not None and not self._emit(plan):
                    return
            else:
                nbytes = rb.pending_nbytes
                n = rb.drop()
                self._rows_dropped += n
                self.source.dropped(n, nbytes)
                log.info("source %r: dropped the last %d rows (fewer than batch_size=%d; last_batch='drop')",
                         self.input_source_name, n, rb.batch_size)
        self._asm.complete(self._asm.reserve(0), END_OF_DATA)

    # ---- the rows it holds: the ledger, the discard at stop --------------------------------------
    def _held_rows(self) -> int:
        """Rows inside this feed, counted where they are (rebatcher, a thread's hands, batches being
        written, ready queue)."""
        return (self._rebatcher.pending_rows + self._inflight_rows + self._asm.inflight_rows
                + self._ready.queued_rows())

    def _check_ledger(self, when: str) -> bool:
        """Rows this feed took from its source = rows delivered + dropped + discarded + still held.
        Never fails."""
        ready, delivered = self._ready.held_and_delivered()
        held = self._rebatcher.pending_rows + self._inflight_rows + self._asm.inflight_rows + ready
        ok = self._rows_taken == delivered + self._rows_dropped + self._rows_discarded + held
        if not ok:
            log.error("source %r: row ledger does not balance at %s: taken %d != delivered %d + dropped %d + "
                      "discarded %d + held %d", self.input_source_name, when, self._rows_taken, delivered,
                      self._rows_dropped, self._rows_discarded, held)
        return ok

    def _discard_held(self) -> bool:
        """At stop, once the enqueuer has ended: the rows this feed still holds are discarded.

        Under the pump lock: a consumer may be rebatching in ``_pump`` (consumer threads are not
        joined at stop); once stop is set, nothing takes or rebatches after this (``_pump_ready``
        looks at the stop flag under the lock). A rebatching step may take long (a very large
        batch, a cold memory-mapped file) and stop() must not wait for it: after DISCARD_LOCK_S
        the discard is left to the thread that holds the lock, which makes it as it lets the lock
        go (``_release_pump``). A batch being written outside the lock (``feeder.assembly``) is
        discarded by its writer when it is done. Returns True if the discard is made; False if it
        was left so (``_when_discarded`` then runs what must follow it, such as the ledger's audit)."""
        with self._discard_lock:
            self._discard_pending = True
        lock = self._pump_lock
        if lock.acquire(timeout=DISCARD_LOCK_S):
            try:
                self._discard_now()
            finally:
                lock.release()
        with self._discard_lock:
            return not self._discard_pending  # (the holder may have made it after the wait gave up)

    def _discard_now(self) -> None:
        """The discard stop() asked for, if not made yet (the caller holds the pump lock); what
        waits for it runs once no thread writes a batch any more."""
        with self._discard_lock:
            if not self._discard_pending or self._discard_made:
                return
            self._discard_made = True
        rows = self._rebatcher.drop() + self._inflight_rows
        self._inflight_rows = 0
        rows += self._asm.discard(self._ready.clear)
        self._book_discarded(rows)
        self._asm.when_idle(self._discard_finished)

    def _discard_finished(self) -> None:
        with self._discard_lock:
            self._discard_pending = False
            after, self._after_discard = self._after_discard, []
        for fn in after:
            fn()

    def _when_discarded(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once what the feed held at stop is discarded: now if it is, else in the thread
        that makes the discard (see _discard_held). ``fn`` must not raise."""
        with self._discard_lock:
            if self._discard_pending:
                self._after_discard.append(fn)
                return
        fn()
