"""Resuming ordered shuffle windows exactly: each worker's window replayed from the run's start.

With ``ordered=True`` a feed takes one chunk per worker in a round-robin, so the row stream is
fixed by what each worker's calls return. With a shuffle window those calls are draws from the
worker's own window, and what a draw holds depends on every unit the worker read and every draw
it made before. A resumed run that started with empty windows delivered each row once, but not the
batches the uninterrupted run would have delivered (the contract's "exactly the batches").

A window's draws depend only on the row counts of the units it reads and on its generator, never
on the rows' values. So the windows can be replayed from the run's start with each row's index
and key alone (what an ArraySource's window holds anyway), turn by turn in the feed's
round-robin, until the first turn not wholly delivered according to the state: every worker's
window is then where it was when the uninterrupted run made that turn's chunk. The replay checks
that what the state lists is exactly the rows of the turns before that one, plus the head of that
turn's draw (a checkpoint falls between batches, and a batch may end inside a chunk); anything
else (a state of an unordered run, of another worker count, or of a source with a filter,
whose dropped rows are recorded as they are fetched, ahead of the stream) and the source resumes
as before: every row not delivered, once, windows empty. A sharded rank's stream is the one its
share was cut from when the stream began (from the basis of an elastic resume, if any): its own
state, less that basis, is what it replays against.

What each worker does first in the resumed run (:class:`WorkerStart`): the undelivered rest of
the turn the checkpoint cut, or that turn's whole draw; ``SKIP`` if its turn in the round the
checkpoint fell in was already taken (the resumed feed's round-robin starts at the first worker);
then its own draws, its window refilled from the sequence index where the replay left it.

Pure logic (numpy, no threads): the source supplies its units (:data:`NextUnit`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from .sharding import undelivered
from .window import ShuffleWindow

# The unit at a sequence index of the run's (unresumed) sequence: (row indices in the table, in the
# order the window takes them, their keys), or None past the sequence's end.
NextUnit = Callable[[int], Optional[Tuple[np.ndarray, np.ndarray]]]


@dataclass
class WorkerStart:
    """Where one worker's window stands when the resumed run begins."""

    window: ShuffleWindow
    cursor: int                         # the sequence index of the next unit it reads
    first: Optional[List[np.ndarray]]   # (row indices, keys) of the draw of the turn the checkpoint cut ...
    head: int                           # ... of which it returns the rows after this many first
    skip: bool                          # its turn in the checkpoint's round was taken: return SKIP first


def replay(workers: Sequence[int], capacity: int, rng_of: Callable[[int], np.random.Generator],
           next_unit: NextUnit, largest_unit: int, ranges: np.ndarray, before: int = 0
           ) -> Optional[Dict[int, WorkerStart]]:
    """Each worker's start for a run resuming from ``ranges`` (the state's rows, merged), or None
    when the state is not a prefix of the ordered stream these windows make (see the module
    docstring). ``workers``: the feed's worker ids (the round-robin goes in sorted order, worker
    ``workers[i]`` reading sequence indices ``i, i + len(workers), ...``); ``capacity``: each
    worker's window, in rows; ``largest_unit``: the draw when a call read no unit (rows);
    ``before``: rows of ``ranges`` delivered before this stream began (a sharded rank's basis)."""
    order = sorted(workers)
    count = len(workers)
    cursor = {w: i for i, w in enumerate(workers)}
    windows = {w: ShuffleWindow(capacity, rng_of(w)) for w in workers}
    left = (int((ranges[:, 1] - ranges[:, 0]).sum()) if len(ranges) else 0) - before
    ended: Set[int] = set()
    pos = 0
    while len(ended) < count:
        w = order[pos % count]
        if w in ended:
            pos += 1
            continue
        drawn = _draw(windows[w], cursor, w, count, next_unit, largest_unit)
        if drawn is None:
            ended.add(w)
            pos += 1
            continue
        done = ~undelivered(drawn[1], ranges)
        head = int(done.sum())
        if head == len(done):  # a turn delivered whole: on to the next
            left -= head
            pos += 1
            continue
        if left != head or not done[:head].all():
            return None  # rows delivered beyond this turn, or not as the head of its draw
        at = pos % count
        return {v: WorkerStart(windows[v], cursor[v], drawn if v == w else None, head,
                               v not in ended and order.index(v) < at) for v in workers}
    if left:
        return None
    return {v: WorkerStart(windows[v], cursor[v], None, 0, False) for v in workers}


def _draw(window: ShuffleWindow, cursor: Dict[int, int], w: int, step: int, next_unit: NextUnit,
          largest_unit: int) -> Optional[List[np.ndarray]]:
    """One call of worker ``w`` (the source's ``_from_window``, rows as indices): its draw, or None
    where the call raises StopIteration."""

    def next_piece() -> Optional[List[np.ndarray]]:
        got = next_unit(cursor[w])
        cursor[w] += step
        return None if got is None else [got[0], got[1]]

    return window.draw(next_piece, largest_unit)
