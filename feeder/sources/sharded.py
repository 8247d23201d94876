"""ShardedSource: a finite table of rows cut into units of work, dealt to the workers that call it.

The base class of ``ArraySource`` and ``ParquetSource`` (and of a source of your own, see the
guide): per-epoch shuffling, epochs, row keys and exact resume, sharding between ranks
(:mod:`feeder.sources.sharding`) and the shuffle window (:mod:`feeder.sources.window`); ``map``
and ``filter`` come from :class:`~feeder.sources.transform.Transformable`.
"""
from __future__ import annotations

import bisect
import logging
import threading
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

from ..ragged import Ragged
from .base import SKIP, SourceBinding
from .sharding import Piece, PieceWalk, RankPlan, check_shard, is_complete, shard_of, share, undelivered
from .state import check_state, ranges_of
from .transform import Transformable
from .window import ShuffleWindow, narrowed
from .windowreplay import WorkerStart, replay

log = logging.getLogger("feeder")


class ShardedSource(Transformable):
    """A finite table of rows cut into units of work, dealt to workers, with per-epoch
    shuffling, epochs, row keys and exact resume. Subclasses give the unit sizes
    (``_unit_rows``) and read rows (``_read``); they are picklable fetch functions.

    Every epoch lists its units (shuffled by ``seed`` and the epoch when ``shuffle``); the epochs
    follow each other into one sequence of units, and each fetch call returns one unit as one
    chunk (its rows shuffled too). Who gets which unit:

    * ``ordered=True``: unit ``m`` of the sequence goes to the worker at position ``m % W`` of the
      binding's sorted worker ids (W workers in all, every replica's). That is exactly the order
      in which ``ordered=True`` takes chunks from workers (and an ordered registration runs every
      worker, "auto" or not), so its rows come in the sequence's order, the same on every run.
    * otherwise: a call takes the next unit of the sequence that no call has taken yet, from a
      counter shared by every worker thread, worker process and replica of the source (in
      shared memory when worker processes call it). Units are thus served whichever workers run
      (``"auto"`` concurrency parks some), epochs follow each other with only the units in
      flight overlapping, and rows are delivered nearly in sequence order, so a state stays small.

    The row at position ``i`` of its unit's (shuffled) row order, in the unit starting at row
    ``s`` of the table, has the key ``e * rows + s + i`` in epoch ``e``. Resuming drops the
    delivered rows from the sequence and deals what is left the same way, so an ordered run
    continues with exactly the rows it would have delivered.

    Args:
        shuffle: Shuffle the units and the rows within each unit, per epoch.
        seed: The shuffle's seed (an int >= 0).
        epochs: Passes over the table (>= 1); None: endless.
        shard: ``(rank, world_size)`` or ``"env"``: read this rank's part of every epoch only
            (:mod:`feeder.sources.sharding`); None: every row.
        equal_steps: With ``shard``, every rank the same number of rows per epoch.
        shuffle_window: Rows held from several units to mix into each chunk (split between
            the workers; :mod:`feeder.sources.window`); None: a chunk is one unit.
    """

    feeder_row_keys = True

    def __init__(self, *, shuffle: bool, seed: int, epochs: Optional[int], shard: Any = None,
                 equal_steps: bool = False, shuffle_window: Optional[int] = None):
        if not isinstance(shuffle, (bool, np.bool_)):
            raise TypeError(f"shuffle must be a bool, got {type(shuffle).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if seed < 0:  # numpy's generators take none, and a fetch must not be where that is found
            raise ValueError(f"seed must be an int >= 0, got {seed}")
        if epochs is not None:
            if isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)):
                raise TypeError(f"epochs must be an int or None (endless), got {type(epochs).__name__}")
            if epochs < 1:
                raise ValueError(f"epochs must be >= 1 or None (endless), got {epochs}")
        if not isinstance(equal_steps, (bool, np.bool_)):
            raise TypeError(f"equal_steps must be a bool, got {type(equal_steps).__name__}")
        if shuffle_window is not None:
            if isinstance(shuffle_window, bool) or not isinstance(shuffle_window, (int, np.integer)):
                raise TypeError(f"shuffle_window must be a number of rows (int) or None, "
                                f"got {type(shuffle_window).__name__}")
            if shuffle_window < 1:
                raise ValueError(f"shuffle_window must be >= 1 rows or None, got {shuffle_window}")
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epochs = None if epochs is None else int(epochs)
        self.shard: Optional[Tuple[int, int]] = check_shard(shard)
        self.equal_steps = bool(equal_steps)
        self.shuffle_window: Optional[int] = None if shuffle_window is None else int(shuffle_window)
        self._rank: Optional[RankPlan] = None  # set at bind when sharded over more than one rank
        self._basis = np.zeros((0, 2), np.int64)  # the complete state's ranges the rank plan starts from
        self._basis_filtered = 0  # ... and how many of its rows were filtered (map/filter), not delivered
        self._walk: Optional[PieceWalk] = None
        self._fresh_walk: Optional[PieceWalk] = None  # the window replay's (see _fresh_locate)
        self._windows: Dict[int, ShuffleWindow] = {}  # worker id -> its window (shuffle_window)
        # ordered + shuffle_window + resume: each worker's window replayed to the checkpoint
        # (feeder.sources.windowreplay); None until the first call works it out, {} for none.
        self._resumed: Optional[Dict[int, WorkerStart]] = None
        self._binding: Optional[SourceBinding] = None
        self._lock = threading.Lock()
        self._order_cache: Optional[Tuple[int, np.ndarray]] = None
        self._init_units([])
        self._cursors: Dict[int, int] = {}  # ordered: worker id -> the next sequence index it takes
        self._next = 0                      # otherwise, in threads: the next sequence index to take
        self._shared: Any = None            # ... and with worker processes: that counter, in shared memory

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
        if self.shard is not None and 0 < self.rows < self.shard[1]:
            raise ValueError(f"shard={self.shard}: {self.rows} rows per epoch cannot be split among {self.shard[1]} "
                             f"ranks (every rank needs at least one row of each epoch)")
        if self.shuffle_window is not None and 0 < self.rows < self.shuffle_window:
            # The window's buffers are sized for it when it first fills: a window beyond the table
            # would never fill, and a mistyped one would fail for memory at the first fetch.
            raise ValueError(f"shuffle_window={self.shuffle_window} rows is more than this source's {self.rows} rows "
                             f"per epoch: the window holds that many rows in memory; pass at most {self.rows} "
                             f"(shuffle_window=len(source) mixes the rows of a whole epoch)")
        self._plan_sequence(None)

    def __len__(self) -> int:
        """Rows per epoch."""
        return self.rows

    def _unit_order(self, epoch: int) -> np.ndarray:
        n = len(self._units)
        if not self.shuffle:
            return np.arange(n)
        cached = self._order_cache  # (epoch, order), replaced whole: safe to read from any thread
        if cached is not None and cached[0] == epoch:
            return cached[1]
        order: np.ndarray = np.random.default_rng([self.seed, epoch, 0]).permutation(n)
        self._order_cache = (epoch, order)
        return order

    def _row_order(self, epoch: int, unit: int) -> np.ndarray:
        n = int(self._units[unit])
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch, 1, unit]).permutation(n)

    # ---- the sequence of units ----
    def _plan_sequence(self, ranges: Optional[np.ndarray]) -> None:
        """Lay out the sequence of units still to deliver as blocks of epochs.

        Without a resume (``ranges`` None) it is every epoch from 0. Otherwise ``ranges`` (shape
        (k, 2), [start, stop) key ranges delivered) are dropped: epochs wholly delivered are
        skipped, an epoch holding an end of a gap in the ranges gets a plan (its units with rows
        left, and which rows), and the epochs inside a gap are whole. The work is a loop over the
        gaps, never over epochs: a state with a gap followed by a million delivered epochs plans
        as fast as one without (the epochs between are one skipped range).

        A block is ``(first epoch, epochs or None for endless, planned)``; ``_starts`` holds the
        sequence index at which each block begins.
        """
        self._order_cache = None
        self._plans: Dict[int, List[Tuple[int, Optional[np.ndarray]]]] = {}
        blocks: List[Tuple[int, Optional[int], bool]] = []
        n, u = self.rows, len(self._units)
        first_full = 0
        if ranges is not None and len(ranges) and n and u:
            r = _merged(ranges)
            end = -(-int(r[-1, 1]) // n) * n  # the end of the last epoch a delivered row is in
            gap_lo = np.concatenate([[0], r[:, 1]])
            gap_hi = np.concatenate([r[:, 0], [end]])
            keep = gap_hi > gap_lo
            gap_lo, gap_hi = gap_lo[keep], gap_hi[keep]
            e_first, e_last = gap_lo // n, (gap_hi - 1) // n
            partial = set(e_first.tolist()) | set(e_last.tolist())
            covered = -1  # the last epoch already laid out
            for lo, hi in zip(e_first.tolist(), e_last.tolist()):
                lo = max(lo, covered + 1)
                if lo > hi:
                    continue
                inner = sorted(e for e in partial if lo <= e <= hi)
                at = lo
                for e in inner:
                    if e > at:
                        blocks.append((at, e - at, False))
                    self._plans[e] = self._epoch_plan(e, r)
                    blocks.append((e, 1, True))
                    at = e + 1
                if at <= hi:
                    blocks.append((at, hi + 1 - at, False))
                covered = hi
            first_full = end // n
        blocks.append((first_full, None, False))
        starts, at = [], 0
        for e0, count, planned in blocks:
            starts.append(at)
            at += len(self._plans[e0]) if planned else (count or 0) * u
        self._blocks, self._starts = blocks, starts

    def _epoch_plan(self, epoch: int, ranges: np.ndarray) -> List[Tuple[int, Optional[np.ndarray]]]:
        """The units of ``epoch`` with rows not in ``ranges``, in the epoch's order, each with the
        positions (in its row order) still to deliver, or None for all of them."""
        starts, stops = ranges[:, 0], ranges[:, 1]
        base = epoch * self.rows
        plan: List[Tuple[int, Optional[np.ndarray]]] = []
        for u in self._unit_order(epoch):
            unit = int(u)
            lo = base + int(self._offsets[unit])
            size = int(self._units[unit])
            i = int(np.searchsorted(stops, lo, side="right"))
            if i >= len(starts) or starts[i] >= lo + size:
                plan.append((unit, None))  # nothing of it was delivered
                continue
            positions = np.arange(size, dtype=np.int64)
            left = undelivered(lo + positions, ranges)
            if left.any():
                plan.append((unit, positions[left]))
        return plan

    def _locate(self, index: int) -> Optional[Tuple[int, int, Optional[np.ndarray]]]:
        """(unit, epoch, positions or None) at ``index`` of the sequence, or None past its end."""
        if self._rank is not None:
            walk = self._walk
            if walk is None:  # made on first use: it is not pickled to worker processes
                with self._lock:
                    walk = self._walk
                    if walk is None:
                        walk = self._walk = PieceWalk(self._rank_epochs)
            return walk.locate(index)
        u = len(self._units)
        if not u:
            return None  # an empty table has nothing in any epoch
        b = bisect.bisect_right(self._starts, index) - 1
        e0, _, planned = self._blocks[b]
        off = index - self._starts[b]
        if planned:
            epoch = e0
        else:
            epoch, off = e0 + off // u, off % u
        if self.epochs is not None and epoch >= self.epochs:
            return None
        if planned:
            unit, positions = self._plans[epoch][off]
            return unit, epoch, positions
        return int(self._unit_order(epoch)[off]), epoch, None

    def _rank_epochs(self, rank: Optional[RankPlan] = None) -> Iterator[Tuple[int, List[Piece]]]:
        """This rank's pieces of each epoch of the sequence, in order (see feeder.sources.sharding);
        as ``rank`` cuts them if given (the fresh stream of a window replay)."""
        rank = rank or self._rank
        assert rank is not None
        for e0, count, planned in self._blocks:
            e = e0
            while count is None or e < e0 + count:
                if self.epochs is not None and e >= self.epochs:
                    return
                if planned:
                    plan = self._plans[e]
                    units = np.array([u for u, _ in plan], dtype=np.int64)
                    positions: Sequence[Optional[np.ndarray]] = [p for _, p in plan]
                    counts = np.array([self._units[u] if p is None else len(p) for u, p in plan], dtype=np.int64)
                else:
                    units = np.asarray(self._unit_order(e), dtype=np.int64)
                    counts = self._units[units]
                    positions = [None] * len(units)
                yield e, rank.pieces(e, self.rows, units, counts, positions, self._offsets)
                e += 1

    # ---- the binding protocol ----
    def feeder_validate(self, input_names: Sequence[str], resume: Optional[Mapping[str, Any]]) -> None:
        """At registration: ValueError for a ``resume`` state of another source definition.

        Args:
            input_names: The registration's inputs.
            resume: Its ``resume_from`` state, or None.
        """
        if resume is not None:
            check_state(resume, self._definition())
            self._rank_plan(None, resume)  # another rank's state, or of another world: refused here already

    def feeder_definition(self) -> Dict[str, Any]:
        """What a checkpoint of this source records about it, to refuse a state of another source."""
        return self._definition()

    def feeder_bind(self, binding: SourceBinding) -> None:
        """At ``start()``: learn which workers call this source and plan the sequence of units,
        less the rows that ``binding.resume`` says were delivered (see the class docstring); for a
        sharded source, this rank's share of them (see :mod:`feeder.sources.sharding`).

        Args:
            binding: What feeder tells the source: its name, the workers of each replica, the
                inputs, ``ordered``, the resume state and the worker processes' context.

        Raises:
            ValueError: ``binding.resume`` is a state of another source definition, or one
                rank's state that cannot resume this rank (merge the ranks' states first).
        """
        resume = binding.resume
        if resume is not None:
            check_state(resume, self._definition())
        rank, basis, basis_filtered = self._rank_plan(binding.source_name, resume)
        with self._lock:
            self._binding = binding
            self._cursors = {}
            self._next = 0
            # Dealt in turn only when ordered (see the class docstring); otherwise from a counter
            # every worker shares, in shared memory when worker processes call this object.
            self._shared = None
            if not binding.ordered and binding.mp_context is not None:
                self._shared = binding.mp_context.Value("q", 0)
            self._rank, self._basis, self._walk, self._fresh_walk = rank, basis, None, None
            self._basis_filtered = basis_filtered
            self._windows = {}
            self._resumed = None
            self._plan_sequence(basis if len(basis) else None)

    def _rank_plan(self, name: Optional[str], resume: Optional[Mapping[str, Any]]
                   ) -> Tuple[Optional[RankPlan], np.ndarray, int]:
        """(how this rank cuts its share, the basis ranges the sequence is planned from, how many of
        the basis's rows were filtered) for a run that resumes from ``resume`` (see
        feeder.sources.sharding). ValueError for a state that
        cannot resume this rank exactly: another rank's, one rank's on an unsharded source, or
        one rank's of another world size."""
        none = np.zeros((0, 2), np.int64)
        record = shard_of(resume) if resume is not None else None
        sharded = self.shard is not None and self.shard[1] > 1
        if is_complete(record):
            ranges = ranges_of(resume) if resume is not None else none
            filtered = int(resume.get("rows_filtered", 0) or 0) if resume is not None and len(ranges) else 0
            if not sharded:
                return None, ranges, filtered
            assert self.shard is not None
            return RankPlan(self.shard[0], self.shard[1], self.equal_steps), ranges, filtered
        assert record is not None and resume is not None
        theirs = f"the state of rank {record['ranks']} of a world of {record['world']}"
        who = f"source {name!r}: " if name else f"{type(self).__name__}: "
        merge = ("merge every rank's state with feeder.sources.merge_states([...]) and resume every rank from the "
                 "merged state")
        if not sharded:
            raise ValueError(f"{who}resume_from is {theirs}, and this source is not sharded: {merge}")
        assert self.shard is not None
        rank, world = self.shard
        if record["world"] != world or record["ranks"] != [rank]:
            raise ValueError(f"{who}resume_from is {theirs}, and this source is rank {rank} of {world}: "
                             f"a rank resumes from its own state on the same world size; otherwise {merge}")
        theirs_equal = record.get("equal_steps")  # (None: a state of a feeder that did not record it)
        if theirs_equal is not None and bool(theirs_equal) != self.equal_steps:
            raise ValueError(f"{who}resume_from is {theirs} with equal_steps={bool(theirs_equal)}, and "
                             f"this source has equal_steps={self.equal_steps}: a rank resumes from its own state with "
                             f"its share cut as before (cut otherwise, rows would be delivered twice or never); "
                             f"create the source with equal_steps={bool(theirs_equal)}, or {merge} (a merged state "
                             f"resumes with either)")
        basis = np.asarray(record.get("basis") or [], dtype=np.int64).reshape(-1, 2)
        filtered = int(record.get("basis_filtered", 0) or 0) if len(basis) else 0
        return RankPlan(rank, world, self.equal_steps, own=_merged(ranges_of(resume))), basis, filtered

    def feeder_total_rows(self) -> Optional[int]:
        """Rows this source delivers over all its epochs in a fresh run (this rank's share when
        sharded; rows left out by ``equal_steps`` not counted); None when endless."""
        if self.epochs is None:
            return None
        if self.shard is None or self.shard[1] < 2:
            return self.rows * self.epochs
        lo, hi = share(self.rows, self.shard[0], self.shard[1], self.equal_steps)
        return (hi - lo) * self.epochs

    def feeder_shard_record(self) -> Optional[Dict[str, Any]]:
        """What a state of this source records of its shard (None: unsharded): the world size, this
        rank, and the basis its share was cut from (see feeder.sources.sharding)."""
        if self.shard is None or self.shard[1] < 2:
            return None
        return {"world": self.shard[1], "ranks": [self.shard[0]], "equal_steps": self.equal_steps,
                "basis": [[int(a), int(b)] for a, b in self._basis], "basis_filtered": self._basis_filtered}

    @property
    def feeder_equal_steps(self) -> bool:
        """Every rank gets the same number of rows per epoch (``equal_steps`` on a source sharded
        between two ranks or more): rows of each epoch are left out."""
        return self.equal_steps and self.shard is not None and self.shard[1] > 1

    def feeder_release(self) -> None:
        """At ``stop()``: forget the workers' cursors and the shared counter."""
        with self._lock:
            self._cursors = {}
            self._shared = None
            self._windows = {}
            self._resumed = None

    def feeder_describe(self) -> str:
        """A phrase for FeedTimeout and ``diagnose()`` messages: rows, units and epochs."""
        ep = "endless" if self.epochs is None else f"{self.epochs} epoch(s)"
        shard = f", rank {self.shard[0]} of {self.shard[1]}" if self.shard is not None else ""
        return f"{type(self).__name__} of {self.rows} rows in {len(self._units)} units, {ep}{shard}"

    # ---- fetching ----
    def _take(self, worker_id: int) -> int:
        """The sequence index of the unit this call returns."""
        binding = self._binding
        if binding is None:
            raise RuntimeError(f"{type(self).__name__} was called before feeder bound it; pass it as the fetch_fun "
                               f"of init_data_input_workers and start the coordinator")
        if not binding.ordered:
            shared = self._shared
            if shared is not None:
                with shared.get_lock():
                    index = int(shared.value)
                    shared.value = index + 1
                return index
            with self._lock:
                index = self._next
                self._next = index + 1
            return index
        ids = binding.worker_ids
        cursor = self._cursors.get(worker_id)
        if cursor is None:  # a worker's first call: its place in the round-robin
            try:
                cursor = ids.index(worker_id)
            except ValueError:
                raise RuntimeError(f"worker {worker_id} is not one of the workers this source was bound to "
                                   f"{ids}") from None
        self._cursors[worker_id] = cursor + len(ids)  # only this worker's thread touches its entry
        return cursor

    def __call__(self, worker_id: int, batch_size: int) -> Any:
        """The next chunk of this worker's sequence: its arrays then their row keys (or SKIP, see
        _from_window)."""
        if self.shuffle_window is not None:
            return self._from_window(worker_id)
        return self._next_unit(worker_id)

    def _from_window(self, worker_id: int) -> Any:
        """A draw from this worker's shuffle window (feeder.sources.window), topped up first. A
        source that can gather rows by their index in the table (``gathers_rows``: arrays in memory
        or mapped) keeps only each row's index and key in the window, and gathers the draw from its
        arrays: one copy of each row, as a shuffled unit costs; others keep the rows themselves.
        An ordered run that resumes starts from each window as it was at the checkpoint
        (:meth:`_new_window`), and may first return SKIP or the rest of a cut draw."""
        window = self._windows.get(worker_id)
        if window is None:
            window = self._windows[worker_id] = self._new_window(worker_id)
        start = self._resumed.get(worker_id) if self._resumed else None
        if start is not None:
            if start.skip:
                start.skip = False
                return SKIP
            if start.first is not None:
                (rows, keys), start.first = start.first, None
                return self._cut_draw(rows, keys, start.head, worker_id)
        by_index = self.gathers_rows

        def next_piece() -> Optional[List[Any]]:
            try:
                if start is not None:
                    unit, rows, keys = self._replayed_rows(start)
                else:
                    unit, rows, keys = self._next_rows(worker_id, stored_order=True)
            except StopIteration:
                return None
            if by_index:
                return [rows + int(self._offsets[unit]), keys]
            return self._read(unit, rows, worker_id) + [keys]

        drawn = window.draw(next_piece, int(self._units.max()))
        if drawn is None:
            raise StopIteration
        if by_index:
            return self._gather(drawn[0]) + [drawn[1]]
        return drawn

    def _cut_draw(self, rows: np.ndarray, keys: np.ndarray, head: int, worker_id: int) -> List[Any]:
        """The rows after the first ``head`` of a draw of ``rows`` (the turn a checkpoint cut), as
        the draw gave them: a string column at the width of the whole draw (window.narrowed)."""
        if self.gathers_rows:
            return list(self._gather(rows[head:])) + [keys[head:]]
        arrays, ragged = self._rows_by_index(rows, worker_id, ragged_as_rows=True)
        out: List[Any] = [Ragged.from_rows(list(a[head:])) if j in ragged else narrowed(a)[head:]
                          for j, a in enumerate(arrays)]
        return out + [keys[head:]]

    def _window_rng(self, worker_id: int) -> np.random.Generator:
        # Each worker's window draws its own stream, and so does each rank's (their worker ids
        # are the same): reproducible from (seed, worker, rank, world).
        entropy = [self.seed, 2, worker_id]
        if self.shard is not None and self.shard[1] > 1:
            entropy += [self.shard[0], self.shard[1]]
        return np.random.default_rng(entropy)

    def _window_rows(self) -> int:
        """Each worker's window, in rows: shuffle_window rows in all, split between the workers."""
        binding = self._binding
        workers = len(binding.worker_ids) if binding is not None else 1
        return max(1, (self.shuffle_window or 1) // workers)

    def _new_window(self, worker_id: int) -> ShuffleWindow:
        """This worker's window: empty, or as the checkpoint left it (a resumed ordered run)."""
        with self._lock:  # worked out once, for every worker (threads share this object)
            if self._resumed is None:
                self._resumed = self._window_starts() or {}
        start = self._resumed.get(worker_id)
        if start is None:
            return ShuffleWindow(self._window_rows(), self._window_rng(worker_id))
        if not self.gathers_rows:  # it replayed row indices: read the rows it holds
            start.window.repaint(*self._rows_by_index(start.window.held(0), worker_id, ragged_as_rows=True))
        return start.window

    def _window_starts(self) -> Optional[Dict[int, WorkerStart]]:
        """Each worker's window at the checkpoint, for an ordered run resuming from a state of
        this feed's stream (feeder.sources.windowreplay); None otherwise (windows start empty,
        and every row not delivered still comes once)."""
        binding = self._binding
        rank = self._rank
        # What the state lists of this stream: the delivered rows (a rank: its own state's, of which the
        # basis its stream was planned from is no part), and how many of them came before the stream.
        ranges = self._basis if rank is None else (rank.own if rank.own is not None else self._basis[:0])
        before = 0 if rank is None else int((self._basis[:, 1] - self._basis[:, 0]).sum())
        if (binding is None or not binding.ordered or binding.resume is None or not len(ranges)
                or len(binding.replicas) != 1 or not len(self._units)):
            return None

        def unit_at(index: int) -> Optional[Tuple[np.ndarray, np.ndarray]]:
            where = self._fresh_locate(index)
            if where is None:
                return None
            unit, rows, keys = self._rows_at(where, stored_order=True)
            return rows + int(self._offsets[unit]), keys

        starts = replay(binding.worker_ids, self._window_rows(), self._window_rng, unit_at,
                        int(self._units.max()), _merged(ranges), before)
        if starts is None:
            log.info("source %r: the resume state is not where this ordered feed's stream stopped (another "
                     "worker count, an unordered run, a merged state of ranks, or a filter on the source, whose "
                     "dropped rows are recorded as they are fetched): the shuffle windows start empty; every row "
                     "not delivered comes once, not in the batches of the interrupted run", binding.source_name)
        return starts

    def _fresh_locate(self, index: int) -> Optional[Tuple[int, int, Optional[np.ndarray]]]:
        """(unit, epoch, positions or None) at ``index`` of the sequence of a run that resumes
        nothing; a rank's: the sequence its share was cut from at the start of its stream (planned
        from the basis, none of its own rows taken out)."""
        rank = self._rank
        if rank is not None:
            walk = self._fresh_walk
            if walk is None:  # (two workers may each make one at once: either walks the same sequence)
                fresh = RankPlan(rank.rank, rank.world, rank.equal_steps)
                walk = self._fresh_walk = PieceWalk(lambda: self._rank_epochs(fresh))
            return walk.locate(index)
        epoch, off = divmod(index, len(self._units))
        if self.epochs is not None and epoch >= self.epochs:
            return None
        return int(self._unit_order(epoch)[off]), epoch, None

    def _replayed_rows(self, start: WorkerStart) -> Tuple[int, np.ndarray, np.ndarray]:
        """The next unit of a replayed worker's sequence (that of a run resuming nothing)."""
        binding = self._binding
        assert binding is not None
        where = self._fresh_locate(start.cursor)
        start.cursor += len(binding.worker_ids)
        if where is None:
            raise StopIteration
        return self._rows_at(where, stored_order=True)

    def _rows_by_index(self, rows: np.ndarray, worker_id: int, ragged_as_rows: bool = False
                       ) -> Tuple[List[Any], Set[int]]:
        """The arrays (one per input) of the table's rows ``rows``, in that order (gathered, or read
        unit by unit), and which inputs' rows differ in shape (a padded input's): those come as an
        object array of their rows if ``ragged_as_rows`` (as a window holds them), else as a Ragged."""
        if self.gathers_rows:
            return list(self._gather(rows)), set()
        units = np.searchsorted(self._offsets, rows, side="right") - 1
        parts: List[Tuple[np.ndarray, List[Any]]] = []
        for unit in np.unique(units).tolist():
            at = np.flatnonzero(units == unit)
            parts.append((at, self._read(unit, rows[at] - int(self._offsets[unit]), worker_id)))
        out: List[Any] = []
        ragged: Set[int] = set()
        for j in range(len(parts[0][1]) if parts else 0):
            pieces = [p[1][j] for p in parts]
            if all(isinstance(a, np.ndarray) and a.shape[1:] == pieces[0].shape[1:] for a in pieces):
                col = np.empty((len(rows),) + pieces[0].shape[1:], np.result_type(*pieces))
                for (at, _), a in zip(parts, pieces):
                    col[at] = a
                out.append(col)
                continue
            held = np.empty(len(rows), dtype=object)
            for (at, _), a in zip(parts, pieces):
                for i, row in zip(at.tolist(), a):
                    held[i] = row
            ragged.add(j)
            out.append(held if ragged_as_rows else Ragged.from_rows(list(held)))
        return out, ragged

    # True for a source whose rows can be gathered by their index in the table (``_gather``:
    # ArraySource); otherwise rows are read unit by unit only (``_read``).
    gathers_rows = False

    def _gather(self, rows: np.ndarray) -> List[np.ndarray]:
        """The arrays (one per input) of the table's rows ``rows`` (indices in the whole table, in
        the order to return them); for sources with ``gathers_rows``."""
        raise NotImplementedError

    def _next_unit(self, worker_id: int) -> List[np.ndarray]:
        """The next unit of this worker's sequence: its arrays, then its row keys."""
        unit, rows, keys = self._next_rows(worker_id)
        arrays = self._read(unit, rows, worker_id)
        arrays.append(keys)
        return arrays

    def _next_rows(self, worker_id: int, stored_order: bool = False) -> Tuple[int, np.ndarray, np.ndarray]:
        """(unit, the rows of it to read, their keys) of the next unit of this worker's sequence.
        ``stored_order``: the rows in the order they are stored (a read without a gather), keys
        still by shuffled order (for the shuffle window, which mixes them anyway)."""
        where = self._locate(self._take(worker_id))
        if where is None:
            raise StopIteration
        return self._rows_at(where, stored_order)

    def _rows_at(self, where: Tuple[int, int, Optional[np.ndarray]], stored_order: bool
                 ) -> Tuple[int, np.ndarray, np.ndarray]:
        """(unit, its rows to read, their keys) of the sequence's entry ``where`` (see _next_rows)."""
        unit, epoch, positions = where
        order = self._row_order(epoch, unit)
        if positions is None and stored_order:
            rows = np.arange(len(order), dtype=np.int64)
            positions = np.empty_like(rows)
            positions[order] = rows  # each row's place in the shuffled order: its key
        elif positions is None:
            positions, rows = np.arange(len(order), dtype=np.int64), order
        else:
            rows = order[positions]
            if stored_order and len(rows) > 1:
                by_row = np.argsort(rows, kind="stable")
                rows, positions = rows[by_row], positions[by_row]
        # A key numbers a row by its place in its unit's (shuffled) order, not by its row index:
        # rows are delivered in that order, so what a consumer got of a unit is a few key ranges
        # (not one range per row, as shuffled row indices would give) and a state stays small.
        keys = positions + (epoch * self.rows + int(self._offsets[unit]))
        return unit, rows, keys

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        state["_order_cache"] = None
        state["_walk"] = state["_fresh_walk"] = None  # made again on first use, in the process that uses it
        state["_windows"] = {}
        state["_resumed"] = None  # each worker process replays the windows itself
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _merged(ranges: np.ndarray) -> np.ndarray:
    """``ranges`` (k, 2) as sorted, disjoint, non-adjacent, non-empty ranges."""
    r = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    r = r[r[:, 1] > r[:, 0]]
    if not len(r):
        return r
    r = r[np.argsort(r[:, 0], kind="stable")]
    reach = np.maximum.accumulate(r[:, 1])
    new = np.concatenate([[True], r[1:, 0] > reach[:-1]])
    idx = np.flatnonzero(new)
    return np.stack([r[idx, 0], np.maximum.reduceat(r[:, 1], idx)], axis=1)
