"""Interpreter exit without stop() and Ctrl-C in a blocked consumer, in subprocesses (issue 4)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from utils import exits_cleanly, read_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = textwrap.dedent("""
    import sys, time, threading
    import numpy as np
    sys.path.insert(0, {root!r})
    import feeder
""").format(root=ROOT)


def spawn(body: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_line(proc: subprocess.Popen, expected: str, timeout: float = 20.0) -> None:
    assert read_line(proc, expected, timeout) == expected


@pytest.mark.parametrize("coordinator", ["global", "private"])
def test_interpreter_exit_without_stop_with_a_fetcher_stuck_in_sleep(coordinator):
    proc = spawn(f"""
        def fetch(worker_id, batch_size):
            if worker_id == 0:
                time.sleep(3600)  # stuck in I/O forever
            return [np.zeros((batch_size, 4), np.float32)]
        c = None if {coordinator!r} == "global" else feeder.GlobalCoordinator()
        coord = feeder.init_data_input_workers(None, ["x"], fetch, 8, num_worker_threads=2, coordinator=c)
        coord.start()
        for _ in range(100):
            coord.feed("train").next_batch(timeout=10)
        print("consumed", flush=True)
        # falls off the end: no stop()
    """)
    wait_for_line(proc, "consumed")
    exits_cleanly(proc)


def test_sigint_in_a_consumer_blocked_in_next_batch_ends_the_program():
    proc = spawn("""
        def fetch(worker_id, batch_size):
            time.sleep(3600)
        # join_timeout: a stop at exit that waited the whole of it would take far longer than the bound below
        coord = feeder.init_data_input_workers(None, ["x"], fetch, 8,
                                               coordinator=feeder.GlobalCoordinator(join_timeout=60))
        coord.start()
        print("blocking", flush=True)
        coord.feed("train").next_batch(timeout=600)
    """)
    wait_for_line(proc, "blocking")
    time.sleep(0.2)  # let the child enter next_batch (nothing to wait on across processes)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 10.0  # about 0.5 s (the stop at exit); room for a loaded machine
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err and "Fatal Python error" not in err, err


def test_exit_while_batches_flow_through_onnxruntime():
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    proc = spawn(f"""
        sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
        from models import linear_model, session
        sess = session(linear_model())
        coord = feeder.init_data_input_workers(sess, None, lambda w, b: [np.ones((5, 4), np.float32)], 16)
        coord.start()
        for _ in range(50):
            coord.feed("train").run()
        print("ran", flush=True)
    """)
    wait_for_line(proc, "ran")
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0 and "Fatal Python error" not in err and "Traceback" not in err, err


def test_forgotten_stop_releases_a_consumer_in_a_non_daemon_thread_at_exit():
    """Issue 9, defect 8: atexit handlers run only after non-daemon threads are joined, so a
    consumer thread waiting in next_batch() kept the interpreter alive for its whole timeout."""
    proc = spawn("""
        def fetch(worker_id, batch_size):
            time.sleep(3600)  # never delivers
        # the consumer's timeout and join_timeout: waiting for either would take far longer than the bound below
        coord = feeder.init_data_input_workers(None, ["x"], fetch, 8, num_worker_threads=1, timeout=60,
                                               coordinator=feeder.GlobalCoordinator(join_timeout=60))
        coord.start()
        outcome = []
        def consume():
            try:
                coord.feed("train").next_batch()
            except feeder.FeedStopped:
                outcome.append("stopped")
                print("consumer released", flush=True)
        threading.Thread(target=consume, name="consumer").start()  # not a daemon
        time.sleep(0.2)
        print("main returns", flush=True)
    """)
    wait_for_line(proc, "main returns")
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    # about 1 s (the stop at exit waits 0.5 s for the stuck fetcher); 3 s was too little on a loaded machine
    assert time.monotonic() - t0 < 10.0, "the interpreter waited for the consumer's timeout or the join budget"
    assert "consumer released" in out and proc.returncode == 0, err
