"""One registration of a fetch function: its fetcher threads, its enqueuer, its consumer API.

Data path::

    fetch_fun --(fetcher threads)--> ChunkQueue (named, shared by replicas)
              --(enqueuer thread: Rebatcher, Runner.prepare)--> ready queue (small, per feed)
              --(consumer: next_batch / run / iteration)--> session

The consumer's path to the next batch is one pop from the ready queue; for ``run()`` it
then binds the OrtValues the enqueuer already made and runs the session.

This module holds :class:`Feed`'s wiring, its lifecycle, the consumer calls, what producers call
(``pump_put``) and where a planned batch goes (``_emit``, ``_size_for``: they read the tunables
below at call time). The rest of the producer side (the enqueuer's loop, the same work done by
producers and consumers, writing batches and handing them on, the end of the data, the discard at
stop, the row ledger) is its base class, :class:`feeder.pump.Pump`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from multiprocessing.context import BaseContext
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Sequence, Tuple, Union, cast, overload

import numpy as np

from .assembly import Assembly
from .chunkqueue import Chunk, ChunkQueue
from .device import Placement
from .diagnosis import StageTimes
from .errors import Failure, FeederError, FeedStopped, FeedTimeout
from .feedstats import FeedStats
from .fetchers import SLICE_S, ThreadFetchers
from .metrics import ConsumerCounters, RateMeter
from .padding import ByteRing, Padding, PadRebatcher
from .processes.parent import STACK_LEAD_S, ProcFetchers
from .processes.starting import ProcessOptions
from .pump import DISCARD_LOCK_S as DISCARD_LOCK_S  # the pump's; tests/test_finite.py reads it from here
from .pump import END_OF_DATA, Pump
from .readyqueue import ReadyQueue
from .rebatcher import BufferRing, Rebatcher
from .runtime import PreparedBatch, Runner
from .sources.rowkeys import public_names
from .trace import TraceHook, Tracer
from .tuning import Throttle, Tuner
from .validation import ChunkValidator, InputSpec

log = logging.getLogger("feeder")

# Depth of the per-feed queue of prepared batches. Deeper lets the enqueuer run further ahead per
# wake-up, which matters when Python fetchers keep the GIL busy (every wake-up may wait for it);
# but each prepared batch is one more buffer in rotation, and big batches then fall out of cache.
# So the depth is what fits READY_BYTES, between 1 and READY_MAX (benchmarks/compare.py a, b).
READY_MAX = 4
READY_BYTES = 4 * 2**20
DEVICE_READY = 2  # on a device, at least this many prepared batches: their bytes are in device slots, not in cache
SLOW_INPUT_WARN_S = 10.0  # a consumer starved this long logs that data input is slow
# Batches with at least this many bytes to copy are written outside the feed's lock, by up to
# ``assemble_threads`` threads at once (feeder.assembly); smaller ones at once by the thread that
# planned them, under the lock: a hand-over would cost more than their copy.
PARALLEL_BYTES = 1 << 20
MAX_ASSEMBLE_THREADS = 4  # the default assemble_threads: the cores, up to this many


def default_assemble_threads() -> int:
    """Threads that may write a feed's big batches at once, by default: the cores, up to
    MAX_ASSEMBLE_THREADS (memory bandwidth, not cores, bounds copies beyond a few)."""
    return max(1, min(MAX_ASSEMBLE_THREADS, os.cpu_count() or 1))


class Feed(Pump):
    """One registration: what a consumer calls, and the fetchers and enqueuer behind it.

    Made by :func:`feeder.init_data_input_workers`; get it with ``coord.feed(name)`` (or
    ``coord.feeds(name)`` for replicas). What a consumer calls, after ``coord.start()``:

    - :meth:`next_batch`: the next batch as ``{input name: numpy array}``;
    - :meth:`run`: the next batch run through the session, its outputs returned (with
      ``with_batch=True``, and the batch's arrays, kept ones included);
    - :meth:`runs`: ``run()`` on every batch until a finite source ends, as an iterator;
    - iteration, ``for batch in feed:``: ``next_batch()`` until a finite source ends;
    - :meth:`metrics`, :meth:`diagnose`, :meth:`stage_times`: what the feed measured.

    Every consumer call raises ``FeedTimeout`` when no batch came in time, ``FetchError`` after a
    fetch failure, ``InputValidationError`` for a bad chunk, ``StopIteration`` once a finite
    source has ended, ``FeedStopped`` once the coordinator has stopped, and ``FeederError``
    before ``start()``. Batches stay valid for as long as the caller holds them: a buffer is
    reused only once nothing references it any more.

    Attributes:
        input_source_name: The name of the source this feed draws from.
        input_names: The arrays of each batch, in order: the inputs, then the ``keep=`` arrays,
            then the masks of ``pad=`` inputs (a resumable source's row-key column is not among
            them: it is stripped from every batch).
        fetched_names: The arrays ``fetch_fun`` returns, in order: ``input_names`` without the
            masks that padding makes.
        kept_names: The ``keep=`` arrays: in every batch, never bound to the session.
        worker_ids: The worker ids of this registration's fetchers, threads or processes.
        session: The session given at registration, or None.
        timeout: Seconds a consumer call waits by default before ``FeedTimeout``.
    """

    def __init__(self, *, coordinator: Any, source: ChunkQueue, session: Any, input_names: Sequence[str],
                 specs: Sequence[InputSpec], batch_axes: Sequence[int], fetch_fun: Callable[[int, int], Any],
                 batch_size: int, worker_ids: Sequence[int], init_fun: Optional[Callable[..., Any]],
                 external_loggers: Sequence[Any], dont_rebatch: bool, timeout: float, last_batch: str,
                 log_interval: float, validator: ChunkValidator, max_fetch_errors: int, auto: bool = False,
                 resume_from: Optional[Dict[str, Any]] = None, processes: Optional[ProcessOptions] = None,
                 placement: Optional[Placement] = None, padding: Optional[Padding] = None,
                 kept: Sequence[str] = (), assemble_threads: Optional[int] = None, pad_short: bool = False):
        self._coordinator = coordinator
        self.source = source
        self.session = session
        self.input_source_name: str = source.name
        # input_names may end with the row-key column (feeder.rowkeys): rebatched with the inputs,
        # stripped from every batch before anyone sees it.
        self._all_names: List[str] = list(input_names)
        # pad=: each padded input's mask follows the inputs in every batch (feeder.padding)
        self.fetched_names: List[str] = public_names(input_names)
        self.input_names: List[str] = self.fetched_names + (padding.mask_names() if padding else [])
        # keep=: arrays after the inputs that ride along, never bound (the Runner's "unfed" ones)
        self.kept_names: List[str] = list(kept)
        self._keyed = len(self._all_names) > len(public_names(input_names))
        self.worker_ids: List[int] = list(worker_ids)
        self._batch_size = int(batch_size)
        self._axes = tuple(batch_axes)
        self._fetch_fun = fetch_fun
        self.resume_from = resume_from  # handed to the source's feeder_bind (feeder.sources.base)
        self._mp_context = processes.context if processes is not None else None
        self.init_fun = init_fun
        self.external_loggers = list(external_loggers)
        self.dont_rebatch = dont_rebatch
        self.timeout = float(timeout)
        self.last_batch = last_batch
        # A fixed batch dimension (the batch size) and last_batch="keep": run() pads the short last
        # batch to the batch size and returns its own rows' outputs (feeder.checks.short_last_batch).
        self._pad_short = pad_short
        self.log_interval = float(log_interval)
        self.max_fetch_errors = max_fetch_errors
        # num_worker_threads="auto": the tuner decides how many of worker_ids run (feeder.tuning).
        # An ordered source needs every worker in its round-robin, so there all of them run.
        self._tuner: Optional[Tuner] = None
        self._throttle: Optional[Throttle] = None
        if auto and not source.ordered:
            self._tuner = Tuner(len(self.worker_ids))
            self._throttle = Throttle(self.worker_ids, self._tuner.current)
        elif auto:
            log.info("source %r: ordered=True runs all %d fetchers of num_worker_threads='auto' (a parked worker "
                     "would stall the round-robin)", source.name, len(self.worker_ids))
        self._specs = list(specs)
        self._validate = validator  # the source's, shared by its replicas
        self._runner = Runner(session, self.input_names, placement=placement) if session is not None else None
        self._checked_names: Optional[Tuple[str, ...]] = None  # run()'s output_names last found valid
        # On a device, batches live in device slots until run; the ready queue may hold two of them
        # whatever their size (the copy of the next overlaps the run of this one).
        self._on_device = self._runner is not None and self._runner.slots is not None

        self._stop = threading.Event()
        self._ready = ReadyQueue(1)  # sized by the first batch, see _size_for
        self._sized = False
        # Batches planned and not yet in the ready queue: written by several threads, handed on in order.
        self._asm = Assembly(assemble_threads or default_assemble_threads(), _Weak(self, "_hand_on"),
                             _Weak(self, "_book_discarded"))
        self._trace = TraceHook()  # the active feed.trace(), looked up by every thread that records
        if self._keyed and source.row_keys is not None:
            self._ready.on_pop = source.row_keys.record
        self._padding = padding
        self._rebatcher: Union[Rebatcher, PadRebatcher]
        self._ring: Union[BufferRing, ByteRing]
        if padding is not None:  # batches of one shape from rows of many (feeder.padding)
            # (on a device: in the staging memory it copies from fast, as the Rebatcher's below)
            self._ring = ByteRing(READY_MAX + 2, allocate=self._runner.host_allocator if self._runner else None)
            self._rebatcher = PadRebatcher(self._batch_size, self._axes, padding.pads, padding.multiple,
                                           padding.window, self._ring, keyed=self._keyed)
            if self._keyed and source.row_keys is not None:  # (a resumed run rounds as the first run did)
                self._rebatcher.seed_varies(source.row_keys.pad_varies())
        else:
            # Batches the rebatcher assembles: in staging memory the device copies from fast, on a device.
            self._ring = BufferRing(READY_MAX + 2, allocate=self._runner.host_allocator if self._runner else None)
            self._rebatcher = Rebatcher(self._batch_size, self._axes, self._ring)  # reorder is set at start
        # One interface for both ways of fetching (feeder.fetchers, feeder.processes.parent).
        self._fetchers: Any
        runner = self._runner
        if runner is not None and runner.transfer is not None:  # copies are traced on the stream's track
            runner.transfer.trace = self._trace
            runner.transfer.track = f"feeder:{source.name}:stream"
        if processes is not None:
            # On a device, each shared-memory segment is registered with the CUDA runtime as it is
            # mapped (and unregistered before it is unmapped): chunks go to the device from there.
            self._fetchers = ProcFetchers(source=source, fetch_fun=fetch_fun, validator=validator,
                                          worker_ids=self.worker_ids, max_fetch_errors=max_fetch_errors,
                                          stop=self._stop, options=processes, throttle=self._throttle,
                                          pump=self.pump_put, register=runner.host_register if runner else None,
                                          trace=self._trace)
        else:
            # On a device, fetchers coalesce small chunks into pinned buffers: batches the device
            # copies straight from there.
            self._fetchers = ThreadFetchers(source=source, fetch_fun=fetch_fun, validator=validator,
                                            worker_ids=self.worker_ids, max_fetch_errors=max_fetch_errors,
                                            stop=self._stop, throttle=self._throttle, pump=self.pump_put,
                                            allocate=runner.host_allocator if runner else None, trace=self._trace)
        self._workers = self._fetchers.states
        self._enqueuer_thread: Optional[threading.Thread] = None
        self._failure: Optional[Failure] = None
        self._init_done = False
        self._started = False
        self._stopped = False
        self._ended = False
        self._live = False  # started, not stopped, not ended: the consumer's fast path checks only this
        self._init_pump()  # its lock, the batch size to take on, the discard at stop, its books (feeder.pump)
        self._waiting = 0  # consumers waiting with nothing ready (guarded by _waiting_lock)
        self._waiting_lock = threading.Lock()
        self.counters = ConsumerCounters()
        self._meter = RateMeter()
        self._next_report = 0.0
        self._frozen_at = 0.0  # when the feed stopped or handed out its end of data: figures freeze there

    # ---- public attributes -----------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Rows per batch (what ``fetch_fun`` is told; changed by ``reset_data_input``)."""
        return self._batch_size

    @property
    def fetch_fun(self) -> Callable[[int, int], Any]:
        """The fetch function (or source object) this registration calls."""
        return self._fetch_fun

    @property
    def mp_context(self) -> Optional[BaseContext]:
        """The multiprocessing context of this registration's worker processes; None for threads."""
        return self._mp_context

    # ---- figures (feeder.feedstats) -------------------------------------------------------
    @property
    def stats(self) -> FeedStats:
        """This feed's figures: metrics, diagnose(), reports, the tuner's tick. Made on each use
        (it holds nothing but the feed), so that no reference cycle keeps a stopped feed alive."""
        return FeedStats(self)

    def metrics(self) -> Dict[str, float]:
        """A snapshot of this feed's counters (``dict[str, float]``): rows along the batch axis,
        times in seconds, bytes; every key is listed in ``feeder.feedstats.METRIC_KEYS`` and in the
        reference ("Beyond the contract"). Frozen once the feed stopped."""
        return self.stats.metrics()

    def stage_times(self) -> StageTimes:
        """The stage times behind :meth:`diagnose`, in seconds (see ``feeder.diagnosis``)."""
        return self.stats.stage_times()

    def diagnose(self) -> str:
        """Plain sentences: which stage bounds throughput (input, model or the consumer's own
        code), by how much, what to change, and the figures behind it (since start)."""
        return self.stats.diagnose()

    def __repr__(self) -> str:
        return (f"Feed(source={self.input_source_name!r}, inputs={self.input_names}, batch_size={self._batch_size}, "
                f"workers={self.worker_ids})")

    # ---- lifecycle (driven by the coordinator) -------------------------------------------
    def _run_init(self) -> None:
        if not self._init_done:
            if self.init_fun is not None:
                self.init_fun(self, self._coordinator)
            self._init_done = True

    def _start_threads(self) -> None:
        if self._started:
            return
        name = self.input_source_name
        self._meter = RateMeter()
        self._next_report = self._meter.start + self.log_interval
        coalesce = not self.dont_rebatch and not self.source.ordered
        # Without a promised order, whole batches that fetchers assembled may overtake short pieces.
        self._rebatcher.reorder = coalesce and not self.source.single_stream()
        self._enqueuer_thread = threading.Thread(target=self._enqueue_loop, name=f"feeder:{name}:enqueue",
                                                 daemon=True)
        self._fetchers.start(self._batch_size, coalesce)
        self._started = True
        self._live = True
        self._enqueuer_thread.start()

    def _signal_stop(self, deadline: Optional[float] = None) -> None:
        """Signal every thread (and worker process) to stop; ``deadline`` (monotonic s) bounds the
        whole stop, which worker processes need to know (polite, then terminate, then kill)."""
        self._frozen_at = self._frozen_at or time.monotonic()
        self._live = False
        self._stopped = True
        self._stop.set()
        self._fetchers.signal_stop(deadline)

    def _release(self) -> None:
        """At stop, once its threads were joined: release what the fetchers hold of the system
        (worker processes, shared memory, descriptors) now, not when the garbage collector runs."""
        self._fetchers.close()
        if self._runner is not None:
            self._runner.close()  # device slots: freed once no running batch refers to them

    def _threads(self) -> List[threading.Thread]:
        threads = list(self._fetchers.threads())
        if self._enqueuer_thread is not None:
            threads.append(self._enqueuer_thread)
        return threads

    def _check_batch_size(self, batch_size: int) -> None:
        check_batch_size(batch_size, self._specs, self._axes, self.dont_rebatch)

    def _set_batch_size(self, batch_size: int) -> None:
        with self._batch_size_lock:
            self._batch_size = int(batch_size)
            self._pending_batch_size = int(batch_size)
            self._fetchers.set_batch_size(int(batch_size))

    # ---- producers (the rest of the producer side is feeder.pump's) ------------------------------
    # pump_put is what fetchers and receivers call; _emit and _size_for decide where a planned batch
    # goes and how deep the ready queue is, from this module's tunables, read at call time.
    def pump_put(self, chunk: Chunk) -> Optional[bool]:
        """Put a producer's chunk on the source and, in the calling producer thread, move what the
        source has into this feed's ready queue while there is room: the enqueuer's work, done
        without a hand-over between threads (each one costs a wake-up and the GIL changing hands,
        per batch). None when that is not possible now (another thread rebatches, the ready queue is
        full, the source has no room): the caller puts the chunk the usual way. The enqueuer thread
        does the rest (waiting, end of data, chunks of the source's other producers)."""
        lock = self._pump_lock
        if not self._live or lock.locked() or not self._room():
            return None
        if not lock.acquire(False):
            return None
        try:
            source = self.source
            if source.put(chunk, 0.0, notify=False) is not True:
                return None
            try:
                self._pump_ready()
            except Exception as e:
                self._pump_failed(e)
                return True  # the chunk is the source's: the failure is the feed's, not the fetch's
            if source.qsize() or self._rebatcher.has_batch():
                source.wake_getters()  # what did not fit: the enqueuer's (or a replica's) to take on
        finally:
            self._release_pump()
        self._work()
        return True

    def _emit(self, plan: Any) -> bool:
        """A batch planned (the caller holds ``_pump_lock``): its place in the order, its buffers,
        and then either written at once (small: a hand-over would cost more than the copy) or left
        for the threads that pass by to write outside the lock (``feeder.assembly``). False if the
        feed stopped or failed (the batch's rows are booked either way)."""
        if not self._sized:
            self._size_for(plan)
        self._stage(plan)
        place = self._asm.reserve(plan.rows)
        self._inflight_rows = 0  # (a chunk in this thread's hands is in the plan now)
        if plan.copy_nbytes >= PARALLEL_BYTES:
            self._asm.defer(place, plan)
            return True
        return self._write(place, plan)

    def _size_for(self, plan: Any) -> None:
        """Size the ready queue (and the rings that follow it) from the first batch: as many as fit
        READY_BYTES, and room for ``assemble_threads`` batches being written when batches are big."""
        self._sized = True
        depth = ready_depth(plan.nbytes)
        if self._on_device:
            depth = max(depth, DEVICE_READY)
        if plan.copy_nbytes >= PARALLEL_BYTES:
            depth += self._asm.threads
        self._ready.maxsize = depth
        self._ring.size = depth + 2
        if self._runner is not None:  # output buffers: those ready, one being run, one the caller holds
            self._runner.ring_size = depth + 3

    # ---- consumer ----------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._stopped:
            raise FeedStopped(f"source {self.input_source_name!r}: the coordinator was stopped; "
                              f"register again and start() to feed more")
        if not self._started:
            raise FeederError(f"source {self.input_source_name!r}: the coordinator has not been started; "
                              f"call coordinator.start() first")

    def _raise_failure(self) -> None:
        failure = self.source.failure or self._failure
        if failure is not None:
            failure.raise_()

    def _next_prepared(self, timeout: Optional[float]) -> Tuple[PreparedBatch, float, float]:
        """The next batch, when the call began and when it got the batch (monotonic seconds); the
        caller counts it (``counters``). Raises as the contract says."""
        start = time.monotonic()
        if timeout is not None and not timeout >= 0:  # also NaN, which would wait forever
            raise ValueError(f"timeout must be >= 0 seconds, got {timeout}")
        # The common case first, in as few steps as possible: the runtime waits on this path.
        if self._live and self.source.failure is None and self._failure is None:
            item = self._ready.pop()
            if item is not None and item is not END_OF_DATA:
                return item, start, time.monotonic()
        else:
            self._check_usable()
            self._raise_failure()
            if self._ended:
                raise StopIteration
            item = self._ready.pop()
        if item is None and self._live:
            self._pump()  # the chunks may be waiting in the source: take them on ourselves
            item = self._ready.pop()
        if item is None:
            item = self._wait_ready(start, start + (self.timeout if timeout is None else timeout))
        if item is END_OF_DATA:
            self.counters.wait_ended()
            self._frozen_at = self._frozen_at or time.monotonic()
            self._live = False
            self._ended = True
            self._check_ledger("end of data")
            if self.source.feed_reached_end():
                self.source.check_ledger("end of data")
            raise StopIteration
        if self.source.max_bytes is not None:
            self.source.notify_room()
        return cast(PreparedBatch, item), start, time.monotonic()

    def _wait_ready(self, start: float, deadline: float) -> Any:
        """Wait in short slices for the next item of the ready queue, or raise."""
        with self._waiting_lock:
            self._waiting += 1
        self.counters.wait_began(start)  # the tuner sees this wait while it lasts
        got = False
        try:
            # A producer held back by max_buffered_bytes may be what this consumer waits for.
            self.source.notify_room()
            warned = False
            asked = False  # for the fetchers' stacks, a little before the deadline (feeder.processes.parent)
            while True:
                if self._stopped:
                    self._check_usable()
                self._raise_failure()
                if self._ended:
                    raise StopIteration
                remaining = deadline - time.monotonic()
                if not asked and remaining <= STACK_LEAD_S:
                    asked = True
                    self._fetchers.request_stacks()
                self._pump()
                item = self._ready.pop()
                if item is not None:
                    got = True
                    return item
                item = self._ready.get(max(0.0, min(SLICE_S, remaining if asked else remaining - STACK_LEAD_S)))
                if item is not None:
                    got = True  # the wait ends when the caller counts the batch (counters.took)
                    return item
                now = time.monotonic()
                if now >= deadline:
                    self.counters.waited(now - start)
                    raise FeedTimeout(self.stats.timeout_message(now - start)) from None
                if not warned and now - start > SLOW_INPUT_WARN_S:
                    warned = True
                    log.warning("source %r: consumer has waited %.0f s for a batch: data input is slow (%s)",
                                self.input_source_name, now - start, self.stats.status_line())
        finally:
            if not got:
                self.counters.wait_ended()
            with self._waiting_lock:
                self._waiting -= 1

    def _starved(self) -> bool:
        """A consumer waits and this feed has nothing ready nor in the making (read lock-free)."""
        return self._waiting > 0 and not len(self._ready) and not self._inflight_rows and not self._asm.inflight

    def next_batch(self, timeout: Optional[float] = None) -> Dict[str, np.ndarray]:
        """The next batch, waiting for it if none is ready.

        Args:
            timeout: Seconds to wait at most; None: the registration's ``timeout``.

        Returns:
            ``{input name: numpy array}``, each array of ``batch_size`` rows along its batch
            axis (a finite source's last batch may be shorter).

        Raises:
            FeedTimeout: No batch came within ``timeout``; the message says what the source was
                doing.
            StopIteration: The finite source has ended.
            FetchError: A fetch failed (sticky: every later call raises it again).
            InputValidationError: A chunk broke the rules.
            FeedStopped: The coordinator has stopped.
            FeederError: Called before ``start()``.
        """
        batch, start, now = self._next_prepared(timeout)
        self.counters.took(batch.rows, batch.nbytes, now - start, start, now)
        tracer = self._trace.tracer
        if tracer is not None and now > start:
            tracer.span("wait", start, now, rows=batch.rows)
        if batch.slot is not None:
            batch.release()  # handed out as host arrays: its device copy is not needed
        return batch.as_dict()  # (a batch that went to the device from shared memory is written now)

    @overload
    def run(self, output_names: Optional[Sequence[str]] = ..., run_options: Any = ..., *, outputs: str = ...,
            with_batch: Literal[False] = ...) -> List[Any]: ...

    @overload
    def run(self, output_names: Optional[Sequence[str]] = ..., run_options: Any = ..., *, outputs: str = ...,
            with_batch: Literal[True]) -> Tuple[List[Any], Dict[str, np.ndarray]]: ...

    @overload
    def run(self, output_names: Optional[Sequence[str]] = ..., run_options: Any = ..., *, outputs: str = ...,
            with_batch: bool = ...) -> Union[List[Any], Tuple[List[Any], Dict[str, np.ndarray]]]: ...

    def run(self, output_names: Optional[Sequence[str]] = None, run_options: Any = None, *,
            outputs: str = "host", with_batch: bool = False
            ) -> Union[List[Any], Tuple[List[Any], Dict[str, np.ndarray]]]:
        """Run the session on the next batch and return its outputs.

        The batch's OrtValues, and with IOBinding its binding, were prepared before the call (on
        a device, already copied there), so the call takes the next prepared batch and runs the
        session (for a training adapter: one training step). Waits at most the registration's
        ``timeout`` for a batch.

        Args:
            output_names: The session outputs to return, in that order; None: every output, in
                the session's order.
            run_options: An ``onnxruntime.RunOptions`` for this run, or None.
            outputs: ``"host"`` (default): numpy arrays, in buffers reused once you drop them;
                ``"device"``: ``onnxruntime.OrtValue``s on the session's device (a GPU's memory
                for a CUDA session), yours to keep: nothing reuses them.
            with_batch: True returns ``(outputs, batch)``, where ``batch`` is the batch that was
                run as ``{name: numpy array}``: its inputs, its ``keep=`` arrays (ids, file names:
                what maps each output row back to its record) and the masks of ``pad=`` inputs,
                as :meth:`next_batch` gives them. Its arrays stay valid while you hold them.

        Returns:
            One output per name, in the order asked for: numpy arrays (``outputs="host"``) or
            OrtValues; with ``with_batch=True``, ``(outputs, batch)``.

        Raises:
            FeederError: The feed has no session (registered with ``session=None``), or was
                called before ``start()``.
            FeedTimeout: No batch came within the registration's ``timeout``.
            StopIteration: The finite source has ended.
            FetchError: A fetch failed; ``InputValidationError``, ``FeedStopped`` as for
                :meth:`next_batch`.
            ValueError: ``outputs`` is neither "host" nor "device", or "device" for a session
                whose outputs come back as numpy only (a training adapter, string inputs); or
                ``output_names`` names an output the session does not have (no batch is taken).
            TypeError: ``with_batch`` is not a bool, or ``output_names`` is a str.
        """
        runner = self._runner
        if runner is None:
            raise FeederError(f"source {self.input_source_name!r}: this feed has no session; "
                              f"use next_batch() or iterate over it")
        if outputs != "host" and (outputs != "device" or not runner.device_outputs):
            runner.check_outputs(outputs)
        if with_batch is not False and with_batch is not True:
            raise TypeError(f"with_batch must be a bool, got {type(with_batch).__name__}")
        if output_names is not None:
            if isinstance(output_names, str):
                raise TypeError(f"output_names must be a list of output names, got the str {output_names!r}")
            if not isinstance(output_names, (list, tuple)):
                output_names = list(output_names)  # (any iterable, read once)
            names = tuple(output_names)
            if names != self._checked_names:  # (by value: a list changed in place is checked again)
                runner.check_output_names(output_names)
                self._checked_names = names
        batch, start, t0 = self._next_prepared(None)
        arrays = batch.as_dict() if with_batch else None  # (the run may give its device slot back)
        tracer = self._trace.tracer
        ticket = batch.ticket
        if ticket is not None and not ticket.done:
            try:
                ticket.wait()  # its copy to the device: waiting for data, not running (GIL released)
            except BaseException:
                batch.release()
                raise
            t0 = time.monotonic()
        if tracer is not None and t0 > start:
            tracer.span("wait", start, t0, rows=batch.rows)
        short = self._pad_short and batch.rows < self._batch_size
        try:
            if short:
                try:
                    got = runner.run_padded(batch, self._padded, output_names, run_options, outputs)
                except FeederError as e:
                    raise FeederError(f"source {self.input_source_name!r}: {e}") from None
            else:
                got = runner.run(batch, output_names, run_options, outputs)
        finally:
            end = time.monotonic()
            self.counters.took_and_ran(batch.rows, batch.nbytes, start, t0, end)
            if tracer is not None:
                tracer.span("run", t0, end, rows=batch.rows)
        return (got, arrays) if arrays is not None else got

    def _padded(self, batch: PreparedBatch, fill: str) -> PreparedBatch:
        """The short last batch padded to the fixed batch size for the runtime: its rows, then its
        ``fill`` row ("last" or "first") repeated (rows of the data; Runner.run_padded runs both
        to tell the outputs with one row per batch row, which it cuts back, from the others)."""
        n, extra = batch.rows, self._batch_size - batch.rows
        arrays = []
        for a in batch.host_arrays():  # (batch axis 0: feeder.checks.short_last_batch)
            row = a[n - 1:n] if fill == "last" else a[:1]
            arrays.append(np.concatenate([a, np.repeat(row, extra, axis=0)]))
        padded = PreparedBatch(batch.names, arrays, self._batch_size)
        padded.unfed = batch.unfed if batch.unfed is not None else {}
        return padded

    def runs(self, output_names: Optional[Sequence[str]] = None, run_options: Any = None, *,
             outputs: str = "host", with_batch: bool = False) -> Iterator[Any]:
        """:meth:`run` on every batch until a finite source ends: ``for outputs in feed.runs():``.

        Each step is one ``run(output_names, run_options, outputs=outputs,
        with_batch=with_batch)``; the iterator ends where ``run()`` would raise
        ``StopIteration`` (so no ``StopIteration`` escapes into a generator that loops over it,
        which Python would turn into a ``RuntimeError``). An endless source's iterator never
        ends. Everything else ``run()`` raises (``FeedTimeout``, ``FetchError``,
        ``InputValidationError``, ``FeedStopped``) comes out of the loop.

        Args:
            output_names: As for :meth:`run`.
            run_options: As for :meth:`run` (the same object for every run).
            outputs: As for :meth:`run`.
            with_batch: As for :meth:`run`: each item is then ``(outputs, batch)``.

        Returns:
            An iterator of what ``run()`` returns, one item per batch.

        Raises:
            FeederError: The feed has no session (at this call, not at the first step).
            ValueError: ``outputs`` is neither "host" nor "device" (or "device" where the session
                cannot give it), at this call.
            TypeError: ``with_batch`` is not a bool, at this call.
        """
        runner = self._runner
        if runner is None:
            raise FeederError(f"source {self.input_source_name!r}: this feed has no session; "
                              f"iterate over it (for batch in feed) or use next_batch()")
        if outputs != "host":
            runner.check_outputs(outputs)
        if with_batch is not False and with_batch is not True:
            raise TypeError(f"with_batch must be a bool, got {type(with_batch).__name__}")
        return self._runs(output_names, run_options, outputs, with_batch)

    def _runs(self, output_names: Optional[Sequence[str]], run_options: Any, outputs: str,
              with_batch: bool) -> Iterator[Any]:
        while True:
            try:
                got = self.run(output_names, run_options, outputs=outputs, with_batch=with_batch)
            except StopIteration:  # the end of a finite source: the end of the loop (PEP 479)
                return
            yield got

    def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
        return self

    def __next__(self) -> Dict[str, np.ndarray]:
        return self.next_batch()

    # ---- tracing ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def trace(self, path: Any) -> Iterator[Tracer]:
        """Record what this feed's threads do meanwhile and write it to ``path`` as a Chrome /
        Perfetto trace (JSON trace events: open it in ui.perfetto.dev or chrome://tracing): per
        batch, ``fetch`` (per chunk), ``assemble``, ``copy`` (device feeds), ``wait`` (a consumer
        waiting) and ``run``, on the track of the thread (or worker process, or stream) that did
        it. One trace at a time per feed; costs nothing when none is active.

        Args:
            path: The file to write (str or path-like), when the ``with`` block ends.

        Yields:
            The :class:`feeder.trace.Tracer` recording (``events()`` gives what it holds).
        """
        if self._trace.tracer is not None:
            raise FeederError(f"source {self.input_source_name!r}: a trace of this feed is already being recorded")
        tracer = Tracer()
        self._trace.tracer = tracer
        try:
            yield tracer
        finally:
            self._trace.tracer = None
            tracer.write(path)


class _Weak:
    """A feed's method called through a weak reference, so that the parts of a feed that call back into
    it (its batches' order) make no reference cycle that would keep a stopped feed for the garbage
    collector. Once the feed is gone, a call does nothing and returns None."""

    __slots__ = ("_ref", "_name")

    def __init__(self, obj: Any, name: str):
        self._ref = weakref.ref(obj)
        self._name = name

    def __call__(self, *args: Any) -> Any:
        obj = self._ref()
        return getattr(obj, self._name)(*args) if obj is not None else None


def ready_depth(batch_nbytes: int) -> int:
    """How many prepared batches a feed keeps ready: as many as fit READY_BYTES, 1 to READY_MAX."""
    return max(1, min(READY_MAX, READY_BYTES // max(1, batch_nbytes)))


def check_batch_size(batch_size: Any, specs: Sequence[InputSpec], axes: Sequence[int], dont_rebatch: bool) -> None:
    """Raise TypeError/ValueError for a batch size that is not an int > 0 or that contradicts a
    fixed batch dimension of the session's inputs (unless chunks are passed on unchanged)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise TypeError(f"batch_size must be an int, got {type(batch_size).__name__}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    if dont_rebatch:
        return
    for spec, ax in zip(specs, axes):
        if spec.shape is not None and ax < len(spec.shape) and spec.shape[ax] is not None \
                and spec.shape[ax] != batch_size:
            raise ValueError(f"batch_size={batch_size} contradicts input {spec.name!r}, whose batch axis {ax} "
                             f"is fixed at {spec.shape[ax]} (shape {spec.shape})")
