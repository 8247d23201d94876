"""The suite's own checks and settings (tests/conftest.py, issue 35): the leak checks report the
shared memory the suite leaves behind, and only that (a shared machine's other programs make
"sem.mp-*" and "psm_*" entries in /dev/shm at any time, and a test must not fail for them); and
the suite passes when started as a shell's background job (SIGINT ignored)."""
from __future__ import annotations

import multiprocessing
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
from multiprocessing import shared_memory, synchronize

import numpy as np
import pytest
from conftest import SegmentWatch
from utils import Sharded, read_line

import feeder
from feeder.processes.shm import new_fd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.path.isdir("/proc/self/fd"),
                                reason="needs /dev/shm and /proc (Linux)")

# Another program on the machine: makes multiprocessing semaphores (named both ways, see NAMINGS)
# and SharedMemory segments, and removes them again, keeping a few at all times, until its stdin closes.
NOISE = textwrap.dedent("""
    import itertools, multiprocessing, os, select, sys
    from multiprocessing import shared_memory, synchronize
    mp_name = synchronize.SemLock._make_name
    loky_name = lambda: f"/loky-{os.getpid()}-{next(synchronize.SemLock._rand)}"
    ctx = multiprocessing.get_context("spawn")
    held = []
    for i in itertools.count():
        if select.select([sys.stdin], [], [], 0.02)[0]:
            break
        synchronize.SemLock._make_name = staticmethod(loky_name if i % 2 else mp_name)
        held.append((ctx.Lock(), shared_memory.SharedMemory(create=True, size=4096)))
        if i == 1:
            print("made", *[lock._semlock.name for lock, _ in held], held[0][1].name, flush=True)
        if len(held) > 4:
            lock, segment = held.pop(0)
            segment.close()
            segment.unlink()
    for lock, segment in held:
        segment.close()
        segment.unlink()
""")


# How a process names its semaphores: multiprocessing's way, and joblib's loky's, which replaces it
# in every process that imports loky (scikit-learn does), as loky/backend/__init__.py does.
NAMINGS = {
    "multiprocessing": lambda: "%s-%s" % (multiprocessing.current_process()._config["semprefix"],
                                          next(synchronize.SemLock._rand)),
    "loky": lambda: f"/loky-{os.getpid()}-{next(synchronize.SemLock._rand)}",
}


def hold_a_semaphore(conn, naming: str) -> None:
    """In a worker process: make a named semaphore, say its /dev/shm entry, keep it until told to end."""
    synchronize.SemLock._make_name = staticmethod(NAMINGS[naming])
    lock = multiprocessing.get_context("spawn").Lock()
    conn.send(sem_entry(lock))
    conn.recv()


def sem_entry(lock) -> str:
    """The /dev/shm entry of a multiprocessing lock's semaphore."""
    name = lock._semlock.name
    assert name and os.path.exists(f"/dev/shm/sem.{name.lstrip('/')}"), name
    return f"sem.{name.lstrip('/')}"


@pytest.fixture
def noise():
    """Another program making and removing sem.mp-*, sem.loky-* and psm_* entries while the test runs."""
    proc = subprocess.Popen([sys.executable, "-c", NOISE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        read_line(proc, "made")
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_other_programs_shared_memory_is_not_reported(noise):
    watch = SegmentWatch()
    first = set(os.listdir("/dev/shm"))
    kinds = ("sem.mp-", "sem.loky-", "psm_")
    for _ in range(100):  # until the other program has made new entries of each kind (two per 20 ms)
        made = {n for n in set(os.listdir("/dev/shm")) - first if n.startswith(kinds)}
        if all(any(n.startswith(k) for n in made) for k in kinds):
            break
        select.select([], [], [], 0.05)
    assert all(any(n.startswith(k) for n in made) for k in kinds), made  # the noise is there ...
    assert not watch.left()  # ... and none of it is the suite's


@pytest.mark.parametrize("naming", NAMINGS)
def test_a_semaphore_the_test_keeps_is_reported(monkeypatch, naming):
    monkeypatch.setattr(synchronize.SemLock, "_make_name", staticmethod(NAMINGS[naming]))
    watch = SegmentWatch()
    lock = multiprocessing.get_context("forkserver").Lock()  # named until it is garbage
    assert watch.left() == {sem_entry(lock)}
    del lock
    assert not watch.left()


@pytest.mark.parametrize("naming", NAMINGS)
def test_a_semaphore_a_worker_process_keeps_is_reported(naming):
    """Semaphores the suite's processes make are the session's too (they inherit its prefix, or
    carry their own pid)."""
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    watch = SegmentWatch()
    proc = ctx.Process(target=hold_a_semaphore, args=(child_end, naming), daemon=True)
    proc.start()
    try:
        assert parent_end.poll(60), "the process made no semaphore"
        name = parent_end.recv()
        assert watch.left() == {name}
        parent_end.send("end")
    finally:
        parent_end.close()  # (after a failure above, the process's recv() ends too)
        proc.join(30)
        proc.kill()
    assert proc.exitcode == 0
    assert not watch.left(wait=10)  # multiprocessing removes it at the process's exit


def test_a_shared_memory_segment_the_test_keeps_is_reported():
    watch = SegmentWatch()
    segment = shared_memory.SharedMemory(create=True, size=4096)
    try:
        assert watch.left() == {segment.name.lstrip("/")}
    finally:
        segment.close()
        segment.unlink()
    assert not watch.left()


def test_a_feeder_segment_left_open_is_reported():
    watch = SegmentWatch()
    fd = new_fd(4096, "feeder-slot-0")
    try:
        left = watch.left()
        assert len(left) == 1 and "memfd:feeder-slot-0" in left.pop()
    finally:
        os.close(fd)
    assert not watch.left()


def test_a_feeder_segment_a_batch_keeps_mapped_after_stop_is_reported(coord):
    watch = SegmentWatch()
    feeder.init_data_input_workers(None, ["id", "x"], Sharded(640, 1, sizes=(64,)), 64, coordinator=coord,
                                   num_worker_processes=1, timeout=30)
    coord.start()
    batch = coord.feed("train").next_batch()  # a view of the worker's segment (no copy)
    coord.stop()
    left = watch.left()
    assert left and all("memfd:feeder-slot-" in n for n in left), left
    assert np.array_equal(batch["id"], np.arange(64))
    del batch
    assert not watch.left(wait=10)


def test_part_of_the_suite_passes_in_the_background_while_other_programs_make_shared_memory(noise):
    """Issue 35: the README's test command failed with 150 errors on a shared machine, the leak check
    reporting every sem.mp-* entry that another program made meanwhile. A few tests of worker
    processes, one with multiprocessing objects of its own, run here beside such a program, in a
    pytest started as a shell starts a background job: with SIGINT ignored, which the programs
    that the Ctrl-C test starts inherited (they then never saw their Ctrl-C)."""
    tests = ["test_lambdas_and_closures_run_in_processes",
             "(test_multiprocessing_objects_held_by_fetch_fun_travel_as_multiprocessing_sends_them and forkserver)",
             "test_ctrl_c_gives_one_keyboard_interrupt"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
                          "tests/test_processes.py", "-k", " or ".join(tests)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    assert re.search(r"\b3 passed", run.stdout), run.stdout[-2000:]


def collected(*args: str) -> list:
    """The node ids a pytest run with ``args`` would run (--collect-only)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    return [line for line in run.stdout.splitlines() if "::" in line]


@pytest.mark.slow  # five pytest runs
def test_the_plain_run_leaves_the_slow_tests_out_and_every_other_way_runs_them():
    """The README's command is the plain run (issue 35: about 3 minutes on 2 cores); .ci/run runs
    the slow tests with -m slow; --slow runs everything; a slow test named by its id runs."""
    slow = "tests/test_tuning.py::test_auto_climbs_for_a_fetch_slower_than_the_window"
    quick = "tests/test_tuning.py::test_auto_settles_on_more_fetchers_for_a_sleeping_fetch"
    plain = collected("tests/test_tuning.py")
    assert quick in plain and slow not in plain
    assert slow in collected("tests/test_tuning.py", "--slow") and quick in collected("tests/test_tuning.py", "--slow")
    only_slow = collected("tests/test_tuning.py", "-m", "slow")
    assert slow in only_slow and quick not in only_slow
    assert collected(slow) == [slow]
