"""What one fetcher is doing and has done: ``WorkerState``, kept by each fetcher thread
(``feeder.fetchers``) and by the receiver of each worker process (``feeder.processes.parent``)."""
from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Dict, Optional

IN_FETCH = "in fetch_fun"
WAITING_FOR_ROOM = "waiting for queue space"


class WorkerState:
    """What one fetcher is doing and has done. Written only by its own thread (so its counters
    need no lock); read by timeouts' diagnoses, metrics and stop()'s straggler report."""

    __slots__ = ("worker_id", "thread", "state", "since", "calls", "chunks", "rows", "rows_put", "none_chunks",
                 "empty_chunks", "fetch_errors", "copied_bytes", "started_at", "ended_at", "fetch_s", "blocked_s",
                 "cpu_s", "cpu_wall_s", "_cpu0", "_parked", "counters", "assemble_s")

    def __init__(self, worker_id: int):
        self.worker_id = worker_id
        self.thread: Optional[threading.Thread] = None
        self.state = "not started"
        self.since = time.monotonic()
        self.calls = self.chunks = self.rows = self.none_chunks = self.empty_chunks = self.fetch_errors = 0
        self.rows_put = 0  # of ``rows``, those put on the source (the rest are held or were discarded)
        self.copied_bytes = 0  # bytes this fetcher copied while coalescing
        self.assemble_s = 0.0  # seconds it spent copying them (writing whole batches out of small chunks)
        # Stage times, seconds (see feeder.diagnosis): running time (the lifetime less the time
        # parked by num_worker_threads="auto"), inside fetch_fun, waiting for room in the source, and
        # CPU time sampled every CPU_SAMPLE_S over cpu_wall_s of the running time.
        self.started_at = self.ended_at = 0.0
        self.fetch_s = self.blocked_s = self.cpu_s = self.cpu_wall_s = 0.0
        self._cpu0 = 0.0
        # (seconds parked in parks that are over, start of the current park or 0.0): one tuple,
        # replaced whole, so that other threads read a consistent pair without a lock.
        self._parked = (0.0, 0.0)
        # A worker process's latest feeder_counters() (see feeder.sources.base), replaced whole.
        self.counters: Dict[str, float] = {}

    def begin(self) -> None:
        """Called by the fetcher itself as it starts: the origin of its lifetime and CPU clock."""
        self.started_at = time.monotonic()
        self._cpu0 = time.thread_time()

    def park(self, now: float) -> None:
        """The tuner parked this fetcher at ``now`` (monotonic s); a park already begun goes on."""
        done, since = self._parked
        if not since:
            self._parked = (done, now)

    def unpark(self, now: float) -> None:
        """The tuner let this fetcher run again at ``now``."""
        done, since = self._parked
        if since:
            self._parked = (done + max(0.0, now - since), 0.0)

    def parked_s(self, now: float) -> float:
        """Seconds this fetcher was parked up to ``now`` (or until it ended)."""
        done, since = self._parked
        if since:
            end = min(now, self.ended_at) if self.ended_at else now
            done += max(0.0, end - since)
        return done

    def sample_cpu(self, now: float) -> None:
        """Read this thread's CPU clock (costs ~0.6 us, so only every CPU_SAMPLE_S)."""
        self.cpu_s = time.thread_time() - self._cpu0
        self.cpu_wall_s = self.running_s(now)

    def running_s(self, now: float) -> float:
        """Seconds this fetcher has run until ``now`` (or until it ended), time parked excluded."""
        if not self.started_at:
            return 0.0
        end = self.ended_at or now
        return max(0.0, end - self.started_at - self.parked_s(end))

    def set(self, state: str) -> None:
        self.state = state
        self.since = time.monotonic()

    def describe(self, now: float, stack_after_s: float = 1.0, frames: int = 3) -> str:
        """One line (plus stack lines when stuck in fetch_fun for ``stack_after_s`` seconds or more)."""
        busy = now - self.since
        text = f"worker {self.worker_id} {self.state} for {busy:.1f} s (call #{self.calls})"
        if self.state == IN_FETCH and busy >= stack_after_s:
            text += stack_of(self.thread, frames)
        return text


def stack_of(thread: Optional[threading.Thread], frames: int) -> str:
    """The innermost ``frames`` frames of a live thread's stack, indented, or ''."""
    if thread is None or thread.ident is None:
        return ""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return ""
    lines = traceback.format_list(traceback.extract_stack(frame)[-frames:])
    return "; stack (innermost last):\n" + "".join("    " + ln.replace("\n", "\n    ").rstrip(" ") for ln in lines)
