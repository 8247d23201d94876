"""What every source shares: the binding protocol and the row-key column.

The base of :mod:`feeder.sources`: it imports no other module of the package. Above it, each
importing only modules named before it (and the helpers): source states (``state``) and the
row-key ledger (``rowkeys``); the mechanisms the sources use (``sharding``, ``window``, and
``transform``: ``map`` and ``filter``); sharded iteration (``sharded``:
:class:`~feeder.sources.sharded.ShardedSource`); the sources (``arrays``; ``parquetfiles``,
``parquetstore``, ``parquet``; ``ray``). ``functionid``, ``mapped``, ``arrow`` and ``readahead``
are helpers that import no module of the package.

The binding protocol (how feeder tells a fetch function who calls it). A ``fetch_fun`` object
may have these optional methods; the coordinator calls them:

* ``feeder_bind(binding)``: in ``coord.start()`` (and on a later start after a stop), once per
  source name per fetch_fun object, before any fetcher thread or worker process of that source
  starts. ``binding`` is a :class:`SourceBinding`: which worker ids call the object (per
  registration), the inputs, the order, the state to resume from and the multiprocessing
  context of the worker processes that call it (None: threads only). Worker processes receive
  the object pickled *after* it was bound, with what it made at bind from that context (a
  ``Value``, a ``Lock``), which they then share: so a bound source can shard by the
  ``worker_id`` each call gets (an ordered one must) or deal from a counter every worker
  shares, in whatever process a call runs.
* ``feeder_release()``: in ``stop()`` / ``stop_coordinator(name)`` once the source's threads were
  signalled: close files, drop iterators.
* ``feeder_describe() -> str``: a short phrase for FeedTimeout and diagnose messages.
* ``feeder_counters(worker_ids) -> Dict[str, float]``: cumulative counters of the given workers
  (rows filtered, seconds in transforms, retries), as counted in the process that calls it.
  In thread mode each feed asks for its worker ids whenever it reports metrics; in process mode
  each worker process asks for its own id with every message it sends the parent, which keeps
  the latest figures per worker and adds them up. Whatever keys a source reports appear in
  ``feed.metrics()``.

What a call may return beyond a chunk (see the contract's "Chunks"): :data:`SKIP`, nothing this
time and no warning (a unit whose rows were all filtered out); in an ordered source it takes
that worker's turn in the round-robin, so that the chunk sequence stays the sequence of units.

What a call may raise: ``StopIteration`` (this worker has no more data); an
:class:`~feeder.errors.InputValidationError` for bad data (a null in a column, a file that
changed), which fails the source whatever ``max_fetch_errors`` says (bad data is not a
transient failure); any other exception, a fetch failure that ``max_fetch_errors`` may
tolerate. An exception whose attribute ``feeder_final`` is true says that the source can never
serve again (a stream whose reader died; its failure was already raised, and counted, once):
the source fails at once with a ``FetchError`` whose message is the exception's and whose
``__cause__`` is the exception's ``__cause__`` (the original failure), never tolerated nor
counted again.

And, for sources that support exact resume (optional, owned by this package):

* ``feeder_row_keys = True``: every chunk carries, as an extra LAST array, an int64 column of
  unique row keys (the reserved input :data:`ROW_KEY`). feeder rebatches it with the inputs,
  strips it before the session or the user sees the batch, and records the keys of each batch
  as a consumer pops it, which is what ``coord.state_dict(name)`` reports.
* ``feeder_validate(input_names, resume)``: at registration; raises ValueError for inputs the
  source cannot provide or a state from another source definition.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from multiprocessing.context import BaseContext
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

log = logging.getLogger("feeder")

ROW_KEY = "__feeder_row_key__"
"""The reserved input name of the int64 row-key column a resumable source appends to each chunk."""


class _Skip:
    """The type of :data:`SKIP` (one instance per process; compared by identity)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SKIP"

    def __reduce__(self) -> str:
        return "SKIP"  # unpickles as this module's own SKIP


SKIP = _Skip()
"""What a fetch call may return for "nothing this time, on purpose": no warning, no chunk; an
ordered source's round-robin counts it as that worker's turn (a unit whose rows a ``filter``
dropped, see :mod:`feeder.sources.transform`)."""

# What a source's filtered rows are handed to in the process that runs the source's feeds:
# on_filtered(rows, their row keys or None).
FilteredSink = Callable[[int, Optional[np.ndarray]], None]


@dataclass(frozen=True)
class SourceBinding:
    """Who calls a source, handed to ``feeder_bind`` before any of its workers starts.

    Attributes:
        source_name: The source's name (``input_source_name``).
        replicas: The worker ids of each registration of the source that uses this fetch_fun
            object, in registration order (one tuple per replica).
        input_names: The inputs the source feeds, in order.
        ordered: Whether the registrations are ``ordered=True``.
        resume: The state passed as ``resume_from`` (the same for every registration), or None.
        mp_context: The ``multiprocessing`` context whose worker processes call the object (that
            of the first registration with ``num_worker_processes``), or None when only threads
            call it; state that those processes must share (a counter) is made from it in
            ``feeder_bind``.
        on_filtered: ``on_filtered(rows, keys)``: where a source hands the rows it dropped on
            purpose (their count, and their row keys or None), in this process; None in a
            worker process (a source there reports them with ``feeder_filtered_keys``). Not
            picklable: a source keeps it out of its pickled state.
        specs: What the sessions declare for each of ``input_names``
            (:class:`~feeder.validation.InputSpec`: dtype, shape), or empty when unknown.
        cast: Whether the registrations convert safe dtype mismatches (``cast=True``).
    """

    source_name: str
    replicas: Tuple[Tuple[int, ...], ...]
    input_names: Tuple[str, ...]
    ordered: bool
    resume: Optional[Dict[str, Any]] = None
    mp_context: Optional[BaseContext] = None
    on_filtered: Optional[FilteredSink] = field(default=None, compare=False, repr=False)
    specs: Tuple[Any, ...] = field(default=(), compare=False, repr=False)
    cast: bool = field(default=False, compare=False)

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["on_filtered"] = None  # the feeds' ledger stays in the process that runs them
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def worker_ids(self) -> Tuple[int, ...]:
        """Every worker id of every replica, sorted: the order an ordered source's round-robin
        visits them in, so dealing units in this order keeps the order deterministic."""
        return tuple(sorted(w for ids in self.replicas for w in ids))


# ---- the coordinator's side of the protocol (duck-typed on Feed objects) --------------------
def _groups(feeds: Iterable[Any]) -> Dict[Tuple[str, int], List[Any]]:
    groups: Dict[Tuple[str, int], List[Any]] = {}
    for f in feeds:
        groups.setdefault((f.input_source_name, id(f.fetch_fun)), []).append(f)
    return groups


def bind_sources(all_feeds: Sequence[Any], pending: Sequence[Any]) -> None:
    """Call ``feeder_bind`` once per (source name, fetch_fun object) that has pending feeds.

    ``all_feeds`` are every registered feed (in registration order), ``pending`` those about to
    start. A source whose feeds already run cannot be re-bound (its shards are in use), so a
    registration added to a running source with a bindable fetch_fun is refused.
    """
    pending_ids = {id(f) for f in pending}
    for (name, _), feeds in _groups(all_feeds).items():
        bind = getattr(feeds[0].fetch_fun, "feeder_bind", None)
        if bind is None or not any(id(f) in pending_ids for f in feeds):
            continue
        running = [f for f in feeds if id(f) not in pending_ids]
        if running:
            from ..errors import FeederError
            raise FeederError(f"source {name!r}: a registration was added while the source runs; its fetch_fun "
                              f"shards rows between every registration, so register every replica before start()")
        resume = next((f.resume_from for f in feeds if getattr(f, "resume_from", None) is not None), None)
        context = next((f.mp_context for f in feeds if getattr(f, "mp_context", None) is not None), None)
        queue = feeds[0].source
        names = tuple(feeds[0].fetched_names)  # what fetch_fun returns (not the masks of pad= inputs)
        validator = getattr(queue, "validator", None)
        specs: Tuple[Any, ...] = ()
        if validator is not None:
            declared = dict(zip(validator.names, validator._declared))
            specs = tuple(declared[n] for n in names if n in declared)
        binding = SourceBinding(source_name=name, replicas=tuple(tuple(f.worker_ids) for f in feeds),
                                input_names=names, ordered=bool(queue.ordered), resume=resume, mp_context=context,
                                on_filtered=getattr(queue, "record_filtered", None), specs=specs,
                                cast=bool(getattr(validator, "cast", False)))
        bind(binding)


def release_sources(feeds: Sequence[Any]) -> None:
    """Call ``feeder_release`` once per fetch_fun object of these (stopped) feeds; never raises."""
    seen = set()
    for f in feeds:
        fun = f.fetch_fun
        release = getattr(fun, "feeder_release", None)
        if release is None or id(fun) in seen:
            continue
        seen.add(id(fun))
        try:
            release()
        except Exception:
            log.warning("source %r: feeder_release() raised", f.input_source_name, exc_info=True)


def describe_source(fetch_fun: Any) -> Optional[str]:
    """The fetch_fun's ``feeder_describe()`` phrase, or None (never raises)."""
    describe = getattr(fetch_fun, "feeder_describe", None)
    if describe is None:
        return None
    try:
        return str(describe())
    except Exception as e:
        return f"feeder_describe() raised {type(e).__name__}: {e}"
