"""Rows from ``feeder.predict``'s replica threads into Parquet part files, committed one by one.

Replicas call :meth:`PartWriter.add` with a batch's columns (model outputs and kept inputs) and
row keys, straight after running it: the rows are copied, under a lock, into the row-group buffer
being filled (one copy per byte; the replica's output buffers are then free for its next run).
A full buffer goes to the writer thread, which turns it into Arrow arrays without a copy (numeric
columns; an n-d column becomes nested fixed-size lists), appends it as one row group to the part
file being written, and hands the buffer back. When a part has ``rows_per_file`` rows (or the data
ended), the writer closes it and commits it (:class:`~feeder.scoring.outputdir.OutputDir`: fsync, rename,
fsync the directory; in a store, :class:`~feeder.scoring.storeout.StoreOutput`: its upload under a
unique name completes), then calls ``on_commit`` with the part and the row keys it holds, which
records the new state. So a part's keys reach the state only once the part is durable.

A few buffers rotate (``BUFFERS``): replicas fill one while the writer encodes another, and a
replica waits (in short slices, watching for a failure) only when the writer falls behind.
Parquet encoding runs in pyarrow's C++ code, which releases the GIL.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import FeederError
from .outputdir import OutputDir
from .storeout import StoreOutput

Output = Union[OutputDir, StoreOutput]

log = logging.getLogger("feeder")

ROW_GROUP_ROWS = 65_536      # rows per Parquet row group at most (what readers handle well)
ROW_GROUP_BYTES = 32 << 20   # and at most this many bytes of a row group's columns in memory
BUFFERS = 3                  # row-group buffers in rotation: one filling, one encoding, one spare
SLICE_S = 0.05               # longest single wait, so that a failure or an abort is seen promptly


@dataclass(frozen=True)
class CommittedPart:
    """A part file made durable and visible under its final name."""

    name: str
    rows: int
    nbytes: int


# on_commit(part or None, its row keys or None, final): record the state; runs in the writer thread.
OnCommit = Callable[[Optional[CommittedPart], Optional[np.ndarray], bool], None]


@dataclass(frozen=True)
class _Layout:
    """One output column as learned from the first batch: numeric rows go into a preallocated
    buffer; strings and other objects are kept as copied pieces and concatenated per row group."""

    name: str
    dtype: np.dtype
    row_shape: Tuple[int, ...]
    pieces: bool


class _RowGroup:
    __slots__ = ("arrays", "pieces", "keys", "fill", "capacity", "part", "last_of_part")

    def __init__(self, layouts: Sequence[_Layout], rows: int, keyed: bool):
        self.arrays: List[Optional[np.ndarray]] = [
            None if lay.pieces else np.empty((rows,) + lay.row_shape, lay.dtype) for lay in layouts]
        self.pieces: List[List[np.ndarray]] = [[] for _ in layouts]
        self.keys: Optional[np.ndarray] = np.empty(rows, np.int64) if keyed else None
        self.fill = 0
        self.capacity = rows
        self.part = 0
        self.last_of_part = False


_FINISH = object()


class PartWriter:
    """Buffers rows from any number of threads and writes them as committed Parquet parts.

    ``names``: the column names, in the order ``add`` gets the columns. ``first_part``: the index
    of the first part file this writer creates. ``durable``: follow the commit protocol (fsyncs);
    False only for benchmarks measuring its cost. ``keyed``: ``add`` gets row keys.
    """

    def __init__(self, out: Output, names: Sequence[str], *, rows_per_file: int, first_part: int,
                 on_commit: OnCommit, keyed: bool, durable: bool = True, thread_name: str = "feeder:predict:writer"):
        from ..sources.parquet import import_pyarrow  # the caller checked that it is installed

        self._pa = import_pyarrow()
        self.out = out
        self.names = list(names)
        self.rows_per_file = int(rows_per_file)
        self.on_commit = on_commit
        self.keyed = keyed
        self.durable = durable
        self._cond = threading.Condition()
        self._layouts: Optional[List[_Layout]] = None
        self._group_rows = 0
        self._free: List[_RowGroup] = []
        self._allocated = 0
        self._full: Deque[Any] = deque()
        self._current: Optional[_RowGroup] = None
        self._part_index = first_part   # the part the next buffer belongs to
        self._part_left = self.rows_per_file
        self._failure: Optional[BaseException] = None
        self._aborted = False
        self.rows_added = 0        # rows handed to add() (computed)
        self._next_seq = 0         # ordered adds: the place of the batch whose turn it is
        self.rows_committed = 0    # rows in parts this writer committed
        # writer thread only:
        self._writer: Any = None
        self._open_part: Optional[int] = None
        self._part_rows = 0
        self._part_keys: List[np.ndarray] = []
        self._schema: Any = None
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self._thread.start()

    # ---- the replicas' side -------------------------------------------------------------------
    @property
    def failure(self) -> Optional[BaseException]:
        return self._failure

    def add(self, columns: Sequence[np.ndarray], keys: Optional[np.ndarray], seq: Optional[int] = None) -> None:
        """Copy one batch's rows (``columns`` in ``names`` order, all with the same row count) and
        their keys into the buffers; returns once the caller's arrays are no longer needed.
        ``seq``: the batch's place in the sequence (0, 1, ...): it waits for the batches before it,
        so that rows are written in sequence whichever thread runs which batch."""
        n = int(columns[0].shape[0]) if columns else 0
        with self._cond:
            if seq is not None:
                while self._next_seq != seq:
                    self._raise_if_failed()
                    self._cond.wait(SLICE_S)
            if self._layouts is None:
                self._learn(columns)
            layouts = self._layouts
            assert layouts is not None
            self._check(layouts, columns, n, keys)
            pos = 0
            while pos < n:
                rg = self._current if self._current is not None else self._take_buffer()
                k = min(n - pos, rg.capacity - rg.fill)
                lo, hi = rg.fill, rg.fill + k
                for i, col in enumerate(columns):
                    buf = rg.arrays[i]
                    if buf is None:
                        rg.pieces[i].append(np.array(col[pos:pos + k], copy=True))
                    else:
                        buf[lo:hi] = col[pos:pos + k]
                if rg.keys is not None and keys is not None:
                    rg.keys[lo:hi] = keys[pos:pos + k]
                rg.fill = hi
                pos += k
                if rg.fill == rg.capacity:
                    self._full.append(rg)
                    self._current = None
                    self._cond.notify_all()
            self.rows_added += n
            if seq is not None:
                self._next_seq = seq + 1
                self._cond.notify_all()

    def _learn(self, columns: Sequence[np.ndarray]) -> None:
        if len(columns) != len(self.names):
            raise FeederError(f"feeder.predict: {len(columns)} columns for {self.names}")
        layouts = []
        row_bytes = 8 if self.keyed else 0
        for name, col in zip(self.names, columns):
            a = np.asarray(col)
            if a.ndim < 1:
                raise FeederError(f"feeder.predict: column {name!r} is a scalar per batch, not one value per row")
            pieces = a.dtype.kind in "OUSV"
            layouts.append(_Layout(name, a.dtype, tuple(int(d) for d in a.shape[1:]), pieces))
            row_bytes += a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
        self._layouts = layouts
        self._group_rows = max(1, min(ROW_GROUP_ROWS, ROW_GROUP_BYTES // max(1, row_bytes), self.rows_per_file))

    def _check(self, layouts: Sequence[_Layout], columns: Sequence[np.ndarray], n: int,
               keys: Optional[np.ndarray]) -> None:
        if len(columns) != len(layouts):
            raise FeederError(f"feeder.predict: {len(columns)} columns for {self.names}")
        for lay, col in zip(layouts, columns):
            if col.shape[0] != n:
                raise FeederError(f"feeder.predict: column {lay.name!r} has {col.shape[0]} rows in a batch of {n}")
            if lay.pieces:
                continue
            if col.dtype != lay.dtype or tuple(col.shape[1:]) != lay.row_shape:
                raise FeederError(f"feeder.predict: column {lay.name!r} has rows of dtype {col.dtype} and shape "
                                  f"{tuple(col.shape[1:])} in this batch, but {lay.dtype} and {lay.row_shape} before; "
                                  f"a Parquet column holds one row type (is the output's shape data-dependent?)")
        if self.keyed and (keys is None or len(keys) != n):
            raise FeederError(f"feeder.predict: a batch of {n} rows came with "
                              f"{'no' if keys is None else len(keys)} row keys")

    def _take_buffer(self) -> _RowGroup:
        """The buffer being filled: a free one set up for the next rows of the current part, or the
        one another replica set up while this one waited (called under the lock)."""
        while True:
            self._raise_if_failed()
            if self._current is not None:  # the wait below releases the lock: another add() got there first
                return self._current
            if self._free:
                rg = self._free.pop()
                break
            if self._allocated < BUFFERS:
                assert self._layouts is not None
                rg = _RowGroup(self._layouts, self._group_rows, self.keyed)
                self._allocated += 1
                break
            self._cond.wait(SLICE_S)  # the writer is behind: wait for it to hand a buffer back
        cap = min(self._group_rows, self._part_left)
        rg.fill, rg.capacity, rg.part = 0, cap, self._part_index
        rg.last_of_part = cap == self._part_left
        self._part_left -= cap
        if self._part_left == 0:
            self._part_index += 1
            self._part_left = self.rows_per_file
        self._current = rg
        return rg

    def _raise_if_failed(self) -> None:
        failure = self._failure
        if isinstance(failure, FeederError):  # feeder's own words already (another call took the output over)
            raise type(failure)(*failure.args) from failure.__cause__
        if failure is not None:
            raise FeederError(f"feeder.predict: writing the output in {self.out.path!r} failed: "
                              f"{type(failure).__name__}: {failure}") from failure
        if self._aborted:
            raise FeederError("feeder.predict: the writer was stopped")

    # ---- the caller's side ----------------------------------------------------------------------
    def finish(self) -> None:
        """Write what is buffered, commit the last part (``on_commit(..., final=True)``) and end the
        writer thread. Call once every ``add`` has returned. Raises the writer's failure."""
        with self._cond:
            self._raise_if_failed()
            rg, self._current = self._current, None
            if rg is not None and rg.fill:
                rg.last_of_part = False  # closed by the finish below, together with the final state
                self._full.append(rg)
            self._full.append(_FINISH)
            self._cond.notify_all()
        while self._thread.is_alive():
            self._thread.join(SLICE_S)  # in slices: Ctrl-C still interrupts a long final commit
        with self._cond:
            self._raise_if_failed()

    def abort(self, timeout: float = 5.0) -> bool:
        """Stop without committing what is not committed (its temporary file is deleted); the
        output stays as the last commit left it. True if the writer thread ended in time."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- the writer thread ------------------------------------------------------------------------
    def _next(self) -> Any:
        with self._cond:
            while not self._full:
                if self._aborted:
                    return None
                self._cond.wait(SLICE_S)
            if self._aborted:
                return None
            return self._full.popleft()

    def _loop(self) -> None:
        try:
            while True:
                item = self._next()
                if item is None:
                    return
                if item is _FINISH:
                    self._close_part(final=True)
                    return
                self._write(item)
        except BaseException as e:  # re-raised by add() / finish() in the threads that can act on it
            log.debug("feeder.predict: the writer failed", exc_info=True)
            with self._cond:
                self._failure = e
                self._cond.notify_all()
        finally:
            self._discard_open_part()

    def _write(self, rg: _RowGroup) -> None:
        pa = self._pa
        layouts = self._layouts
        assert layouts is not None
        arrays = [_to_arrow(pa, lay, rg.arrays[i], rg.pieces[i], rg.fill) for i, lay in enumerate(layouts)]
        table = pa.Table.from_arrays(arrays, names=self.names)
        if self._writer is None:
            if self._schema is None:
                self._schema = table.schema
            dictionary = [lay.name for lay in layouts if lay.pieces]  # ids and labels compress; floats do not
            self._open_part = rg.part
            where, filesystem = self.out.part_target(rg.part)
            self._writer = pa.parquet.ParquetWriter(where, self._schema, filesystem=filesystem,
                                                    compression="snappy", use_dictionary=dictionary)
            self._part_rows, self._part_keys = 0, []
        self._writer.write_table(table, row_group_size=max(1, rg.fill))
        del arrays, table  # views of the buffer: gone before the buffer is handed back
        self._part_rows += rg.fill
        if rg.keys is not None:
            self._part_keys.append(rg.keys[:rg.fill].copy())
        last = rg.last_of_part
        with self._cond:
            rg.pieces = [[] for _ in layouts]
            rg.fill = 0
            self._free.append(rg)
            self._cond.notify_all()
        if last:
            self._close_part(final=False)

    def _close_part(self, final: bool) -> None:
        if self._writer is None:
            if final:
                self.on_commit(None, None, True)
            return
        index, rows = self._open_part, self._part_rows
        assert index is not None
        self._writer.close()
        self._writer = None
        nbytes = self.out.publish_part(index, durable=self.durable)
        self._open_part = None
        keys = np.concatenate(self._part_keys) if self._part_keys else (np.zeros(0, np.int64) if self.keyed else None)
        self._part_keys = []
        self.on_commit(CommittedPart(self.out.part_name(index), rows, nbytes), keys, final)
        self.rows_committed += rows

    def _discard_open_part(self) -> None:
        """After a failure or an abort: close and delete the part being written (never committed)."""
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:
                pass
            self._writer = None
        if self._open_part is not None:
            try:
                self.out.discard_part(self._open_part)
            except Exception:  # an object store that failed: the next call's recovery deletes it
                log.warning("feeder.predict: the part being written could not be deleted", exc_info=True)
            self._open_part = None


def _to_arrow(pa: Any, lay: _Layout, buf: Optional[np.ndarray], pieces: List[np.ndarray], rows: int) -> Any:
    """The first ``rows`` rows of a column as an Arrow array: numeric values without a copy, n-d rows
    as (nested) fixed-size lists."""
    if buf is not None:
        values = buf[:rows]
    elif pieces:
        values = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    else:
        values = np.empty((0,) + lay.row_shape, lay.dtype)
    arr = pa.array(values.reshape(-1))
    for size in reversed(lay.row_shape):
        arr = pa.FixedSizeListArray.from_arrays(arr, size)
    return arr
