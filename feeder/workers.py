"""Fetcher threads: call the user's ``fetch_fun`` and put validated chunks on the source's queue.

The loop is a module-level function with explicit arguments (after torchdata's
``_populate_queue``) so it can be driven without the feed that owns it.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from typing import Any, Callable, List, Optional

from .errors import Failure, FetchError, InputValidationError, FeederError
from .metrics import Counters
from .rebatcher import rows_of
from .source import CLOSED, Chunk, ChunkQueue

log = logging.getLogger("feeder")

SLICE_S = 0.05  # longest single wait, so a stop is seen within this many seconds


class WorkerState:
    """What one fetcher is doing, for timeouts' diagnoses and stop()'s straggler report."""

    __slots__ = ("worker_id", "thread", "state", "since", "calls")

    def __init__(self, worker_id: int):
        self.worker_id = worker_id
        self.thread: Optional[threading.Thread] = None
        self.state = "not started"
        self.since = time.monotonic()
        self.calls = 0

    def set(self, state: str) -> None:
        self.state = state
        self.since = time.monotonic()

    def describe(self, now: float, stack_after_s: float = 1.0, frames: int = 3) -> str:
        """One line (plus stack lines when stuck in fetch_fun for ``stack_after_s`` seconds or more)."""
        busy = now - self.since
        text = f"worker {self.worker_id} {self.state} for {busy:.1f} s (call #{self.calls})"
        if self.state == "in fetch_fun" and busy >= stack_after_s:
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


def fetch_loop(*, source: ChunkQueue, source_name: str, fetch_fun: Callable[[int, int], Any],
               validate: Callable[[Any, int], tuple], batch_axes: tuple, state: WorkerState,
               batch_size: Callable[[], int], stop: threading.Event, counters: Counters,
               max_fetch_errors: int) -> None:
    """Fetch, validate and enqueue chunks until stop, StopIteration, or a failure."""
    wid = state.worker_id
    try:
        while not stop.is_set() and source.failure is None:
            state.set("in fetch_fun")
            state.calls += 1
            try:
                raw = fetch_fun(wid, batch_size())
            except StopIteration:
                state.set("ended (StopIteration)")
                source.worker_ended(wid)
                return
            except BaseException as e:  # noqa: B902 - KeyboardInterrupt/SystemExit must reach the consumer too
                if stop.is_set():
                    return
                counters.add("fetch_errors")
                n = source.note_fetch_error()
                if isinstance(e, Exception) and n <= max_fetch_errors:
                    log.warning("source %r worker %d: fetch_fun raised (%d of %d tolerated); skipping that call",
                                source_name, wid, n, max_fetch_errors, exc_info=e)
                    continue
                msg = f"source {source_name!r}, worker {wid}: fetch_fun raised {type(e).__name__}: {e}"
                if max_fetch_errors:
                    msg += f" (fetch error {n}, more than max_fetch_errors={max_fetch_errors})"
                state.set("failed")
                source.fail(Failure(FetchError(msg), e))
                return
            if raw is None:
                counters.add("none_chunks")
                log.warning("source %r worker %d: fetch_fun returned None; skipped", source_name, wid)
                continue
            state.set("validating")
            try:
                arrays = validate(raw, wid)
            except InputValidationError as e:
                state.set("failed")
                source.fail(Failure(e))
                return
            rows = rows_of(arrays, batch_axes)
            if rows == 0:
                counters.add("empty_chunks")
                log.warning("source %r worker %d: fetch_fun returned a chunk with 0 rows; skipped",
                            source_name, wid)
                continue
            chunk = Chunk(wid, arrays, rows)
            state.set("waiting for queue space")
            while True:
                put = source.put(chunk, SLICE_S)
                if put is True:
                    break
                if put is CLOSED or stop.is_set() or source.failure is not None:
                    return
            counters.add_many(chunks_fetched=1, rows_fetched=rows)
    except BaseException as e:  # a bug here must not leave the source waiting on a dead worker
        state.set("failed")
        source.fail(Failure(FeederError(f"source {source_name!r}, worker {wid}: fetcher thread failed: "
                                        f"{type(e).__name__}: {e}"), e))
        log.error("source %r worker %d: fetcher thread failed", source_name, wid, exc_info=True)
    finally:
        if not state.state.startswith(("ended", "failed")):
            state.set("stopped")
