"""Shared fixtures: a private coordinator per test, and checks around every test that it leaves no
thread, worker process or shared memory of its own behind and that the row ledger balances."""
from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import threading
import time
import weakref
from multiprocessing import shared_memory

import pytest

import feeder
from feeder.processes import parent, shm

# A shell's background job (`pytest ... &` in a script, nohup) starts with SIGINT ignored, and the
# programs the Ctrl-C tests start would inherit that and never see their Ctrl-C: a handler here
# makes the programs this session starts begin with the default one.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


# Shared memory the suite could leave behind, told apart from what other programs on the machine
# make meanwhile (a shared machine always runs some: issue 35). Three kinds, each checked by names
# that only this test session's own objects carry:
# - feeder's segments: anonymous memory files ("memfd:feeder-slot-3", feeder.processes.shm) with no
#   name in /dev/shm; one leaks by staying mapped or open in *this* process after the test (a view
#   or descriptor the parent kept). Its mappings are recorded where feeder makes them (map_fd, as
#   feeder.processes.parent calls it: reading /proc/self/maps around every test cost 5 ms a test),
#   its descriptors are those /proc/self/fd shows.
# - multiprocessing's named semaphores (a Lock, Value or Queue of a "spawn" or "forkserver" context
#   keeps its name in /dev/shm until it is garbage). multiprocessing names them "sem.mp-*" after
#   its per-process "semprefix", which every process started by multiprocessing inherits from its
#   parent (multiprocessing/process.py: "Everything in self._config will be inherited by descendant
#   processes"): giving it this process's pid names this session's semaphores, and those of its
#   worker processes and their children, apart from every other program's. Once joblib's loky is
#   imported (scikit-learn imports it), a process names them "sem.loky-<its pid>-*" instead: those
#   of this process and of the processes it started are this session's.
# - multiprocessing.shared_memory segments (/dev/shm/psm_*): the names this process makes are recorded.
# (Only in the test session's own process: a worker process that imports this module, through a
# test module it unpickles a function from, keeps the prefix it inherited.)
_SESSION = multiprocessing.parent_process() is None
if _SESSION:
    multiprocessing.current_process()._config["semprefix"] = f"/mp-feedertests{os.getpid()}"
SEM_PREFIX = multiprocessing.current_process()._config["semprefix"]
_started_pids = {os.getpid()}  # this process and the processes it started with multiprocessing
_SESSION_START = time.time()  # a loky entry older than this run is no leak of it, whatever pid it names
_mapped: list = []  # (serial, segment, weak reference to the mapping) of feeder's mappings in this process
_mapped_lock = threading.Lock()
_mapped_serial = [0]
_map_fd = shm.map_fd
_made_segments: set = set()
_make_filename = shared_memory._make_filename
_start = multiprocessing.process.BaseProcess.start


def _recorded_make_filename():
    name = _make_filename()
    _made_segments.add(name.lstrip("/"))
    return name


def _recorded_start(self):
    _start(self)
    _started_pids.add(self.pid)


def _recorded_map_fd(fd, size, *, close=True, **kwargs):
    try:
        segment = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        segment = f"segment of fd {fd}"
    mem = _map_fd(fd, size, close=close, **kwargs)
    try:
        ref = weakref.ref(mem)
    except TypeError:  # pragma: no cover - the mmap.mmap fallback (no C library mmap)
        return mem
    with _mapped_lock:
        _mapped_serial[0] += 1
        _mapped.append((_mapped_serial[0], segment, ref))
    return mem


if _SESSION:
    shared_memory._make_filename = _recorded_make_filename
    multiprocessing.process.BaseProcess.start = _recorded_start
    for _module in (shm, parent):  # every module of feeder that maps segments in the parent
        assert _module.map_fd is _map_fd
        _module.map_fd = _recorded_map_fd


def _feeder_memory():
    """feeder's segments mapped or open in this process: {(serial or descriptor, name)} (the serial
    tells a new mapping from an old one; the inode a new descriptor from an old one in its place)."""
    with _mapped_lock:
        _mapped[:] = [m for m in _mapped if m[2]() is not None]
        found = {(serial, segment) for serial, segment, _ in _mapped}
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith("/memfd:feeder"):
                    found.add((f"fd {fd}, inode {os.stat(f'/proc/self/fd/{fd}').st_ino}", target))
            except OSError:  # closed meanwhile (the listing's own descriptor, another thread's)
                continue
    except OSError:  # no /proc (not Linux): no descriptors to check
        pass
    return found


def suite_shm_entries():
    """The named shared memory this test session made that exists now: entries of /dev/shm (see above)."""
    try:
        names = set(os.listdir("/dev/shm"))
    except OSError:
        return set()
    ours = ("sem." + SEM_PREFIX.lstrip("/") + "-", *(f"sem.loky-{pid}-" for pid in _started_pids))
    return {n for n in names if n.startswith(ours) and _made_since_start(n)} | (names & _made_segments)


def _made_since_start(name):
    """Whether /dev/shm/``name`` was made during this run: a pid of ours may be one a process of an
    earlier boot or run had (pids are reused), whose leftover entries then carry it."""
    try:
        return os.stat(os.path.join("/dev/shm", name)).st_mtime >= _SESSION_START - 1.0
    except OSError:
        return False  # gone meanwhile


class SegmentWatch:
    """What a piece of the suite leaves behind of the shared memory above (see ``left``)."""

    def __init__(self):
        self.named, self.feeder = suite_shm_entries(), _feeder_memory()

    def left(self, wait: float = 0.0):
        """Segments made since this watch began that are still there, after waiting up to ``wait``
        seconds for them to go (a mapping goes when its last view is garbage, which a reference cycle
        can hold until the garbage collector runs: it is run before anything is reported)."""
        deadline = time.monotonic() + wait
        collected = False
        while True:
            feeder_left = _feeder_memory() - self.feeder
            left = (suite_shm_entries() - self.named) | \
                {f"{n} ({'mapped' if isinstance(w, int) else w})" for w, n in feeder_left}
            if not left:
                return left
            if not collected:
                gc.collect()
                collected = True
                continue
            if time.monotonic() > deadline:
                return left
            time.sleep(0.01)


def feeder_processes():
    return [p for p in multiprocessing.active_children() if p.name.startswith("feeder:")]


@pytest.fixture(autouse=True)
def no_process_or_segment_left_behind():
    """Every test must leave no worker process and no shared memory (waits up to 3 s): see SegmentWatch."""
    watch = SegmentWatch()
    before = set(feeder_processes())
    yield
    deadline = time.monotonic() + 3.0
    while True:
        left = [p for p in feeder_processes() if p not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not left, f"worker processes left running: {[(p.name, p.pid) for p in left]}"
    left_shm = watch.left(wait=3.0)
    assert not left_shm, f"shared-memory segments left: {sorted(left_shm)}"


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


# Tests that start Ray (a local instance for the session, or a simulated 2-node cluster) take seconds
# each (Ray's startup, and its scheduling of every task): they are slow whether marked or not.
SLOW_FIXTURES = {"ray_local", "cluster_results"}


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow (stress, soak and Ray tests: .ci/run runs them); "
                          "without it they are deselected unless -m is given or a test is named by its id")


def _named(config, item) -> bool:
    """The command line names this test (or its parametrization) by node id: path::name."""
    for arg in config.args:
        if "::" not in arg:
            continue
        path, _, rest = arg.partition("::")
        if os.path.abspath(os.path.join(config.invocation_params.dir, path)) == str(item.path) and \
                item.nodeid.split("::", 1)[1].startswith(rest):
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m and -k selection (markers added here count there)
def pytest_collection_modifyitems(config, items):
    """The plain run leaves the tests marked slow out (it is the README's test command: about 3
    minutes on 2 cores); ``--slow`` runs them too, ``-m`` chooses by marker instead (``-m slow``:
    only them), and a test named by its node id always runs.

    Ray tests run last: the local Ray instance they start lives until the session ends, and its
    processes and threads must not take CPU from the timing-sensitive tests of other modules."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if not config.getoption("--slow") and not config.getoption("markexpr"):
        slow = [item for item in items if item.get_closest_marker("slow") is not None and not _named(config, item)]
        if slow:
            config.hook.pytest_deselected(items=slow)
            left = set(map(id, slow))
            items[:] = [item for item in items if id(item) not in left]
    items.sort(key=lambda item: item.get_closest_marker("ray") is not None)  # stable: order kept otherwise
