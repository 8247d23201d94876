"""Fetcher threads: call the user's ``fetch_fun`` and put validated chunks on the source's queue.

The loop is a module-level function with explicit arguments (after torchdata's
``_populate_queue``) so it can be driven without the feed that owns it.

Small chunks of fast calls are coalesced into whole batches by the fetcher that fetched them
(``feeder.coalescing``); short calls are made one fetcher at a time (``Turns``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .chunkqueue import CLOSED, Chunk, ChunkQueue
from .coalescing import COALESCE_FRACTION, COALESCE_HOLD_S, COALESCE_SLOW_CALL_S, Coalescer, burst, made
from .errors import Failure, FeederError, FetchError, InputValidationError, exception_text
from .pacing import AFTER_NONE, EmptyReport, NoneReport, none_pause
from .sources.base import SKIP
from .trace import TraceHook
from .tuning import Throttle
from .validation import ChunkValidator

# Re-exported: feeder.processes.parent and tests/test_fetchers.py import these from here.
from .workerstate import IN_FETCH as IN_FETCH
from .workerstate import WAITING_FOR_ROOM as WAITING_FOR_ROOM
from .workerstate import WorkerState as WorkerState

log = logging.getLogger("feeder")

SLICE_S = 0.05            # longest single wait, so a stop is seen within this many seconds
CPU_SAMPLE_S = 0.05       # fetchers read their CPU clock this often (it is ~8x dearer than monotonic)
SHORT_CALL_S = 0.0002     # fetch_fun calls shorter than this are made by one fetcher of a source at a time (Turns)
TURN_S = 0.005            # a fetcher with the turn hands it on after a batch, or after this long, if others wait
STEAL_S = 0.002           # a waiter takes the turn from a fetcher that has not started a call for this long


def put_chunk(source: ChunkQueue, chunk: Chunk, state: WorkerState, stop: threading.Event,
              pump: Optional[Callable[[Chunk], Optional[bool]]] = None) -> bool:
    """Put with short waits until it fits; False if the source stopped, closed or failed meanwhile.
    Counts the rows put and the time blocked on ``state`` (fetcher threads and process receivers).

    The first try does not wait, so the blocked clock starts at the first moment the chunk does
    not fit: a model-bound feed's puts wait a few milliseconds each, and all of it is blocked time
    (``diagnose()`` rests on it). The fast path costs one clock read, as the timed try did."""
    if pump is not None and pump(chunk):  # put, and taken on into the feed's ready queue (Feed.pump_put)
        state.rows_put += chunk.rows
        return True
    put = source.put(chunk, 0.0)
    if put is True:
        state.rows_put += chunk.rows
        return True
    state.set(WAITING_FOR_ROOM)
    blocked_since = state.since
    try:
        while put is not True:
            if put is CLOSED or stop.is_set() or source.failure is not None:
                return False
            put = source.put(chunk, SLICE_S)
    finally:
        state.blocked_s += time.monotonic() - blocked_since
    state.rows_put += chunk.rows
    return True


class Turns:
    """Which fetcher of a source may make short ``fetch_fun`` calls now: one at a time, in turn.

    Two fetcher threads making calls of a few microseconds each do not fetch twice as fast: the
    GIL lets one run at a time, and every time one lets it go (numpy does around each copy of more
    than a few hundred elements) the other takes it, so each call pays for a hand-over between
    threads (measured: tiny chunks, 1 fetcher 917k rows/s, 2 fetchers 695k). So while its calls
    are short (SHORT_CALL_S), a fetcher first takes the turn; the others wait for it, blocked, and
    do not compete for the GIL; the holder hands the turn on after a batch or TURN_S, to the
    fetcher that has waited longest (so every worker's share is served), at the first batch it
    makes after TURN_S (a hand-over costs a thread's wake-up: not once per batch). Calls that take
    longer (I/O, sleeps, work in C that releases the GIL) are made without the turn, side by side,
    and so are short calls that made a big chunk (``feeder.coalescing.made``): their time went to
    one copy without the GIL (measured: 3 MB chunks copied in 0.12 ms, 2 fetchers in turn 0.96-1.0x
    the serial loop, side by side 1.3x).
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._owner: Optional[int] = None  # worker id holding the turn
        self._holder: Optional[WorkerState] = None  # its state: when its current call began
        self._queue: Deque[Tuple[int, threading.Event]] = deque()

    @property
    def waiting(self) -> bool:
        """Another fetcher waits for the turn (read without the lock: a hint)."""
        return bool(self._queue)

    def holds(self, wid: int) -> bool:
        return self._owner == wid

    def take(self, state: WorkerState, stop: threading.Event, source: ChunkQueue) -> bool:
        """Wait, in short slices, for the turn; False if the source stopped or failed meanwhile.

        A call that began short may block (it waits for input): a waiter takes the turn from a
        holder that has not started a call for STEAL_S, so no fetcher waits on another's I/O."""
        wid = state.worker_id
        state.since = time.monotonic()  # its next call begins now: not one to take the turn from
        with self._mutex:
            if self._owner is None:
                self._owner, self._holder = wid, state
                return True
            entry = (wid, threading.Event())
            self._queue.append(entry)
        while not entry[1].wait(STEAL_S):
            with self._mutex:
                if self._owner == wid:  # handed over just as the wait ended
                    break
                if stop.is_set() or source.failure is not None:
                    self._queue.remove(entry)  # (still queued: only give() takes entries, and it makes us owner)
                    return False
                holder = self._holder
                # No steal from a turn just handed over (holder None, owner set): its new owner is
                # waking up, and its entry has left the queue already.
                if self._owner is None or (holder is not None and time.monotonic() - holder.since > STEAL_S):
                    self._queue.remove(entry)
                    self._owner = wid
                    break
        state.since = time.monotonic()
        with self._mutex:
            self._holder = state
        if stop.is_set() or source.failure is not None:
            self.give(wid)
            return False
        return True

    def give(self, wid: int) -> None:
        """Hand the turn to the fetcher that has waited longest (or free it)."""
        with self._mutex:
            if self._owner == wid:
                if self._queue:
                    self._owner, event = self._queue.popleft()
                    self._holder = None  # until the new owner says it runs (take, after its wait)
                    event.set()
                else:
                    self._owner = self._holder = None


def _park(throttle: Throttle, state: WorkerState, co: Optional[Coalescer], stop: threading.Event,
          source: ChunkQueue) -> bool:
    """Wait, in short slices, until the throttle lets this fetcher run; its held rows go first
    (they must not wait on a parked fetcher). False if the source stopped or failed meanwhile."""
    if co is not None and co.rb.pending_rows and not co.put_pending():
        return False
    state.set("parked (auto concurrency)")
    state.park(state.since)  # parked time is not running time (feeder.diagnosis)
    wid = state.worker_id
    try:
        while not throttle.wait(wid, SLICE_S):
            if stop.is_set() or source.failure is not None:
                return False
        return True
    finally:
        state.unpark(time.monotonic())


def fetch_loop(*, source: ChunkQueue, source_name: str, fetch_fun: Callable[[int, int], Any],
               validator: ChunkValidator, state: WorkerState, batch_size: Callable[[], int],
               stop: threading.Event, max_fetch_errors: int, coalesce: bool,
               throttle: Optional[Throttle] = None, turns: Optional[Turns] = None,
               pump: Optional[Callable[[Chunk], Optional[bool]]] = None,
               nones: Optional[NoneReport] = None, empties: Optional[EmptyReport] = None,
               allocate: Optional[Callable[..., np.ndarray]] = None,
               trace: Optional[TraceHook] = None) -> None:
    """Fetch, validate and enqueue chunks until stop, StopIteration, or a failure. With a
    ``throttle`` (``num_worker_threads="auto"``) the fetcher parks while it is not let run; with
    ``turns`` (a coalescing fetcher of an unordered source) it makes short calls only in its turn.
    After a call that returned None it pauses (``none_pause``) and reports it to ``nones``.
    ``allocate`` makes the coalescing buffers (a device feed's staging memory); ``trace`` is where
    the feed's active trace is (each call that returned a chunk is a "fetch" span)."""
    nones, empties = nones or NoneReport(source_name), empties or EmptyReport(source_name)
    pause = 0.0  # the last pause after a None; 0.0 once a call returned something else
    wid = state.worker_id
    co = _coalescer(state, source, validator, batch_size(), stop, pump, allocate, trace) if coalesce else None
    monotonic = time.monotonic
    check = validator.check
    state.begin()
    if throttle is not None and wid not in throttle.active:
        state.park(state.started_at)  # parked from the start: it has not run at all
    now = monotonic()
    cpu_due = now + CPU_SAMPLE_S
    carried: Optional[Tuple[Any, Optional[BaseException], float]] = None  # a call the burst made
    mine = False    # this fetcher has the turn (Turns)
    short = False   # its last call was short: it makes the next in its turn
    taken_at = 0.0  # when it took the turn
    try:
        while not stop.is_set() and source.failure is None:
            if carried is None:
                if co is not None and co.held_since and now - co.held_since > COALESCE_HOLD_S:
                    if not co.put_pending():
                        return
                if throttle is not None and wid not in throttle.active:
                    if mine and turns is not None:
                        turns.give(wid)
                        mine = False
                    if not _park(throttle, state, co, stop, source):
                        return
                    now = monotonic()
                if turns is not None and co is not None:
                    mine = turns.holds(wid)  # (another may have taken it while a call blocked)
                if turns is not None and co is not None and short != mine:
                    if short:  # short calls: in turn, the others blocked (see Turns)
                        if not turns.take(state, stop, source):
                            return
                        taken_at = monotonic()
                    else:
                        turns.give(wid)
                    mine = short
                    co.rb.hold_gil = not mine  # numpy may let the GIL go around each piece when nobody waits
            bs = batch_size()
            if state.state is not IN_FETCH:
                state.state = IN_FETCH
            raw: Any = None
            error: Optional[BaseException] = None
            was_carried = carried is not None
            if carried is not None:
                raw, error, state.since = carried
                carried = None
                parked = False
            else:
                state.since = monotonic()  # with the state: what a FeedTimeout diagnosis reports
                state.calls += 1
                parked = bool(co is not None and co.held_since)  # park (see Coalescer)
                if parked and co is not None:
                    co.parked.append(True)
                try:
                    raw = fetch_fun(wid, bs)
                except BaseException as raised:  # noqa: B902 - KeyboardInterrupt/SystemExit must reach the consumer too
                    error = raised
            if error is not None:
                if parked and co is not None:
                    co.reclaim()
                if _fetch_raised(error, state, source, source_name, co, throttle, stop, max_fetch_errors):
                    continue  # a fetch error tolerated: that call is skipped
                return
            if parked and co is not None:  # reclaim (inline for speed)
                try:
                    co.parked.pop()
                except IndexError:
                    co.reclaim()
            now = monotonic()
            if not was_carried:  # the burst counted its own calls' time
                state.fetch_s += now - state.since
                tracer = trace.tracer if trace is not None else None
                if tracer is not None and raw is not None:
                    tracer.span("fetch", state.since, now)
            short = now - state.since < SHORT_CALL_S
            if now >= cpu_due:
                state.sample_cpu(now)
                cpu_due = now + CPU_SAMPLE_S
            if raw is None:
                paused = _pause_after_none(pause, state, nones, co, turns if mine else None, stop)
                if paused is None:
                    return
                pause, mine, now = paused, False, monotonic()  # (the turn went with the pause)
                continue
            pause = 0.0
            if raw is SKIP:  # nothing this time, on purpose; an ordered source's round-robin counts the turn
                if source.ordered and not put_chunk(source, Chunk(wid, (), 0), state, stop, pump):
                    return
                continue
            try:
                arrays, rows = check(raw, wid)
            except InputValidationError as e:
                state.set("failed")
                source.fail(Failure(e))
                return
            if rows == 0:
                state.empty_chunks += 1
                empties.note(wid)
                continue
            state.chunks += 1
            state.rows += rows
            # A big chunk written at memory speed: the call's time went to a copy numpy makes without
            # the GIL, which the other fetchers can make beside it (no turn, see Turns); its fetcher
            # may cut it into batches itself (see Coalescer.add).
            made_chunk = co is not None and rows * COALESCE_FRACTION > bs and made(arrays, now - state.since)
            if made_chunk:
                short = False
            if co is None:
                if not put_chunk(source, Chunk(wid, arrays, rows), state, stop, pump):
                    return
                continue
            rb = co.rb
            slow = now - state.since > COALESCE_SLOW_CALL_S
            if not slow and co.may_hold(rows, bs):
                # the common case: a tiny chunk that does not complete a batch is held, and the next
                # calls go the short way while they are like it (see feeder.coalescing.burst)
                if not rb.pending_rows:
                    co.held_since = now
                rb.append(arrays, rows)
                co.unput += 1
                carried = burst(co, fetch_fun, wid, bs, validator._single, check, state)
                continue
            put_before = state.rows_put
            if not co.add(arrays, rows, bs, now, slow, made_chunk):
                return
            state.copied_bytes = rb.copied_bytes
            if mine and turns is not None and turns.holds(wid) and turns.waiting and now - taken_at > TURN_S and (
                    state.rows_put != put_before or now - taken_at > 2 * TURN_S):
                turns.give(wid)  # its time is up (at a batch made, so that few rows wait): the next one's turn
                mine = False
    except BaseException as e:  # a bug here must not leave the source waiting on a dead worker
        _fetcher_failed(e, state, source, source_name)
    finally:
        _fetcher_ended(state, source, turns)


def _coalescer(state: WorkerState, source: ChunkQueue, validator: ChunkValidator, batch_size: int,
               stop: threading.Event, pump: Optional[Callable[[Chunk], Optional[bool]]],
               allocate: Optional[Callable[..., np.ndarray]], trace: Optional[TraceHook]) -> Optional[Coalescer]:
    """The coalescer of a fetcher that coalesces, registered as a flusher of the source's held rows."""
    if validator.ragged:  # rows of padded inputs are written once, into the padded batch
        return None
    co = Coalescer(state, source, validator.axes, batch_size,
                   lambda chunk: put_chunk(source, chunk, state, stop, pump), allocate, trace)
    source.add_flusher(co.flush_if_stale)
    return co


def _fetch_raised(e: BaseException, state: WorkerState, source: ChunkQueue, source_name: str,
                  co: Optional[Coalescer], throttle: Optional[Throttle], stop: threading.Event,
                  max_fetch_errors: int) -> bool:
    """A call of ``fetch_fun`` raised ``e`` (the fetch loop's, once the held rows are back): a
    StopIteration ends the worker (its held rows put first), bad data or a source that cannot serve
    again fails the source, any other exception is counted and skipped up to ``max_fetch_errors``,
    then fails the source. True if the fetcher goes on (the call skipped), False if it ends."""
    wid = state.worker_id
    if isinstance(e, StopIteration):
        if co is not None and not co.put_pending():
            return False
        state.set("ended (StopIteration)")
        source.worker_ended(wid)
        if throttle is not None:
            throttle.ended(wid)
        return False
    if stop.is_set():
        return False
    if isinstance(e, InputValidationError):  # bad data (feeder.sources): never tolerated
        state.set("failed")
        source.fail(Failure(InputValidationError(f"source {source_name!r}, worker {wid}: {exception_text(e)}"), e))
        return False
    if getattr(e, "feeder_final", False):  # the source cannot serve again (feeder.sources.base)
        state.set("failed")
        source.fail(Failure(FetchError(f"source {source_name!r}, worker {wid}: {exception_text(e)}"),
                            e.__cause__ or e))
        return False
    state.fetch_errors += 1
    n = source.note_fetch_error()
    if isinstance(e, Exception) and n <= max_fetch_errors:
        log.warning("source %r worker %d: fetch_fun raised (%d of %d tolerated); skipping that call",
                    source_name, wid, n, max_fetch_errors, exc_info=e)
        return True
    msg = f"source {source_name!r}, worker {wid}: fetch_fun raised {type(e).__name__}: {exception_text(e)}"
    if max_fetch_errors:
        msg += f" (fetch error {n}, more than max_fetch_errors={max_fetch_errors})"
    state.set("failed")
    source.fail(Failure(FetchError(msg), e))
    return False


def _pause_after_none(pause: float, state: WorkerState, nones: NoneReport, co: Optional[Coalescer],
                      turns: Optional[Turns], stop: threading.Event) -> Optional[float]:
    """A call of ``fetch_fun`` returned None (``turns``: the source's, if this fetcher has the turn;
    else None). Returns the pause made before the next call (seconds), None if the fetcher ends
    (stop, or its held rows could not be put)."""
    state.none_chunks += 1
    nones.note(state.worker_id)
    # Nothing this time: nothing is likely to come at once either. Held rows go now (they
    # must not wait on the pause), the turn goes to another fetcher, and the next call
    # waits a little longer after each None in a row (stop ends the wait at once).
    if co is not None and co.rb.pending_rows and not co.put_pending():
        return None
    if turns is not None:
        turns.give(state.worker_id)
    pause = none_pause(pause)
    state.set(AFTER_NONE)
    if stop.wait(pause):
        return None
    return pause


def _fetcher_failed(e: BaseException, state: WorkerState, source: ChunkQueue, source_name: str) -> None:
    """The fetch loop itself raised ``e`` (a bug): the source fails, so that nobody waits on this worker."""
    wid = state.worker_id
    state.set("failed")
    source.fail(Failure(FeederError(f"source {source_name!r}, worker {wid}: fetcher thread failed: "
                                    f"{type(e).__name__}: {exception_text(e)}"), e))
    log.error("source %r worker %d: fetcher thread failed", source_name, wid, exc_info=True)


def _fetcher_ended(state: WorkerState, source: ChunkQueue, turns: Optional[Turns]) -> None:
    """What a fetcher does last, however it ended: the turn given back, its state and CPU time
    final, and the rows it fetched and never put booked as discarded."""
    if turns is not None:
        turns.give(state.worker_id)
    if not state.state.startswith(("ended", "failed")):
        state.set("stopped")
    state.ended_at = time.monotonic()
    state.sample_cpu(state.ended_at)
    # Rows fetched but never put (held for coalescing, or a chunk refused at stop) enter the
    # ledger as fetched and discarded: every row fetch_fun returned is accounted for.
    source.discarded(state.rows - state.rows_put, fetched=True)


class ThreadFetchers:
    """The fetchers of one feed as threads running :func:`fetch_loop`.

    The feed reaches its fetchers only through this interface, which
    ``feeder.processes.parent.ProcFetchers`` offers too: ``states`` (one :class:`WorkerState` each),
    ``start``, ``set_batch_size``, ``signal_stop``, ``threads``, ``close``, ``request_stacks`` and
    ``describe``.
    """

    mode = "threads"

    def __init__(self, *, source: ChunkQueue, fetch_fun: Callable[[int, int], Any], validator: ChunkValidator,
                 worker_ids: Sequence[int], max_fetch_errors: int, stop: threading.Event,
                 throttle: Optional[Throttle] = None, pump: Optional[Callable[[Chunk], Optional[bool]]] = None,
                 allocate: Optional[Callable[..., np.ndarray]] = None, trace: Optional[TraceHook] = None):
        self.source = source
        self._pump = pump  # Feed.pump_put: producers take their chunks on into the ready queue
        self._allocate = allocate  # coalescing buffers: a device feed's staging memory
        self._trace = trace
        self.states = [WorkerState(w) for w in worker_ids]
        self._fetch_fun = fetch_fun
        self._validator = validator
        self._max_fetch_errors = max_fetch_errors
        self._stop = stop
        self._throttle = throttle
        self._batch_size = 0
        self.nones = NoneReport(source.name)  # fetch_fun returning None, logged for all of them
        self.empties = EmptyReport(source.name)  # ... and chunks of 0 rows

    def start(self, batch_size: int, coalesce: bool) -> None:
        self._batch_size = batch_size
        name = self.source.name
        turns = None
        if coalesce:  # one Turns per source: replicas' fetchers share the GIL too (coordinator.start: one thread)
            if self.source.turns is None:
                self.source.turns = Turns()
            turns = self.source.turns
        for state in self.states:
            state.thread = threading.Thread(
                target=fetch_loop, name=f"feeder:{name}:fetch-{state.worker_id}", daemon=True,
                kwargs=dict(source=self.source, source_name=name, fetch_fun=self._fetch_fun,
                            validator=self._validator, state=state, batch_size=lambda: self._batch_size,
                            stop=self._stop, max_fetch_errors=self._max_fetch_errors, coalesce=coalesce,
                            throttle=self._throttle, turns=turns, pump=self._pump, nones=self.nones,
                            empties=self.empties, allocate=self._allocate, trace=self._trace))
        for state in self.states:
            state.set("starting")
            assert state.thread is not None
            state.thread.start()

    def set_batch_size(self, batch_size: int) -> None:
        """Every fetcher's next fetch_fun call sees ``batch_size``."""
        self._batch_size = batch_size

    def signal_stop(self, deadline: Optional[float] = None) -> None:
        self._stop.set()

    def threads(self) -> List[threading.Thread]:
        return [s.thread for s in self.states if s.thread is not None]

    def close(self) -> None:
        """Threads hold no process, shared memory or descriptor; only the feed's pump_put, a
        reference back to the feed (a cycle that would keep it for the garbage collector)."""
        self._pump = None

    def request_stacks(self) -> None:
        """Nothing to ask ahead: a thread's stack is read at once."""

    def counters(self) -> Dict[str, float]:
        """The fetch_fun's ``feeder_counters`` for this feed's workers (see ``feeder.sources.base``),
        counted in this process, where the threads run; {} when it has none (or it raised)."""
        counters = getattr(self._fetch_fun, "feeder_counters", None)
        if counters is None:
            return {}
        try:
            return {str(k): float(v) for k, v in counters(tuple(s.worker_id for s in self.states)).items()}
        except Exception:
            log.debug("source %r: feeder_counters() raised", self.source.name, exc_info=True)
            return {}

    def describe(self, now: float, stack_after_s: float = 1.0) -> List[str]:
        return [s.describe(now, stack_after_s=stack_after_s) for s in self.states]

    def live_descriptions(self) -> List[str]:
        now = time.monotonic()
        return [s.describe(now, stack_after_s=0.0) for s in self.states
                if s.thread is not None and s.thread.is_alive()]
