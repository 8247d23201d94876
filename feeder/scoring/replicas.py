"""The replica threads running the model, the calling thread's watch over them and the progress
bar (:class:`_Replicas`)."""
from __future__ import annotations

import importlib
import logging
import sys
import threading
import time
from typing import Any, List, Optional

from ..coordinator import GlobalCoordinator
from .partwriter import PartWriter
from .plan import SOURCE_NAME, _Plan

log = logging.getLogger("feeder")

PROGRESS_S = 0.2  # how often the calling thread refreshes the progress bar (and checks on the threads)


class _Replicas:
    """The replica threads, the calling thread's watch over them, and the end of a run."""

    def __init__(self, coord: GlobalCoordinator, writer: PartWriter, plan: _Plan, todo: Optional[int],
                 progress: Optional[bool], replicas: int = 1):
        self.coord = coord
        self.writer = writer
        self.plan = plan
        self.todo = todo
        self.progress = progress
        self.replicas = replicas
        self.errors: List[BaseException] = []
        self.wake = threading.Event()

    def _replica(self, feed: Any) -> None:
        writer, plan = self.writer, self.plan
        n_out, n_keep = len(plan.outputs), len(plan.keep)
        try:
            while True:
                try:
                    got = feed.run()
                except StopIteration:
                    return
                # outputs, kept, keys[, seq] -> the part's columns (kept first), copied before the next run
                outs = got[:n_out]
                if plan.squeeze:
                    outs = [g.reshape(len(g)) if g.ndim == 2 and g.shape[1] == 1 else g for g in outs]
                keys = got[n_out + n_keep] if plan.keyed else None
                writer.add(got[n_out:n_out + n_keep] + outs, keys, got[-1] if plan.ordered else None)
        except BaseException as e:  # re-raised by the calling thread
            self.errors.append(e)
        finally:
            self.wake.set()

    def run(self) -> int:
        coord, writer = self.coord, self.writer
        threads: List[threading.Thread] = []
        bar = None
        ok = False
        try:
            coord.start()
            feeds = coord.feeds(SOURCE_NAME)
            consumers = feeds * self.replicas if self.plan.ordered else feeds  # ordered: one feed, shared
            threads = [threading.Thread(target=self._replica, args=(f,), name=f"feeder:{SOURCE_NAME}:replica-{i}",
                                        daemon=True) for i, f in enumerate(consumers)]
            for t in threads:
                t.start()
            bar = _progress_bar(self.progress, self.todo)
            while any(t.is_alive() for t in threads) and not self.errors and writer.failure is None:
                self.wake.wait(PROGRESS_S)
                self.wake.clear()
                if bar is not None:
                    bar.update(writer.rows_added - bar.n)
            if self.errors and writer.failure is None:  # a replica's own failure (the writer's is raised below)
                raise self.errors[0]
            writer.finish()  # the last part, and the state that says the output is complete
            if bar is not None:
                bar.update(writer.rows_added - bar.n)
            for i, feed in enumerate(feeds):
                log.info("feeder.predict replica %d: %s", i, feed.diagnose())
            ok = True
            return writer.rows_committed
        finally:
            if bar is not None:
                bar.close()
            if not ok:  # first, so that replicas waiting in add() for a writer that hangs stop at once
                writer.abort(timeout=0.0)
            coord.stop()  # wakes replicas still waiting for a batch (FeedStopped)
            deadline = time.monotonic() + coord.join_timeout
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            if not ok:
                writer.abort()  # the part being written is dropped; the output stays at its last commit


def _progress_bar(progress: Optional[bool], total: Optional[int]) -> Any:
    """A tqdm bar on stderr (rows, rows/s, ETA when the total is known), or None."""
    if progress is False:
        return None
    if progress is None:
        try:
            if sys.stderr is None or not sys.stderr.isatty():
                return None
        except (AttributeError, ValueError):
            return None
    try:
        tqdm = importlib.import_module("tqdm").tqdm  # the `examples` / `test` extras; without it, no bar
    except ImportError:
        if progress:
            log.warning("feeder.predict: progress=True needs tqdm (pip install tqdm); no progress bar")
        return None
    return tqdm(total=total, unit="row", unit_scale=True, desc="feeder.predict", file=sys.stderr,
                mininterval=PROGRESS_S, dynamic_ncols=True)
