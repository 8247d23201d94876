"""The public entry point, ``init_data_input_workers``: argument checks (``feeder.checks``), then registration."""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from . import checks
from .checks import _mask_names  # noqa: F401 - tests/test_pad_feed.py imports it as feeder.api._mask_names
from .chunkqueue import ChunkQueue
from .coordinator import GlobalCoordinator
from .feed import Feed
from .validation import int_arg

# num_worker_threads="auto" takes this many worker ids and runs as many of them as raise
# throughput (feeder.tuning): I/O-bound fetch functions profit from many threads, and parked
# ones cost a sleeping thread each.
AUTO_MAX_THREADS = 8
# num_worker_processes="auto" takes as many worker ids as there are cores: a process is for
# CPU-bound Python work, and more processes than cores only contend.
AUTO_MAX_PROCESSES = max(1, os.cpu_count() or 1)


# Over 150 lines only by its signature and docstring, which are the public contract (the reference
# is generated from the docstring); the code is the short sequence at the end, the checks grouped
# by concern in feeder.checks.
def init_data_input_workers(
    session: Any,
    input_names: Optional[Sequence[str]],
    fetch_fun: Callable[[int, int], Any],
    batch_size: int,
    num_worker_threads: Union[int, str] = 2,
    input_source_name: str = "train",
    max_buffered_batches: int = 800,
    init_fun: Optional[Callable[[Feed, GlobalCoordinator], Any]] = None,
    external_loggers: Optional[Sequence[Any]] = None,
    dont_rebatch: bool = False,
    batch_columns: Optional[Sequence[int]] = None,
    timeout: float = 600.0,
    *,
    coordinator: Optional[GlobalCoordinator] = None,
    last_batch: str = "keep",
    log_interval: float = 60.0,
    ordered: bool = False,
    cast: bool = False,
    max_fetch_errors: int = 0,
    max_buffered_bytes: Optional[int] = None,
    resume_from: Optional[Dict[str, Any]] = None,
    num_worker_processes: Union[int, str] = 0,
    mp_context: Any = None,
    worker_init_fun: Optional[Callable[[int], Any]] = None,
    seed: Optional[int] = None,
    device: Optional[str] = None,
    pad: Optional[Dict[str, Union[int, float, bool]]] = None,
    pad_to_multiple_of: Optional[int] = None,
    length_window: Optional[int] = None,
    mask_names: Optional[Dict[str, str]] = None,
    keep: Optional[Sequence[str]] = None,
    replica: bool = False,
    assemble_threads: Optional[int] = None,
) -> GlobalCoordinator:
    """Register a fetch function feeding ``batch_size``-row batches of ``input_names`` to ``session``.

    ``fetch_fun(worker_id, batch_size)`` runs in ``num_worker_threads`` fetcher threads (or
    ``num_worker_processes`` worker processes) and returns a chunk: a list or tuple of numpy
    arrays in ``input_names`` order, a dict by input name, or None (nothing this time). Chunks
    may have any number of rows; they are rebatched to exactly ``batch_size`` rows along each
    input's batch axis. Raising ``StopIteration`` ends that worker; when every worker of every
    registration of the source has ended, the source is finite and consumers get
    ``StopIteration`` after the last batch. Nothing runs until the coordinator's ``start()``.

    Args:
        session: An ``onnxruntime.InferenceSession``; a training session adapter
            (:class:`~feeder.StatefulSession`, :class:`~feeder.OrtTrainingModule`, or any object
            with ``get_inputs()`` and ``run_batch()``); or None, for a feed that hands out numpy
            batches (``next_batch()``, iteration) and cannot ``run()``.
        input_names: The inputs this source feeds, in the order a list-returning ``fetch_fun``
            returns them. None with a session: all of the session's inputs, in its order.
        fetch_fun: ``fetch_fun(worker_id, batch_size) -> chunk``; a source of
            ``feeder.sources`` is one.
        batch_size: Rows per batch handed to the session (> 0). It must agree with a fixed
            batch dimension of the session's inputs, unless ``dont_rebatch``.
        num_worker_threads: Fetcher threads of this registration (>= 1), or ``"auto"``: feeder
            chooses, while running, how many of up to 8 run. Ignored with worker processes.
        input_source_name: The source's name. Registrations that share it share its chunk
            queue: data-parallel replicas, each row going to one of them.
        max_buffered_batches: Bound of the source's chunk queue, in chunks as ``fetch_fun``
            returns them (of any row count), not batches despite its name; the first
            registration of a name sizes it. ``max_buffered_bytes`` bounds the bytes.
        init_fun: ``init_fun(feed, coordinator)``, called once, serially, by ``start()`` before
            any thread starts; an exception from it propagates from ``start()``.
        external_loggers: Objects with ``log(metrics: dict[str, float])``, called every
            ``log_interval`` seconds and at stop; one that raises is logged and kept.
        dont_rebatch: True hands each chunk on as one batch, whatever its row count.
        batch_columns: The batch axis of each input, in ``input_names`` order (default 0 for
            all).
        timeout: Seconds (> 0) a consumer call waits for a batch before ``FeedTimeout``.
        coordinator: The :class:`~feeder.GlobalCoordinator` to register on; None: the
            module-level ``feeder.global_coordinator``.
        last_batch: For a finite source, ``"keep"`` its short final batch or ``"drop"`` it (the
            rows dropped are logged and counted). On a session input with a fixed batch
            dimension, ``run()`` pads a kept short batch to it and returns its own rows' outputs
            (a training adapter or a device feed drops it).
        log_interval: Seconds between throughput log lines (and calls of the external loggers).
        ordered: True builds batches from chunks in a fixed round-robin of worker ids, so that
            the batches are the same on every run whatever the thread timing.
        cast: True converts safe dtype mismatches (float64 to a float32 input, int64 to int32
            when the values fit) where the chunk was fetched, instead of refusing them.
        max_fetch_errors: Exceptions from ``fetch_fun`` that are logged, counted and skipped
            before the source fails (bad data a source reports is never skipped).
        max_buffered_bytes: Hard bound, in bytes, on what the source holds between fetchers and
            consumers; None: the queue stops taking chunks at 64 MiB queued.
        resume_from: A state from ``coord.state_dict(name)`` (the same for every registration
            of the source): the source continues after the rows that state says were delivered.
        num_worker_processes: Worker processes running ``fetch_fun`` instead of threads (0:
            threads), or ``"auto"`` (one worker id per core, the tuner chooses how many run).
            ``fetch_fun`` travels to them with cloudpickle; chunks come back through shared
            memory.
        mp_context: Start method of the worker processes (``"forkserver"``, ``"spawn"``,
            ``"fork"``) or a multiprocessing context; None: ``"forkserver"`` where available,
            else ``"spawn"``.
        worker_init_fun: ``worker_init_fun(worker_id)``, run in each worker process before its
            first fetch.
        seed: Each worker process seeds ``random`` and numpy's global generator from ``(seed,
            worker_id)``; None draws a fresh base seed at each ``start()``.
        device: Where batches go before ``feed.run()`` runs them: None, the session's device
            (its first provider and that provider's ``device_id``); ``"cpu"`` the host path for
            any session; ``"cuda"`` or ``"cuda:N"`` a session on the CUDA provider: each batch
            is copied to the device when it is made, into device buffers allocated once and
            reused, so that the copy of the next batch overlaps the run of this one (see the
            guide, "GPUs"); ``"cpu:staged"`` that device path with host memory standing in for
            the device (to test it without a GPU).
        pad: ``{input name: pad value}``: inputs whose rows may differ in shape (a list of
            arrays per chunk, one per row; a 1-d object array of arrays; a
            :class:`feeder.Ragged`; or a plain array). Each batch is padded to its longest row
            along each axis (rounded up to ``pad_to_multiple_of``; an axis the session fixes is
            padded to that size) with the value, and gains a mask per padded input (1 for
            values, 0 for padding; the padded input's shape; the dtype of the session's input
            of that name, else bool), named as ``mask_names`` says. Inputs not named here must
            still agree in shape. None: no padding.
        pad_to_multiple_of: Round each padded axis up to a multiple of this many (> 0) positions;
            None: to the longest row.
        length_window: Hold up to this many rows (>= ``batch_size``) and cut them, sorted by
            length, into batches of rows of similar length (fewer padded positions); order
            within the window is given up (``ordered=True`` keeps it deterministic). Needs ``pad``.
        mask_names: ``{padded input: mask name}``, for masks named otherwise than the rule:
            ``<input>_mask``, unless the session has no such input but has ``attention_mask``
            (``decoder_attention_mask`` for ``decoder_input_ids``), which it then takes (for one
            padded input). A mask need not be in ``input_names``: ``fetch_fun`` never returns it,
            and a session input of its name is fed with it.
        keep: Names of arrays that ride along with each batch without being bound to the session,
            so that outputs can be matched to their rows (ids, file names as fixed-width bytes or
            str, labels): ``fetch_fun`` returns them after the inputs (a list in ``input_names +
            keep`` order, or a dict with these keys too; a source of ``feeder.sources`` reads the
            columns of these names). They are rebatched with the inputs (batch axis 0, the same row
            count), may have any dtype (learned from the source's first chunk) and appear in
            ``next_batch()``, iteration and ``run(..., with_batch=True)``. A name the session takes
            as an input is refused: list it in ``input_names``.
        replica: True says that registering a source name this coordinator already has is meant
            (another data-parallel replica of it); without it, the first such registration of a
            name logs a WARNING saying what it does. Registering again adds a replica either way.
        assemble_threads: How many threads at most write big batches (1 MiB or more to copy) at once,
            each outside the feed's lock while the next batch is planned: the threads that pass by
            (fetchers, receivers, the enqueuer, a consumer with nothing ready) do it, no thread is
            added. None (>= 1 otherwise): the machine's cores, up to 4. Batches stay in their order.

    Returns:
        The coordinator the feed was registered on (the same object every time): call
        ``start()`` on it, or use it as a context manager.

    Raises:
        TypeError: An argument of the wrong type, naming it; a ``fetch_fun`` or
            ``worker_init_fun`` that cannot be sent to worker processes, naming what failed.
        ValueError: An argument out of range, naming it; a ``batch_size`` that contradicts a
            fixed batch dimension of the session; a ``resume_from`` state of another source
            definition; a column a source lacks; a device or provider the installed onnxruntime
            lacks (naming those it has and the package to install).
    """
    coord = checks.coordinator_of(coordinator)
    checks.check_functions(fetch_fun, init_fun, input_source_name)
    num_workers, auto, processes = checks.workers(
        input_source_name, fetch_fun, num_worker_threads, num_worker_processes, worker_init_fun, mp_context, seed,
        auto_threads=AUTO_MAX_THREADS, auto_processes=AUTO_MAX_PROCESSES)
    max_buffered_batches = int_arg("max_buffered_batches", max_buffered_batches, 1)
    if assemble_threads is not None:
        assemble_threads = int_arg("assemble_threads", assemble_threads, 1)
    max_fetch_errors = int_arg("max_fetch_errors", max_fetch_errors, 0)
    if max_buffered_bytes is not None:
        max_buffered_bytes = int_arg("max_buffered_bytes", max_buffered_bytes, 1)
    timeout = checks.seconds_arg("timeout", timeout)
    log_interval = checks.seconds_arg("log_interval", log_interval)
    dont_rebatch = checks.bool_arg("dont_rebatch", dont_rebatch)
    ordered, cast = checks.bool_arg("ordered", ordered), checks.bool_arg("cast", cast)
    checks.refuse_unequal_steps(fetch_fun, dont_rebatch, input_source_name)
    if last_batch not in ("keep", "drop"):
        raise ValueError(f"last_batch must be 'keep' or 'drop', got {last_batch!r}")
    loggers = checks.logger_list(external_loggers)
    checks.check_resume_from(resume_from)

    placement = checks.placement_for(session, device)
    arrays = checks.arrays_of(session, input_names, fetch_fun, batch_size, batch_columns, dont_rebatch, pad,
                              mask_names, pad_to_multiple_of, length_window, keep)
    replica = checks.bool_arg("replica", replica)
    last_batch, pad_short = checks.short_last_batch(last_batch, arrays, dont_rebatch, input_source_name, session,
                                                    placement)
    arrays = checks.source_columns(fetch_fun, resume_from, arrays)
    checks.refuse_shared_source(coord, fetch_fun, input_source_name, resume_from)
    names, specs, axes = arrays.names, arrays.specs, arrays.axes

    def make_feed(queue: ChunkQueue, worker_ids: List[int]) -> Feed:
        validator = queue.validator
        assert validator is not None  # _register sets the source's validator before it makes the feed
        return Feed(coordinator=coord, source=queue, session=session, input_names=names, specs=specs,
                    batch_axes=axes, fetch_fun=fetch_fun, batch_size=batch_size, worker_ids=worker_ids,
                    init_fun=init_fun, external_loggers=loggers, dont_rebatch=dont_rebatch, timeout=timeout,
                    last_batch=last_batch, log_interval=log_interval, validator=validator,
                    max_fetch_errors=max_fetch_errors, auto=auto, resume_from=resume_from, processes=processes,
                    placement=placement, padding=arrays.padding, kept=arrays.kept,
                    assemble_threads=assemble_threads, pad_short=pad_short)

    coord._register(make_feed, name=input_source_name, input_names=names, batch_axes=axes, dont_rebatch=dont_rebatch,
                    max_buffered_batches=max_buffered_batches, num_workers=num_workers,
                    ordered=ordered, max_bytes=max_buffered_bytes, specs=specs, cast=cast, resume_from=resume_from,
                    replica=replica, masks={m: p for p, m in arrays.masks.items()})
    return coord
