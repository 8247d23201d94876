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
source, and starts one pump thread per shard. A pump iterates its shard's batches (Arrow
tables, converted to numpy by the converter ParquetSource uses, so a null in a used column is an
``InputValidationError`` naming it, never a NaN) and hands them to the fetcher threads of its
replica through a small bounded queue; a fetch call takes one. Why a pump thread rather than
fetchers calling ``next()`` under a lock: a call into Ray can block for good (a lost node whose
task cannot be retried), and only a wait we own can be bounded. Every split must start
iterating for the split coordinator's epoch barrier to pass, which the pumps do at bind
whatever the replicas' fetchers are doing.

Columns at registration. ``feeder_validate`` checks that the dataset has every column the
inputs need. Where the plan knows its schema without running (a read, ``range``) that costs
nothing; after a ``map_batches`` the schema is only known by running, so registration runs the
pipeline's first block, as ``Dataset.schema()`` does (``limit(1)``), through a
``streaming_split(1)`` of its own read by a thread: the wait is bounded by ``stall_timeout`` (the
split's coordinator actor is killed then, which ends the thread), and a pipeline that cannot run
its first block in that time is a :class:`RayStallError` at registration saying so. The block is
not kept: the stream a ``start()`` splits runs the pipeline from its beginning (Ray offers no way
to hand a block already made to one of the shards of a later split), so the first block is
computed twice. The columns learned are kept by the source object, so its replicas and later
starts do not run it again.

Faults. An exception from Ray (a failed task: ``RayTaskError`` wrapping the user's exception;
an object lost with its node and not reconstructable) ends the shard's stream. The next fetch
call of its replica raises it, so consumers get ``FetchError`` with it as ``__cause__`` (with
``max_fetch_errors``, that one call is counted and skipped); every later call raises
:class:`RayShardFailed`, which says it is final (``feeder_final``, see ``feeder.sources.base``):
the source fails at once with a ``FetchError`` whose ``__cause__`` is Ray's exception, never
counted again. A shard that has been waiting on Ray for ``stall_timeout`` seconds raises
:class:`RayStallError` the same way, once per ``stall_timeout`` it goes on waiting: never a hang.
Ray retries tasks of a lost node where it can; then the stream simply continues.

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

from ..errors import FeederError, InputValidationError
from ..joins import join_all
from .arrow import to_numpy
from .base import ROW_KEY, SourceBinding
from .transform import Transformable

log = logging.getLogger("feeder")

INSTALL_HINT = "pip install 'onnx-feeder[ray]' (or pip install 'ray[data]')"
SLICE_S = 0.05          # longest single wait of a fetch call or a pump, so stop and stalls are seen
PUMP_QUEUE = 2          # numpy batches a shard's pump holds ready ahead of its fetchers
RELEASE_WAIT_S = 0.5    # release() lets pumps finish a call into Ray this long before killing the split actor
RELEASE_JOIN_S = 2.0    # and waits this long for them afterwards


class RayStallError(TimeoutError):
    """A Ray Data shard produced no batch for ``stall_timeout`` seconds while feeder waited on it
    (or, at registration, the dataset's first block did not come in that time)."""


class RayShardFailed(RuntimeError):
    """A fetch from a Ray Data shard whose stream already failed (its error was raised once): the
    stream cannot go on, so feeder fails the source at once (``feeder_final``); ``__cause__`` is
    the shard's error."""

    feeder_final = True


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
        # Fetch calls' side (guarded by _said): whether the pump's error was raised yet, and when a
        # stall was last raised (each stall_timeout of waiting is one fetch error, not one per call).
        self._said = threading.Lock()
        self.error_raised = False
        self.stall_raised = 0.0
        self.started_at = time.monotonic()
        self.batches = 0
        self.rows = 0
        self.thread = threading.Thread(target=self._pump, name=f"feeder:{source_name}:ray-shard-{index}",
                                       daemon=True)

    # ---- the pump thread -------------------------------------------------------------------
    def _pump(self) -> None:
        it: Any = None
        try:
            it = iter(self.iterator.iter_batches(batch_size=self.batch_size, batch_format="pyarrow",
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
                rows = int(batch.num_rows)
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

    def _select(self, batch: Any) -> List[np.ndarray]:
        """The inputs' columns of an Arrow table, as numpy arrays (a null: InputValidationError)."""
        out = []
        names = list(batch.column_names)
        for name, column in self.columns:
            if column not in names:
                # a ValueError too: the consumer sees the column named, as at registration
                raise InputValidationError(f"RayDataSource for source {self.source_name!r}: column {column!r} (input "
                                           f"{name!r}) is not in the dataset; its columns are {sorted(names)}")
            where = f"column {column!r} (input {name!r}) of Ray Data shard {self.index}"
            out.append(to_numpy(batch.column(column), where))
        return out

    # ---- fetch calls (fetcher threads) ---------------------------------------------------------
    def take(self, worker_id: int, stall_timeout: float) -> List[np.ndarray]:
        """The next batch of this shard; StopIteration at its end; the shard's error once, then
        RayShardFailed; RayStallError once per ``stall_timeout`` of waiting on Ray."""
        while True:
            try:
                return self.ready.get(timeout=SLICE_S)
            except queue.Empty:
                pass
            error = self.error
            if error is not None:
                with self._said:
                    first, self.error_raised = not self.error_raised, True
                if first:
                    raise error
                raise RayShardFailed(f"Ray Data shard {self.index} failed earlier ({type(error).__name__}: {error}); "
                                     f"its stream cannot go on") from error
            if self.stop.is_set():
                # Only after stop() signalled the fetchers, which then ignore what a call raises.
                raise RuntimeError(f"source {self.source_name!r}: Ray Data shard {self.index} was released")
            if self.ended:  # set by the pump after its last put, so an empty buffer now stays empty
                if self.ready.empty():
                    raise StopIteration
                continue
            since = self.waiting_since
            if since and time.monotonic() - max(since, self.stall_raised) > stall_timeout:
                with self._said:
                    now = time.monotonic()
                    if now - max(since, self.stall_raised) <= stall_timeout:
                        continue  # another fetcher of this shard raised it just now
                    self.stall_raised = now
                raise RayStallError(
                    f"source {self.source_name!r}, worker {worker_id}: Ray Data shard {self.index} produced no batch "
                    f"for {now - since:.1f} s (stall_timeout={stall_timeout:g} s): Ray cannot make "
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


def _schema_names(schema: Any) -> Optional[List[str]]:
    names = getattr(schema, "names", None)
    return [str(n) for n in names] if names else None


class RayDataSource(Transformable):
    """A fetch function reading a ``ray.data.Dataset``: one ``streaming_split`` shard per replica.

    Use fetcher threads with it (``num_worker_processes`` is a TypeError at registration); it
    cannot resume (a Ray Data stream has no row keys).

    Args:
        dataset: A ``ray.data.Dataset``, split with ``streaming_split(n, equal=False)`` at every
            ``start()``, n being the number of registrations (replicas) of the source; or a
            ``ray.data.DataIterator`` (a shard made elsewhere, e.g. one of a driver's
            ``streaming_split`` handed to this host), which all registrations then share.
        columns: ``{input name: column name}``; None: the columns named like the inputs.
        batch_size: Rows per numpy batch taken from Ray; None: Ray's blocks as they come
            (feeder rebatches anyway).
        prefetch_batches: Ray's own prefetch per shard, in batches.
        stall_timeout: Seconds a shard may wait on Ray for one batch before the source fails
            with :class:`RayStallError` (a ``FetchError`` to consumers).

    Raises:
        ImportError: Ray Data (the ``ray`` extra) is not installed.
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
        self._names: Optional[List[str]] = None  # the dataset's columns, once learned (see _learn_names)

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
        self._names = None

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
            raise ValueError(f"RayDataSource columns give no column for inputs {missing}: columns= maps every "
                             f"input, and every array kept with keep=, to its column (e.g. add "
                             f"{missing[0]!r}: {missing[0]!r}), or leave columns=None to read same-named columns")
        return [(name, self.columns[name]) for name in input_names]

    def _learn_names(self) -> Optional[List[str]]:
        """The dataset's column names, learned once (see "Columns at registration" in the module
        docstring); None only for a kind of DataIterator whose schema cannot be asked for, or a
        dataset with no block at all (the first batch checks then)."""
        if self._names is not None:
            return self._names
        rd = _import_ray_data()
        dataset = self.dataset
        if isinstance(dataset, rd.DataIterator):
            base = getattr(dataset, "_base_dataset", None)  # private: a plain iterator's dataset
            if base is None:
                # A shard of a split made elsewhere: its coordinator actor knows the schema (and
                # learns it as Dataset.schema() does); a wait on an actor call can be bounded.
                actor = getattr(dataset, "_coord_actor", None)  # private, as in feeder_bind
                if actor is None:
                    return None
                import ray
                try:
                    schema = ray.get(actor.get_dataset_schema.remote(), timeout=self.stall_timeout)
                except ray.exceptions.GetTimeoutError:
                    raise RayStallError(self._stalled_text("the DataIterator's split coordinator did not say its "
                                                           "schema")) from None
                self._names = _schema_names(schema)
                return self._names
            dataset = base
        try:
            names = _schema_names(dataset.schema(fetch_if_missing=False))
        except Exception:  # an exotic plan: learn it by running, below
            log.debug("RayDataSource: schema not available without running", exc_info=True)
            names = None
        self._names = names if names else self._probe_names(dataset)
        return self._names

    def _probe_names(self, dataset: Any) -> Optional[List[str]]:
        """Run the dataset's first block (``limit(1)``) in a thread of our own, bounded by
        ``stall_timeout``: its columns, or None for a dataset without rows."""
        import ray
        (split,) = dataset.limit(1).streaming_split(1, equal=False)
        actor = getattr(split, "_coord_actor", None)  # private; killing it ends a wait on Ray
        box: Dict[str, Any] = {}

        def first_block() -> None:
            try:
                for batch in split.iter_batches(batch_size=None, batch_format="pyarrow"):
                    box["names"] = list(batch.column_names)
                    return
            except BaseException as e:  # noqa: B902 - re-raised by the caller
                box["error"] = e

        thread = threading.Thread(target=first_block, name="feeder:ray-schema", daemon=True)
        thread.start()
        thread.join(self.stall_timeout)
        timed_out = thread.is_alive()
        if actor is not None:
            try:
                ray.kill(actor)
            except Exception:
                log.debug("RayDataSource: killing the schema probe's split coordinator", exc_info=True)
        join_all([thread], time.monotonic() + RELEASE_JOIN_S)
        if timed_out:
            raise RayStallError(self._stalled_text("its first block did not come"))
        error = box.get("error")
        if error is not None:
            raise FeederError(f"RayDataSource: learning the dataset's columns at registration ran its first block, "
                              f"which failed: {type(error).__name__}: {error}") from error
        names: Optional[List[str]] = box.get("names")
        return names

    def _stalled_text(self, what: str) -> str:
        return (f"RayDataSource: the dataset's columns could not be learned at registration: {what} within "
                f"stall_timeout={self.stall_timeout:g} s (Ray cannot run the pipeline now: resources no node has, "
                f"or a cluster busy with other work). The columns are checked at registration so that a missing "
                f"one is found before start(); give the source a larger stall_timeout if the first block is slow")

    def _transform_columns(self) -> List[str]:
        """What ``map`` and ``filter`` functions see: the inputs ``columns`` maps, or with
        ``columns=None`` every column of the dataset (learned as at registration)."""
        if self.columns is not None:
            return list(self.columns)
        names = self._learn_names()
        if not names:
            raise ValueError("RayDataSource: map and filter see every column of the dataset when columns=None, "
                             "but its columns cannot be learned before it runs; give columns={input: column}")
        return list(names)

    def _offered_columns(self) -> Optional[Tuple[List[str], bool]]:
        """The columns the source can name at registration (``feeder.checks``: a mask named like one
        is refused there, not at the first chunk), and whether each of them feeds an input."""
        if self.columns is not None:  # columns= maps exactly the inputs
            return list(self.columns), True
        names = self._learn_names()  # (learned once: registration's feeder_validate needs them too)
        return (list(names), False) if names else None

    def _check_columns(self, pairs: Sequence[Tuple[str, str]]) -> None:
        """ValueError naming a column the inputs need that the dataset lacks (see _learn_names)."""
        names = self._learn_names()
        if not names:
            return
        for name, column in pairs:
            if column not in names:
                raise ValueError(f"RayDataSource: column {column!r} (input {name!r}) "
                                 f"is not in the dataset; its columns are {sorted(names)}")

    def feeder_validate(self, input_names: Sequence[str], resume: Optional[Mapping[str, Any]]) -> None:
        """At registration: columns for every input, present in the dataset (learned by running
        its first block when the plan does not know them, see the module docstring), and no
        resume state.

        Args:
            input_names: The registration's inputs.
            resume: Its ``resume_from`` state: must be None.
        """
        if resume is not None:
            raise ValueError("RayDataSource cannot resume from a state: a Ray Data stream has no row keys "
                             "(run it again from the start, or checkpoint upstream of Ray)")
        self._check_columns(self._pairs([n for n in input_names if n != ROW_KEY]))

    def feeder_bind(self, binding: SourceBinding) -> None:
        """Split the dataset, one shard per replica, and start a pump per shard (see the module doc).

        Args:
            binding: What feeder tells the source (see :class:`~feeder.sources.SourceBinding`).
        """
        if binding.resume is not None:
            raise ValueError(f"source {binding.source_name!r}: RayDataSource cannot resume from a state; Ray Data "
                             f"streams have no row keys (run it again from the start, or checkpoint upstream)")
        pairs = self._pairs([n for n in binding.input_names if n != ROW_KEY])
        self._check_columns(pairs)  # learned at registration: nothing runs here
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


