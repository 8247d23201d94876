"""Feeding training sessions: a train-step graph with its state kept in OrtValues (issue 6, part 1)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from models import LOGISTIC_STATE, logistic_eval, logistic_train_step, logistic_zero_state, session  # noqa: E402

import feeder  # noqa: E402

DIM = 8


def separable(n, seed):
    """Two Gaussian blobs split by a fixed hyperplane: labels are exactly learnable."""
    rng = np.random.default_rng(seed)
    w_true = np.linspace(-1.0, 1.0, DIM).astype(np.float32)
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    margin = x @ w_true
    keep = np.abs(margin) > 0.3
    x = x[keep]
    y = (x @ w_true > 0).astype(np.float32)
    return x, y


def chunked(x, y, rows=20):
    """fetch_fun serving (x, y) in chunks of ``rows`` rows, once, for one worker."""
    pos = {"i": 0}

    def fetch(worker_id, batch_size):
        i = pos["i"]
        if i >= len(x):
            raise StopIteration
        pos["i"] = i + rows
        return {"x": x[i:i + rows], "y": y[i:i + rows]}

    return fetch


def numpy_reference(x, y, batch_size, lr=0.5, mu=0.9):
    """The same steps in numpy (float32), batch after batch in order, short last batch kept."""
    W = np.zeros(DIM, np.float32)
    b = np.float32(0)
    vW = np.zeros(DIM, np.float32)
    vb = np.float32(0)
    losses = []
    for i in range(0, len(x), batch_size):
        xb, yb = x[i:i + batch_size], y[i:i + batch_size]
        z = xb @ W + b
        losses.append(float(np.mean(np.logaddexp(0, z) - yb * z)))
        dz = 1 / (1 + np.exp(-z)) - yb
        gW = np.mean(xb * dz[:, None], axis=0)
        gb = np.mean(dz)
        vW = np.float32(mu) * vW + gW
        vb = np.float32(mu) * vb + gb
        W = W - np.float32(lr) * vW
        b = b - np.float32(lr) * vb
    return {"W": W, "b": b, "vW": vW, "vb": vb}, losses


def accuracy(state, x, y):
    return float(np.mean(((x @ state["W"] + state["b"]) > 0) == (y > 0.5)))


def test_train_step_graph_learns_and_matches_numpy(coord):
    x, y = separable(6000, seed=1)
    x_test, y_test = separable(2000, seed=2)
    adapter = feeder.StatefulSession(session(logistic_train_step(DIM)), LOGISTIC_STATE, logistic_zero_state(DIM))
    assert [a.name for a in adapter.get_inputs()] == ["x", "y"]
    feeder.init_data_input_workers(adapter, None, chunked(x, y), 32, num_worker_threads=1, ordered=True,
                                   coordinator=coord, timeout=30)
    coord.start()
    feed = coord.feed("train")
    losses = []
    while True:
        try:
            (loss,) = feed.run(["loss"])
        except StopIteration:
            break
        losses.append(float(loss))
    assert adapter.steps == len(losses) == -(-len(x) // 32)
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:5])  # the loss fell
    state = adapter.state()
    assert accuracy(state, x_test, y_test) > 0.95
    expected, ref_losses = numpy_reference(x, y, 32)
    for name in ("W", "b", "vW", "vb"):
        np.testing.assert_allclose(state[name], expected[name], rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)


def test_checkpoint_round_trips_through_savez(tmp_path, coord):
    x, y = separable(3000, seed=3)
    train = session(logistic_train_step(DIM))
    a = feeder.StatefulSession(train, LOGISTIC_STATE, logistic_zero_state(DIM))
    feeder.init_data_input_workers(a, None, chunked(x, y), 50, num_worker_threads=1, ordered=True,
                                   coordinator=coord, timeout=30)
    coord.start()
    feed = coord.feed("train")
    for _ in range(20):
        feed.run(["loss"])
    path = tmp_path / "ckpt.npz"
    np.savez(path, **a.state())
    b = feeder.StatefulSession(train, LOGISTIC_STATE)
    with np.load(path) as ckpt:
        b.load_state(dict(ckpt))
    for name, value in a.state().items():
        np.testing.assert_array_equal(b.state()[name], value)
    # the same next step from both gives the same state
    batch = feed.next_batch()
    from feeder.runtime import PreparedBatch

    for adapter in (a, b):
        adapter.run_batch(PreparedBatch(["x", "y"], [batch["x"], batch["y"]], len(batch["x"])), ["loss"], None)
    for name, value in a.state().items():
        np.testing.assert_array_equal(b.state()[name], value)


def test_state_outputs_can_be_asked_for_and_state_is_not_fed(coord):
    adapter = feeder.StatefulSession(session(logistic_train_step(DIM)), LOGISTIC_STATE, logistic_zero_state(DIM))
    with pytest.raises(ValueError, match="not inputs of the session"):
        feeder.init_data_input_workers(adapter, ["x", "y", "W"], lambda w, b: None, 8, coordinator=coord)
    x, y = separable(400, seed=4)
    feeder.init_data_input_workers(adapter, ["x", "y"], chunked(x, y), 16, num_worker_threads=1,
                                   coordinator=coord, timeout=30)
    coord.start()
    loss, w_new = coord.feed("train").run(["loss", "W_new"])
    assert loss.shape == () and w_new.shape == (DIM,)
    np.testing.assert_array_equal(w_new, adapter.state()["W"])
    with pytest.raises(ValueError, match="unknown outputs"):
        coord.feed("train").run(["nope"])


def test_data_inputs_are_validated_like_any_session(coord):
    adapter = feeder.StatefulSession(session(logistic_train_step(DIM)), LOGISTIC_STATE, logistic_zero_state(DIM))
    feeder.init_data_input_workers(adapter, None, lambda w, b: {"x": np.zeros((4, DIM + 1), np.float32),
                                                                "y": np.zeros(4, np.float32)},
                                   4, coordinator=coord, timeout=10)
    coord.start()
    with pytest.raises(feeder.InputValidationError, match="input 'x'.*dim 1 = 8"):
        coord.feed("train").run()


def test_adapter_checks_its_arguments():
    train = session(logistic_train_step(DIM))
    with pytest.raises(ValueError, match="not an output"):
        feeder.StatefulSession(train, {"nope": "W"})
    with pytest.raises(ValueError, match="not an input"):
        feeder.StatefulSession(train, {"W_new": "nope"})
    a = feeder.StatefulSession(train, LOGISTIC_STATE)
    with pytest.raises(ValueError, match="missing state inputs"):
        a.load_state({"W": np.zeros(DIM, np.float32)})
    with pytest.raises(ValueError, match="shape"):
        a.load_state({**logistic_zero_state(DIM), "W": np.zeros(DIM + 1, np.float32)})
    from feeder.runtime import PreparedBatch

    with pytest.raises(feeder.FeederError, match="not set"):
        a.run_batch(PreparedBatch(["x", "y"], [np.zeros((2, DIM), np.float32), np.zeros(2, np.float32)], 2),
                    None, None)


def test_train_and_eval_sources_on_one_coordinator(coord):
    """The example's shape: "train" feeds the train step, "test" an eval graph holding the same weights."""
    x, y = separable(4000, seed=5)
    x_test, y_test = separable(1000, seed=6)
    train = feeder.StatefulSession(session(logistic_train_step(DIM)), LOGISTIC_STATE, logistic_zero_state(DIM))
    evaluate = feeder.StatefulSession(session(logistic_eval(DIM)), {}, {"W": np.zeros(DIM, np.float32),
                                                                      "b": np.float32(0)})
    lock = threading.Lock()
    rng = np.random.default_rng(0)

    def train_fetch(worker_id, batch_size):
        with lock:
            idx = rng.integers(0, len(x), 16)
        return {"x": x[idx], "y": y[idx]}

    feeder.init_data_input_workers(train, None, train_fetch, 64, input_source_name="train", coordinator=coord)
    feeder.init_data_input_workers(evaluate, ["x"], lambda w, b: [x_test], len(x_test), input_source_name="test",
                                   dont_rebatch=True, coordinator=coord)
    coord.start()
    accs = []
    for step in range(1, 201):
        coord.feed("train").run(["loss"])
        if step % 50 == 0:
            evaluate.load_state({k: v for k, v in train.state().items() if k in ("W", "b")})
            (p,) = coord.feed("test").run()
            accs.append(float(np.mean((p > 0.5) == (y_test > 0.5))))
    assert accs[-1] > 0.95


def test_returned_state_outputs_are_copies(coord):
    adapter = feeder.StatefulSession(session(logistic_train_step(DIM)), LOGISTIC_STATE, logistic_zero_state(DIM))
    x, y = separable(2000, seed=7)
    feeder.init_data_input_workers(adapter, None, chunked(x, y), 16, num_worker_threads=1, coordinator=coord,
                                   timeout=30)
    coord.start()
    feed = coord.feed("train")
    (w1,) = feed.run(["W_new"])
    kept = w1.copy()
    for _ in range(3):
        feed.run(["loss"])  # the buffers swap and are written again
    np.testing.assert_array_equal(w1, kept)


def test_the_train_and_eval_example_checkpoints_and_resumes(tmp_path):
    """examples/train_and_eval.py: Parquet data written on the first run, weights and source state
    saved together, --resume continues at the saved step with the rows not yet trained on."""
    import json
    import os
    import subprocess
    import sys
    pytest.importorskip("pyarrow")
    pytest.importorskip("tqdm")
    example = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                           "train_and_eval.py")
    data = tmp_path / "data"

    def run(*args):
        out = subprocess.run([sys.executable, example, "--data", str(data), "--checkpoint-every", "40", *args],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    first = run("--steps", "100")
    assert "wrote the data" in first and (data / "train").is_dir()
    with np.load(data / "checkpoint.npz") as z:
        assert int(z["__step__"]) == 100
        state = json.loads(str(z["__source__"]))
    assert state["rows_delivered"] == 100 * 64  # exactly the batches trained on
    second = run("--steps", "150", "--resume")
    assert "resumed from step 100 (6400 rows trained on)" in second and "wrote the data" not in second
    assert "step  150" in second and "50 train steps" in second
    with np.load(data / "checkpoint.npz") as z:
        assert int(z["__step__"]) == 150
        assert json.loads(str(z["__source__"]))["rows_delivered"] == 150 * 64
