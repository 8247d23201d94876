"""Fetcher threads' turn-taking (feeder.fetchers.Turns): every hand-over and steal, under races."""
import random
import threading
import time

from feeder import fetchers
from feeder.chunkqueue import ChunkQueue
from feeder.fetchers import Turns, WorkerState


def test_turns_hand_overs_and_steals_race_without_error(monkeypatch):
    # Holders that hold longer than STEAL_S between calls get their turn stolen while give()
    # hands it on to the longest waiter: a steal must never race with a hand-over (it once removed
    # an entry give() had taken: "ValueError: ... is not in deque" in a fetcher thread).
    monkeypatch.setattr(fetchers, "STEAL_S", 0.0002)  # steals as often as hand-overs: the race in reach
    turns, stop = Turns(), threading.Event()
    source = ChunkQueue("turns", 4)
    counts, errors = [0] * 8, []

    def worker(wid):
        rng, state = random.Random(wid), WorkerState(wid)
        try:
            while not stop.is_set():
                if not turns.take(state, stop, source):
                    continue
                if turns.holds(wid):
                    counts[wid] += 1
                    # Sometimes "block" in a call so that a waiter steals the turn.
                    time.sleep(rng.choice((0.0, 0.0, 0.0001, 0.0003)))
                turns.give(wid)
        except BaseException as e:  # noqa: BLE001 - the test reports any error of a worker
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(5)
    assert not errors, errors
    assert all(counts), f"every worker gets turns: {counts}"
    assert not any(t.is_alive() for t in threads)
