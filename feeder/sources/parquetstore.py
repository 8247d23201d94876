"""Reading the row groups of objects in a store: shared handles, version checks, retries, readahead.

The second part of :class:`~feeder.sources.parquet.ParquetSource` (see
:mod:`feeder.sources.parquetfiles`). An object's row groups are read through one handle per
object and process, shared by the workers (no second request for its size or footer), each read
confirmed to be of the version the source was created from, with transient failures retried
(:func:`feeder.storage.retrying`); to hide each request's latency, the next units of the sequence
are taken and read ahead on a small pool of threads (:mod:`feeder.sources.readahead`), adjacent
row groups of one object in one request.
"""
from __future__ import annotations

import errno
import logging
import re
import threading
from collections import deque
from typing import Any, Deque, List, Optional, Sequence, Tuple

from ..errors import InputValidationError
from ..storage import is_io_failure, is_transient, retrying
from .arrow import import_pyarrow
from .parquetfiles import ParquetFiles, _read_error, _read_footer
from .readahead import Readahead

log = logging.getLogger("feeder")

READAHEAD_THREADS = 16     # units read ahead (READAHEAD_UNITS) by at most this many threads per source
COALESCE_BYTES = 8 << 20   # adjacent row groups of one object read in one request up to this many bytes on disk
OPEN_HANDLES = 64          # objects kept open per source (and process), least recently used closed first
PRE_BUFFER = True          # a row group's column chunks fetched in few coalesced, concurrent requests


class ParquetStoreReads(ParquetFiles):
    """Reading a :class:`~feeder.sources.parquet.ParquetSource`'s objects in a store, and reading
    them ahead (see the module docstring)."""

    def _release_io(self) -> None:
        with self._io_lock:
            self._active = False  # a fetch still under way after stop() reads without a pool
            pool, self._pool = self._pool, None
            handles = [entry[0] for entry in self._open.values()]
            self._open.clear()
            self._ahead, self._ended = {}, set()
        self._stop.set()  # a retry waiting out its backoff gives up
        if pool is not None and not pool.close():
            log.warning("ParquetSource: readahead threads of %r did not end within %.0f s", pool.name, 2.0)
        for h in handles:
            try:
                h.close()
            except Exception:
                pass

    # ---- reading objects through handles shared by the workers ----
    def _read_remote(self, units: Sequence[int], worker_id: int) -> List[Any]:
        """Row groups of one object (adjacent ones, fetched in one request), each as its own table
        (or a ``_Failed`` holding what reading it raised), read through the object's shared handle
        with transient failures retried. When a read of several fails, each is read on its own, so
        that a damaged row group fails only itself."""
        index = self._unit_at[units[0]][0]
        rgs = [self._unit_at[u][1] for u in units]
        assert self.columns is not None  # set at registration
        cols = self._flat(self.columns)
        pa = import_pyarrow()
        shown = self.files[index][0]
        where = f"Parquet file {shown!r}, row group{'s' if len(rgs) > 1 else ''} {', '.join(map(str, rgs))}"

        def once() -> Any:
            handle, footer, pinned = self._acquire(index, worker_id)
            try:
                table = pa.parquet.ParquetFile(handle, metadata=footer, pre_buffer=PRE_BUFFER).read_row_groups(
                    rgs, columns=cols)
            except Exception as e:
                if is_transient(e) or _expired(e):
                    # the retry opens the object again, checking its size and version: one deleted
                    # or replaced under this handle is then named, never read through it again
                    self._forget(index, handle)
                if _expired(e):  # s3fs: the object's ETag no longer matches (its If-Match failed)
                    raise InputValidationError(self._changed(index, worker_id) or
                                               f"Parquet file {shown!r} changed while it was read ({e})") from e
                raise
            finally:
                self._unuse(index)
            if not pinned:
                # The handle's GETs carry no If-Match: the object must still be the version the
                # handle opened once they are answered, or the bytes may be another object's
                # (replaced by one of the same size). One HEAD begun after the read, shared by
                # every read of the object that ended meanwhile.
                self._confirm(index, worker_id, handle)
            return table
        try:
            table = self._io(once, f"reading {where}", worker_id, shown)
        except Exception as e:
            if len(units) > 1:
                return [self._read_remote([u], worker_id)[0] for u in units]
            if isinstance(e, (InputValidationError, _CheckFailed)) or not isinstance(e, (pa.ArrowException, OSError)):
                return [_Failed(e)]
            if not is_transient(e) and is_io_failure(e):
                # A failure no retry mends (the object is gone, or denied now): the object changed
                # (bad data, never skipped) when it is no longer what the source was created from.
                changed = self._changed(index, worker_id)
                if changed is not None:
                    gone = InputValidationError(changed)
                    gone.__cause__ = e
                    return [_Failed(gone)]
            failed = _read_error(e, where)
            failed.__cause__ = e
            return [_Failed(failed)]
        out, at = [], 0
        for u in units:
            n = int(self._units[u])
            out.append(table.slice(at, n) if len(units) > 1 else table)
            at += n
        return out

    def _acquire(self, index: int, worker: Optional[int]) -> Tuple[Any, Any, bool]:
        """(the object's open handle, its footer, whether the store checks its version at each
        read), opened once per process by one thread while the others wait (on S3 a HEAD request,
        whose size and ETag must be what they were: InputValidationError if not)."""
        while True:
            with self._io_lock:
                entry = self._open.get(index)
                if entry is not None:
                    entry[1] += 1
                    self._open.move_to_end(index)
                    return entry[0], self._footers[index], entry[2]
                opening = self._opening.get(index)
                if opening is None:
                    opening = self._opening[index] = threading.Event()
                    break
            opening.wait(1.0)  # another thread opens it (a request): use its handle, or try again
        try:
            handle, footer, pinned = self._open_object(index, worker)
        finally:
            with self._io_lock:
                del self._opening[index]
            opening.set()
        idle = []
        with self._io_lock:
            self._footers[index] = footer
            self._open[index] = [handle, 1, pinned]
            while len(self._open) > OPEN_HANDLES:
                oldest = next((i for i, (_, users, _) in self._open.items() if users == 0), None)
                if oldest is None:
                    break
                idle.append(self._open.pop(oldest)[0])
        for h in idle:
            h.close()
        return handle, footer, pinned

    def _open_object(self, index: int, worker: Optional[int]) -> Tuple[Any, Any, bool]:
        """(an open handle, the footer, whether reads through the handle are checked against its
        version by the store) of object ``index``, whose size and version must be what they were
        (InputValidationError naming how it changed, or that it is gone). A transient failure is
        raised as it came (the read that opens it retries)."""
        store, path, shown = self._stores[index], self._paths[index], self.files[index][0]
        try:
            opened = store.open_versioned(path)  # type: ignore[attr-defined]
        except (FileNotFoundError, PermissionError, IsADirectoryError) as e:  # gone or denied: as a local stat says
            raise InputValidationError(f"Parquet file {shown!r} cannot be read any more ({type(e).__name__}: "
                                       f"{e})") from e
        handle = opened.handle
        try:
            now = (opened.size, opened.version)
            if now != self._stamps[index]:
                changed = self._how_changed(index, now, worker)
                if changed is not None:
                    raise InputValidationError(changed)
            footer = self._footers[index]
            if footer is None:  # in a worker process: footers are not pickled
                footer = _read_footer(import_pyarrow(), handle, shown)
        except BaseException:
            handle.close()
            raise
        return handle, footer, opened.pinned

    def _confirm(self, index: int, worker: Optional[int], handle: Any) -> None:
        """InputValidationError when object ``index`` is no longer the version the source was
        created from, checked by a request begun after this call (the read before it was then of
        that version); a transient failure of the check (after its retries) is an OSError. Reads
        of one object that end together share one check (:class:`~feeder.storage.SharedCheck`)."""
        store, path, shown = self._stores[index], self._paths[index], self.files[index][0]

        def check() -> Tuple[str, Any]:
            try:
                now = retrying(lambda: store.stat(path), f"checking {shown!r}", self._retry,  # type: ignore
                               stop=self._stop, counts=self._counts, worker=worker)
            except Exception as e:
                if is_transient(e):
                    return "failed", e
                return "changed", f"Parquet file {shown!r} cannot be read any more ({type(e).__name__}: {e})"
            changed = self._how_changed(index, now, worker) if now != self._stamps[index] else None
            return ("changed", changed) if changed is not None else ("same", None)

        outcome, detail = self._checks.check(index, check)
        if outcome == "changed":
            self._forget(index, handle)
            raise InputValidationError(detail)
        if outcome == "failed":
            raise _CheckFailed(f"checking that {shown!r} did not change while it was read failed (after "
                               f"{self._retry.attempts} retries): {type(detail).__name__}: {detail}") from detail

    def _forget(self, index: int, handle: Any) -> None:
        """Stop sharing ``handle`` (its users finish with it; it closes when they let go)."""
        with self._io_lock:
            entry = self._open.get(index)
            if entry is not None and entry[0] is handle:
                del self._open[index]

    def _unuse(self, index: int) -> None:
        with self._io_lock:
            entry = self._open.get(index)
            if entry is not None:
                entry[1] -= 1

    # ---- reading ahead (objects in a store) ----
    def _take(self, worker_id: int) -> int:
        """The sequence index this call reads, as :meth:`ShardedSource._take`; reading from a store
        with ``readahead``, the next units of the sequence are taken too and read ahead (per worker
        when ordered, since each worker's units are its own; otherwise shared by the process's
        fetchers), so that their requests are in flight while this call hands its unit on."""
        if not self._readahead or not self.remote:
            return super()._take(worker_id)
        binding = self._binding
        key = worker_id if binding is not None and binding.ordered else -1
        with self._io_lock:
            pool = self._pool
            if pool is None:
                if not self._active:  # released (stopped): no pool that nobody would close
                    return super()._take(worker_id)
                pool = self._pool = self._start_pool(binding.source_name if binding is not None else "parquet")
            queue = self._ahead.setdefault(key, deque())
            if not queue:
                queue.append(self._claim(worker_id, key))
            entry = queue.popleft()
            self._top_up(pool, queue, worker_id, key)
        return int(entry[0])

    def _start_pool(self, name: str) -> Readahead:
        threads = min(self._readahead, READAHEAD_THREADS)
        pa = import_pyarrow()
        if pa.io_thread_count() < threads:
            # pre-buffered reads run on pyarrow's I/O pool (8 threads by default): as many as the
            # readahead's, or its requests would queue there (process-wide; never lowered)
            log.debug("ParquetSource: pyarrow's I/O thread pool raised from %d to %d threads", pa.io_thread_count(),
                      threads)
            pa.set_io_thread_count(threads)
        return Readahead(f"feeder:{name}:readahead", threads, self._readahead_bytes)

    def _claim(self, worker_id: int, key: int) -> List[Any]:
        index = super()._take(worker_id)
        where = self._locate(index)
        if where is None:
            self._ended.add(key)  # every later index is past the end too
        return [index, None if where is None else where[0], False]

    def _adjacent(self, unit: int, after: int) -> bool:
        f0, r0 = self._unit_at[after]
        f1, r1 = self._unit_at[unit]
        return f0 == f1 and r1 == r0 + 1

    def _top_up(self, pool: Readahead, queue: Deque[List[Any]], worker_id: int, key: int) -> None:
        """Once half of what was taken ahead is consumed, take units up to ``readahead`` ahead again
        (in batches, so that adjacent units are read together); then read ahead those not yet
        submitted: runs of adjacent row groups of one object in one request each (up to
        COALESCE_BYTES on disk and ``readahead_bytes`` decoded), as far as ``readahead_bytes``
        allows. Called under the I/O lock."""
        if len(queue) <= self._readahead // 2:  # in batches, so that adjacent units make one request
            while len(queue) < self._readahead and key not in self._ended:
                queue.append(self._claim(worker_id, key))
        decoded, disk = self._unit_bytes, self._unit_disk
        assert decoded is not None and disk is not None  # taken at registration with the columns
        runs: List[List[List[Any]]] = []
        run: List[List[Any]] = []
        run_disk = run_decoded = 0
        for entry in queue:
            unit = entry[1]
            if entry[2] or unit is None:
                if run:
                    runs.append(run)
                run = []
                continue
            if run and self._adjacent(unit, run[-1][1]) and run_disk + int(disk[unit]) <= COALESCE_BYTES \
                    and run_decoded + int(decoded[unit]) <= self._readahead_bytes:
                run.append(entry)
                run_disk += int(disk[unit])
                run_decoded += int(decoded[unit])
            else:
                if run:
                    runs.append(run)
                run, run_disk, run_decoded = [entry], int(disk[unit]), int(decoded[unit])
        if run:
            runs.append(run)
        for r in runs:
            units = [e[1] for e in r]
            sizes = [int(decoded[u]) for u in units]
            if not pool.room(sum(sizes)):
                break
            pool.submit(units, _ReadRun(self, units, worker_id), sizes)
            for e in r:
                e[2] = True


class _ReadRun:
    """A readahead job: adjacent row groups of one object, read for the worker that took them."""

    __slots__ = ("source", "units", "worker_id")

    def __init__(self, source: ParquetStoreReads, units: List[int], worker_id: int):
        self.source, self.units, self.worker_id = source, units, worker_id

    def __call__(self) -> List[Any]:
        return self.source._read_remote(self.units, self.worker_id)


class _CheckFailed(OSError):
    """The check that an object did not change while it was read failed, after its own retries:
    a fetch error (retried no more), never taken for a changed object."""

    feeder_transient = False


def _expired(e: BaseException) -> bool:
    """Whether a read failed because the object is no longer the version its handle opened: s3fs's
    ``FileExpired`` (an OSError EBUSY: its ``If-Match`` on the ETag failed), or a store's 412."""
    if type(e).__name__ == "FileExpired" or (isinstance(e, OSError) and e.errno == errno.EBUSY
                                             and "no longer exists" in str(e)):
        return True
    return bool(re.search(r"PreconditionFailed|PRECONDITION_FAILED|HTTP status 412", str(e)))


class _Failed:
    """What reading one unit ahead raised, re-raised by the fetch call that takes the unit."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error
