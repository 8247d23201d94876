"""Small test doubles and waits shared by the test modules."""
from __future__ import annotations

import subprocess
import threading
import time
from typing import Callable

import numpy as np


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Wait for a state that no Event announces (e.g. a queue filling up), bounded by ``timeout`` s
    (a deadline, not a duration: it returns as soon as the state is there, and on a loaded 2-core
    machine starting a worker process alone can take seconds; 5 s timed out there, issue 35)."""
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        tick.wait(0.005)


def workers(mode: str, n: int) -> dict:
    """The keyword that asks for ``n`` fetchers in ``mode`` ("threads" or "processes")."""
    return {"num_worker_threads": n} if mode == "threads" else {"num_worker_processes": n}


class Dataset:
    """A finite dataset of ``n`` rows served in chunks: ids plus a float copy to check alignment.

    Thread-safe; chunk sizes come from ``sizes`` (cycled). Raises StopIteration when drained.
    """

    def __init__(self, n: int, sizes=(5,), width: int = 2, delay: Callable[[], float] = None):
        self.n = n
        self.sizes = list(sizes)
        self.width = width
        self._next = 0
        self._calls = 0
        self._lock = threading.Lock()
        self.delay = delay

    def __call__(self, worker_id: int, batch_size: int):
        if self.delay is not None:
            d = self.delay()
            if d:
                time.sleep(d)  # simulates I/O latency; not used to synchronise
        with self._lock:
            if self._next >= self.n:
                raise StopIteration
            size = self.sizes[self._calls % len(self.sizes)]
            self._calls += 1
            start, stop = self._next, min(self.n, self._next + size)
            self._next = stop
        ids = np.arange(start, stop, dtype=np.int64)
        return [ids, np.repeat(ids[:, None].astype(np.float32), self.width, axis=1)]


def check_aligned(batch) -> np.ndarray:
    ids = batch["id"]
    assert (batch["x"] == ids[:, None]).all(), "rows of the inputs are not aligned"
    return ids.copy()


class ListLogger:
    """An external logger recording every metrics dict it receives."""

    def __init__(self):
        self.records = []
        self.got = threading.Event()

    def log(self, metrics):
        self.records.append(metrics)
        self.got.set()


class Sharded:
    """``n`` rows (ids plus an aligned float copy) split into ``workers`` contiguous shards: worker
    ``w`` (``first_id + w`` is its worker id) serves its own shard in chunks of ``sizes`` (cycled),
    then raises StopIteration. Per-worker state only, so the same rows come out whether the workers
    are threads sharing this object or processes holding copies of it (module-level, picklable)."""

    def __init__(self, n: int, workers: int, sizes=(5,), width: int = 2, first_id: int = 0, delay: float = 0.0):
        self.n, self.workers, self.sizes, self.width = n, workers, list(sizes), width
        self.first_id, self.delay = first_id, delay
        self._pos = {}

    def shard(self, w: int):
        k = w - self.first_id
        return self.n * k // self.workers, self.n * (k + 1) // self.workers

    def __call__(self, worker_id: int, batch_size: int):
        if self.delay:
            time.sleep(self.delay)
        lo, hi = self.shard(worker_id)
        pos, calls = self._pos.get(worker_id, (lo, 0))
        if pos >= hi:
            raise StopIteration
        stop = min(hi, pos + self.sizes[calls % len(self.sizes)])
        self._pos[worker_id] = (stop, calls + 1)
        ids = np.arange(pos, stop, dtype=np.int64)
        return [ids, np.repeat(ids[:, None].astype(np.float32), self.width, axis=1)]


def rows_of_ones(n: int = 4):
    return [np.ones((n, 2), np.float32)]


class FailAt:
    """Raises ``exc`` at call ``n`` of worker ``worker`` (any worker if None), else returns 4 rows."""

    def __init__(self, n: int, exc: BaseException, worker=None):
        self.n, self.exc, self.worker = n, exc, worker
        self._calls = {}

    def __call__(self, worker_id: int, batch_size: int):
        k = self._calls[worker_id] = self._calls.get(worker_id, 0) + 1
        if k == self.n and (self.worker is None or worker_id == self.worker):
            raise self.exc
        return rows_of_ones()


class UnprintableError(Exception):
    """An exception whose own ``__str__`` raises."""

    def __str__(self):
        raise RuntimeError("str is broken")


class UnpicklableError(Exception):
    """Pickles, but cannot be rebuilt (its __init__ wants two arguments)."""

    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


def raise_unpicklable(worker_id: int, batch_size: int):
    raise UnpicklableError("left", "right")


class DieAt:
    """Worker ``worker`` dies at its call ``n``: ``how`` is "exit" (os._exit(7)), "segfault" or "sigkill"."""

    def __init__(self, n: int, how: str, worker: int = 0, stamp: str = ""):
        self.n, self.how, self.worker, self.stamp = n, how, worker, stamp
        self._calls = 0

    def __call__(self, worker_id: int, batch_size: int):
        import os
        import signal
        if worker_id == self.worker:
            self._calls += 1
            if self._calls == self.n:
                if self.stamp:  # when it died, for the parent to measure how soon it knew
                    with open(self.stamp, "w") as f:
                        f.write(repr(time.time()))
                if self.how == "exit":
                    os._exit(7)
                if self.how == "segfault":
                    import ctypes
                    import faulthandler
                    faulthandler.disable()  # keep the test's output quiet
                    ctypes.string_at(0)
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.001)
        return rows_of_ones()


def sleep_forever(worker_id: int, batch_size: int):
    time.sleep(3600)  # stuck in "I/O"


def hang_worker_zero(worker_id: int, batch_size: int):
    if worker_id == 0:
        time.sleep(3600)
    return rows_of_ones()


def random_probe(worker_id: int, batch_size: int):
    """One row: worker id, a draw from `random` and one from numpy's global generator."""
    import random
    return [np.array([[worker_id, random.random(), np.random.random()]])]


_INIT = {}


def record_init(worker_id: int):
    _INIT["worker"] = worker_id * 100


def report_init(worker_id: int, batch_size: int):
    return [np.array([_INIT.get("worker", -1)], np.int64)]


def echo_batch_size(worker_id: int, batch_size: int):
    time.sleep(0.002)
    return [np.full(batch_size, batch_size, np.int64)]


class BadAt:
    """Returns int64 ids; at call ``n`` a float32 chunk (a dtype the source does not take)."""

    def __init__(self, n: int):
        self.n = n
        self._calls = 0

    def __call__(self, worker_id: int, batch_size: int):
        self._calls += 1
        if self._calls == self.n:
            return [np.zeros(3, np.float32)]
        return [np.arange(3, dtype=np.int64)]


_STRING_CALLS = {}


def strings(worker_id: int, batch_size: int):
    """Rows of a str array (any width; every other call an object array of str, which a string input
    takes too) and a bytes array."""
    k = _STRING_CALLS[worker_id] = _STRING_CALLS.get(worker_id, 0) + 1
    texts = [f"w{worker_id}-{'x' * i}" for i in range(3)]
    return [np.array(texts, dtype=object if k % 2 == 0 else str), np.array([b"ab", b"c", b"def"])]


class PerWorker:
    """Deterministic per worker: worker w's k-th chunk holds ids w*1e6 + k*1000 + row, ``chunks[w]``
    chunks in all, with random pauses of up to ``delay`` s (jitter, not synchronisation)."""

    def __init__(self, chunks_per_worker, sizes, delay=0.0, seed=None):
        self.chunks, self.sizes, self.delay, self.seed = list(chunks_per_worker), list(sizes), delay, seed
        self._calls = {}
        self._rngs = {}

    def __call__(self, worker_id: int, batch_size: int):
        import random
        k = self._calls.get(worker_id, 0)
        self._calls[worker_id] = k + 1
        rng = self._rngs.setdefault(worker_id, random.Random(f"{self.seed}-{worker_id}"))
        pause = rng.random() * self.delay
        if k >= self.chunks[worker_id % len(self.chunks)]:
            raise StopIteration
        if pause:
            time.sleep(pause)
        n = self.sizes[(worker_id + k) % len(self.sizes)]
        ids = worker_id * 1_000_000 + k * 1000 + np.arange(n, dtype=np.int64)
        return [ids, np.repeat(ids[:, None].astype(np.float32), 2, axis=1)]


class NoneAndEmpty(Sharded):
    """A Sharded dataset whose worker returns None at every 3rd call and an empty chunk at the next."""

    def __call__(self, worker_id: int, batch_size: int):
        k = self._pos.get(("k", worker_id), 0)
        self._pos[("k", worker_id)] = k + 1
        if k % 3 == 0:
            return None
        if k % 3 == 1:
            return [np.zeros(0, np.int64), np.zeros((0, 2), np.float32)]
        return super().__call__(worker_id, batch_size)


def tiny_by_worker(worker_id: int, batch_size: int):
    return [np.zeros((1 + worker_id % 3, 4), np.float32)]  # tiny chunks: coalesced


def ones4(worker_id: int, batch_size: int):
    return rows_of_ones()


def four_tiny_then_block(worker_id: int, batch_size: int):
    """Four chunks of 2 rows (a quarter of a batch of 8) at once, then a call that blocks for long."""
    n = _STRING_CALLS[("held", worker_id)] = _STRING_CALLS.get(("held", worker_id), 0) + 1
    if n <= 4:
        return [np.full(2, worker_id * 100 + n, np.int64)]
    time.sleep(10)  # waits for new input, for a long time
    raise StopIteration


def regex_forever(worker_id: int, batch_size: int):
    """Holds the GIL in C code (catastrophic backtracking in the regex engine) for a very long time."""
    import re
    re.match(r"(a+)+$", "a" * 64 + "b")


class Cycle:
    """Chunks of ``sizes`` rows (cycled, per worker): ``seq`` [2, n, 4] batched on axis 1 holding the row id,
    ``y`` [n] the same ids."""

    def __init__(self, sizes):
        self.sizes = list(sizes)
        self._k = {}

    def __call__(self, worker_id: int, batch_size: int):
        k = self._k[worker_id] = self._k.get(worker_id, 0) + 1
        n = self.sizes[(k - 1) % len(self.sizes)]
        ids = np.arange(n, dtype=np.int64) + 1000 * k
        return [np.broadcast_to(ids[None, :, None], (2, n, 4)).astype(np.float32), ids]


class Const:
    """Returns the same chunk at every call (module-level: worker processes can run it)."""

    def __init__(self, chunk):
        self.chunk = chunk

    def __call__(self, worker_id: int, batch_size: int):
        return self.chunk


def batch_of_64k(worker_id: int, batch_size: int):
    return [np.ones((batch_size, 16 * 1024 // batch_size), np.float32)]


def until(seconds: float):
    """Iterate for ``seconds`` (a loop bounded in time, not in iterations)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        yield


class FreshSlices:
    """A copy of 64 rows of 3x64x64 float32 (3 MB) from a pool, fresh per call, as a decoding fetch
    makes; the pool is built in the process (not pickled) and sits below the fresh arrays."""

    def __init__(self, pool_rows: int = 512):
        self.pool_rows = pool_rows
        self.pool = None

    def __call__(self, worker_id: int, batch_size: int):
        if self.pool is None:
            self.pool = np.ones((self.pool_rows, 3, 64, 64), np.float32)
        start = (worker_id * 64) % (self.pool_rows - 64)
        return [self.pool[start:start + 64].copy()]


def read_line(proc: subprocess.Popen, prefix: str, timeout: float = 30.0) -> str:
    """The first line the child prints that starts with ``prefix`` (stripped); fails if it exits
    or ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line.strip()
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"child never printed {prefix!r}: {proc.communicate()[1]}")


def exits_cleanly(proc: subprocess.Popen, within: float = 3.0) -> None:
    """The child exits by itself within ``within`` seconds, with status 0 and no traceback."""
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert time.monotonic() - t0 < within
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "Fatal Python error" not in err, err


class CountCalls:
    """Appends a line to ``path`` at every call, in whichever process it runs; worker ``fail_worker``
    (every worker if None) raises ValueError, the others return 4 rows after 1 ms."""

    def __init__(self, path: str, fail_worker=None):
        self.path, self.fail_worker = path, fail_worker

    def __call__(self, worker_id: int, batch_size: int):
        with open(self.path, "a") as f:
            f.write(f"{worker_id}\n")
        if self.fail_worker is None or worker_id == self.fail_worker:
            raise ValueError("broken source")
        time.sleep(0.001)
        return rows_of_ones()


def count_lines(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


class ZeroWidth(Sharded):
    """A Sharded dataset whose second input has rows but no bytes: shape (rows, 0)."""

    def __call__(self, worker_id: int, batch_size: int):
        ids, _ = super().__call__(worker_id, batch_size)
        return [ids, np.zeros((len(ids), 0), np.float32)]


class ShrinkSegments:
    """Hostile, for worker processes only: from its first call on it records a descriptor of every
    shared-memory segment its process creates (feeder.processes.shm.new_fd), and at every call truncates them
    all to 0 bytes, as a buggy or malicious fetch_fun could. ``unsealed=True`` also makes the
    segments without any seal. Returns ``rows`` rows of 1024 ones."""

    def __init__(self, rows: int = 64, unsealed: bool = False):
        self.rows, self.unsealed = rows, unsealed
        self._kept = None

    def __call__(self, worker_id: int, batch_size: int):
        import os

        from feeder.processes import shm
        if self._kept is None:
            kept = self._kept = []
            real = shm.new_fd

            def spy(size, name="feeder"):
                if self.unsealed:
                    fd = os.memfd_create(name, os.MFD_CLOEXEC)
                    os.ftruncate(fd, size)
                else:
                    fd = real(size, name)
                kept.append(os.dup(fd))
                return fd

            shm.new_fd = spy
        for fd in self._kept:
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass  # sealed against shrinking
        return [np.ones((self.rows, 1024), np.float32)]


def counted_fetch(counter, queue=None):
    """A closure (cloudpickled to worker processes) holding multiprocessing objects: increments
    ``counter`` (a multiprocessing Value) at every call and puts its worker id on ``queue`` once."""
    seen = []

    def fetch(worker_id, batch_size):
        with counter.get_lock():
            counter.value += 1
        if queue is not None and not seen:
            seen.append(worker_id)
            queue.put(worker_id)
        time.sleep(0.001)
        return [np.full(4, worker_id, np.int64)]

    return fetch


def limit_open_files(worker_id: int) -> None:
    """A worker_init_fun: this process may have 256 descriptors open (a process holds far fewer
    than its hundreds of slots)."""
    import resource
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


class XOnly:
    """A ``Sharded``-like fetch function's second array (x) alone, for a session that takes x only."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, worker_id: int, batch_size: int):
        return [self.inner(worker_id, batch_size)[1]]


class TinyThenBlock:
    """``n`` chunks of one row (ids 0 to n-1), then a call that blocks for long, which first creates
    the file ``entered`` (so that a test knows, whether this runs in a thread or a process)."""

    def __init__(self, n: int, entered: str):
        self.n, self.entered, self.calls = n, entered, 0

    def __call__(self, worker_id: int, batch_size: int):
        self.calls += 1
        if self.calls <= self.n:
            return [np.full(1, self.calls - 1, np.int64)]
        open(self.entered, "w").close()
        time.sleep(3600)


class CountingSource:
    """A fetch function with ``feeder_counters`` (what issue 28's retries use): each call counts one
    "retries" for its worker, in the process it runs in; ``chunks`` calls per worker."""

    def __init__(self, chunks: int = 5):
        self.chunks = chunks
        self.done: dict = {}

    def feeder_counters(self, worker_ids):
        return {"retries": float(sum(self.done.get(w, 0) for w in worker_ids)), "rows_filtered": 0.0}

    def __call__(self, worker_id: int, batch_size: int):
        n = self.done.get(worker_id, 0)
        if n >= self.chunks:
            raise StopIteration
        self.done[worker_id] = n + 1
        return [np.full((4, 1), worker_id, np.float32)]


class IdAndOne:
    """A ``Sharded``-like fetch function's rows as x = [id, 1.0] (what ``id_outputs_model``'s outputs
    tell the rows by: tests/test_runtime.py ``ids_of``), for threads and worker processes alike."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, worker_id: int, batch_size: int):
        ids = self.inner(worker_id, batch_size)[0]
        x = np.ones((len(ids), 2), np.float32)
        x[:, 0] = ids
        return [x]
