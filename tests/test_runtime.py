"""Feeding a real ONNX Runtime InferenceSession built with onnx.helper."""
from __future__ import annotations

import collections
import sys
import threading

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from models import id_outputs_model, linear_model, session, two_input_model  # noqa: E402

import feeder  # noqa: E402


def counting_fetcher(rows=5, dim=4):
    lock = threading.Lock()
    state = {"next": 0}

    def fetch(worker_id, batch_size):
        with lock:
            start = state["next"]
            state["next"] += rows
        ids = np.arange(start, start + rows, dtype=np.float32)
        return [ids[:, None] * np.linspace(0.1, 1.0, dim, dtype=np.float32)[None, :]]

    return fetch


def test_run_equals_session_run_on_the_same_batch(coord):
    sess = session(linear_model())
    fetch = counting_fetcher()
    feeder.init_data_input_workers(sess, None, fetch, 8, num_worker_threads=1, coordinator=coord)
    coord.start()
    feed = coord.feed("train")
    reference = counting_fetcher()
    rows = np.concatenate([reference(0, 8)[0] for _ in range(40)])
    for i in range(20):
        y, s = feed.run()
        expected = sess.run(None, {"x": rows[i * 8:(i + 1) * 8]})
        np.testing.assert_allclose(y, expected[0], rtol=1e-6)
        np.testing.assert_allclose(s, expected[1], rtol=1e-6)
        assert y.shape == (8, 3)


def test_run_with_output_names_and_run_options(coord):
    import onnxruntime as ort

    sess = session(linear_model())
    feeder.init_data_input_workers(sess, ["x"], counting_fetcher(), 4, coordinator=coord)
    coord.start()
    feed = coord.feed("train")
    (s,) = feed.run(["s"])
    assert s.shape == (4,)
    y, s2 = feed.run(["y", "s"], ort.RunOptions())
    assert y.shape == (4, 3) and s2.shape == (4,)
    (s3,) = feed.run(["s"])
    assert s3.shape == (4,)


def test_two_threads_each_with_their_own_feed_of_one_session(coord):
    sess = session(linear_model())
    for name in ("a", "b"):
        feeder.init_data_input_workers(sess, None, counting_fetcher(rows=3), 16, input_source_name=name,
                                       coordinator=coord)
    coord.start()
    results, errors = {}, []

    def consume(name):
        try:
            results[name] = [coord.feed(name).run()[0].shape for _ in range(200)]
        except BaseException as e:  # noqa: B902
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert results["a"] == [(16, 3)] * 200 and results["b"] == [(16, 3)] * 200


def test_two_threads_running_one_feed_use_separate_bindings(coord):
    sess = session(linear_model())
    feeder.init_data_input_workers(sess, None, counting_fetcher(rows=3), 16, coordinator=coord)
    coord.start()
    feed = coord.feed("train")
    errors = []

    def consume():
        try:
            for _ in range(200):
                assert feed.run()[0].shape == (16, 3)
        except BaseException as e:  # noqa: B902
            errors.append(e)

    threads = [threading.Thread(target=consume) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


def test_two_inputs_dict_chunks(coord):
    sess = session(two_input_model())

    def fetch(worker_id, batch_size):
        n = 3
        return {"k": np.arange(n, dtype=np.int64)[:, None], "a": np.ones((n, 4), np.float32)}

    feeder.init_data_input_workers(sess, None, fetch, 5, coordinator=coord)
    coord.start()
    feed = coord.feed("train")
    assert feed.input_names == ["a", "k"]
    (out,) = feed.run()
    assert out.shape == (5, 4)
    batch = feed.next_batch()
    expected = np.broadcast_to(2.0 + batch["k"].astype(np.float32), (5, 4))
    np.testing.assert_allclose(sess.run(None, batch)[0], expected)


def test_registration_checks_against_the_session(coord):
    sess = session(linear_model(batch=8))
    with pytest.raises(ValueError, match="fixed at 8"):
        feeder.init_data_input_workers(sess, None, counting_fetcher(), 4, coordinator=coord)
    with pytest.raises(ValueError, match="not inputs of the session"):
        feeder.init_data_input_workers(sess, ["nope"], counting_fetcher(), 8, coordinator=coord)
    with pytest.raises(ValueError, match="not in input_names"):
        feeder.init_data_input_workers(session(two_input_model()), ["a"], counting_fetcher(), 8,
                                       coordinator=coord)
    with pytest.raises(ValueError, match="out of range"):
        feeder.init_data_input_workers(sess, None, counting_fetcher(), 8, batch_columns=[2], coordinator=coord)
    # a fixed batch dimension is fine when it matches, or when chunks are passed through
    feeder.init_data_input_workers(sess, None, counting_fetcher(), 8, coordinator=coord)
    feeder.init_data_input_workers(sess, None, counting_fetcher(rows=8), 3, dont_rebatch=True,
                                   input_source_name="raw", coordinator=coord)
    coord.start()
    assert coord.feed("train").run()[0].shape == (8, 3)
    assert coord.feed("raw").run()[0].shape == (8, 3)
    with pytest.raises(ValueError, match="fixed at 8"):
        coord.reset_data_input("train", 4)


def test_run_handles_batches_of_changing_row_counts(coord):
    """A short last batch, dont_rebatch chunks of varying size and reset_data_input all change the
    row count between runs; outputs must be computed afresh for each shape."""
    sess = session(linear_model())
    sizes = iter([6])

    def finite(worker_id, batch_size):
        n = next(sizes, None)
        if n is None:
            raise StopIteration
        return [np.ones((n, 4), np.float32)]

    varying = iter([3, 5, 1, 7] * 100)
    feeder.init_data_input_workers(sess, None, finite, 4, num_worker_threads=1, coordinator=coord, timeout=10)
    feeder.init_data_input_workers(sess, None, lambda w, b: [np.ones((next(varying), 4), np.float32)], 2,
                                   num_worker_threads=1, dont_rebatch=True, input_source_name="raw",
                                   coordinator=coord, timeout=10)
    feeder.init_data_input_workers(sess, None, counting_fetcher(rows=3), 8, input_source_name="resized",
                                   coordinator=coord, timeout=10)
    coord.start()
    feed = coord.feed("train")
    assert feed.run()[0].shape == (4, 3)
    assert feed.run()[0].shape == (2, 3)  # the short last batch
    with pytest.raises(StopIteration):
        feed.run()
    raw = coord.feed("raw")
    assert [raw.run()[0].shape[0] for _ in range(8)] == [3, 5, 1, 7] * 2
    resized = coord.feed("resized")
    assert resized.run()[0].shape == (8, 3)
    coord.reset_data_input("resized", 5)
    seen = {resized.run()[0].shape[0] for _ in range(10)}
    assert 5 in seen and seen <= {5, 8}


@pytest.mark.parametrize("outputs", ["host", "device"])
def test_fixed_batch_dimension_pads_the_short_last_batch_for_run_and_loses_no_row(coord, caplog, outputs):
    """Issue 9, defect 4: with x: [4, 4] and 10 rows, the third run() raised ONNX Runtime's own
    'Got invalid dimensions' error and the 2 rows were counted as delivered. Then the short batch
    was dropped, against last_batch="keep" and "no row is lost". Now run() pads it to 4 rows (its
    last row repeated) and returns the outputs of its own 2 rows, as feeder.predict does."""
    import logging

    sess = session(linear_model(batch=4))
    x = np.arange(40, dtype=np.float32).reshape(10, 4) / 10
    rows = iter([x])

    def fetch(worker_id, batch_size):
        return [next(rows)]  # one chunk of 10 rows, then StopIteration

    with caplog.at_level(logging.INFO, logger="feeder"):
        feeder.init_data_input_workers(sess, None, fetch, 4, num_worker_threads=1, coordinator=coord, timeout=10)
        assert any("fixed" in r.getMessage() and "pads" in r.getMessage() for r in caplog.records)
        coord.start()
        feed = coord.feed("train")
        outs = [feed.run(outputs=outputs, with_batch=True) for _ in range(3)]
        with pytest.raises(StopIteration):
            feed.run()
    got = [[np.asarray(o.numpy() if outputs == "device" else o) for o in out] for out, _ in outs]
    assert [[o.shape for o in g] for g in got] == [[(4, 3), (4,)], [(4, 3), (4,)], [(2, 3), (2,)]]
    padded = np.concatenate([x, x[-1:], x[-1:]])  # (the model takes 4 rows at a time)
    want = [np.concatenate(w)[:10] for w in zip(*(sess.run(None, {"x": padded[i:i + 4]}) for i in (0, 4, 8)))]
    np.testing.assert_allclose(np.concatenate([g[0] for g in got]), want[0], rtol=1e-6)
    np.testing.assert_allclose(np.concatenate([g[1] for g in got]), want[1], rtol=1e-6)
    assert outs[2][1]["x"].tolist() == x[8:].tolist()  # the batch as it was: 2 rows
    m = feed.metrics()
    assert m["source_rows_delivered"] == 10 and m["source_rows_dropped"] == 0


def test_fixed_batch_dimension_gives_next_batch_the_short_batch_and_drop_still_drops(coord):
    sess = session(linear_model(batch=4))

    def register(name, **kw):
        rows = iter([np.ones((10, 4), np.float32)])
        feeder.init_data_input_workers(sess, None, lambda w, b: [next(rows)], 4, num_worker_threads=1,
                                       coordinator=coord, timeout=10, input_source_name=name, **kw)

    register("kept")
    register("dropped", last_batch="drop")
    with coord:
        assert [len(b["x"]) for b in coord.feed("kept")] == [4, 4, 2]
        assert [o[0].shape[0] for o in coord.feed("dropped").runs()] == [4, 4]
        assert coord.feed("dropped").metrics()["source_rows_dropped"] == 2


def test_a_short_last_batch_on_a_fixed_batch_dimension_refuses_outputs_that_mix_rows(coord):
    # m = the mean over the batch: for a padded batch it is no answer (cut to 2 values it was 2 of
    # the 4 columns' means, taken over the padded rows, found by a review); y = 2x is per row.
    import onnx
    from models import batch_mean_model

    model = onnx.load_from_string(batch_mean_model(dim=4))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 4  # x: [4, 4]
    sess = session(model.SerializeToString())
    x = np.arange(40, dtype=np.float32).reshape(10, 4)
    rows = iter([x])
    feeder.init_data_input_workers(sess, None, lambda w, b: [next(rows)], 4, num_worker_threads=1,
                                   coordinator=coord, timeout=10)
    coord.start()
    feed = coord.feed("train")
    assert [feed.run(["y"])[0].tolist() for _ in range(2)] == [(x[:4] * 2).tolist(), (x[4:8] * 2).tolist()]
    with pytest.raises(feeder.FeederError, match=r"source 'train': output 'm' of the short last batch depends on "
                                                 r"more than each row.*last_batch='drop'"):
        feed.run(["y", "m"])


def test_a_short_last_batch_on_a_fixed_batch_dimension_gives_device_outputs_that_own_their_memory(coord):
    # They were OrtValues made around a numpy view of ONNX Runtime's output: once the caller dropped
    # the OrtValue and kept its .numpy(), the array read memory ONNX Runtime had freed and reused.
    sess = session(linear_model(batch=4))
    x = np.arange(40, dtype=np.float32).reshape(10, 4) / 10

    def run_all():
        rows = iter([x])
        c = feeder.GlobalCoordinator(join_timeout=3.0)
        feeder.init_data_input_workers(sess, None, lambda w, b: [next(rows)], 4, num_worker_threads=1,
                                       coordinator=c, timeout=10)
        with c:
            return [[np.asarray(v.numpy()) for v in out] for out in c.feed("train").runs(outputs="device")]

    want = [np.concatenate(o) for o in zip(*run_all())]
    for _ in range(3):
        got = run_all()
        run_all()  # more runs of the same session: its arena reuses what was freed
        assert [np.concatenate(o).tolist() for o in zip(*got)] == [w.tolist() for w in want]
    assert want[0].shape == (10, 3)


class IdRows:
    """A finite fetch function: chunks of 1..``max_rows`` rows of x = [id, 1.0], every id of
    0..n-1 once (so batches span chunks and are assembled in reused buffers)."""

    def __init__(self, n, max_rows=24, seed=0):
        self.n, self.max_rows = n, max_rows
        self._next = 0
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()

    def __call__(self, worker_id, batch_size):
        with self._lock:
            if self._next >= self.n:
                raise StopIteration
            k = int(self._rng.integers(1, self.max_rows + 1))
            start, self._next = self._next, min(self.n, self._next + k)
            stop = self._next
        x = np.ones((stop - start, 2), np.float32)
        x[:, 0] = np.arange(start, stop)
        return [x]


ID_OUTPUTS = ["a", "b", "c"]


def ids_of(name, out):
    """The row ids an output of id_outputs_model encodes."""
    return {"a": lambda o: o[:, 0], "b": lambda o: o[:, 0] / 2, "c": lambda o: o - 1}[name](out)


def consume_checking(feed, patterns, seen, errors, keep=3):
    """Run ``feed`` until its source ends, asking for the output lists of ``patterns`` in turn:
    every call's outputs must be the ones asked for (None: all, in the session's order) and tell
    the same row ids; the last ``keep`` results are held and must not change meanwhile."""
    held = collections.deque()
    k = 0
    try:
        while True:
            names = patterns[k % len(patterns)]
            k += 1
            try:
                outs = feed.run(names)
            except StopIteration:
                break
            want = ID_OUTPUTS if names is None else names
            assert len(outs) == len(want), f"asked {names}, got {len(outs)} outputs"
            ids = None
            for name, out in zip(want, outs):
                rows = out.shape[0]
                assert out.shape == ((rows, 2) if name in ("a", "b") else (rows,)), (name, out.shape)
                got = ids_of(name, out)
                if ids is None:
                    ids = got.copy()
                assert np.array_equal(got, ids), f"outputs {want} of one run tell different rows"
            seen.extend(ids.astype(np.int64).tolist())
            for old, copies in held:
                for o, c in zip(old, copies):
                    assert np.array_equal(o, c), "an output held by the consumer was overwritten"
            held.append((outs, [o.copy() for o in outs]))
            if len(held) > keep:
                held.popleft()
    except BaseException as e:  # noqa: B902 - reported by the test
        errors.append(e)


@pytest.mark.parametrize("interval", [1e-6, 1e-5])
def test_consumers_asking_for_different_outputs_never_share_or_lose_buffers(interval):
    """Issue 26, item 18: output buffers came from a ring that was not thread-safe, taken both by
    the thread preparing batches and by a consumer rebinding other outputs: outputs of other rows,
    held outputs overwritten, wrong shapes, an IndexError in the enqueuer, rows lost."""
    sess = session(id_outputs_model())
    patterns = [[["a"], None], [["b", "c"], ["c"]], [None, ["c", "a", "b"]], [["a", "c"], ["b"], None]]
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        for it in range(3):
            coord = feeder.GlobalCoordinator(join_timeout=3.0)
            n = 4000
            feeder.init_data_input_workers(sess, None, IdRows(n, seed=it), 16, num_worker_threads=2,
                                           coordinator=coord, timeout=60)
            seen, errors = [], []
            with coord:
                feed = coord.feed("train")
                threads = [threading.Thread(target=consume_checking, args=(feed, p, seen, errors))
                           for p in patterns]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(120)
            assert not errors, errors[0]
            assert sorted(seen) == list(range(n)), "rows lost or delivered twice"
    finally:
        sys.setswitchinterval(old)


def test_run_without_names_always_means_every_output(coord):
    """Issue 26, item 19: after run(["s"]), run() returned [s] (and after run(["s", "y"]) the two in
    that order), not every output in the session's order."""
    sess = session(id_outputs_model())
    feeder.init_data_input_workers(sess, None, IdRows(10**6), 4, num_worker_threads=1, coordinator=coord,
                                   timeout=30)
    coord.start()
    feed = coord.feed("train")
    for names in (None, ["c"], None, ["c", "a"], None, ["b"], ["b"], None, None):
        outs = feed.run(names)
        want = ID_OUTPUTS if names is None else names
        assert len(outs) == len(want), (names, [o.shape for o in outs])
        ids = ids_of(want[0], outs[0])
        for name, out in zip(want, outs):
            assert np.array_equal(ids_of(name, out), ids), (names, name)


def test_outputs_are_reused_for_each_list_a_consumer_alternates(coord):
    """Item 18's rings are per output list: a consumer alternating two lists reuses the buffers of
    each (before, each change of list started the one ring afresh, allocating every time)."""
    sess = session(id_outputs_model())
    feeder.init_data_input_workers(sess, None, IdRows(10**6), 16, num_worker_threads=1, coordinator=coord,
                                   timeout=30)
    coord.start()
    feed = coord.feed("train")
    for i in range(300):
        names = ["a"] if i % 2 else ["b", "c"]
        outs = feed.run(names)
        assert len(outs) == len(names)
        del outs
    assert feed._runner.output_allocations <= 2 * feed._runner.ring_size
