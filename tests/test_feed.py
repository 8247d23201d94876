"""The seed's own test suite restated on this API, plus the consumer calls of a feed."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from utils import Cycle, Sharded, check_aligned, wait_until, workers

import feeder
import feeder.feed


def random_rows_fetcher(seed=0, low=1, high=64, width=3):
    """Chunks of 1..64 random rows: data [n, width] float32, label = data[:, 0]."""
    lock = threading.Lock()
    rng = np.random.default_rng(seed)

    def fetch(worker_id, batch_size):
        with lock:
            n = int(rng.integers(low, high + 1))
            data = rng.standard_normal((n, width)).astype(np.float32)
        return [data, data[:, 0].copy()]

    return fetch


def test_seed_suite_500_batches_of_32_rows_aligned(coord):
    feeder.init_data_input_workers(None, ["data", "label"], random_rows_fetcher(), 32, coordinator=coord)
    coord.start()
    feed = coord.feed("train")
    for _ in range(500):
        batch = feed.next_batch(timeout=10)
        assert set(batch) == {"data", "label"}
        assert batch["data"].shape == (32, 3) and batch["label"].shape == (32,)
        np.testing.assert_array_equal(batch["data"][:, 0], batch["label"])
    assert feed.metrics()["batches"] == 500
    assert coord.stop() is True


def test_worker_ids_come_from_one_sequence(coord):
    seen = {}
    lock = threading.Lock()

    def fetch_for(name):
        def fetch(worker_id, batch_size):
            with lock:
                seen.setdefault(name, set()).add(worker_id)
            return [np.zeros((1, 1), np.float32)]
        return fetch

    assert feeder.init_data_input_workers(None, ["x"], fetch_for("a"), 4, num_worker_threads=3,
                                          input_source_name="a", coordinator=coord) is coord
    feeder.init_data_input_workers(None, ["x"], fetch_for("b"), 4, num_worker_threads=2,
                                   input_source_name="b", coordinator=coord)
    assert coord.feed("a").worker_ids == [0, 1, 2]
    assert coord.feed("b").worker_ids == [3, 4]
    coord.start()
    coord.feed("a").next_batch(timeout=10)
    coord.feed("b").next_batch(timeout=10)
    coord.stop()
    assert seen["a"] <= {0, 1, 2} and seen["b"] <= {3, 4}
    # ids keep counting after a stop: unique within the coordinator
    feeder.init_data_input_workers(None, ["x"], fetch_for("c"), 4, input_source_name="c", coordinator=coord)
    assert coord.feed("c").worker_ids == [5, 6]


def test_stop_returns_true_while_enqueuer_is_blocked_with_nobody_consuming(coord):
    produced = threading.Event()

    def fetch(worker_id, batch_size):
        produced.set()
        return [np.zeros((batch_size, 2), np.float32)]

    feeder.init_data_input_workers(None, ["x"], fetch, 8, max_buffered_batches=2, coordinator=coord)
    coord.start()
    assert produced.wait(5)
    feed = coord.feed("train")
    # fill everything: ready queue and chunk queue are full, enqueuer and fetchers are blocked
    wait_until(lambda: feed.metrics()["ready_batches"] == feed._ready.maxsize
               and coord.get_queue("train", 2).full(), what="a full pipeline")
    assert coord.stop() is True


def test_batches_keep_input_order_with_one_worker(coord):
    counter = iter(range(10**9))

    def fetch(worker_id, batch_size):
        start = next(counter) * 5
        return {"id": np.arange(start, start + 5)}

    feeder.init_data_input_workers(None, ["id"], fetch, 7, num_worker_threads=1, coordinator=coord)
    coord.start()
    feed = coord.feed("train")
    got = np.concatenate([feed.next_batch(timeout=10)["id"] for _ in range(20)])
    assert got.tolist() == list(range(140))


def test_dont_rebatch_passes_chunks_through(coord, mode):
    feeder.init_data_input_workers(None, ["seq", "y"], Cycle([3, 5, 1, 7]), 4, dont_rebatch=True,
                                   batch_columns=[1, 0], coordinator=coord, **workers(mode, 1))
    coord.start()
    feed = coord.feed("train")
    assert [feed.next_batch(timeout=10)["y"].shape[0] for _ in range(8)] == [3, 5, 1, 7] * 2


def test_batch_columns_rebatch_along_another_axis(coord, mode):
    feeder.init_data_input_workers(None, ["seq", "y"], Cycle([3]), 5, batch_columns=[1, 0], coordinator=coord,
                                   **workers(mode, 2))
    coord.start()
    for _ in range(10):
        b = coord.feed("train").next_batch(timeout=10)
        assert b["seq"].shape == (2, 5, 4) and b["y"].shape == (5,)
        assert (b["seq"] == b["y"][None, :, None]).all()  # rows of both inputs stay aligned


def test_iteration_and_fetch_fun_sees_batch_size(coord):
    asked = []

    def fetch(worker_id, batch_size):
        asked.append(batch_size)
        return [np.zeros((2, 1))]

    feeder.init_data_input_workers(None, ["x"], fetch, 6, num_worker_threads=1, coordinator=coord)
    with coord:
        for i, batch in enumerate(coord.feed("train")):
            assert batch["x"].shape == (6, 1)
            if i == 4:
                break
    assert set(asked) == {6}


def test_run_without_session_raises(coord):
    feeder.init_data_input_workers(None, ["x"], lambda w, b: [np.zeros((1, 1))], 2, coordinator=coord)
    coord.start()
    with pytest.raises(feeder.FeederError, match="no session"):
        coord.feed("train").run()


def test_reset_data_input_changes_batch_size_without_losing_rows(coord):
    counter = iter(range(10**9))
    asked = []

    def fetch(worker_id, batch_size):
        asked.append(batch_size)
        start = next(counter) * 3
        return [np.arange(start, start + 3)]

    feeder.init_data_input_workers(None, ["id"], fetch, 4, num_worker_threads=1, max_buffered_batches=2,
                                   coordinator=coord)
    coord.start()
    feed = coord.feed("train")
    got = [feed.next_batch(timeout=10)["id"] for _ in range(3)]
    coord.reset_data_input("train", 10)
    assert feed.batch_size == 10
    for _ in range(12):
        got.append(feed.next_batch(timeout=10)["id"])
    sizes = [len(g) for g in got]
    assert sizes[:3] == [4, 4, 4] and sizes[-1] == 10 and set(sizes) <= {4, 10}
    flat = np.concatenate(got)
    assert flat.tolist() == list(range(len(flat)))
    assert 10 in asked
    with pytest.raises(ValueError):
        coord.reset_data_input("train", 0)
    with pytest.raises(KeyError):
        coord.reset_data_input("nope", 3)


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("slow_every", [0, 7], ids=["fast", "some-slow-calls"])
def test_each_byte_is_copied_at_most_once(coord, workers, slow_every):
    """Tiny chunks are coalesced in the fetchers; whatever path rows take, no byte is copied twice."""
    lock = threading.Lock()
    state = {"next": 0, "calls": 0}

    def fetch(worker_id, batch_size):
        with lock:
            state["calls"] += 1
            slow = slow_every and state["calls"] % slow_every == 0
            n = 1 + state["calls"] % 8
            start = state["next"]
            state["next"] += n
        if start >= 20_000:
            raise StopIteration
        if slow:
            threading.Event().wait(0.003)  # a slow call: its rows are put uncoalesced
        ids = np.arange(start, start + n)
        return [ids, np.repeat(ids[:, None].astype(np.float32), 64, axis=1)]

    feeder.init_data_input_workers(None, ["id", "x"], fetch, 32, num_worker_threads=workers, coordinator=coord,
                                   timeout=20)
    coord.start()
    feed = coord.feed("train")
    got = []
    for batch in feed:
        assert (batch["x"] == batch["id"][:, None]).all()
        got.append(batch["id"].copy())
    flat = np.concatenate(got)
    assert sorted(flat.tolist()) == list(range(len(flat))) and len(flat) >= 20_000
    if workers == 1:
        assert flat.tolist() == list(range(len(flat)))  # one worker, one feed: the order fetched
    m = feed.metrics()
    assert 0 < m["bytes_copied"] <= m["bytes_delivered"]
    if not slow_every:
        # most batches were assembled by the fetchers and handed on uncopied (rows a fetcher held
        # past COALESCE_HOLD_S, e.g. while other threads had the GIL, are put raw and copied once)
        assert m["zero_copy_batches"] >= 0.5 * m["batches"]


@pytest.mark.parametrize("workers", [1, 2])
def test_rows_held_for_coalescing_do_not_wait_on_a_blocking_fetch(coord, workers):
    """Tiny chunks are held to be coalesced; if the next fetch_fun call blocks, they still go on."""
    gate = threading.Event()
    calls = {}

    def fetch(worker_id, batch_size):
        n = calls[worker_id] = calls.get(worker_id, 0) + 1
        if n <= 4:
            return [np.full(2, worker_id * 100 + n, np.int64)]  # 2 rows: a quarter of a batch
        gate.wait(10)  # waits for new input, for a long time
        raise StopIteration

    feeder.init_data_input_workers(None, ["x"], fetch, 8 if workers == 1 else 16, num_worker_threads=workers,
                                   coordinator=coord, timeout=5)
    coord.start()
    try:
        batch = coord.feed("train").next_batch(timeout=2)  # the fetched rows make one whole batch
        assert sorted(batch["x"].tolist()) == sorted(w * 100 + n for w in range(workers) for n in (1, 2, 3, 4)
                                                     for _ in range(2))
    finally:
        gate.set()


def test_string_inputs_of_any_width_are_never_truncated(coord):
    texts = iter(["ab", "abcdefghij", "x", "a much longer string than the others"] * 50)

    def fetch(worker_id, batch_size):
        t = next(texts)
        return {"text": np.array([t]), "n": np.array([len(t)])}

    feeder.init_data_input_workers(None, ["text", "n"], fetch, 3, num_worker_threads=1, coordinator=coord,
                                   timeout=10)
    coord.start()
    feed = coord.feed("train")
    for _ in range(20):
        batch = feed.next_batch()
        assert [len(t) for t in batch["text"].tolist()] == batch["n"].tolist()


class _NodeArg:
    def __init__(self, name, type=None, shape=None):
        self.name, self.type, self.shape = name, type, shape


class PrepareFailsAt:
    """A session adapter of one's own whose prepare_batch raises at its ``n``-th call (and records
    the threads it was called in); run_batch returns the batch's ids."""

    def __init__(self, n):
        self.n, self.calls, self.threads = n, 0, set()
        self._lock = threading.Lock()

    def get_inputs(self):
        return [_NodeArg("id", "tensor(int64)", ["N"]), _NodeArg("x", "tensor(float)", ["N", 2])]

    def get_outputs(self):
        return [_NodeArg("id")]

    def prepare_batch(self, batch):
        with self._lock:
            self.calls += 1
            self.threads.add(threading.current_thread().name)
            if self.calls == self.n:
                raise ZeroDivisionError("prepare_batch broke on this batch")

    def run_batch(self, batch, output_names, run_options):
        return [batch.arrays[0].copy()]


@pytest.mark.parametrize("consumers", [1, 3])
def test_a_prepare_batch_that_raises_fails_the_source_and_loses_no_row_silently(coord, mode, consumers):
    """Issue 26, item 21: prepare_batch raising in a consumer's (or a producer's) pump went to that
    one caller, the feed went on without the batch's rows, and the ledger failed at the end. Now
    it fails the source like any failure: every consumer call (of every replica) raises it again,
    naming prepare_batch, with the original as __cause__, and the batch's rows are accounted
    for (the ledger check of every test)."""
    adapter = PrepareFailsAt(40)
    n = 4000
    fetch = Sharded(n, 2, sizes=(5, 11, 3))
    feeder.init_data_input_workers(adapter, ["id", "x"], fetch, 8, coordinator=coord, timeout=30, **workers(mode, 2))
    feeder.init_data_input_workers(adapter, ["id", "x"], fetch, 8, coordinator=coord, timeout=30,
                                   num_worker_threads=1)  # a replica: it fails with the source
    coord.start()
    feeds = coord.feeds("train")
    got, errors = [], []

    def consume(feed):
        try:
            while True:
                got.extend(feed.run()[0].tolist())
        except BaseException as e:  # noqa: B902
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(feeds[i % 2],)) for i in range(consumers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(errors) == consumers
    for e in errors:
        assert type(e) is feeder.FeederError, repr(e)
        assert "prepare_batch" in str(e) and "'train'" in str(e) and "ZeroDivisionError" in str(e)
        assert isinstance(e.__cause__, ZeroDivisionError)
    for feed in feeds:  # sticky
        with pytest.raises(feeder.FeederError, match="prepare_batch") as again:
            feed.run()
        assert isinstance(again.value.__cause__, ZeroDivisionError)
    assert len(got) == len(set(got)) and len(got) < n
    m = feeds[0].metrics()
    assert m["source_rows_discarded"] >= 8  # the failed batch's rows, at least
    coord.stop()  # the ledger check at stop must balance (the autouse fixture fails the test if not)


class _TinyChunks:
    """``n`` rows (ids, and their float copy) in chunks of 1-3 rows; one worker's (no lock: it travels)."""

    def __init__(self, n):
        self.n, self.next, self.calls = n, 0, 0

    def __call__(self, worker_id, batch_size):
        if self.next >= self.n:
            raise StopIteration
        size = (1, 2, 1, 3)[self.calls % 4]
        self.calls += 1
        ids = np.arange(self.next, min(self.n, self.next + size))
        self.next += len(ids)
        return [ids, np.repeat(ids[:, None].astype(np.float32), 2, axis=1)]


@pytest.mark.parametrize("bound", [1, 5, 40, 200])
def test_tiny_chunks_never_fill_the_source_queue_past_max_buffered_batches(coord, mode, bound):
    """The queue is bounded in chunks as fetch_fun returned them, and a batch a fetcher coalesced
    from tiny chunks counts as all of them; one standing for more than the bound went in alone,
    so max_buffered_batches=1 held 64 (fetch_fun ran 6 batches ahead of a consumer, not 4 + 1)."""
    import time

    # (batches of 512 rows: more chunks than every bound but the last holds, and more than it too)
    feeder.init_data_input_workers(None, ["id", "x"], _TinyChunks(4000), 512 if bound == 200 else 64,
                                   coordinator=coord, max_buffered_batches=bound, timeout=20, **workers(mode, 1))
    q = coord.get_queue("train", bound)
    coord.start()
    feed = coord.feed("train")
    peak, deadline = 0, time.monotonic() + 0.5
    while time.monotonic() < deadline:  # nobody consumes: the fetcher fills everything it may
        peak = max(peak, q.qsize())
        time.sleep(0.001)
    ids = []
    for batch in feed:
        ids.extend(check_aligned(batch).tolist())
        peak = max(peak, q.qsize())
    assert peak <= bound
    assert sorted(ids) == list(range(4000))
