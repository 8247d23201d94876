"""Bounded joins: threads joined against one shared deadline, so that stop() has one budget.

Below everything that starts threads (the fetchers, the coordinator, ``sources.ray``), so that
none of them imports another for it."""
from __future__ import annotations

import threading
import time
from typing import Sequence


def join_all(threads: Sequence[threading.Thread], deadline: float) -> None:
    """Join threads against one shared deadline (monotonic seconds), not a timeout each."""
    me = threading.current_thread()
    for t in threads:
        if t is not me and t.is_alive():
            t.join(max(0.0, deadline - time.monotonic()))
