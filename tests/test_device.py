"""The device path (issue 27) on the CPU provider: ``device="cpu:staged"`` runs the same code as a
GPU feed (staging memory, device slots allocated once and reused, their order and release) with
host memory standing in for the device. The GPU itself is tested in test_gpu.py."""
from __future__ import annotations

import collections
import gc
import sys
import threading
import time
import weakref

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from models import (  # noqa: E402
    LOGISTIC_STATE,
    id_outputs_model,
    linear_model,
    logistic_train_step,
    logistic_zero_state,
    session,
)
from test_runtime import ID_OUTPUTS, IdRows, consume_checking, counting_fetcher, ids_of  # noqa: E402
from utils import Sharded, XOnly, workers  # noqa: E402

import feeder  # noqa: E402
from feeder.device import Placement, parse_device  # noqa: E402

STAGED = "cpu:staged"


class RecordingSession:
    """An InferenceSession that records every input address bound and can run late: ``delay`` s
    pass inside run_with_iobinding before the real run reads its inputs (a run still reading
    them, as an asynchronous device would)."""

    def __init__(self, inner, delay=0.0):
        self._inner = inner
        self.delay = delay
        self.bound = collections.Counter()  # (name, address) -> times bound
        self.runs = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def io_binding(self):
        return RecordingBinding(self._inner.io_binding(), self)

    def run_with_iobinding(self, binding, run_options=None):
        if self.delay:
            time.sleep(self.delay)
        with self._lock:
            self.runs += 1
        self._inner.run_with_iobinding(binding._inner, run_options)


class RecordingBinding:
    def __init__(self, inner, owner):
        self._inner, self._owner = inner, owner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def bind_ortvalue_input(self, name, value):
        with self._owner._lock:
            self._owner.bound[(name, value.data_ptr())] += 1
        self._inner.bind_ortvalue_input(name, value)


def slow_copies(runner, pause=0.0005):
    """Make the runner's copies to the device slow and torn: half the batch, a pause, the rest. A
    run reading a slot while it is written would see rows of two batches."""
    memory = runner.slots.memory

    def to_device(array, value):
        dst = value.numpy()  # a view: the "device" is host memory here
        half = len(array) // 2
        dst[:half] = array[:half]
        time.sleep(pause)
        dst[half:] = array[half:]

    memory.to_device = to_device


def test_device_strings_are_parsed_and_refused_clearly():
    assert parse_device(None) is None
    assert parse_device("cpu") == Placement()
    assert parse_device("CUDA:1") == Placement("cuda", 1)
    assert parse_device(STAGED).on_device and not parse_device("cpu").on_device
    with pytest.raises(ValueError, match="'cpu', 'cuda' or 'cuda:N'"):
        parse_device("gpu")
    with pytest.raises(ValueError, match="'cpu', 'cuda' or 'cuda:N'"):
        parse_device("cuda:x")
    with pytest.raises(TypeError, match="device must be"):
        parse_device(0)


@pytest.mark.skipif("CUDAExecutionProvider" in feeder.device.available_providers(), reason="CUDA is installed here")
def test_asking_for_a_gpu_the_installed_onnxruntime_lacks_is_a_value_error_naming_the_fix(coord):
    sess = session(linear_model())
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match="CUDAExecutionProvider is not available") as e:
            feeder.init_data_input_workers(sess, None, counting_fetcher(), 4, coordinator=coord, device=device)
        assert "CPUExecutionProvider" in str(e.value) and "onnxruntime-gpu" in str(e.value)
    with pytest.raises(ValueError, match="onnxruntime-gpu"):
        feeder.StatefulSession(session(logistic_train_step(8)), LOGISTIC_STATE, device="cuda")
    assert not coord.feeds("train")


def test_device_that_does_not_apply_is_refused(coord):
    with pytest.raises(ValueError, match="without a session"):
        feeder.init_data_input_workers(None, ["x"], counting_fetcher(), 4, coordinator=coord, device=STAGED)
    adapter = feeder.StatefulSession(session(logistic_train_step(8)), LOGISTIC_STATE, logistic_zero_state(8))
    with pytest.raises(ValueError, match="StatefulSession\\(device="):
        feeder.init_data_input_workers(adapter, None, counting_fetcher(), 4, coordinator=coord, device=STAGED)
    # "cpu" is fine anywhere: today's path
    feeder.init_data_input_workers(None, ["x"], counting_fetcher(), 4, coordinator=coord, device="cpu")


def test_staged_device_path_equals_session_run_batch_by_batch(coord):
    sess = session(linear_model())
    feeder.init_data_input_workers(sess, None, counting_fetcher(), 8, num_worker_threads=1, coordinator=coord,
                                   device=STAGED)
    coord.start()
    feed = coord.feed("train")
    assert feed._runner.slots is not None
    reference = counting_fetcher()
    rows = np.concatenate([reference(0, 8)[0] for _ in range(120)])
    for i in range(60):
        y, s = feed.run()
        expected = sess.run(None, {"x": rows[i * 8:(i + 1) * 8]})
        np.testing.assert_allclose(y, expected[0], rtol=1e-6)
        np.testing.assert_allclose(s, expected[1], rtol=1e-6)


def test_staged_inputs_keep_their_addresses_and_slots_are_reused(coord):
    """Each slot's device buffers are bound once; 400 runs use no more addresses than slots (what
    enable_cuda_graph needs), and the rebatcher assembles batches in the staging memory."""
    sess = RecordingSession(session(id_outputs_model()))
    feeder.init_data_input_workers(sess, None, IdRows(10**7, max_rows=24), 16, num_worker_threads=2,
                                   coordinator=coord, device=STAGED, timeout=30)
    coord.start()
    feed = coord.feed("train")
    runner = feed._runner
    for _ in range(400):
        (a,) = feed.run(["a"])
        assert a.shape == (16, 2)
    ring = runner.slots
    addresses = {addr for (name, addr) in sess.bound}
    assert ring.slots() <= runner.ring_size
    assert len(addresses) <= ring.allocations + ring.one_offs
    assert ring.one_offs == 0 and ring.allocations <= runner.ring_size
    assert sum(sess.bound.values()) == len(addresses)  # bound once each, never again per run
    assert feed._ring._alloc == runner.slots.memory.host_array  # batches assembled in staging memory


@pytest.mark.parametrize("interval", [1e-6, 1e-5])
def test_no_slot_is_reused_while_a_run_may_read_it(interval):
    """Torn, slow copies into the slots and runs that read their inputs late, three consumers asking
    for different outputs: every row exactly once, each run's outputs of one batch, held outputs
    intact, and the ledger balances (checked by every test)."""
    patterns = [[["a"], None], [["b", "c"], ["c"]], [None, ["c", "a", "b"]]]
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        for it in range(2):
            coord = feeder.GlobalCoordinator(join_timeout=3.0)
            sess = RecordingSession(session(id_outputs_model()), delay=0.0003)
            n = 3000
            feeder.init_data_input_workers(sess, None, IdRows(n, seed=it), 16, num_worker_threads=2,
                                           coordinator=coord, timeout=60, device=STAGED)
            slow_copies(coord.feed("train")._runner)
            seen, errors = [], []
            with coord:
                feed = coord.feed("train")
                threads = [threading.Thread(target=consume_checking, args=(feed, p, seen, errors)) for p in patterns]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(120)
            assert not errors, errors[0]
            assert sorted(seen) == list(range(n)), "rows lost or delivered twice"
    finally:
        sys.setswitchinterval(old)


def test_outputs_on_the_device_are_the_callers_to_keep(coord):
    import onnxruntime as ort

    sess = session(id_outputs_model())
    feeder.init_data_input_workers(sess, None, IdRows(10**6), 8, num_worker_threads=1, coordinator=coord,
                                   device=STAGED, timeout=30)
    coord.start()
    feed = coord.feed("train")
    kept = []
    for i in range(40):
        outs = feed.run(["c", "a"] if i % 3 else None, outputs="device")
        assert all(isinstance(o, ort.OrtValue) for o in outs)
        names = ID_OUTPUTS if i % 3 == 0 else ["c", "a"]
        ids = ids_of(names[0], outs[0].numpy())
        for name, o in zip(names, outs):
            assert np.array_equal(ids_of(name, o.numpy()), ids)
        kept.append((names, outs, [o.numpy().copy() for o in outs]))
        host = feed.run(["a"])  # host outputs in between: another binding of the same slots
        assert host[0].shape == (8, 2)
    for _names, outs, copies in kept:  # nothing overwrote what the caller holds
        for o, c in zip(outs, copies):
            assert np.array_equal(o.numpy(), c)


def test_outputs_must_be_host_or_device(coord):
    feeder.init_data_input_workers(session(linear_model()), None, counting_fetcher(), 4, coordinator=coord)
    adapter = feeder.StatefulSession(session(logistic_train_step(8)), LOGISTIC_STATE, logistic_zero_state(8))
    feeder.init_data_input_workers(adapter, None, lambda w, b: {"x": np.zeros((4, 8), np.float32),
                                                                "y": np.zeros(4, np.float32)},
                                   4, coordinator=coord, input_source_name="train2")
    coord.start()
    with pytest.raises(ValueError, match="'host' or 'device'"):
        coord.feed("train").run(outputs="gpu")
    with pytest.raises(ValueError, match="numpy arrays only"):
        coord.feed("train2").run(outputs="device")
    assert coord.feed("train2").metrics()["batches"] == 0  # refused before a batch was taken


def test_device_memory_is_bounded_and_let_go_at_stop(coord):
    sess = session(id_outputs_model())
    feeder.init_data_input_workers(sess, None, IdRows(10**7), 16, num_worker_threads=2, coordinator=coord,
                                   device=STAGED, timeout=30)
    coord.start()
    feed = coord.feed("train")
    ring = feed._runner.slots
    for _ in range(200):
        feed.run()
        assert ring.slots() <= feed._runner.ring_size
    per_batch = 16 * 2 * 4
    assert 0 < ring.device_bytes() <= feed._runner.ring_size * per_batch
    value = weakref.ref(ring._slots[0].inputs[0])
    coord.stop()
    assert ring.slots() == 0 and ring.device_bytes() == 0
    gc.collect()
    assert value() is None, "a device buffer outlived stop()"


def test_next_batch_on_a_device_feed_gives_its_slot_back(coord):
    feeder.init_data_input_workers(session(id_outputs_model()), None, IdRows(10**7), 16, num_worker_threads=1,
                                   coordinator=coord, device=STAGED, timeout=30)
    coord.start()
    feed = coord.feed("train")
    for _ in range(100):
        batch = feed.next_batch()
        assert batch["x"].shape == (16, 2)
    ring = feed._runner.slots
    assert ring.one_offs == 0 and ring.allocations <= feed._runner.ring_size


def test_staged_feed_of_changing_shapes_short_last_batch_and_resets(coord):
    sess = session(id_outputs_model())
    n = 1000
    feeder.init_data_input_workers(sess, None, IdRows(n), 48, num_worker_threads=1, coordinator=coord,
                                   device=STAGED, timeout=30)
    varying = iter([3, 5, 1, 7] * 100)
    feeder.init_data_input_workers(sess, None, lambda w, b: [np.ones((next(varying), 2), np.float32)], 2,
                                   num_worker_threads=1, dont_rebatch=True, input_source_name="raw",
                                   coordinator=coord, timeout=30, device=STAGED)
    coord.start()
    feed = coord.feed("train")
    seen = []
    for k in range(100):
        if k == 5:
            coord.reset_data_input("train", 32)
        try:
            (c,) = feed.run(["c"])
        except StopIteration:
            break
        seen.extend((c - 1).astype(int).tolist())
    assert sorted(seen) == list(range(n))  # the short last batch included
    raw = coord.feed("raw")
    assert [raw.run(["a"])[0].shape[0] for _ in range(12)] == [3, 5, 1, 7] * 3
    for f in (feed, raw):
        assert f._runner.slots.slots() <= f._runner.ring_size


def test_worker_processes_feed_the_device_path(coord, mode):
    n = 2000
    fetch = Sharded(n, 2, sizes=(5, 16, 11))

    sess = session(id_outputs_model())  # Sharded's x repeats each row's id: the outputs tell the rows
    feeder.init_data_input_workers(sess, ["x"], XOnly(fetch), 16, coordinator=coord, timeout=60, device=STAGED,
                                   **workers(mode, 2))
    coord.start()
    feed = coord.feed("train")
    seen = []
    while True:
        try:
            (a,) = feed.run(["a"])
        except StopIteration:
            break
        assert (a[:, 1] == a[:, 0]).all()  # Sharded's x repeats the id in every column
        seen.extend(a[:, 0].astype(int).tolist())
    assert sorted(seen) == list(range(n))
    if mode == "processes":
        # Children cut whole batches: each goes from its shared-memory slot to the device with no
        # host copy in the parent; only the two children's last pieces were joined (one copy).
        assert feed._rebatcher.copied_batches <= 1 and feed._rebatcher.zero_copy_batches >= n // 16 - 2


def test_stateful_session_staged_gives_the_cpu_losses_and_weights(coord):
    from test_training import DIM, chunked, separable

    x, y = separable(2000, seed=11)
    results = {}
    for device in ("cpu", STAGED):
        c = feeder.GlobalCoordinator(join_timeout=3.0)
        adapter = feeder.StatefulSession(session(logistic_train_step(DIM)), LOGISTIC_STATE, logistic_zero_state(DIM),
                                         device=device)
        feeder.init_data_input_workers(adapter, None, chunked(x, y), 32, num_worker_threads=1, ordered=True,
                                       coordinator=c, timeout=30)
        losses = []
        with c:
            feed = c.feed("train")
            while True:
                try:
                    (loss,) = feed.run(["loss"])
                except StopIteration:
                    break
                losses.append(float(loss))
        results[device] = (losses, adapter.state())
        if device == STAGED:
            assert adapter._slots is not None and adapter._slots.one_offs == 0
    (l0, s0), (l1, s1) = results["cpu"], results[STAGED]
    assert l0 == l1
    for name in s0:
        np.testing.assert_array_equal(s0[name], s1[name])


# ---- providers everywhere ------------------------------------------------------------------------------
NO_CUDA = "CUDAExecutionProvider" not in feeder.device.available_providers()
ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def _env():
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.skipif(not NO_CUDA, reason="CUDA is installed here: nothing is refused")
def test_predict_refuses_a_provider_that_is_not_installed_before_writing_anything(tmp_path):
    pytest.importorskip("pyarrow")
    from feeder.sources import ArraySource

    n = 300
    x = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)
    model = tmp_path / "m.onnx"
    model.write_bytes(linear_model())
    for providers in ("cuda", "cuda:1", ["TensorrtExecutionProvider", "CPUExecutionProvider"]):
        with pytest.raises(ValueError, match="is not available in the installed onnxruntime") as e:
            feeder.predict(str(model), ArraySource({"x": x, "id": np.arange(n)}), tmp_path / "out", keep=["id"],
                           providers=providers, progress=False)
        assert "onnxruntime-gpu" in str(e.value) and "CPUExecutionProvider" in str(e.value)
        assert "cannot be loaded" not in str(e.value)  # the model is fine: only the provider is missing
        assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="applies to a model given as a path"):
        feeder.predict(session(linear_model()), ArraySource({"x": x, "id": np.arange(n)}), tmp_path / "out",
                       keep=["id"], providers="cpu", progress=False)
    result = feeder.predict(str(model), ArraySource({"x": x, "id": np.arange(n)}), tmp_path / "out", keep=["id"],
                            providers="cpu", batch_size=32, progress=False)
    assert result.rows == n


@pytest.mark.skipif(not NO_CUDA, reason="CUDA is installed here: nothing is refused")
def test_the_command_lines_take_a_provider_and_refuse_a_missing_one_in_one_line(tmp_path):
    import subprocess

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    n = 200
    x = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 4),
                             "id": pa.array(np.arange(n))}), str(tmp_path / "in.parquet"))
    (tmp_path / "m.onnx").write_bytes(linear_model())
    base = [sys.executable, "-m", "feeder", "predict", str(tmp_path / "m.onnx"), str(tmp_path / "in.parquet"),
            str(tmp_path / "out"), "--keep", "id", "--no-progress"]
    bad = subprocess.run(base + ["--provider", "cuda"], capture_output=True, text=True, env=_env(), timeout=120)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.count("\n") == 1 and "onnxruntime-gpu" in bad.stderr and "Traceback" not in bad.stderr
    assert "cannot be loaded" not in bad.stderr
    # --columns loads the model itself (to name its inputs): the same one line
    cols = subprocess.run(base + ["--provider", "cuda", "--columns", "x=x"], capture_output=True, text=True,
                          env=_env(), timeout=120)
    assert cols.returncode == 2 and cols.stderr.count("\n") == 1 and "onnxruntime-gpu" in cols.stderr, cols.stderr
    assert "cannot be loaded" not in cols.stderr
    assert not (tmp_path / "out").exists()
    good = subprocess.run(base + ["--provider", "cpu"], capture_output=True, text=True, env=_env(), timeout=120)
    assert good.returncode == 0 and good.stdout.startswith(f"{n} rows written"), good.stderr
    bench = subprocess.run([sys.executable, "-m", "feeder", "bench", str(ROOT / "tests" / "utils.py") + ":ones4",
                            "--model", str(tmp_path / "m.onnx"), "--provider", "cuda", "--seconds", "0.1"],
                           capture_output=True, text=True, env=_env(), timeout=120)
    assert bench.returncode == 2 and "onnxruntime-gpu" in bench.stderr, bench.stderr


def test_padded_batches_are_assembled_in_the_staging_memory(coord, monkeypatch):
    # A padded feed's batches are made in the memory the device copies from fast (pinned on a
    # GPU), as an unpadded feed's are: they were made in ordinary memory, then copied from it.
    from test_pad_feed import RaggedRows, expected_sums, mask_model

    made = []
    real = feeder.device.DeviceMemory.host_array

    def host_array(self, shape, dtype):
        a = real(self, shape, dtype)
        made.append(a)
        return a

    monkeypatch.setattr(feeder.device.DeviceMemory, "host_array", host_array)
    feeder.init_data_input_workers(session(mask_model("tokens_mask")), None, RaggedRows(64), 8, num_worker_threads=1,
                                   coordinator=coord, pad={"tokens": 0}, device=STAGED)
    seen = []
    with coord:
        feed = coord.feed("train")
        batch = feed.next_batch()
        assert any(np.shares_memory(batch["tokens"], m) for m in made)
        seen += batch["id"].tolist()
        while True:
            try:
                out, ids = feed.run()
            except StopIteration:
                break
            np.testing.assert_array_equal(out, expected_sums(ids))
            seen += ids.tolist()
    assert sorted(seen) == list(range(64))
