"""Feeding from Ray Data: one ``streaming_split`` shard per replica, pulled by the replica's fetchers.

Ray Data runs reads and ``map_batches`` across a cluster; feeder is the last mile on each host
(exact batch sizes, validation against the model, OrtValues prepared off the consumer's path,
timeouts with a diagnosis, the row ledger). So this source does no distribution of its own::

    ds = ray.data.read_parquet(...).map_batches(preprocess)
    source = RayDataSource(ds, columns={"x": "pixels"})
    for session in sessions:                      # replicas: one shard each
        feeder.init_data_input_workers(session, ["x"], source, batch_size=64, coordinator=coord)

How it works. ``feeder_bind`` (called by ``coord.start()`` before any fetcher runs) splits the
dataset with ``streaming_split(n, equal=False)``, n being the number of registrations of the
source, and starts one pump thread per shard. A pump iterates its shard's numpy batches and
hands them to the fetcher threads of its replica through a small bounded queue; a fetch call
takes one. Why a pump thread rather than fetchers calling ``next()`` under a lock: a call into
Ray can block for good (a lost node whose task cannot be retried), and only a wait we own can be
bounded. Every split must start iterating for the split coordinator's epoch barrier to pass,
which the pumps do at bind whatever the replicas' fetchers are doing.

Faults. An exception from Ray (a failed task: ``RayTaskError`` wrapping the user's exception;
an object lost with its node and not reconstructable) is raised by the replica's fetch calls, so
consumers get ``FetchError`` with it as ``__cause__``. A shard that has been waiting on Ray for
``stall_timeout`` seconds raises :class:`RayStallError` the same way: never a hang. Ray retries
tasks of a lost node where it can; then the stream simply continues.

``feeder_release`` (at ``stop()``) stops the pumps, closes their iterators and kills the split
coordinator actor it created, so a pump stuck in Ray returns and no thread is left behind. A later
``start()`` binds again: the dataset is executed again from its beginning.

Ray is imported only when a source is created; ``import feeder`` never imports it. Use fetcher
threads, not worker processes, with this source: Ray already runs the work in parallel, and the
fetch call only takes a ready batch.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..errors import InputValidationError
from ..workers import join_all
from .base import ROW_KEY, SourceBinding

log = logging.getLogger("feeder")

INSTALL_HINT = "pip install 'feeder[ray]' (or pip install 'ray[data]')"
SLICE_S = 0.05          # longest single wait of a fetch call or a pump, so stop and stalls are seen
PUMP_QUEUE = 2          # numpy batches a shard's pump holds ready ahead of its fetchers
RELEASE_WAIT_S = 0.5    # release() lets pumps finish a call into Ray this long before killing the split actor
RELEASE_JOIN_S = 2.0    # and waits this long for them afterwards


class RayStallError(TimeoutError):
    """A Ray Data shard produced no batch for ``stall_timeout`` seconds while feeder waited on it."""


def _import_ray_data() -> Any:
    try:
        import ray.data
    except ImportError as e:
        raise ImportError(f"RayDataSource needs Ray Data, which is not installed: {INSTALL_HINT}") from e
    return ray.data


class _Shard:
    """One ``streaming_split`` shard: its pump thread and the batches it has ready.

    The pump writes ``error``, ``ended`` and its counters; fetch calls and ``describe`` only
    read them (single writer, so no lock)."""

    def __init__(self, source_name: str, index: int, iterator: Any, columns: Sequence[Tuple[str, str]],
                 batch_size: Optional[int], prefetch_batches: int):
        self.source_name = source_name
        self.index = index
        self.iterator = iterator
        self.columns = list(columns)  # (input name, column name), in input order
        self.batch_size = batch_size
        self.prefetch_batches = prefetch_batches
        self.ready: "queue.Queue[List[np.ndarray]]" = queue.Queue(PUMP_QUEUE)
        self.stop = threading.Event()
        self.error: Optional[BaseException] = None
        self.ended = False
        self.waiting_since = 0.0  # monotonic time the pump began waiting on Ray; 0.0: not waiting
        self.started_at = time.monotonic()
        self.batches = 0
        self.rows = 0
        self.thread = threading.Thread(target=self._pump, name=f"feeder:{source_name}:ray-shard-{index}",
                                       daemon=True)

    # ---- the pump thread -------------------------------------------------------------------
    def _pump(self) -> None:
        it: Any = None
        try:
            it = iter(self.iterator.iter_batches(batch_size=self.batch_size, batch_format="numpy",
                                                 prefetch_batches=self.prefetch_batches))
            while not self.stop.is_set():
                self.waiting_since = time.monotonic()
                try:
                    batch = next(it)
                except StopIteration:
                    self.ended = True
                    return
                finally:
                    self.waiting_since = 0.0
                arrays = self._select(batch)
                rows = len(arrays[0]) if arrays else 0
                while not self.stop.is_set():
                    try:
                        self.ready.put(arrays, timeout=SLICE_S)
                    except queue.Full:
                        continue
                    self.batches += 1
                    self.rows += rows
                    break
        except BaseException as e:  # noqa: B902 - whatever Ray raises must reach the consumer
            if not self.stop.is_set():
                self.error = e
                log.debug("source %r: Ray Data shard %d failed", self.source_name, self.index, exc_info=True)
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                try:  # tells Ray's split coordinator this shard is done (early stop included)
                    close()
                except Exception:
                    log.debug("source %r: closing Ray Data shard %d", self.source_name, self.index, exc_info=True)

    def _select(self, batch: Mapping[str, Any]) -> List[np.ndarray]:
        out = []
        for name, column in self.columns:
            if column not in batch:
                # a ValueError too: the consumer sees the column named, as at registration
                raise InputValidationError(f"RayDataSource for source {self.source_name!r}: column {column!r} (input "
                                 f"{name!r}) is not in the dataset; its columns are {sorted(batch)}")
            out.append(np.asarray(batch[column]))
        return out

    # ---- fetch calls (fetcher threads) ---------------------------------------------------------
    def take(self, worker_id: int, stall_timeout: float) -> List[np.ndarray]:
        """The next batch of this shard; StopIteration at its end; Ray's error; RayStallError."""
        while True:
            try:
                return self.ready.get(timeout=SLICE_S)
            except queue.Empty:
                pass
            if self.error is not None:
                raise self.error
            if self.stop.is_set():
                # Only after stop() signalled the fetchers, which then ignore what a call raises.
                raise RuntimeError(f"source {self.source_name!r}: Ray Data shard {self.index} was released")
            if self.ended:  # set by the pump after its last put, so an empty buffer now stays empty
                if self.ready.empty():
                    raise StopIteration
                continue
            since = self.waiting_since
            if since and time.monotonic() - since > stall_timeout:
                raise RayStallError(
                    f"source {self.source_name!r}, worker {worker_id}: Ray Data shard {self.index} produced no batch "
                    f"for {time.monotonic() - since:.1f} s (stall_timeout={stall_timeout:g} s): Ray cannot make "
                    f"progress (a lost node whose tasks it cannot retry, or resources no node has); "
                    f"see ray status and the Ray Data logs")

    def describe(self, now: float) -> str:
        if self.error is not None:
            what = f"failed ({type(self.error).__name__})"
        elif self.ended:
            what = "ended"
        elif self.waiting_since:
            what = f"waiting on Ray for its next batch for {now - self.waiting_since:.1f} s"
        elif self.ready.full():
            what = "has batches ready, waiting for fetchers"
        else:
            what = "running"
        return f"Ray Data shard {self.index} {what} ({self.batches} batches, {self.rows} rows so far)"


class RayDataSource:
    """A fetch function reading a ``ray.data.Dataset``: one ``streaming_split`` shard per replica.

    ``dataset``: a ``ray.data.Dataset``, split with ``streaming_split(n, equal=False)`` at every
    ``start()``, n being the number of registrations (replicas) of the source; or a
    ``ray.data.DataIterator`` (a shard made elsewhere, e.g. one of a driver's
    ``streaming_split`` handed to this host), which all registrations then share.
    ``columns``: dict input name -> column name; None: the columns named as the inputs.
    ``batch_size``: rows per numpy batch taken from Ray (None: Ray's blocks as they come; feeder
    rebatches anyway). ``prefetch_batches``: Ray's own prefetch per shard. ``stall_timeout``:
    seconds a shard may wait on Ray for one batch before the source fails with
    :class:`RayStallError` (a ``FetchError`` to consumers).
    """

    # Ray already runs the pipeline in its own processes; a shard iterator lives in this process.
    feeder_threads_only = True

    def __init__(self, dataset: Any, columns: Optional[Mapping[str, str]] = None, *,
                 batch_size: Optional[int] = None, prefetch_batches: int = 1, stall_timeout: float = 300.0):
        rd = _import_ray_data()
        if not isinstance(dataset, (rd.Dataset, rd.DataIterator)):
            raise TypeError(f"RayDataSource needs a ray.data.Dataset or DataIterator, got {type(dataset).__name__}")
        if columns is not None:
            if not isinstance(columns, Mapping) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in columns.items()):
                raise TypeError("columns must be a dict of input name -> column name (strings), or None")
            columns = dict(columns)
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"batch_size must be None or an int >= 1, got {batch_size!r}")
        if isinstance(prefetch_batches, bool) or not isinstance(prefetch_batches, int) or prefetch_batches < 0:
            raise ValueError(f"prefetch_batches must be an int >= 0, got {prefetch_batches!r}")
        if isinstance(stall_timeout, bool) or not isinstance(stall_timeout, (int, float)) or not stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, got {stall_timeout!r}")
        self.dataset = dataset
        self.columns = columns
        self.batch_size = batch_size
        self.prefetch_batches = prefetch_batches
        self.stall_timeout = float(stall_timeout)
        self._lock = threading.Lock()
        self._shards: List[_Shard] = []
        self._by_worker: Dict[int, _Shard] = {}
        self._split_actors: List[Any] = []
        self._source_name = ""

    def __repr__(self) -> str:
        return f"RayDataSource({type(self.dataset).__name__}, columns={self.columns!r})"

    # Picklable as a definition: the shards of a run (threads, iterators) stay behind.
    def __getstate__(self) -> Dict[str, Any]:
        return {k: self.__dict__[k] for k in ("dataset", "columns", "batch_size", "prefetch_batches",
                                              "stall_timeout")}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._shards = []
        self._by_worker = {}
        self._split_actors = []
        self._source_name = ""

    # ---- the binding protocol ------------------------------------------------------------------
    def _pairs(self, input_names: Sequence[str]) -> List[Tuple[str, str]]:
        if self.columns is None:
            return [(name, name) for name in input_names]
        unknown = sorted(set(self.columns) - set(input_names))
        if unknown:
            raise ValueError(f"RayDataSource columns name inputs {unknown} that the source does not feed "
                             f"(its inputs are {list(input_names)})")
        missing = [name for name in input_names if name not in self.columns]
        if missing:
            raise ValueError(f"RayDataSource columns give no column for inputs {missing}")
        return [(name, self.columns[name]) for name in input_names]

    def _check_schema(self, pairs: Sequence[Tuple[str, str]]) -> None:
        """Missing columns are a ValueError at registration where the plan knows its schema without
        running. Otherwise (a ``map_batches`` may rename columns) the first batch checks and the
        consumer gets an InputValidationError (a ValueError) naming the column: learning the schema
        here would run the pipeline's first block, which waits forever when the cluster cannot
        place it (registration must never hang)."""
        rd = _import_ray_data()
        if not isinstance(self.dataset, rd.Dataset):
            return
        try:
            schema = self.dataset.schema(fetch_if_missing=False)
        except Exception:  # an exotic plan: the first batch checks instead
            log.debug("RayDataSource: schema not available cheaply", exc_info=True)
            return
        names = getattr(schema, "names", None)
        if not names:
            return
        for name, column in pairs:
            if column not in names:
                raise ValueError(f"RayDataSource: column {column!r} (input {name!r}) "
                                 f"is not in the dataset; its columns are {sorted(names)}")

    def feeder_validate(self, input_names: Sequence[str], resume: Optional[Mapping[str, Any]]) -> None:
        """At registration: columns for every input, present in the dataset where its schema is
        known without running it (otherwise the first batch checks), and no resume state."""
        if resume is not None:
            raise ValueError("RayDataSource cannot resume from a state: a Ray Data stream has no row keys "
                             "(run it again from the start, or checkpoint upstream of Ray)")
        self._check_schema(self._pairs([n for n in input_names if n != ROW_KEY]))

    def feeder_bind(self, binding: SourceBinding) -> None:
        """Split the dataset, one shard per replica, and start a pump per shard (see the module doc)."""
        if binding.resume is not None:
            raise ValueError(f"source {binding.source_name!r}: RayDataSource cannot resume from a state; Ray Data "
                             f"streams have no row keys (run it again from the start, or checkpoint upstream)")
        pairs = self._pairs([n for n in binding.input_names if n != ROW_KEY])
        self._check_schema(pairs)
        self.feeder_release()  # a bind after a start without stop: never two live splits
        rd = _import_ray_data()
        n = len(binding.replicas)
        if isinstance(self.dataset, rd.Dataset):
            iterators = self.dataset.streaming_split(n, equal=False)
            actor = getattr(iterators[0], "_coord_actor", None)  # private; only used to unblock release()
            actors = [actor] if actor is not None else []
        else:
            iterators, actors = [self.dataset], []
        shards = [_Shard(binding.source_name, i, it, pairs, self.batch_size, self.prefetch_batches)
                  for i, it in enumerate(iterators)]
        by_worker = {wid: shards[min(r, len(shards) - 1)] for r, wids in enumerate(binding.replicas) for wid in wids}
        with self._lock:
            self._shards, self._by_worker, self._split_actors = shards, by_worker, actors
            self._source_name = binding.source_name
        for s in shards:
            s.thread.start()
        log.debug("source %r: RayDataSource bound, %d shard(s) for %d replica(s)", binding.source_name,
                  len(shards), n)

    def feeder_release(self) -> None:
        """Stop the pumps, close their iterators, kill the split actor; bounded in time."""
        with self._lock:
            shards, self._shards, self._by_worker = self._shards, [], {}
            actors, self._split_actors = self._split_actors, []
        if not shards:
            return
        for s in shards:
            s.stop.set()
        join_all([s.thread for s in shards], time.monotonic() + RELEASE_WAIT_S)
        if actors:
            # A pump waiting on Ray (a stalled shard) returns when the split coordinator goes away;
            # killing it also stops the dataset's execution (this source made it, nothing else uses it).
            import ray
            for actor in actors:
                try:
                    ray.kill(actor)
                except Exception:
                    log.debug("RayDataSource: killing the split coordinator", exc_info=True)
            join_all([s.thread for s in shards], time.monotonic() + RELEASE_JOIN_S)
        left = [s.thread.name for s in shards if s.thread.is_alive()]
        if left:
            log.warning("RayDataSource: pump thread(s) %s still waiting on Ray after release", left)

    def feeder_describe(self) -> str:
        """What the source waits on, for FeedTimeout's and diagnose()'s messages."""
        with self._lock:
            shards = list(self._shards)
        if not shards:
            return "Ray Data source not bound (start() binds it)"
        now = time.monotonic()
        return "waiting on Ray Data: " + "; ".join(s.describe(now) for s in shards)

    # ---- the fetch function ------------------------------------------------------------------
    def __call__(self, worker_id: int, batch_size: int) -> List[np.ndarray]:
        shard = self._by_worker.get(worker_id)
        if shard is None:
            raise RuntimeError(f"RayDataSource: worker {worker_id} is not bound to a shard. The source is bound by "
                               f"coord.start() and runs in fetcher threads only (num_worker_threads): in a worker "
                               f"process, outside a coordinator or after stop() it has no shard")
        return shard.take(worker_id, self.stall_timeout)


