"""What every source shares: the binding protocol, the row-key column, and sharded iteration.

The binding protocol (how feeder tells a fetch function who calls it). A ``fetch_fun`` object
may have these optional methods; the coordinator calls them:

* ``feeder_bind(binding)``: in ``coord.start()`` (and on a later start after a stop), once per
  source name per fetch_fun object, before any fetcher thread or worker process of that source
  starts. ``binding`` is a :class:`SourceBinding`: which worker ids call the object (per
  registration), the inputs, the order and the state to resume from. Worker processes receive
  the object pickled *after* it was bound, so a bound source shards by the ``worker_id`` each
  call gets, in whatever process that call runs.
* ``feeder_release()``: in ``stop()`` / ``stop_coordinator(name)`` once the source's threads were
  signalled: close files, drop iterators.
* ``feeder_describe() -> str``: a short phrase for FeedTimeout and diagnose messages.

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
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

log = logging.getLogger("feeder")

ROW_KEY = "__feeder_row_key__"
"""The reserved input name of the int64 row-key column a resumable source appends to each chunk."""

STATE_FORMAT = "feeder.source-state/1"


@dataclass(frozen=True)
class SourceBinding:
    """Who calls a source, handed to ``feeder_bind`` before any of its workers starts.

    ``replicas``: the worker ids of each registration of the source that uses this fetch_fun
    object, in registration order (one tuple per replica). ``resume``: the state passed as
    ``resume_from`` (the same for every registration), or None.
    """

    source_name: str
    replicas: Tuple[Tuple[int, ...], ...]
    input_names: Tuple[str, ...]
    ordered: bool
    resume: Optional[Dict[str, Any]] = None

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
        binding = SourceBinding(source_name=name, replicas=tuple(tuple(f.worker_ids) for f in feeds),
                                input_names=tuple(feeds[0].input_names), ordered=bool(feeds[0].source.ordered),
                                resume=resume)
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


# ---- sharded sources -----------------------------------------------------------------------
class _Cursor:
    """One worker's place in the source's sequence of units: epoch and position within it."""

    __slots__ = ("epoch", "pos")

    def __init__(self, epoch: int, pos: int):
        self.epoch = epoch
        self.pos = pos


class ShardedSource:
    """A finite table of rows cut into units of work, dealt to workers round-robin, with
    per-epoch shuffling, epochs, row keys and exact resume. Subclasses give the unit sizes
    (``_unit_rows``) and read rows (``_read``); they are picklable fetch functions.

    Every epoch lists its units (shuffled by ``seed`` and the epoch when ``shuffle``); the epochs
    follow each other into one sequence of units. Unit ``m`` of that sequence goes to the worker
    at position ``m % W`` of the binding's sorted worker ids (W workers in all, every replica's),
    which returns it as one chunk (its rows shuffled too). That is exactly the order in which
    ``ordered=True`` takes chunks from workers, so an ordered source's rows come in the
    sequence's order. The row at position ``i`` of its unit's (shuffled) row order, in the unit
    starting at row ``s`` of the table, has the key ``e * rows + s + i`` in epoch ``e``.
    Resuming drops the delivered rows from the sequence and deals what is left the same way, so
    an ordered run continues with exactly the rows it would have delivered.
    """

    feeder_row_keys = True

    def __init__(self, *, shuffle: bool, seed: int, epochs: Optional[int]):
        if not isinstance(shuffle, (bool, np.bool_)):
            raise TypeError(f"shuffle must be a bool, got {type(shuffle).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if epochs is not None:
            if isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)):
                raise TypeError(f"epochs must be an int or None (endless), got {type(epochs).__name__}")
            if epochs < 1:
                raise ValueError(f"epochs must be >= 1 or None (endless), got {epochs}")
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epochs = None if epochs is None else int(epochs)
        self._binding: Optional[SourceBinding] = None
        self._init_units([])
        self._cursors: Dict[int, _Cursor] = {}
        self._lock = threading.Lock()

    # ---- to be provided by subclasses ----
    def _read(self, unit: int, rows: np.ndarray, worker_id: int) -> List[np.ndarray]:
        """The arrays (one per input, in input order) of ``rows`` (indices within ``unit``, in the
        order to return them), read for worker ``worker_id`` (in that worker's thread)."""
        raise NotImplementedError

    def _definition(self) -> Dict[str, Any]:
        """What a state must match (JSON-able): the data, its columns, the unit cut, the shuffle."""
        return {"type": type(self).__name__, "rows": self.rows, "units": len(self._units),
                "shuffle": self.shuffle, "seed": self.seed}

    # ---- units ----
    def _init_units(self, unit_rows: Sequence[int]) -> None:
        self._units = np.asarray(unit_rows, dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(self._units)]).astype(np.int64)
        self.rows = int(self._offsets[-1])
        self._resume_plan: Dict[int, List[Tuple[int, Optional[np.ndarray]]]] = {}
        self._first_epoch = 0

    def __len__(self) -> int:
        """Rows per epoch."""
        return self.rows

    def _unit_order(self, epoch: int) -> np.ndarray:
        n = len(self._units)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, 0]).permutation(n)

    def _row_order(self, epoch: int, unit: int) -> np.ndarray:
        n = int(self._units[unit])
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, 1, unit]).permutation(n)

    def _epoch_len(self, epoch: int) -> int:
        plan = self._resume_plan.get(epoch)
        return len(plan) if plan is not None else len(self._units)

    def _entry(self, epoch: int, pos: int) -> Tuple[int, Optional[np.ndarray]]:
        """(unit, positions in the unit's row order still to deliver, or None for all) at ``pos``
        of epoch ``epoch``'s list."""
        plan = self._resume_plan.get(epoch)
        if plan is not None:
            return plan[pos]
        return int(self._unit_order(epoch)[pos]), None

    # ---- the binding protocol ----
    def feeder_validate(self, input_names: Sequence[str], resume: Optional[Mapping[str, Any]]) -> None:
        if resume is not None:
            check_state(resume, self._definition())

    def feeder_definition(self) -> Dict[str, Any]:
        """What a checkpoint of this source records about it, to refuse a state of another source."""
        return self._definition()

    def feeder_bind(self, binding: SourceBinding) -> None:
        with self._lock:
            self._binding = binding
            self._cursors = {}
            self._init_units(self._units.tolist())
            if binding.resume is not None:
                check_state(binding.resume, self._definition())
                self._plan_resume(ranges_of(binding.resume))

    def feeder_release(self) -> None:
        with self._lock:
            self._cursors = {}

    def feeder_describe(self) -> str:
        ep = "endless" if self.epochs is None else f"{self.epochs} epoch(s)"
        return f"{type(self).__name__} of {self.rows} rows in {len(self._units)} units, {ep}"

    def _plan_resume(self, ranges: np.ndarray) -> None:
        """Drop the delivered rows (key ranges ``ranges``, shape (k, 2), sorted, disjoint) from the
        sequence: epochs wholly delivered are skipped, the others keep their undelivered rows."""
        n = self.rows
        if not len(ranges) or n == 0:
            return
        starts, stops = ranges[:, 0], ranges[:, 1]
        epoch = 0
        # every epoch covered by one range from its first key to its last is done
        while True:
            k = int(np.searchsorted(stops, epoch * n, side="right"))
            if k < len(starts) and starts[k] <= epoch * n and stops[k] >= (epoch + 1) * n:
                epoch = int(stops[k] // n)
                continue
            break
        self._first_epoch = epoch
        last = int((stops[-1] - 1) // n)
        for e in range(epoch, last + 1):
            plan: List[Tuple[int, Optional[np.ndarray]]] = []
            for u in self._unit_order(e):
                unit = int(u)
                lo = e * n + int(self._offsets[unit])
                hi = lo + int(self._units[unit])
                i = int(np.searchsorted(stops, lo, side="right"))
                if i >= len(starts) or starts[i] >= hi:
                    plan.append((unit, None))  # nothing of it was delivered
                    continue
                positions = np.arange(int(self._units[unit]), dtype=np.int64)
                keys = lo + positions
                j = np.searchsorted(stops, keys, side="right")
                safe = np.minimum(j, len(starts) - 1)
                done = (j < len(starts)) & (starts[safe] <= keys)
                if not done.all():
                    plan.append((unit, positions[~done]))
            self._resume_plan[e] = plan

    # ---- fetching ----
    def _cursor(self, worker_id: int) -> Tuple[_Cursor, int]:
        cur = self._cursors.get(worker_id)
        binding = self._binding
        if binding is None:
            raise RuntimeError(f"{type(self).__name__} was called before feeder bound it; pass it as the fetch_fun "
                               f"of init_data_input_workers and start the coordinator")
        ids = binding.worker_ids
        if cur is None:
            try:
                k = ids.index(worker_id)
            except ValueError:
                raise RuntimeError(f"worker {worker_id} is not one of the workers this source was bound to "
                                   f"{ids}") from None
            cur = self._cursors[worker_id] = _Cursor(self._first_epoch, k)
        return cur, len(ids)

    def __call__(self, worker_id: int, batch_size: int) -> List[np.ndarray]:
        cur, step = self._cursor(worker_id)
        while True:
            if self.epochs is not None and cur.epoch >= self.epochs:
                raise StopIteration
            size = self._epoch_len(cur.epoch)
            if cur.pos < size:
                break
            cur.pos -= size
            cur.epoch += 1
            if size == 0 and not self._units.size:
                raise StopIteration  # an empty table has nothing in any epoch
        epoch, pos = cur.epoch, cur.pos
        cur.pos += step
        unit, positions = self._entry(epoch, pos)
        order = self._row_order(epoch, unit)
        if positions is None:
            positions, rows = np.arange(len(order), dtype=np.int64), order
        else:
            rows = order[positions]
        arrays = self._read(unit, rows, worker_id)
        # A key numbers a row by its place in its unit's (shuffled) order, not by its row index:
        # rows are delivered in that order, so what a consumer got of a unit is a few key ranges
        # (not one range per row, as shuffled row indices would give) and a state stays small.
        keys = positions + (epoch * self.rows + int(self._offsets[unit]))
        arrays.append(keys)
        return arrays

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


# ---- states ----------------------------------------------------------------------------------
def ranges_of(state: Mapping[str, Any]) -> np.ndarray:
    """The delivered key ranges of a state as an int64 array of shape (k, 2): [start, stop)."""
    delivered = state.get("delivered", [])
    arr = np.asarray(delivered, dtype=np.int64).reshape(-1, 2)
    return arr


def check_state(state: Any, definition: Mapping[str, Any]) -> None:
    """ValueError unless ``state`` is a source state for a source of this ``definition``."""
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"resume_from must be a state from coord.state_dict(name) (format {STATE_FORMAT!r}), "
                         f"got {type(state).__name__}"
                         + (f" of format {state.get('format')!r}" if isinstance(state, Mapping) else ""))
    theirs = state.get("definition") or {}
    diffs = [f"{k}: the state has {theirs.get(k)!r}, this source {v!r}" for k, v in definition.items()
             if _jsonish(theirs.get(k)) != _jsonish(v)]
    diffs += [f"{k}: the state has {theirs[k]!r}, this source has none" for k in theirs if k not in definition]
    if diffs:
        raise ValueError("resume_from is the state of a different source definition; " + "; ".join(diffs))


def _jsonish(v: Any) -> Any:
    """Compare as JSON would see it (tuples are lists after a round trip)."""
    if isinstance(v, (list, tuple)):
        return [_jsonish(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonish(x) for k, x in v.items()}
    return v
