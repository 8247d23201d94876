"""The argument checks of ``init_data_input_workers`` (``feeder.api``), grouped by concern.

Each group takes the arguments of one concern, raises TypeError or ValueError naming the argument
(the messages are part of the contract: tests match them), and returns what it checked in the form
the registration uses. ``feeder.api`` calls them in a fixed order, which is the order in which the
errors of several wrong arguments are found:

- what registers where: :func:`coordinator_of`, :func:`check_functions`;
- threads or worker processes: :func:`workers`;
- bounds, timeouts and flags: :func:`seconds_arg`, :func:`bool_arg`, :func:`refuse_unequal_steps`,
  :func:`logger_list`, :func:`check_resume_from`;
- the session and the device: :func:`placement_for`;
- the arrays (inputs, padding and its masks, kept arrays, batch axes): :func:`arrays_of`, then
  :func:`short_last_batch`;
- the source (resuming, row keys, its columns, one source object per name): :func:`source_columns`,
  :func:`refuse_shared_source`.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .coordinator import GlobalCoordinator, global_coordinator
from .device import CPU, Placement, parse_device, resolve
from .feed import check_batch_size
from .padding import Padding, PadInput
from .processes.sending import check_sendable
from .processes.starting import ProcessOptions, get_context
from .runtime import input_specs, is_session
from .sources.rowkeys import public_names, with_row_keys
from .sources.state import pad_varies_of
from .validation import InputSpec, fixed_batch_inputs, holds_value, int_arg

log = logging.getLogger("feeder")


# ---- scalars ------------------------------------------------------------------------------------
def seconds_arg(name: str, value: Any) -> float:
    """``value`` as seconds, for an argument ``name`` that takes a number > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if not seconds > 0 or math.isnan(seconds):
        raise ValueError(f"{name} must be > 0 seconds, got {value}")
    return seconds


def bool_arg(name: str, value: Any) -> bool:
    """``value`` as a bool, for an argument ``name`` that takes one (numpy's bool too)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


# ---- what registers where -----------------------------------------------------------------------
def coordinator_of(coordinator: Optional[GlobalCoordinator]) -> GlobalCoordinator:
    """The coordinator to register on: ``coordinator``, or the module-level one for None."""
    coord = global_coordinator if coordinator is None else coordinator
    if not isinstance(coord, GlobalCoordinator):
        raise TypeError(f"coordinator must be a GlobalCoordinator, got {type(coord).__name__}")
    return coord


def check_functions(fetch_fun: Any, init_fun: Any, input_source_name: Any) -> None:
    """``fetch_fun`` and ``init_fun`` callable (``init_fun`` or None), the source's name a str."""
    if not callable(fetch_fun):
        raise TypeError(f"fetch_fun must be callable, got {type(fetch_fun).__name__}")
    if init_fun is not None and not callable(init_fun):
        raise TypeError(f"init_fun must be callable or None, got {type(init_fun).__name__}")
    if not isinstance(input_source_name, str) or not input_source_name:
        raise TypeError(f"input_source_name must be a non-empty str, got {input_source_name!r}")


# ---- threads or worker processes ----------------------------------------------------------------
def workers(input_source_name: str, fetch_fun: Any, num_worker_threads: Union[int, str],
            num_worker_processes: Union[int, str], worker_init_fun: Any, mp_context: Any, seed: Any, *,
            auto_threads: int, auto_processes: int) -> Tuple[int, bool, Optional[ProcessOptions]]:
    """How many worker ids the registration takes, whether "auto" chooses how many of them run, and
    its worker processes' options (None: fetcher threads). ``auto_threads`` and ``auto_processes``
    are the worker ids that "auto" takes (``feeder.api.AUTO_MAX_THREADS``, ``AUTO_MAX_PROCESSES``).
    Checks ``fetch_fun`` and ``worker_init_fun`` can be sent to worker processes."""
    threads_given = num_worker_threads
    threads_auto = num_worker_threads == "auto"
    num_worker_threads = auto_threads if threads_auto else int_arg("num_worker_threads", num_worker_threads, 1)
    processes = None
    # In process mode num_worker_processes alone says how many fetchers run and whether "auto"
    # chooses: num_worker_threads="auto" beside num_worker_processes=2 must not park one of two.
    if num_worker_processes == "auto":
        num_workers, auto = auto_processes, True
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
    return num_workers, auto, processes


# ---- bounds and flags ---------------------------------------------------------------------------
def refuse_unequal_steps(fetch_fun: Any, dont_rebatch: bool, input_source_name: str) -> None:
    """ValueError for a source sharded with ``equal_steps=True`` whose chunks are handed on whole."""
    if dont_rebatch and getattr(fetch_fun, "feeder_equal_steps", False):
        # A batch is then a chunk: a unit, or the part of one that a rank shares with its
        # neighbour, so that ranks of equal rows get unequal numbers of batches, and a collective
        # step waits forever on the rank that has one more.
        raise ValueError(f"source {input_source_name!r}: {type(fetch_fun).__name__} has equal_steps=True, which gives "
                         f"every rank the same number of rows, and dont_rebatch=True makes each chunk a batch: a "
                         f"rank's chunks are its units and the parts of units it shares with its neighbours, so "
                         f"ranks would get different numbers of batches. Rebatch (dont_rebatch=False: every rank "
                         f"then gets the same number of batches of batch_size rows), or shard without equal_steps")


def logger_list(external_loggers: Optional[Sequence[Any]]) -> List[Any]:
    """The external loggers, each with a callable ``.log(metrics)``."""
    if external_loggers is None:
        return []
    if isinstance(external_loggers, (str, bytes)) or not hasattr(external_loggers, "__iter__"):
        raise TypeError("external_loggers must be a list of objects with a .log(metrics) method")
    loggers = list(external_loggers)
    for lg in loggers:
        if not callable(getattr(lg, "log", None)):
            raise TypeError(f"external logger {lg!r} has no callable .log(metrics) method")
    return loggers


def check_resume_from(resume_from: Any) -> None:
    """``resume_from`` a dict or None (whether the source can resume is :func:`source_columns`')."""
    if resume_from is not None and not isinstance(resume_from, dict):
        raise TypeError(f"resume_from must be a dict from coord.state_dict(name) or None, "
                        f"got {type(resume_from).__name__}")
    if resume_from is not None:
        pad_varies_of(resume_from)  # (ValueError before anything is registered)


# ---- the session and the device -----------------------------------------------------------------
def placement_for(session: Any, device: Any) -> Placement:
    """Where the feed's batches go, once ``session`` is known to be a session (or None)."""
    if isinstance(session, (str, bytes, os.PathLike)):
        path = os.fsdecode(session)
        raise TypeError(f"session is a path ({path!r}), not a session: load the model and pass the session, "
                        f"session = onnxruntime.InferenceSession({path!r}, providers=[\"CPUExecutionProvider\"]) "
                        f"(feeder.predict is the one that takes a model path)")
    if session is not None and not is_session(session):
        raise TypeError(f"session must be an onnxruntime.InferenceSession, a training session adapter or None, "
                        f"got {type(session).__name__}")
    return _placement(session, device)


# ---- the arrays: inputs, padding and its masks, kept arrays, batch axes -------------------------
@dataclasses.dataclass
class Arrays:
    """The arrays of a registration, checked against each other and against the session.

    Attributes:
        names: What ``fetch_fun`` returns, in order: the inputs (masks excepted), then the kept
            arrays (then the row keys, for a source that has them: :func:`source_columns`).
        specs: Their specs, in that order (a padded input's with its pad value).
        axes: Their batch axes, in that order.
        kept: The ``keep=`` names.
        masks: ``{padded input: mask name}``; empty without ``pad=``.
        mask_specs: The masks' specs, in the order of ``pad=``.
        padding: The feed's padding; None without ``pad=``.
    """

    names: List[str]
    specs: List[InputSpec]
    axes: List[int]
    kept: List[str]
    masks: Dict[str, str]
    mask_specs: List[InputSpec]
    padding: Optional[Padding]


def arrays_of(session: Any, input_names: Optional[Sequence[str]], fetch_fun: Any, batch_size: Any,
              batch_columns: Optional[Sequence[int]], dont_rebatch: bool, pad: Any, mask_names: Any,
              pad_to_multiple_of: Any, length_window: Any, keep: Optional[Sequence[str]]) -> Arrays:
    """The registration's arrays: the inputs ``fetch_fun`` returns (``input_names``, or the
    session's), their batch axes and ``batch_size`` against the session's signature, the padded
    inputs and their masks, then the kept arrays."""
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
    return Arrays(names + kept, specs + [InputSpec(k, kept=True) for k in kept], axes + [0] * len(kept), kept, masks,
                  mask_specs, padding)


def short_last_batch(last_batch: str, arrays: Arrays, dont_rebatch: bool, input_source_name: str,
                     session: Any = None, placement: Placement = CPU) -> Tuple[str, bool]:
    """(``last_batch``, whether ``run()`` pads a short batch to the batch size) where an input's
    batch dimension is fixed (to the batch size, or registration refused it): the runtime cannot
    take a short batch there.

    ``"keep"`` keeps the short last batch: ``next_batch()`` gives it as it is, and ``run()`` of an
    InferenceSession on the host pads it to the fixed size (its last row repeated) and returns the
    outputs of its own rows only, as ``feeder.predict`` does, so that no row is lost. A training
    adapter (a padded row would be trained on) or a device feed (its slots hold whole batches)
    drops it instead (logged and counted)."""
    mask_specs = arrays.mask_specs
    fixed = fixed_batch_inputs(arrays.specs + mask_specs, arrays.axes + [0] * len(mask_specs))
    if not fixed or dont_rebatch or last_batch != "keep":
        return last_batch, False
    custom = callable(getattr(session, "run_batch", None))
    fed_on_axis_0 = all(ax == 0 for spec, ax in zip(arrays.specs, arrays.axes) if not spec.kept)
    if session is not None and not custom and not placement.on_device and fed_on_axis_0:
        log.info("source %r: input(s) %s have a fixed batch dimension: run() pads a finite source's short last "
                 "batch to it (its last row repeated) and returns the outputs of its own rows", input_source_name,
                 fixed)
        return "keep", True
    why = ("a training session would train on padded rows" if custom else
           "a device feed's slots hold whole batches" if placement.on_device else
           "an input's batch axis is not its first")
    log.info("source %r: input(s) %s have a fixed batch dimension, so a finite source's short last batch will be "
             "dropped (last_batch='drop'; %s)", input_source_name, fixed, why)
    return "drop", False


# ---- the source ---------------------------------------------------------------------------------
def source_columns(fetch_fun: Any, resume_from: Optional[Dict[str, Any]], arrays: Arrays) -> Arrays:
    """The arrays as the source returns them: with its row-key column appended, for a source with
    row keys. ValueError for ``resume_from`` with a source that cannot resume; a source that checks
    the names it is asked for and the state it resumes from (``feeder_validate``) does so here (a
    column it lacks, a state of another source definition)."""
    names, specs, axes = arrays.names, arrays.specs, arrays.axes
    keyed = bool(getattr(fetch_fun, "feeder_row_keys", False))
    if resume_from is not None and not keyed and not hasattr(fetch_fun, "feeder_validate"):
        raise ValueError(f"resume_from needs a source that can resume (feeder.sources.ArraySource, ParquetSource, "
                         f"or one with row keys); {type(fetch_fun).__name__} cannot")
    if keyed:  # the source appends row keys to every chunk (feeder.rowkeys)
        names, specs, axes = with_row_keys(names, specs, axes)
    validate = getattr(fetch_fun, "feeder_validate", None)
    if validate is not None:  # e.g. a column the source does not have, a state of another source
        validate(tuple(public_names(names)), resume_from)
    return dataclasses.replace(arrays, names=names, specs=specs, axes=axes)


def refuse_shared_source(coord: GlobalCoordinator, fetch_fun: Any, input_source_name: str,
                         resume_from: Optional[Dict[str, Any]]) -> None:
    """ValueError for a source object that feeds another source name already (itself, or the
    source a map or filter wraps), and for replicas of a source given different ``resume_from``."""
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


# ---- the parts of the groups above --------------------------------------------------------------
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
