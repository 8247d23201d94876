"""The coordinator: named chunk queues, registered feeds, one worker-id sequence, lifecycle.

``start()`` runs pending ``init_fun``s serially, then starts every pending feed's threads.
``stop()`` signals every thread, closes the queues (which wakes every blocked put and
get at once), then joins all threads against one total budget, so N stuck fetchers cost
``join_timeout`` seconds, not N times it. Stragglers are named in the log and make
``stop()`` return False.
"""
from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from .chunkqueue import ChunkQueue
from .errors import FeederError
from .feed import Feed
from .joins import join_all
from .metrics import Monitor
from .processes.mainguard import ADVICE, refuse_in_bootstrap, unguarded_call
from .sources.base import ROW_KEY, bind_sources, release_sources
from .sources.rowkeys import KeyLedger, source_state
from .validation import ChunkValidator, InputSpec

log = logging.getLogger("feeder")

EXIT_JOIN_S = 0.5  # at interpreter exit, stop() waits at most this long: exit must be prompt
MONITOR_JOIN_S = 0.5  # the monitor's final reports get this long even when fetchers used up the budget


class GlobalCoordinator:
    """Owns the named bounded queues and the feeds registered on them.

    Every coordinator is independent; ``feeder.global_coordinator`` is just the default one.
    ``with coord:`` calls ``start()`` on entry and ``stop()`` on exit.

    Args:
        join_timeout: Total seconds (>= 0) that ``stop()`` waits for all threads and worker
            processes to end.
    """

    def __init__(self, *, join_timeout: float = 5.0):
        if not join_timeout >= 0:
            raise ValueError(f"join_timeout must be >= 0 seconds, got {join_timeout!r}")
        self.join_timeout = float(join_timeout)
        self._lock = threading.RLock()
        self._queues: Dict[str, ChunkQueue] = {}
        self._feeds: List[Feed] = []
        self._next_worker_id = 0
        self._monitor: Optional[Monitor] = None
        self._atexit: Optional[Callable[[], None]] = None
        self._starting = False  # inside start(): an init_fun calling start() again is an error
        # The row keys of stopped sources, so that state_dict(name) works after stop().
        self._stopped_keys: Dict[str, Tuple[KeyLedger, Any]] = {}
        # Source names whose second registration was warned about (once per name until it is stopped).
        self._replicas_told: Set[str] = set()

    # ---- registration ------------------------------------------------------------------
    def get_queue(self, name: str, max_buffered_batches: int) -> ChunkQueue:
        """The named bounded chunk queue, created on first use.

        Args:
            name: The source's name (``input_source_name``).
            max_buffered_batches: The queue's bound in chunks, if this call creates it.
        """
        with self._lock:
            q = self._queues.get(name)
            if q is None:
                q = self._queues[name] = ChunkQueue(name, max_buffered_batches)
            return q

    def _take_worker_ids(self, n: int) -> List[int]:
        with self._lock:
            ids = list(range(self._next_worker_id, self._next_worker_id + n))
            self._next_worker_id += n
            return ids

    def _register(self, make_feed: Callable[[ChunkQueue, List[int]], Feed], *, name: str,
                  input_names: Sequence[str], batch_axes: Sequence[int], dont_rebatch: bool,
                  max_buffered_batches: int, num_workers: int, ordered: bool, max_bytes: Optional[int],
                  specs: Sequence[InputSpec], cast: bool, resume_from: Optional[Dict[str, Any]] = None,
                  replica: bool = False, masks: Optional[Dict[str, str]] = None) -> Feed:
        with self._lock:
            others = sum(1 for f in self._feeds if f.input_source_name == name)
            for other in self._feeds:
                if other.input_source_name != name:
                    continue
                # Replicas take each other's chunks, so they must agree on what a chunk is.
                mine = {"inputs": list(input_names), "batch_columns": list(batch_axes), "dont_rebatch": dont_rebatch}
                theirs = {"inputs": other._all_names, "batch_columns": list(other._axes),
                          "dont_rebatch": other.dont_rebatch}
                for key in mine:
                    if mine[key] != theirs[key]:
                        raise ValueError(f"source {name!r} is already fed with {key}={theirs[key]}; a replica "
                                         f"must use the same, got {mine[key]}")
            q = self.get_queue(name, max_buffered_batches)
            q.configure(ordered=ordered, max_bytes=max_bytes)
            if ROW_KEY in input_names and q.row_keys is None:
                q.row_keys = KeyLedger.from_state(name, resume_from)
                self._stopped_keys.pop(name, None)
            # One validator per source: replicas rebatch each other's chunks, so what the source
            # accepts is decided once, from every replica's session and the source's first chunk.
            if q.validator is None:
                q.validator = ChunkValidator(name, input_names, batch_axes, specs, cast=cast,
                                             dont_rebatch=dont_rebatch, masks=masks)
            else:
                q.validator.add_replica(specs, cast=cast)
            ids = self._take_worker_ids(num_workers)
            feed = make_feed(q, ids)
            q.register_workers(ids)
            q.add_holder(feed._held_rows, feed._ready.delivered, feed._starved)
            self._feeds.append(feed)
            if others and not replica and name not in self._replicas_told:
                # Registering a name again adds a replica (the contract); a notebook cell run again
                # does it by accident, and coord.feed(name) then refuses: say so, once per name.
                self._replicas_told.add(name)
                log.warning("source %r was already registered on this coordinator: this registration adds a "
                            "replica (%d feeds now share its queue and its rows; coord.feed(%r) refuses, "
                            "coord.feeds(%r) lists them). To replace the first registration instead (a notebook "
                            "cell run again), call coord.stop_coordinator(%r) before registering again; to add "
                            "replicas on purpose, pass replica=True. (Logged once per source name.)",
                            name, others + 1, name, name, name)
            return feed

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Run pending ``init_fun``s serially, then start every pending feed's threads.

        An exception from an ``init_fun`` propagates unchanged and no thread is started.

        Raises:
            FeederError: called from an ``init_fun``; or worker processes would be started (by
                "spawn" or "forkserver") from top-level code of the main script that is not under
                ``if __name__ == "__main__":`` (each would run it again: see
                ``feeder.processes.mainguard``). Nothing is started then.
        """
        with self._lock:
            if self._starting:
                raise FeederError("start() was called from an init_fun; init_funs run inside start()")
            pending = [f for f in self._feeds if not f._started]
            if pending:
                _check_main_script(pending)
            self._starting = True
            try:
                for feed in pending:
                    feed._run_init()
            finally:
                self._starting = False
            # Sources learn who calls them before any of their workers starts (feeder.sources.base).
            bind_sources(self._feeds, pending)
            for feed in pending:
                feed._start_threads()
            if self._monitor is None and self._feeds:
                self._monitor = Monitor("feeder:monitor", self._due_reports, tune=self._tune_feeds)
                self._monitor.start()
            if self._atexit is None:
                ref = weakref.ref(self)

                def stop_at_exit() -> None:
                    coord = ref()
                    if coord is not None and coord._atexit is stop_at_exit:
                        coord.stop(timeout=min(coord.join_timeout, EXIT_JOIN_S))

                self._atexit = stop_at_exit
                atexit.register(stop_at_exit)
                # atexit handlers run only after the interpreter has joined every non-daemon
                # thread, so a consumer waiting in such a thread would hold the exit for its whole
                # timeout. threading's own exit hooks run before that join (concurrent.futures
                # uses them too); they cannot be unregistered, hence the check of _atexit above.
                register_early = getattr(threading, "_register_atexit", None)
                if register_early is not None:
                    try:
                        register_early(stop_at_exit)
                    except RuntimeError:  # the interpreter is already shutting down
                        pass

    def _due_reports(self, now: float) -> List[Callable[[], None]]:
        with self._lock:
            feeds = list(self._feeds)
        return [f.stats.report for f in feeds if f.stats.due_report(now)]

    def _tune_feeds(self, now: float) -> None:
        """The tuners' tick (num_worker_threads="auto"), on the monitor's tuner thread."""
        with self._lock:
            feeds = list(self._feeds)
        for f in feeds:
            f.stats.tune(now)

    def stop(self, timeout: Optional[float] = None) -> bool:
        """Stop and remove every feed and queue, discarding what they hold. Idempotent; never hangs.

        Args:
            timeout: Total seconds to wait for every thread and process to end; None: the
                coordinator's ``join_timeout``.

        Returns:
            True if every thread ended within the budget (a thread still stuck in ``fetch_fun``
            is logged with its stack).
        """
        with self._lock:
            feeds, self._feeds = self._feeds, []
            queues, self._queues = list(self._queues.values()), {}
            monitor, self._monitor = self._monitor, None
            self._replicas_told.clear()
            if self._atexit is not None:
                atexit.unregister(self._atexit)
                self._atexit = None
        return self._shutdown(feeds, queues, monitor, stop_monitor=True, timeout=timeout)

    def stop_coordinator(self, name: str) -> bool:
        """Stop and remove the feeds and the queue of one source.

        Args:
            name: The source's name.

        Returns:
            True if its threads all ended within the coordinator's ``join_timeout``.
        """
        with self._lock:
            feeds = [f for f in self._feeds if f.input_source_name == name]
            self._feeds = [f for f in self._feeds if f.input_source_name != name]
            q = self._queues.pop(name, None)
            monitor = self._monitor
            self._replicas_told.discard(name)
        return self._shutdown(feeds, [q] if q is not None else [], monitor, stop_monitor=False, timeout=None)

    def _shutdown(self, feeds: Sequence[Feed], queues: Sequence[ChunkQueue], monitor: Optional[Monitor],
                  stop_monitor: bool, timeout: Optional[float]) -> bool:
        deadline = time.monotonic() + (self.join_timeout if timeout is None else timeout)
        for feed in feeds:
            feed._signal_stop(deadline)  # worker processes are stopped against the same budget
        ended = {q.name: not q.live_workers() for q in queues}  # (before the stop makes every worker end)
        discarded = {q.name: q.close() for q in queues}  # wakes every blocked put and get at once
        # Before the join: a fetch call waiting on its source's iterator (Ray Data) returns once released.
        release_sources(feeds)
        threads = [t for f in feeds for t in f._threads()]
        join_all(threads, deadline)
        stragglers = [t for t in threads if t.is_alive() and t is not threading.current_thread()]
        if not stragglers:  # only a quiescent source can be audited exactly
            # A feed whose discard waits for a consumer's rebatch in progress is audited, and so is
            # its source, once that consumer has made it (Feed._discard_held): stop() never waits.
            late = [f for f in feeds if f._started and not f._discard_held()]
            for feed in feeds:
                if feed._started and feed not in late:
                    feed._check_ledger("stop")
            for q in queues:
                _audit_when_discarded(q, [f for f in late if f.source is q])
        with self._lock:
            for q in queues:
                mine = [f for f in feeds if f.input_source_name == q.name]
                if q.row_keys is not None and mine:
                    self._stopped_keys[q.name] = (q.row_keys, mine[0].fetch_fun)
        for name, (chunks, rows) in discarded.items():
            if rows:
                _log_discarded(name, rows, chunks, ended[name], [f for f in feeds if f.input_source_name == name])
        if monitor is not None:
            # Final reports run on the monitor thread: a hanging external logger cannot hang stop().
            # Called on that thread (an external logger's log() stopping the coordinator), stop() is
            # what keeps them from running: they run once it has returned, and the thread then ends.
            me = threading.current_thread()
            reported = monitor.final([functools.partial(f.stats.report, final=True) for f in feeds if f._started])
            if not stop_monitor and me not in monitor.threads() and \
                    not reported.wait(max(deadline - time.monotonic(), MONITOR_JOIN_S)):
                log.warning("feeder stop: the final throughput reports of %s did not finish in time (a slow "
                            "external logger?)", sorted({f.input_source_name for f in feeds}))
            if stop_monitor:
                monitor.stop()
                join_all(monitor.threads(), max(deadline, time.monotonic() + MONITOR_JOIN_S))
                stragglers += [t for t in monitor.threads() if t.is_alive() and t is not me]
        if stragglers:
            details = [d for f in feeds for d in f.stats.live_descriptions()]
            log.warning("feeder stop: %d thread(s) still running after the join budget: %s%s",
                        len(stragglers), ", ".join(t.name for t in stragglers),
                        "".join("\n  " + d for d in details))
        for feed in feeds:  # processes, shared memory, descriptors: now, not when the GC runs
            feed._release()
        if not stragglers:  # no thread uses the feeds' callbacks any more
            for q in queues:
                q.detach()
        return not stragglers

    def __enter__(self) -> "GlobalCoordinator":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- checkpoint ------------------------------------------------------------------------
    def state_dict(self, name: str) -> Dict[str, Any]:
        """Which rows of a source were delivered to consumers, to continue after them.

        Consistent while consumers run: a batch is in it if and only if a consumer has popped it.
        Works after ``stop()`` too.

        Args:
            name: The source's name; its fetch function must give row keys (the sources of
                ``feeder.sources`` do, except ``RayDataSource``).

        Returns:
            A small JSON-serializable dict; pass it as ``resume_from`` to every registration of
            the source.
        """
        with self._lock:
            feeds = [f for f in self._feeds if f.input_source_name == name]
            q = self._queues.get(name)
            if feeds and q is not None:
                ledger, fun = q.row_keys, feeds[0].fetch_fun
            elif name in self._stopped_keys:
                ledger, fun = self._stopped_keys[name]
            else:
                raise KeyError(f"no source {name!r} is registered (nor was one stopped)")
        return source_state(name, ledger, fun)

    # ---- control and lookup --------------------------------------------------------------
    def reset_data_input(self, name: str, batch_size: int) -> None:
        """Change the batch size of every feed of a source while running.

        Leftover rows are kept; ``fetch_fun`` sees the new size on its next call; batches already
        prepared at the old size are handed out first.

        Args:
            name: The source's name.
            batch_size: The new number of rows per batch (> 0).

        Raises:
            KeyError: No feed is registered for ``name``.
        """
        feeds = self.feeds(name)
        if not feeds:
            raise KeyError(f"no feed registered for source {name!r}")
        for feed in feeds:
            feed._check_batch_size(batch_size)
        for feed in feeds:
            feed._set_batch_size(batch_size)

    def feed(self, name: str) -> Feed:
        """The single feed of a source.

        Args:
            name: The source's name.

        Raises:
            KeyError: No feed is registered for ``name``.
            ValueError: The source has several feeds (replicas): use :meth:`feeds`.
        """
        feeds = self.feeds(name)
        if not feeds:
            raise KeyError(f"no feed registered for source {name!r}")
        if len(feeds) > 1:
            raise ValueError(f"source {name!r} has {len(feeds)} feeds (replicas); use feeds({name!r})")
        return feeds[0]

    def feeds(self, name: str) -> List[Feed]:
        """All feeds of a source, in registration order (empty if none).

        Args:
            name: The source's name.
        """
        with self._lock:
            return [f for f in self._feeds if f.input_source_name == name]

    @property
    def sources(self) -> List[str]:
        """Names of the sources with a queue."""
        with self._lock:
            return list(self._queues)

    def __repr__(self) -> str:
        with self._lock:
            return f"GlobalCoordinator(sources={list(self._queues)}, feeds={len(self._feeds)})"


def _check_main_script(pending: Sequence[Feed]) -> None:
    """Refuse a start that worker processes would make again as they import the main script
    (``feeder.processes.mainguard``): up front where the parent can tell, else in the worker."""
    refuse_in_bootstrap(any(f.mp_context is not None for f in pending))
    for feed in pending:
        method = feed.mp_context.get_start_method() if feed.mp_context is not None else None
        where = unguarded_call(method) if method is not None else None
        if where is not None:
            raise FeederError(f"source {feed.input_source_name!r}: start() was called from the top level of "
                              f"{where[0]} (line {where[1]}), outside `if __name__ == \"__main__\":`, with worker "
                              f"processes started by {method!r}; no process was started: {ADVICE}")


def _log_discarded(name: str, rows: int, chunks: int, ended: bool, feeds: Sequence[Feed]) -> None:
    """Say what a stop discarded, as loudly as it matters. Fetchers run ahead of the consumers, so a
    source that is still being read always has rows in its queue at a stop: after a job that ran
    as long as it meant to, those are of no interest (DEBUG). Rows of a finite source (one whose
    workers had all ended, or a source of ``feeder.sources`` with a number of epochs) that never
    reached a consumer are part of the data the job did not see: INFO."""
    if ended or any(_epochs(f.fetch_fun) is not None for f in feeds):
        log.info("source %r: stop discarded %d rows of this finite source (%d chunks) that no consumer had taken%s",
                 name, rows, chunks, ": its fetchers had read it to the end" if ended else "")
    else:
        log.debug("source %r: stop discarded %d prefetched rows in %d chunks (fetched ahead of the consumers)",
                  name, rows, chunks)


def _epochs(fetch_fun: Any) -> Optional[int]:
    """The number of epochs of a source of ``feeder.sources`` (a map or filter of one included);
    None for an endless one, or a fetch function that does not say."""
    for _ in range(16):  # (a chain of maps and filters)
        epochs = getattr(fetch_fun, "epochs", None)
        if isinstance(epochs, int):
            return epochs
        fetch_fun = getattr(fetch_fun, "wrapped", None)
        if fetch_fun is None:
            return None
    return None


def _audit_when_discarded(q: ChunkQueue, late: Sequence[Feed]) -> None:
    """Check a stopped source's ledger now or, where feeds of it have left their discard to a
    consumer still rebatching (``late``), each of those feeds and then the source once the last
    of them has discarded."""
    if not late:
        q.check_ledger("stop")
        return
    left = [len(late)]
    lock = threading.Lock()

    def discarded(feed: Feed) -> None:
        feed._check_ledger("stop")
        with lock:
            left[0] -= 1
            last = not left[0]
        if last:
            q.check_ledger("stop")

    for feed in late:
        feed._when_discarded(functools.partial(discarded, feed))


global_coordinator = GlobalCoordinator()
"""The default coordinator: ``init_data_input_workers`` registers on it unless given ``coordinator=``.
It is stopped at interpreter exit. Tests and libraries should make their own
:class:`GlobalCoordinator` instead, so that their sources never share names with the user's."""
