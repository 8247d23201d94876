"""Row keys: which rows of a source were delivered, kept small enough to checkpoint.

A source that supports exact resume (``feeder_row_keys = True``, see ``feeder.sources.base``)
appends an int64 column of unique row keys, the reserved input ``ROW_KEY``, as the last array
of every chunk. It travels with the inputs through validation, the queue and the rebatcher, so
every batch carries the keys of exactly its rows; the feed strips it before anyone sees the
batch (:func:`split_keys`), and the feed's ready queue hands each batch it pops to
:meth:`KeyLedger.record` under the same lock as the pop. So a batch counts as delivered if and
only if its keys are recorded, whichever thread asks (``coord.state_dict(name)``).

The ledger keeps the keys as sorted disjoint ``[start, stop)`` ranges: sources number rows so
that whole units of work and whole epochs are single ranges, and a state stays a few numbers
per unit at most.

Rows a source drops on purpose (``source.filter(pred)``, see ``feeder.sources.transform``) are
recorded as they are fetched (:meth:`KeyLedger.record_filtered`): they will never be delivered,
so they are done, and recording them keeps the ranges whole (a state with a hole per filtered
row would grow with the data) and a resume from not reading them again. They are counted apart:
a state's ``delivered`` ranges hold the keys of the rows delivered *or filtered* (what a resume
skips), its ``rows_delivered`` counts the rows delivered to consumers and ``rows_filtered``
(present when any was) those filtered.

A filtered row is fetched long before the rows around it are delivered (they wait in the queue,
the rebatcher, the ready batches), and a filter that drops one row in ten leaves one lone key per
dropped row ahead of the consumer: a state holding them would be a range per filtered row. So the
ledger holds filtered keys *loose* until they join what is done: a run of loose keys enters the
ranges once it touches (is adjacent to) a range, once it is long (``SETTLE_RUN`` keys or more: a
unit the filter emptied), and at the end of the data. A state leaves the loose keys out (and out
of its ``rows_filtered``): a resume reads those rows again and filters them again, and the state
stays a few ranges per unit in flight, whatever the filter drops.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from ..validation import InputSpec
from .base import ROW_KEY
from .state import STATE_FORMAT, pad_varies_of, ranges_of

log = logging.getLogger("feeder")

COMPACT_KEYS = 1 << 16  # recorded runs of keys merged into the ranges once this many are pending
SETTLE_RUN = 64  # a run of filtered keys this long enters the ranges without waiting for a neighbour


def with_row_keys(names: Sequence[str], specs: Sequence[InputSpec], axes: Sequence[int]
                  ) -> Tuple[List[str], List[InputSpec], List[int]]:
    """Inputs, specs and batch axes with the row-key column appended (what the source returns)."""
    if ROW_KEY in names:
        raise ValueError(f"{ROW_KEY!r} is reserved for the row keys of feeder.sources; rename that input")
    return (list(names) + [ROW_KEY], list(specs) + [InputSpec(ROW_KEY, np.dtype(np.int64), (None,))],
            list(axes) + [0])


def public_names(names: Sequence[str]) -> List[str]:
    return [n for n in names if n != ROW_KEY]


def split_keys(arrays: Sequence[np.ndarray]) -> Tuple[List[np.ndarray], np.ndarray]:
    """(the inputs, the row keys) of a batch whose last array holds the keys."""
    return list(arrays[:-1]), arrays[-1]


def one_run(keys: np.ndarray) -> Optional[np.ndarray]:
    """``keys`` as one ``[start, stop)`` range, shape (1, 2), when they are consecutive in the order
    given (a batch cut from one stretch of a unit: the common case, told without a pass of Python);
    else None."""
    n = len(keys)
    if n == 0:
        return None
    first, last = int(keys[0]), int(keys[-1])
    if last - first != n - 1 or (n > 2 and not bool((np.diff(keys) == 1).all())):
        return None
    return np.array([[first, last + 1]], dtype=np.int64)


def merge_ranges(ranges: np.ndarray, keys: Optional[np.ndarray] = None) -> Tuple[np.ndarray, int]:
    """The union of ``ranges`` (k, 2) and ``keys`` as sorted disjoint, non-adjacent ranges, and how
    many keys were counted twice (overlaps)."""
    parts = [ranges.reshape(-1, 2)]
    if keys is not None and keys.size:
        k = np.sort(keys.astype(np.int64, copy=False))
        breaks = np.flatnonzero(np.diff(k) != 1) + 1
        first = np.concatenate([[0], breaks])
        last = np.concatenate([breaks - 1, [len(k) - 1]])
        parts.append(np.stack([k[first], k[last] + 1], axis=1))
    allr = np.concatenate(parts).astype(np.int64, copy=False)
    if not len(allr):
        return allr.reshape(0, 2), 0
    counted = int((allr[:, 1] - allr[:, 0]).sum())
    allr = allr[np.argsort(allr[:, 0], kind="stable")]
    starts, stops = allr[:, 0], allr[:, 1]
    reach = np.maximum.accumulate(stops)
    new = np.concatenate([[True], starts[1:] > reach[:-1]])
    idx = np.flatnonzero(new)
    merged = np.stack([starts[idx], np.maximum.reduceat(stops, idx)], axis=1)
    covered = int((merged[:, 1] - merged[:, 0]).sum())
    return merged, counted - covered


def _touching(runs: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    """Mask of the ``runs`` (sorted disjoint [start, stop) ranges) that overlap or are adjacent to
    one of ``ranges`` (sorted, disjoint)."""
    if not len(ranges) or not len(runs):
        return np.zeros(len(runs), dtype=bool)
    i = np.searchsorted(ranges[:, 1], runs[:, 0], side="left")  # the first range ending at or after a run's start
    safe = np.minimum(i, len(ranges) - 1)
    out: np.ndarray = (i < len(ranges)) & (ranges[safe, 0] <= runs[:, 1])
    return out


class KeyLedger:
    """The keys of the rows a source delivered to consumers or filtered, as ranges (see module
    docstring). ``filtered``: how many of them were filtered (those of ``ranges`` included); the
    filtered keys still loose are apart (``loose_filtered``)."""

    def __init__(self, source: str, ranges: Optional[np.ndarray] = None, filtered: int = 0,
                 pad_varies: Optional[Dict[str, List[int]]] = None):
        self.source = source
        self._lock = threading.Lock()
        # Per padded input, the axes its rows had differed along by the last batch delivered
        # (feeder.padding rounds those): what a resumed run must start from to shape its batches alike.
        self._pad_varies: Dict[str, Set[int]] = {k: set(v) for k, v in (pad_varies or {}).items()}
        self._ranges = np.zeros((0, 2), np.int64) if ranges is None else merge_ranges(ranges)[0]
        self._pending: List[np.ndarray] = []       # keys recorded, not yet merged into the ranges
        self._pending_runs: List[np.ndarray] = []  # ... and batches of consecutive keys, as ranges
        self._pending_n = 0
        self._filtered_new: List[np.ndarray] = []  # filtered keys not yet merged into the loose runs
        self._loose = np.zeros((0, 2), np.int64)   # runs of filtered keys not yet in the ranges
        self.duplicates = 0
        self.filtered = int(filtered)
        # What the ledger started with, so that its end-of-data check counts this run's keys only.
        self.start_covered = int((self._ranges[:, 1] - self._ranges[:, 0]).sum())
        self.start_filtered = self.filtered
        # Called with every array of filtered keys, after it is recorded (feeder.predict commits them).
        self.on_filtered: Optional[Callable[[np.ndarray], None]] = None

    @classmethod
    def from_state(cls, source: str, state: Optional[Dict[str, Any]]) -> "KeyLedger":
        """A ledger that starts with what ``state`` says was delivered or filtered (a resumed run's
        checkpoints cover the rows done before the resume too)."""
        if state is None:
            return cls(source)
        return cls(source, ranges_of(state), int(state.get("rows_filtered", 0) or 0), pad_varies_of(state))

    def record(self, item: Any) -> None:
        """Called with every item a feed's ready queue pops, under that queue's lock: cheap."""
        keys = getattr(item, "keys", None)
        if keys is not None:
            self.record_keys(keys, getattr(item, "pad_varies", None))

    def pad_varies(self) -> Dict[str, List[int]]:
        """Per padded input, the axes its rows had differed along by the last batch delivered."""
        with self._lock:
            return self._varies_now()

    def _varies_now(self) -> Dict[str, List[int]]:
        return {k: sorted(v) for k, v in self._pad_varies.items() if v}

    def record_keys(self, keys: np.ndarray, pad_varies: Optional[Dict[str, List[int]]] = None) -> None:
        """Record the keys of rows delivered (or committed: feeder.predict), and the padding's
        rounding history after their batch: one step, so that a state never has one without the other."""
        # Outside the lock (it is the consumer's path): a batch of consecutive keys is kept as its
        # range; others as a copy of their keys (the batch buffer is reused), sorted when merged.
        run = one_run(keys)
        kept = run if run is not None else np.array(keys, dtype=np.int64)
        with self._lock:
            if pad_varies:
                for name, axes in pad_varies.items():
                    self._pad_varies.setdefault(name, set()).update(axes)
            if run is not None:
                self._pending_runs.append(run)
            else:
                self._pending.append(kept)
            self._pending_n += len(kept)
            if self._pending_n >= COMPACT_KEYS:
                self._compact()

    def record_filtered(self, keys: np.ndarray) -> None:
        """Record the keys of rows the source dropped on purpose (from any thread)."""
        if not len(keys):
            return
        with self._lock:
            self._filtered_new.append(np.array(keys, dtype=np.int64))
            self._pending_n += len(keys)
            if self._pending_n >= COMPACT_KEYS:
                self._compact()
        listener = self.on_filtered
        if listener is not None:
            listener(keys)

    def _compact(self, settle: bool = False) -> None:
        dup = 0
        if self._pending or self._pending_runs:
            ranges = np.concatenate([self._ranges] + self._pending_runs) if self._pending_runs else self._ranges
            keys = np.concatenate(self._pending) if self._pending else None
            self._pending, self._pending_runs = [], []
            self._ranges, dup = merge_ranges(ranges, keys)
        if self._filtered_new:
            new = np.concatenate(self._filtered_new)
            self._filtered_new = []
            self._loose, twice = merge_ranges(self._loose, new)
            dup += twice
        self._pending_n = 0
        loose = self._loose
        if len(loose):
            done = np.ones(len(loose), dtype=bool) if settle else (
                _touching(loose, self._ranges) | (loose[:, 1] - loose[:, 0] >= SETTLE_RUN))
            if done.any():
                joined = loose[done]
                self.filtered += int((joined[:, 1] - joined[:, 0]).sum())
                self._ranges, twice = merge_ranges(np.concatenate([self._ranges, joined]))
                dup += twice
                self._loose = loose[~done]
        if dup:
            self.duplicates += dup
            log.error("source %r: row ledger does not balance: %d row key(s) were delivered twice",
                      self.source, dup)

    def settle(self) -> None:
        """Take every loose filtered key into the ranges (at the end of the data: nothing is left
        in flight for them to wait for)."""
        with self._lock:
            self._compact(settle=True)

    def ranges(self) -> np.ndarray:
        """The delivered keys as an (k, 2) int64 array of sorted disjoint [start, stop) ranges."""
        with self._lock:
            self._compact()
            ranges: np.ndarray = self._ranges.copy()
            return ranges

    def snapshot(self, loose: bool = False) -> Tuple[np.ndarray, int]:
        """(the ranges of keys delivered or filtered, how many of them were filtered), together;
        a state's. ``loose``: with the filtered keys still loose too (every key recorded: what the
        ledger's checks count)."""
        with self._lock:
            self._compact()
            if loose and len(self._loose):
                count = int((self._loose[:, 1] - self._loose[:, 0]).sum())
                return merge_ranges(np.concatenate([self._ranges, self._loose]))[0], self.filtered + count
            return self._ranges.copy(), self.filtered

    def state_parts(self) -> Tuple[np.ndarray, int, Dict[str, List[int]]]:
        """:meth:`snapshot` and :meth:`pad_varies` read together (a state's)."""
        with self._lock:
            self._compact()
            return self._ranges.copy(), self.filtered, self._varies_now()

    @property
    def loose_filtered(self) -> int:
        """Filtered keys recorded and not yet in the ranges (nor in a state)."""
        with self._lock:
            self._compact()
            return int((self._loose[:, 1] - self._loose[:, 0]).sum())

    def rows(self) -> int:
        """Rows delivered or filtered (whose keys the ledger holds)."""
        r = self.ranges()
        return int((r[:, 1] - r[:, 0]).sum())


def source_state(name: str, ledger: Optional[KeyLedger], fetch_fun: Any) -> Dict[str, Any]:
    """The JSON-serializable state of a source: its definition and the key ranges delivered."""
    if ledger is None:
        raise ValueError(f"source {name!r} cannot be checkpointed: its fetch_fun gives no row keys (use a source "
                         f"from feeder.sources, or see 'Checkpoint and resume' in the guide, docs/sources.md)")
    definition = getattr(fetch_fun, "feeder_definition", None)
    shard = getattr(fetch_fun, "feeder_shard_record", None)
    ranges, filtered, varies = ledger.state_parts()
    state = {
        "format": STATE_FORMAT,
        "source": name,
        "definition": definition() if definition is not None else {},
        "rows_delivered": int((ranges[:, 1] - ranges[:, 0]).sum()) - filtered,
        "delivered": [[int(a), int(b)] for a, b in ranges],
    }
    record = shard() if shard is not None else None
    if record is not None:  # one rank's state: feeder.sources.merge_states joins the ranks'
        state["shard"] = record
    if filtered:
        state["rows_filtered"] = filtered
    if varies:
        state["pad_varies"] = varies
    return state
