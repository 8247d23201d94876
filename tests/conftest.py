"""Shared fixtures: a private coordinator per test, and a thread-leak check around every test."""
from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time

import pytest

import feeder


def feeder_threads():
    return [t for t in threading.enumerate() if t.name.startswith("feeder:")]


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    """Every test must leave no feeder thread running (waits up to 3 s for them to end)."""
    before = set(feeder_threads())
    yield
    deadline = time.monotonic() + 3.0
    while True:
        left = [t for t in feeder_threads() if t not in before and t.is_alive()]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not left, f"threads left running: {[t.name for t in left]}"


def _shm_entries():
    """Entries of /dev/shm that Python's multiprocessing or feeder could have made (other programs on
    the machine may add their own meanwhile)."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return set()
    return {n for n in names if n.startswith(("psm_", "feeder", "sem.mp-", "mp-"))}


def feeder_processes():
    return [p for p in multiprocessing.active_children() if p.name.startswith("feeder:")]


@pytest.fixture(autouse=True)
def no_process_or_segment_left_behind():
    """Every test must leave no worker process and no shared-memory segment (waits up to 3 s)."""
    shm_before = _shm_entries()
    before = set(feeder_processes())
    yield
    deadline = time.monotonic() + 3.0
    while True:
        left = [p for p in feeder_processes() if p not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not left, f"worker processes left running: {[(p.name, p.pid) for p in left]}"
    assert _shm_entries() <= shm_before, f"shared-memory segments left: {_shm_entries() - shm_before}"


MODES = ["threads", "processes"]


@pytest.fixture(params=MODES)
def mode(request):
    """Run a test with fetchers as threads and as worker processes (fetch functions must then be
    module-level or instances of module-level classes: tests/utils.py)."""
    return request.param


@pytest.fixture
def coord():
    c = feeder.GlobalCoordinator(join_timeout=3.0)
    yield c
    c.stop()


class _LedgerWatch(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.bad = []

    def emit(self, record):
        if "ledger does not balance" in record.getMessage():
            self.bad.append(record.getMessage())


@pytest.fixture(autouse=True)
def ledger_always_balances(request):
    """Every test doubles as a ledger audit: an unbalanced row ledger is a bug wherever it shows."""
    watch = _LedgerWatch()
    logger = logging.getLogger("feeder")
    logger.addHandler(watch)
    yield watch
    logger.removeHandler(watch)
    if "ledger_may_fail" not in request.keywords:
        assert not watch.bad, watch.bad


def pytest_collection_modifyitems(config, items):
    """Ray tests run last: the local Ray instance they start lives until the session ends, and its
    processes and threads must not take CPU from the timing-sensitive tests of other modules."""
    items.sort(key=lambda item: item.get_closest_marker("ray") is not None)  # stable: order kept otherwise
