"""The public entry point, ``init_data_input_workers``: argument checks, then registration."""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .chunkqueue import ChunkQueue
from .coordinator import GlobalCoordinator, global_coordinator
from .device import CPU, Placement, parse_device, resolve
from .feed import Feed, check_batch_size
from .padding import Padding, PadInput
from .processes.sending import check_sendable
from .processes.starting import ProcessOptions, get_context
from .runtime import input_specs, is_session
from .sources.rowkeys import public_names, with_row_keys
from .validation import InputSpec, fixed_batch_inputs, holds_value, int_arg

log = logging.getLogger("feeder")

# num_worker_threads="auto" takes this many worker ids and runs as many of them as raise
# throughput (feeder.tuning): I/O-bound fetch functions profit from many threads, and parked
# ones cost a sleeping thread each.
AUTO_MAX_THREADS = 8
# num_worker_processes="auto" takes as many worker ids as there are cores: a process is for
# CPU-bound Python work, and more processes than cores only contend.
AUTO_MAX_PROCESSES = max(1, os.cpu_count() or 1)


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if not seconds > 0 or math.isnan(seconds):
        raise ValueError(f"{name} must be > 0 seconds, got {value}")
    return seconds


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


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
            rows dropped are logged and counted).
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
    coord = global_coordinator if coordinator is None else coordinator
    if not isinstance(coord, GlobalCoordinator):
        raise TypeError(f"coordinator must be a GlobalCoordinator, got {type(coord).__name__}")
    if not callable(fetch_fun):
        raise TypeError(f"fetch_fun must be callable, got {type(fetch_fun).__name__}")
    if init_fun is not None and not callable(init_fun):
        raise TypeError(f"init_fun must be callable or None, got {type(init_fun).__name__}")
    if not isinstance(input_source_name, str) or not input_source_name:
        raise TypeError(f"input_source_name must be a non-empty str, got {input_source_name!r}")
    threads_given = num_worker_threads
    threads_auto = num_worker_threads == "auto"
    num_worker_threads = AUTO_MAX_THREADS if threads_auto else int_arg("num_worker_threads", num_worker_threads, 1)
    processes = None
    # In process mode num_worker_processes alone says how many fetchers run and whether "auto"
    # chooses: num_worker_threads="auto" beside num_worker_processes=2 must not park one of two.
    if num_worker_processes == "auto":
        num_workers, auto = AUTO_MAX_PROCESSES, True
    else:
        num_workers = int_arg("num_worker_processes", num_worker_processes, 0)
        auto = threads_auto and not num_workers
        num_workers = num_workers or num_worker_threads
    if num_worker_processes != 0 and threads_given != 2:  # 2: the default, said or not
        log.warning("source %r: num_worker_threads=%r is ignored: fetch_fun runs in worker processes "
                    "(num_worker_processes=%r)", input_source_name, threads_given, num_worker_processes)
    if num_worker_processes != 0:
        if getattr(fetch_fun, "feeder_threads_only", False):
            raise TypeError(f"fetch_fun {type(fetch_fun).__name__} runs in fetcher threads only: use "
                            f"num_worker_threads, not num_worker_processes")
        if worker_init_fun is not None and not callable(worker_init_fun):
            raise TypeError(f"worker_init_fun must be callable or None, got {type(worker_init_fun).__name__}")
        if seed is not None:
            seed = int_arg("seed", seed, -(2**63))  # any int, as random.seed takes
        ctx = get_context(mp_context)
        check_sendable("fetch_fun", fetch_fun, ctx)
        check_sendable("worker_init_fun", worker_init_fun, ctx)
        processes = ProcessOptions(context=ctx, worker_init_fun=worker_init_fun, seed=seed)
    elif worker_init_fun is not None or mp_context is not None or seed is not None:
        raise ValueError("worker_init_fun, mp_context and seed apply to worker processes only "
                         "(num_worker_processes > 0)")
    max_buffered_batches = int_arg("max_buffered_batches", max_buffered_batches, 1)
    if assemble_threads is not None:
        assemble_threads = int_arg("assemble_threads", assemble_threads, 1)
    max_fetch_errors = int_arg("max_fetch_errors", max_fetch_errors, 0)
    if max_buffered_bytes is not None:
        max_buffered_bytes = int_arg("max_buffered_bytes", max_buffered_bytes, 1)
    timeout = _seconds("timeout", timeout)
    log_interval = _seconds("log_interval", log_interval)
    dont_rebatch, ordered, cast = _bool("dont_rebatch", dont_rebatch), _bool("ordered", ordered), _bool("cast", cast)
    if dont_rebatch and getattr(fetch_fun, "feeder_equal_steps", False):
        # A batch is then a chunk: a unit, or the part of one that a rank shares with its
        # neighbour, so that ranks of equal rows get unequal numbers of batches, and a collective
        # step waits forever on the rank that has one more.
        raise ValueError(f"source {input_source_name!r}: {type(fetch_fun).__name__} has equal_steps=True, which gives "
                         f"every rank the same number of rows, and dont_rebatch=True makes each chunk a batch: a "
                         f"rank's chunks are its units and the parts of units it shares with its neighbours, so "
                         f"ranks would get different numbers of batches. Rebatch (dont_rebatch=False: every rank "
                         f"then gets the same number of batches of batch_size rows), or shard without equal_steps")
    if last_batch not in ("keep", "drop"):
        raise ValueError(f"last_batch must be 'keep' or 'drop', got {last_batch!r}")
    loggers = _loggers(external_loggers)
    if resume_from is not None and not isinstance(resume_from, dict):
        raise TypeError(f"resume_from must be a dict from coord.state_dict(name) or None, "
                        f"got {type(resume_from).__name__}")

    if isinstance(session, (str, bytes, os.PathLike)):
        path = os.fsdecode(session)
        raise TypeError(f"session is a path ({path!r}), not a session: load the model and pass the session, "
                        f"session = onnxruntime.InferenceSession({path!r}, providers=[\"CPUExecutionProvider\"]) "
                        f"(feeder.predict is the one that takes a model path)")
    if session is not None and not is_session(session):
        raise TypeError(f"session must be an onnxruntime.InferenceSession, a training session adapter or None, "
                        f"got {type(session).__name__}")
    placement = _placement(session, device)
    session_specs = input_specs(session) if session is not None else None
    masks = _mask_names(pad, mask_names, session_specs)
    _refuse_mask_clashes(masks, mask_names or {}, input_names, session_specs, fetch_fun)
    names = _input_names(input_names, session_specs, masks.values())
    specs = _specs_for(names, session_specs)
    axes = _batch_axes(batch_columns, names, specs)
    check_batch_size(batch_size, specs, axes, dont_rebatch)
    padding: Optional[Padding] = None
    mask_specs: List[InputSpec] = []
    if pad is not None:
        specs, mask_specs, padding = _padding(pad, masks, pad_to_multiple_of, length_window, names, specs, axes,
                                              session_specs, batch_size, dont_rebatch)
    elif pad_to_multiple_of is not None or length_window is not None:
        raise ValueError("pad_to_multiple_of and length_window need pad= (the inputs whose rows differ in shape: "
                         "without them there is nothing to pad, nor any length to sort by)")
    check_batch_size(batch_size, mask_specs, [0] * len(mask_specs), dont_rebatch)
    kept = _kept_names(keep, names, session_specs, masks.values())
    # Kept arrays follow the inputs in every chunk (so padding's and the row keys' places are
    # unchanged), on batch axis 0, any dtype: never bound (feeder.runtime.Runner: "unfed").
    names, specs, axes = names + kept, specs + [InputSpec(k) for k in kept], axes + [0] * len(kept)
    replica = _bool("replica", replica)
    fixed = fixed_batch_inputs(specs + mask_specs, axes + [0] * len(mask_specs))
    if fixed and not dont_rebatch and last_batch == "keep":
        # The runtime cannot take a short batch on a fixed batch dimension, so a finite source's
        # short last batch is dropped (logged and counted) rather than failing inside run().
        log.info("source %r: input(s) %s have a fixed batch dimension, so a finite source's short last "
                 "batch will be dropped (last_batch='drop')", input_source_name, fixed)
        last_batch = "drop"

    keyed = bool(getattr(fetch_fun, "feeder_row_keys", False))
    if resume_from is not None and not keyed and not hasattr(fetch_fun, "feeder_validate"):
        raise ValueError(f"resume_from needs a source that can resume (feeder.sources.ArraySource, ParquetSource, "
                         f"or one with row keys); {type(fetch_fun).__name__} cannot")
    if keyed:  # the source appends row keys to every chunk (feeder.rowkeys)
        names, specs, axes = with_row_keys(names, specs, axes)
    validate = getattr(fetch_fun, "feeder_validate", None)
    if validate is not None:  # e.g. a column the source does not have, a state of another source
        validate(tuple(public_names(names)), resume_from)
    if hasattr(fetch_fun, "feeder_bind"):
        # A source is bound to one source name's workers (its shards, ledger and resume state);
        # a second name would take it from the first. So is the source a map or filter wraps.
        from .sources.transform import TransformedSource

        def base(fun: Any) -> Any:
            return fun.wrapped if isinstance(fun, TransformedSource) else fun

        for other in coord._feeds:
            if other.fetch_fun is fetch_fun and other.input_source_name != input_source_name:
                raise ValueError(f"this {type(fetch_fun).__name__} already feeds source {other.input_source_name!r}; "
                                 f"a source object feeds one input_source_name: create another for "
                                 f"{input_source_name!r}")
            if other.fetch_fun is not fetch_fun and base(other.fetch_fun) is base(fetch_fun):
                raise ValueError(f"this {type(base(fetch_fun)).__name__} already feeds source "
                                 f"{other.input_source_name!r} through another object (a map or filter of it, or the "
                                 f"source itself): a source object is read by one fetch function; create another")
    for other in coord.feeds(input_source_name):
        if other.fetch_fun is fetch_fun and other.resume_from != resume_from:
            raise ValueError(f"source {input_source_name!r}: every registration of a source must pass the same "
                             f"resume_from")

    def make_feed(queue: ChunkQueue, worker_ids: List[int]) -> Feed:
        validator = queue.validator
        assert validator is not None  # _register sets the source's validator before it makes the feed
        return Feed(coordinator=coord, source=queue, session=session, input_names=names, specs=specs,
                    batch_axes=axes, fetch_fun=fetch_fun, batch_size=batch_size, worker_ids=worker_ids,
                    init_fun=init_fun, external_loggers=loggers, dont_rebatch=dont_rebatch, timeout=timeout,
                    last_batch=last_batch, log_interval=log_interval, validator=validator,
                    max_fetch_errors=max_fetch_errors, auto=auto, resume_from=resume_from, processes=processes,
                    placement=placement, padding=padding, kept=kept, assemble_threads=assemble_threads)

    coord._register(make_feed, name=input_source_name, input_names=names, batch_axes=axes, dont_rebatch=dont_rebatch,
                    max_buffered_batches=max_buffered_batches, num_workers=num_workers,
                    ordered=ordered, max_bytes=max_buffered_bytes, specs=specs, cast=cast, resume_from=resume_from,
                    replica=replica, masks={m: p for p, m in masks.items()})
    return coord


def _placement(session: Any, device: Any) -> Placement:
    """Where the feed's batches go (feeder.device); ValueError for a device that cannot be had."""
    asked = parse_device(device)  # TypeError / ValueError for what is not a device at all
    if session is None or callable(getattr(session, "run_batch", None)):
        if asked is not None and asked != CPU:
            what = "a feed without a session" if session is None else \
                f"a session adapter ({type(session).__name__}): give the adapter its own (StatefulSession(device=...))"
            raise ValueError(f"device={device!r} does not apply to {what}")
        return CPU
    return resolve(session, device)


def _loggers(external_loggers: Optional[Sequence[Any]]) -> List[Any]:
    if external_loggers is None:
        return []
    if isinstance(external_loggers, (str, bytes)) or not hasattr(external_loggers, "__iter__"):
        raise TypeError("external_loggers must be a list of objects with a .log(metrics) method")
    loggers = list(external_loggers)
    for lg in loggers:
        if not callable(getattr(lg, "log", None)):
            raise TypeError(f"external logger {lg!r} has no callable .log(metrics) method")
    return loggers


def _input_names(input_names: Optional[Sequence[str]], session_specs: Optional[List[InputSpec]],
                 masks: Collection[str] = ()) -> List[str]:
    """The inputs fetch_fun returns: ``input_names`` (or the session's inputs), masks excepted."""
    masks = set(masks)
    if input_names is None:
        if session_specs is None:
            raise ValueError("input_names is required when session is None")
        return [s.name for s in session_specs if s.name not in masks]
    if isinstance(input_names, str) or not hasattr(input_names, "__iter__"):
        raise TypeError(f"input_names must be a list of str, got {type(input_names).__name__}")
    names = list(input_names)
    if not names:
        raise ValueError("input_names must name at least one input")
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"input_names must be str, got {n!r}")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"input_names has duplicates: {dupes}")
    names = [n for n in names if n not in masks]  # made by padding, never fetched
    if not names:
        raise ValueError("input_names must name at least one input that fetch_fun returns (not only masks)")
    if session_specs is not None:
        known = [s.name for s in session_specs]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"input_names {unknown} are not inputs of the session (its inputs: {known}); to "
                             f"carry arrays with each batch without binding them (ids, names), pass keep={unknown}")
        missing = [n for n in known if n not in names and n not in masks]
        if missing:
            raise ValueError(f"the session's inputs {missing} are not in input_names {names}; "
                             f"feed.run() needs every input")
    return names


def _kept_names(keep: Optional[Sequence[str]], names: List[str], session_specs: Optional[List[InputSpec]],
                masks: Collection[str]) -> List[str]:
    """The names of ``keep``, checked: str, distinct, neither an input nor a session input nor a mask."""
    if keep is None:
        return []
    if isinstance(keep, (str, bytes)) or not hasattr(keep, "__iter__"):
        raise TypeError(f"keep must be a list of names (str), got {type(keep).__name__}")
    kept = list(keep)
    for n in kept:
        if not isinstance(n, str) or not n:
            raise TypeError(f"keep must name arrays with non-empty str, got {n!r}")
    dupes = sorted({n for n in kept if kept.count(n) > 1})
    if dupes:
        raise ValueError(f"keep has duplicates: {dupes}")
    session = [s.name for s in session_specs] if session_specs is not None else []
    fed = sorted(set(kept) & set(session))
    if fed:
        raise ValueError(f"keep names {fed}, which the session takes as inputs: kept arrays are never bound to the "
                         f"session; name them in input_names instead (or not at all: input_names=None feeds "
                         f"every input of the session)")
    both = sorted(set(kept) & set(names))
    if both:
        raise ValueError(f"{both} are named in both input_names and keep: an array is either an input (bound to "
                         f"the session) or kept (carried with the batch, never bound)")
    masks_kept = sorted(set(kept) & set(masks))
    if masks_kept:
        raise ValueError(f"keep names {masks_kept}, which are the masks that pad= makes: they are in every batch "
                         f"already")
    return kept


def _specs_for(names: List[str], session_specs: Optional[List[InputSpec]]) -> List[InputSpec]:
    if session_specs is None:
        return [InputSpec(n) for n in names]
    by_name = {s.name: s for s in session_specs}
    return [by_name[n] for n in names]


def _batch_axes(batch_columns: Optional[Sequence[int]], names: List[str], specs: List[InputSpec]) -> List[int]:
    if batch_columns is None:
        return [0] * len(names)
    if isinstance(batch_columns, (str, bytes)) or not hasattr(batch_columns, "__iter__"):
        raise TypeError(f"batch_columns must be a list of int, got {type(batch_columns).__name__}")
    axes = list(batch_columns)
    if len(axes) != len(names):
        raise ValueError(f"batch_columns has {len(axes)} entries for {len(names)} inputs {names}")
    for ax, spec in zip(axes, specs):
        int_arg(f"batch_columns entry for input {spec.name!r}", ax, 0)
        if spec.shape is not None and ax >= len(spec.shape):
            raise ValueError(f"batch_columns entry {ax} for input {spec.name!r} is out of range for its rank "
                             f"{len(spec.shape)}")
    return [int(a) for a in axes]


def _mask_names(pad: Any, explicit: Optional[Dict[str, str]], session_specs: Optional[List[InputSpec]]
                ) -> Dict[str, str]:
    """Each padded input's mask name: ``mask_names``, else ``<input>_mask``, else the session's
    ``attention_mask`` (see the docstring of init_data_input_workers, ``mask_names``)."""
    if pad is None:
        if explicit is not None:
            raise ValueError("mask_names needs pad= (only padded inputs have masks)")
        return {}
    if not isinstance(pad, dict) or not pad:
        raise TypeError(f"pad must be a non-empty dict {{input name: pad value}}, got {pad!r:.100}")
    for name, value in pad.items():
        if not isinstance(name, str):
            raise TypeError(f"pad's keys must be input names (str), got {name!r}")
        if isinstance(value, (np.generic, np.ndarray)) and np.ndim(value) == 0:
            value = value.item()
        if not isinstance(value, (bool, int, float)):
            raise TypeError(f"pad value for input {name!r} must be a number, got {type(value).__name__}")
    if explicit is not None:
        if not isinstance(explicit, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                     for k, v in explicit.items()):
            raise TypeError(f"mask_names must be a dict {{padded input: mask name}} of str, got {explicit!r:.100}")
        unknown = sorted(set(explicit) - set(pad))
        if unknown:
            raise ValueError(f"mask_names names inputs that are not padded: {unknown} (padded: {sorted(pad)})")
    explicit = explicit or {}
    session = [s.name for s in session_specs] if session_specs is not None else []
    masks: Dict[str, str] = {}
    rest = []
    for name in pad:
        prefix = name[:-len("input_ids")] if name.endswith("input_ids") else None
        if name in explicit:
            masks[name] = explicit[name]
        elif f"{name}_mask" in session:
            masks[name] = f"{name}_mask"
        elif prefix is not None and f"{prefix}attention_mask" in session and f"{prefix}attention_mask" not in pad:
            masks[name] = f"{prefix}attention_mask"  # the Hugging Face names: input_ids -> attention_mask
        else:
            rest.append(name)
    taken = set(masks.values())
    if len(rest) == 1 and "attention_mask" in session and "attention_mask" not in taken | set(pad):
        masks[rest.pop()] = "attention_mask"
    for name in rest:
        masks[name] = f"{name}_mask"
    clash = sorted({m for m in masks.values() if list(masks.values()).count(m) > 1} | (set(masks.values()) & set(pad)))
    if clash:
        raise ValueError(f"mask names {clash} clash (two padded inputs' masks, or a mask named like a padded input): "
                         f"set mask_names")
    return masks


def _refuse_mask_clashes(masks: Dict[str, str], explicit: Dict[str, str], input_names: Optional[Sequence[str]],
                         session_specs: Optional[List[InputSpec]], fetch_fun: Any) -> None:
    """ValueError when a mask's name is also the name of data: a column of the source (where the
    source can name its columns at registration), or a name ``mask_names`` chose that
    ``input_names`` lists without the session having an input of that name (what would be fetched
    is then taken for the mask). A plain fetch function's chunks are checked at the first one
    (the validator names the mask)."""
    if not masks:
        return
    listed = set(input_names) if isinstance(input_names, (list, tuple)) else set()
    session = {s.name for s in session_specs} if session_specs is not None else set()
    offer = getattr(fetch_fun, "_offered_columns", None)
    offered = offer() if offer is not None else None
    columns, all_fed = offered if offered is not None else (None, False)
    what = type(getattr(fetch_fun, "wrapped", fetch_fun)).__name__
    for padded, mask in masks.items():
        rename = f"mask_names={{{padded!r}: {padded + '_pad_mask'!r}}}"
        if columns is not None and mask in columns and (all_fed or mask in listed or mask in session):
            chosen = "mask_names names" if padded in explicit else "pad= makes"
            raise ValueError(f"{chosen} a mask {mask!r} for padded input {padded!r}, and the {what} has a column "
                             f"{mask!r}: a mask is made by padding, never fetched, so the column would never be "
                             f"read. Name the mask otherwise ({rename}) or rename the column")
        if padded in explicit and mask in listed and mask not in session:
            raise ValueError(f"mask_names names the mask of padded input {padded!r} {mask!r}, which input_names also "
                             f"lists: {mask!r} would be taken for the mask and never fetched. Name the mask otherwise "
                             f"({rename}), or leave {mask!r} out of input_names (a mask need not be listed)")


def _padding(pad: Dict[str, Any], masks: Dict[str, str], multiple: Any, window: Any, names: List[str],
             specs: List[InputSpec], axes: List[int], session_specs: Optional[List[InputSpec]], batch_size: int,
             dont_rebatch: bool) -> Tuple[List[InputSpec], List[InputSpec], Padding]:
    """The specs of the fetched inputs with their pad values, the masks' specs, and the feed's Padding."""
    if multiple is not None:
        multiple = int_arg("pad_to_multiple_of", multiple, 1)
    if window is not None:
        window = int_arg("length_window", window, 1)
        if dont_rebatch:
            raise ValueError("length_window cannot sort rows into batches with dont_rebatch=True (each chunk is its "
                             "own batch)")
        if window < batch_size:
            raise ValueError(f"length_window={window} holds fewer rows than one batch (batch_size={batch_size}): it "
                             f"must be >= batch_size, typically many batches (e.g. 16 * batch_size)")
    missing = [n for n in pad if n not in names]
    if missing:
        raise ValueError(f"pad names {missing}, which are not inputs that fetch_fun returns ({names})")
    by_session = {s.name: s for s in session_specs} if session_specs is not None else {}
    specs = list(specs)
    pads = []
    for name, value in pad.items():
        i = names.index(name)
        if isinstance(value, np.generic):
            value = value.item()
        spec = specs[i]
        if axes[i] != 0:
            raise ValueError(f"input {name!r} is padded, so its batch axis must be 0 (batch_columns says {axes[i]})")
        if spec.is_string:
            raise ValueError(f"input {name!r} is a string input: only numeric inputs can be padded")
        if spec.shape is not None and len(spec.shape) < 2:
            raise ValueError(f"input {name!r} has rank {len(spec.shape)} in the session: a padded input has rows of "
                             f"rank >= 1 (a batch axis and at least one more)")
        if spec.dtype is not None and not holds_value(spec.dtype, value):
            raise ValueError(f"pad value {value!r} for input {name!r} does not fit its dtype {spec.dtype}")
        specs[i] = dataclasses.replace(spec, pad=value)
        mask = by_session.get(masks[name])
        mask_dtype = mask.dtype if mask is not None and mask.dtype is not None else np.dtype(bool)
        if mask is not None:
            if mask.is_string:
                raise ValueError(f"the session's input {mask.name!r}, the mask of padded input {name!r}, takes "
                                 f"strings")
            if mask.shape is not None and spec.shape is not None and len(mask.shape) != len(spec.shape):
                raise ValueError(f"the session's input {mask.name!r}, the mask of padded input {name!r}, has rank "
                                 f"{len(mask.shape)}; a mask has the padded input's shape (rank {len(spec.shape)}): "
                                 f"use mask_names to name another input")
        fixed = tuple(spec.shape[1:]) if spec.shape is not None else ()
        if mask is not None and mask.shape is not None:  # the mask's fixed axes fix the padded input's too
            fixed = tuple(a if a is not None else b for a, b in zip(fixed or (None,) * (len(mask.shape) - 1),
                                                                     mask.shape[1:]))
        pads.append(PadInput(i, name, value, fixed, masks[name], np.dtype(mask_dtype)))
    mask_specs = [by_session.get(p.mask_name) or InputSpec(p.mask_name, np.dtype(bool)) for p in pads]
    return specs, mask_specs, Padding(tuple(pads), multiple, window)
