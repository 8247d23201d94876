"""Sharding a source across hosts (ranks) that never talk to each other, and merging their states.

Every rank computes the same seeded sequence of epochs (each epoch: the units of work in their
shuffled order, the rows of each unit in their shuffled order) and keeps its own part of each
epoch: rank ``r`` of ``world`` takes the contiguous stretch ``[floor(r*R/w), floor((r+1)*R/w))``
of the epoch's ``R`` rows, in sequence order. So ranks are disjoint and together cover every row
of every epoch, shares differ by at most one row, a rank reads whole units but for the (at most
two) it shares with its neighbours, and a rank gets rows even when there are fewer units than
ranks. With ``equal_steps`` every rank takes ``q = R // w`` rows (``[r*q, (r+1)*q)``) and the last
``R - w*q`` rows of the epoch's sequence (fewer than ``w``; with shuffling, random ones) are
dropped from that epoch: every rank then has the same number of rows per epoch, hence of batches,
and a collective step never waits on a rank that ran out.

Resuming (see :class:`RankPlan`): a complete state (one unsharded run's, or :func:`merge_states`
of every rank's) resumes on any world size: each epoch's rows that no rank delivered (the
*basis*) are what the new ranks split among them, the same way. A rank's own state resumes that
rank on the same world size: its share is cut as it was (from the basis its run started from,
recorded in the state), less the rows it delivered since. Either way every row is delivered
exactly once across the ranks, and no rank needs another's state but through the merge.

This module is pure logic (numpy, no threads, no I/O): the sequence of pieces one rank reads.
"""
from __future__ import annotations

import bisect
import os
import threading
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

from .rowkeys import merge_ranges
from .state import STATE_FORMAT, check_state, pad_varies_of, ranges_of

Piece = Tuple[int, Optional[np.ndarray]]  # (unit, positions in its row order; None: all of them)

# Where shard="env" finds this process's rank and the world size: each launcher's pair of
# variables, in this order (a launcher started inside another one comes first: torchrun is
# started by srun or mpirun, mpirun and mpiexec inside a Slurm job).
SHARD_ENV: Tuple[Tuple[str, str, str], ...] = (
    ("RANK", "WORLD_SIZE", "torchrun, torch.distributed launchers, Kubernetes operators"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
    ("PMI_RANK", "PMI_SIZE", "MPICH and Intel MPI's mpiexec, srun --mpi=pmi2"),
    ("SLURM_PROCID", "SLURM_NTASKS", "Slurm's srun"),
)
# Set beside RANK and WORLD_SIZE by launchers that start the processes themselves (torchrun,
# DeepSpeed, accelerate): their RANK and WORLD_SIZE are the processes' own, whatever the
# variables of the launcher that started them (srun, mpirun) say.
LAUNCHED_BY_TORCH = "LOCAL_RANK"


def _pair_text(rank_var: str, world_var: str, values: Tuple[str, str]) -> str:
    return f"{rank_var}={values[0]} and {world_var}={values[1]}"


def env_shard(environ: Optional[Mapping[str, str]] = None) -> Tuple[Tuple[int, int], str]:
    """``((rank, world_size), where)`` from the environment (see :data:`SHARD_ENV`): the first
    launcher whose two variables are both set; ValueError naming the variables for one set without
    its partner ahead of it, for values that are not integers, for two launchers whose values
    disagree where one cannot be started inside the other, and for none set at all."""
    env = os.environ if environ is None else environ
    found: List[Tuple[int, Tuple[str, str]]] = []  # (index in SHARD_ENV, the two values as set)
    half: List[str] = []
    for i, (rv, wv, _) in enumerate(SHARD_ENV):
        r, w = env.get(rv), env.get(wv)
        if r is not None and w is not None:
            found.append((i, (r, w)))
        elif (r is None) != (w is None) and not found:
            have, lack = (rv, wv) if r is not None else (wv, rv)
            half.append(f"{have}={env.get(have)!r} is set but {lack} is not")
    if not found:
        names = ", ".join(f"{rv}/{wv} ({who})" for rv, wv, who in SHARD_ENV)
        detail = "; ".join(half) if half else (f"{SHARD_ENV[0][0]} is not set, nor "
                                               + ", ".join(rv for rv, _, _ in SHARD_ENV[1:]))
        raise ValueError(f"shard='env' needs the rank and world size in the environment: RANK and WORLD_SIZE, or "
                         f"another launcher's pair, read in this order: {names}; {detail}. Pass "
                         f"shard=(rank, world_size) where no launcher sets them")
    first, values = found[0]
    rv, wv, who = SHARD_ENV[first]
    if half:  # a partner missing ahead of the pair found: a variable left over, or set by hand
        raise ValueError(f"shard='env': {half[0]}, while {_pair_text(rv, wv, values)} ({who}) are: unset the "
                         f"stray one, or pass shard=(rank, world_size)")
    parsed = []
    for var, text in ((rv, values[0]), (wv, values[1])):
        try:
            parsed.append(int(text))
        except ValueError:
            raise ValueError(f"shard='env': {var}={text!r} is not an integer") from None
    for other, theirs in found[1:]:
        orv, owv, owho = SHARD_ENV[other]
        try:
            same = (int(theirs[0]), int(theirs[1])) == (parsed[0], parsed[1])
        except ValueError:
            same = False
        if same or _nests(first, other, env):
            continue
        raise ValueError(f"shard='env': {_pair_text(rv, wv, values)} ({who}) disagree with "
                         f"{_pair_text(orv, owv, theirs)} ({owho}), and neither launcher starts the other"
                         + (f" ({rv} and {wv} without {LAUNCHED_BY_TORCH}: left over from another job? A "
                            f"launcher of your own that starts the ranks inside this job sets {LAUNCHED_BY_TORCH} "
                            f"beside them, as torchrun does)" if first == 0 else "")
                         + ": unset the variables that are wrong here, or pass shard=(rank, world_size)")
    return (parsed[0], parsed[1]), f" (from {rv} and {wv})"


def _nests(inner: int, outer: int, env: Mapping[str, str]) -> bool:
    """Launcher ``inner`` of SHARD_ENV may have been started by launcher ``outer``, so that their
    values differ rightly: torchrun (and the launchers like it, which set LOCAL_RANK) under any
    other; mpirun or mpiexec inside a Slurm job."""
    if inner == 0:
        return LAUNCHED_BY_TORCH in env
    return SHARD_ENV[outer][0] == "SLURM_PROCID"


def check_shard(shard: Any) -> Optional[Tuple[int, int]]:
    """``(rank, world_size)`` from a ``shard=`` argument: None, a pair of ints, or ``"env"`` (the
    variables a launcher sets: ``RANK`` and ``WORLD_SIZE`` from torchrun, or Open MPI's, MPICH's
    or Slurm's, see :func:`env_shard`). ValueError or TypeError naming what is wrong."""
    if shard is None:
        return None
    if isinstance(shard, str):
        if shard != "env":
            raise ValueError(f"shard must be (rank, world_size), 'env' or None, got {shard!r}")
        (rank, world), where = env_shard()
    else:
        if not isinstance(shard, (tuple, list)) or len(shard) != 2:
            raise TypeError(f"shard must be (rank, world_size), 'env' or None, got {shard!r}")
        for v in shard:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"shard must be a pair of ints (rank, world_size), got {shard!r}")
        rank, world = int(shard[0]), int(shard[1])
        where = ""
    if world < 1:
        raise ValueError(f"shard: world_size must be >= 1, got {world}{where}")
    if not 0 <= rank < world:
        raise ValueError(f"shard: rank must be in [0, {world}), got {rank}{where}")
    return rank, world


def share(total: int, rank: int, world: int, equal_steps: bool) -> Tuple[int, int]:
    """The ``[lo, hi)`` stretch of an epoch's ``total`` rows (in sequence order) that ``rank`` takes."""
    if equal_steps:
        q = total // world
        return rank * q, (rank + 1) * q
    return rank * total // world, (rank + 1) * total // world


def cut(units: np.ndarray, counts: np.ndarray, positions: Sequence[Optional[np.ndarray]], lo: int,
        hi: int) -> List[Piece]:
    """The pieces of the rows ``[lo, hi)`` of a sequence of units: ``units[i]`` offers ``counts[i]``
    rows, its positions ``positions[i]`` (None: ``0 .. counts[i]-1``, the whole unit)."""
    if hi <= lo:
        return []
    ends = np.cumsum(counts)
    first = int(np.searchsorted(ends, lo, side="right"))
    last = int(np.searchsorted(ends, hi, side="left"))  # the unit holding row hi-1
    out: List[Piece] = []
    for i in range(first, min(last, len(units) - 1) + 1):
        start = int(ends[i] - counts[i])
        a, b = max(lo - start, 0), min(hi - start, int(counts[i]))
        if b <= a:
            continue
        p = positions[i]
        if p is None:
            out.append((int(units[i]), None if (a == 0 and b == counts[i]) else np.arange(a, b, dtype=np.int64)))
        else:
            out.append((int(units[i]), p[a:b]))
    return out


def undelivered(keys: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    """Mask of the ``keys`` that no ``[start, stop)`` range of ``ranges`` (sorted, disjoint) holds."""
    if not len(ranges):
        return np.ones(len(keys), dtype=bool)
    starts, stops = ranges[:, 0], ranges[:, 1]
    j = np.searchsorted(stops, keys, side="right")
    safe = np.minimum(j, len(starts) - 1)
    done = (j < len(starts)) & (starts[safe] <= keys)
    return ~done


# ---- states ---------------------------------------------------------------------------------------
def shard_of(state: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The ``shard`` record of a state (``{"world": w, "ranks": [...]}``), None for an unsharded one."""
    rec = state.get("shard")
    if rec is None:
        return None
    if not isinstance(rec, Mapping) or not isinstance(rec.get("world"), int) or not isinstance(rec.get("ranks"), list):
        raise ValueError(f"resume_from: its 'shard' entry {rec!r} is not one feeder wrote")
    return dict(rec)


def is_complete(rec: Optional[Mapping[str, Any]]) -> bool:
    """A state covers every rank of its world (unsharded, merged, or a world of one)."""
    return rec is None or sorted(rec["ranks"]) == list(range(rec["world"]))


def merge_states(states: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """One state from the states of every rank of a sharded source: what any rank delivered
    counts as delivered. The result resumes on any world size (``resume_from=`` on every new
    rank): rows no rank delivered are dealt once.

    Args:
        states: Each rank's ``coord.state_dict(name)`` (its last checkpoint), every rank of
            the world once, in any order.

    Returns:
        A state (JSON-serializable, as ``coord.state_dict`` gives) for ``resume_from``.

    Raises:
        ValueError: The states are not of one source definition, a rank of their world is
            missing or given twice (its rows would be delivered again, or the states are of two
            runs), or a state is not a feeder source state.
    """
    states = list(states)
    if not states:
        raise ValueError("merge_states needs the state of every rank, got none")
    first = states[0]
    for i, s in enumerate(states):
        if not isinstance(s, Mapping) or s.get("format") != STATE_FORMAT:
            raise ValueError(f"merge_states: state #{i} is not a state from coord.state_dict(name) "
                             f"(format {STATE_FORMAT!r})")
        if i:
            try:
                check_state(s, first.get("definition") or {})
            except ValueError as e:
                raise ValueError(f"merge_states: state #{i} is of another source definition than state #0: "
                                 f"{str(e).split('; ', 1)[-1]}") from None
    records = [shard_of(s) for s in states]
    if any(r is None for r in records):
        if not all(r is None for r in records):
            raise ValueError("merge_states: some states are of sharded runs and some are not")
        merged_rec = None
    else:
        worlds = sorted({r["world"] for r in records if r is not None})
        if len(worlds) > 1:
            raise ValueError(f"merge_states: the states are of different world sizes {worlds}: merge the states "
                             f"of one run (every rank's last checkpoint)")
        world = worlds[0]
        ranks = [k for r in records if r is not None for k in r["ranks"]]
        twice = sorted({k for k in ranks if ranks.count(k) > 1})
        missing = sorted(set(range(world)) - set(ranks))
        if twice:
            raise ValueError(f"merge_states: rank(s) {twice} given twice (the states of two runs?)")
        if missing:
            raise ValueError(f"merge_states: the state of rank(s) {missing} of {world} is missing: without it the "
                             f"rows those ranks delivered would be delivered again")
        merged_rec = {"world": world, "ranks": list(range(world))}
    ranges, _ = merge_ranges(np.concatenate([ranges_of(s) for s in states]))
    # Rows a filter dropped (map/filter sources): their keys are in the ranges too. Each rank's
    # count includes those of the basis it started from (a merged state every rank resumed from):
    # those are counted once.
    basis = [int((r or {}).get("basis_filtered", 0) or 0) for r in records]
    filtered = max(basis, default=0) + sum(int(s.get("rows_filtered", 0) or 0) - b for s, b in zip(states, basis))
    out: Dict[str, Any] = {
        "format": STATE_FORMAT,
        "source": first.get("source"),
        "definition": first.get("definition") or {},
        "rows_delivered": int((ranges[:, 1] - ranges[:, 0]).sum()) - filtered,
        "delivered": [[int(a), int(b)] for a, b in ranges],
    }
    if filtered:
        out["rows_filtered"] = filtered
    varies: Dict[str, Set[int]] = {}
    for s in states:  # every rank's rounding history: the merged run rounds where any of them did
        for name, axes in pad_varies_of(s).items():
            varies.setdefault(name, set()).update(axes)
    if varies:
        out["pad_varies"] = {k: sorted(v) for k, v in varies.items()}
    if merged_rec is not None:
        out["shard"] = merged_rec
    return out


# ---- one rank's sequence of pieces ----------------------------------------------------------------
class RankPlan:
    """How one rank cuts its pieces out of each epoch (see the module docstring).

    The source's plan offers each epoch's rows less the basis (the rows a complete state says
    were delivered); the rank's share is cut from those. ``own``: the delivered key ranges of this
    rank's own state (a resume on the same world size), taken out of the share; else None.
    """

    def __init__(self, rank: int, world: int, equal_steps: bool, own: Optional[np.ndarray] = None):
        self.rank, self.world, self.equal_steps = rank, world, equal_steps
        self.own = own

    def pieces(self, epoch: int, rows: int, units: np.ndarray, counts: np.ndarray,
               positions: Sequence[Optional[np.ndarray]], offsets: np.ndarray) -> List[Piece]:
        """This rank's pieces of ``epoch``: ``units`` in the epoch's order, each offering ``counts``
        rows at ``positions`` (None: all); ``rows`` per epoch and the units' first rows
        ``offsets`` make the keys (``epoch * rows + offsets[unit] + position``)."""
        lo, hi = share(int(counts.sum()), self.rank, self.world, self.equal_steps)
        got = cut(units, counts, positions, lo, hi)
        own = self.own
        if own is None or not len(own):
            return got
        base = epoch * rows
        out: List[Piece] = []
        for unit, pos in got:
            first = base + int(offsets[unit])
            if pos is None:
                n = int(offsets[unit + 1] - offsets[unit])
                if not _touches(own, first, first + n):
                    out.append((unit, None))
                    continue
                pos = np.arange(n, dtype=np.int64)
            elif not len(pos) or not _touches(own, first + int(pos.min()), first + int(pos.max()) + 1):
                if len(pos):
                    out.append((unit, pos))
                continue
            left = pos[undelivered(first + pos, own)]
            if len(left):
                out.append((unit, left))
        return out


def _touches(ranges: np.ndarray, lo: int, hi: int) -> bool:
    """Some range of ``ranges`` (sorted, disjoint) overlaps ``[lo, hi)``."""
    i = int(np.searchsorted(ranges[:, 1], lo, side="right"))
    return i < len(ranges) and int(ranges[i, 0]) < hi


class PieceWalk:
    """Index -> piece over one rank's sequence of pieces, walking the epochs as indices grow.

    A rank's pieces per epoch vary (its stretch of rows starts and ends inside units that the
    epoch's shuffle places anywhere), so the piece at an index is found by walking the epochs in
    order, not by arithmetic. Workers take indices in nearly increasing order (a counter shared by
    all, or a round-robin), so the walk keeps only the last epochs it made (``KEEP_PIECES``
    pieces); an index older than those starts the walk again (correct, just slower). ``epochs``
    makes a fresh iterator of ``(epoch, pieces)`` in sequence order. Thread-safe."""

    KEEP_PIECES = 4096

    def __init__(self, epochs: Callable[[], Iterator[Tuple[int, List[Piece]]]]):
        self._make = epochs
        self._lock = threading.Lock()
        self._restart()

    def _restart(self) -> None:
        self._it = self._make()
        self._starts: List[int] = []
        self._entries: List[Tuple[int, List[Piece]]] = []
        self._end = 0  # the index after the last piece made
        self._done = False

    def locate(self, index: int) -> Optional[Tuple[int, int, Optional[np.ndarray]]]:
        """(unit, epoch, positions or None) at ``index`` of this rank's sequence; None past its end."""
        with self._lock:
            if (self._starts and index < self._starts[0]) or (not self._starts and index < self._end):
                self._restart()
            while index >= self._end and not self._done:
                try:
                    epoch, pieces = next(self._it)
                except StopIteration:
                    self._done = True
                    break
                if not pieces:
                    continue
                self._starts.append(self._end)
                self._entries.append((epoch, pieces))
                self._end += len(pieces)
                while len(self._starts) > 1 and self._end - self._starts[1] >= self.KEEP_PIECES:
                    del self._starts[0], self._entries[0]
            if index >= self._end:
                return None
            i = bisect.bisect_right(self._starts, index) - 1
            epoch, pieces = self._entries[i]
            unit, positions = pieces[index - self._starts[i]]
            return unit, epoch, positions
