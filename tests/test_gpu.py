"""The device path on a real GPU (issue 27). Runs only where onnxruntime-gpu and a CUDA device are
present (``pytest -m gpu tests/test_gpu.py``); skipped, with the reason, everywhere else. The same
code runs on the CPU provider in test_device.py."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from models import (  # noqa: E402
    LOGISTIC_STATE,
    id_outputs_model,
    linear_model,
    logistic_train_step,
    logistic_zero_state,
)
from test_device import RecordingSession  # noqa: E402
from test_runtime import IdRows, ids_of  # noqa: E402
from utils import Sharded, XOnly, workers  # noqa: E402

import feeder  # noqa: E402

CUDA = "CUDAExecutionProvider" in ort.get_available_providers()
pytestmark = [pytest.mark.gpu]
if not CUDA:
    pytestmark.append(pytest.mark.skip(reason="CUDAExecutionProvider is not available here (pip install "
                                              "onnxruntime-gpu, on a machine with a CUDA GPU)"))


def cuda_session(model, graph=False):
    options = {"device_id": "0"}
    if graph:
        options["enable_cuda_graph"] = "1"
    sess = ort.InferenceSession(model, ort.SessionOptions(),
                                providers=[("CUDAExecutionProvider", options), "CPUExecutionProvider"])
    if sess.get_providers()[0] != "CUDAExecutionProvider":
        pytest.skip(f"the CUDA provider did not load (its CUDA or cuDNN libraries?): {sess.get_providers()}")
    return sess


def test_a_cuda_session_gets_its_batches_on_the_device_equal_to_session_run(coord, mode):
    n = 4000
    sess = cuda_session(id_outputs_model())
    feeder.init_data_input_workers(sess, ["x"], XOnly(Sharded(n, 2, sizes=(5, 16, 11))), 16, coordinator=coord,
                                   timeout=60, **workers(mode, 2))
    coord.start()
    feed = coord.feed("train")
    assert str(feed._runner.placement) == "cuda:0" and feed._runner.slots is not None
    seen = []
    while True:
        try:
            a, b, c = feed.run()
        except StopIteration:
            break
        assert (a[:, 1] == a[:, 0]).all()
        np.testing.assert_array_equal(b, 2 * a)
        np.testing.assert_allclose(c, a.sum(axis=1), rtol=1e-6)
        seen.extend(a[:, 0].astype(int).tolist())
    assert sorted(seen) == list(range(n))
    assert all(v.device_name() == "cuda" for s in feed._runner.slots._slots for v in s.inputs)


def test_device_inputs_keep_their_addresses_and_staging_is_pinned(coord):
    from feeder.device import _HostBuffer

    sess = RecordingSession(cuda_session(id_outputs_model()))
    feeder.init_data_input_workers(sess, None, IdRows(10**7, max_rows=12), 64, num_worker_threads=2,
                                   coordinator=coord, timeout=60)
    coord.start()
    feed = coord.feed("train")
    for _ in range(300):
        (a,) = feed.run(["a"])
        assert a.shape == (64, 2)
    ring = feed._runner.slots
    addresses = {addr for _, addr in sess.bound}
    assert sum(sess.bound.values()) == len(addresses) <= ring.allocations + ring.one_offs
    assert ring.allocations <= feed._runner.ring_size
    staged = [a for s in feed._ring._sets for a in s]
    assert staged and all(isinstance(a.base, _HostBuffer) for a in staged), \
        "batches were not assembled in pinned memory (cudaHostAlloc failed? see the log)"


def test_outputs_on_the_device_are_cuda_values_the_caller_keeps(coord):
    sess = cuda_session(id_outputs_model())
    feeder.init_data_input_workers(sess, None, IdRows(10**6), 32, num_worker_threads=1, coordinator=coord, timeout=60)
    coord.start()
    feed = coord.feed("train")
    kept = []
    for _ in range(30):
        outs = feed.run(["a", "c"], outputs="device")
        assert [o.device_name() for o in outs] == ["cuda", "cuda"]
        a, c = (o.numpy() for o in outs)
        assert np.array_equal(ids_of("a", a), ids_of("c", c))
        kept.append((outs, [a.copy(), c.copy()]))
        feed.run()  # host outputs in between
    for outs, copies in kept:
        for o, copy in zip(outs, copies):
            assert np.array_equal(o.numpy(), copy)


@pytest.mark.parametrize("outputs", ["host", "device"])
def test_a_cuda_graph_session_runs_each_slot_as_its_graph_and_the_short_batch_without(coord, outputs):
    n = 16 * 40 + 5  # a short last batch
    sess = cuda_session(id_outputs_model(), graph=True)
    feeder.init_data_input_workers(sess, None, IdRows(n), 16, num_worker_threads=1, coordinator=coord, timeout=60)
    coord.start()
    feed = coord.feed("train")
    assert feed._runner._graph
    seen = []
    while True:
        try:
            outs = feed.run(["a", "b"], outputs=outputs)
        except StopIteration:
            break
        a, b = (o.numpy() if outputs == "device" else o for o in outs)
        np.testing.assert_array_equal(b, 2 * a)
        seen.extend(a[:, 0].astype(int).tolist())
    assert sorted(seen) == list(range(n))


def test_stateful_session_on_cuda_gives_the_cpu_losses_and_weights(coord):
    from models import session as cpu_session
    from test_training import DIM, chunked, separable

    x, y = separable(3000, seed=12)
    results = {}
    for device in ("cpu", "cuda"):
        c = feeder.GlobalCoordinator(join_timeout=3.0)
        inner = cuda_session(logistic_train_step(DIM)) if device == "cuda" else cpu_session(logistic_train_step(DIM))
        adapter = feeder.StatefulSession(inner, LOGISTIC_STATE, logistic_zero_state(DIM), device=device)
        feeder.init_data_input_workers(adapter, None, chunked(x, y), 32, num_worker_threads=1, ordered=True,
                                       coordinator=c, timeout=60)
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
    (l0, s0), (l1, s1) = results["cpu"], results["cuda"]
    np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-6)
    for name in s0:
        np.testing.assert_allclose(s1[name], s0[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_predict_on_cuda_writes_what_the_cpu_writes(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    from feeder.sources import ArraySource

    n = 3000
    x = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)
    model = tmp_path / "m.onnx"
    model.write_bytes(linear_model())
    got = {}
    for provider in ("cpu", "cuda"):
        feeder.predict(str(model), ArraySource({"x": x, "id": np.arange(n)}), tmp_path / provider, keep=["id"],
                       batch_size=128, providers=provider, progress=False)
        table = pq.read_table(str(tmp_path / provider)).sort_by("id")
        got[provider] = np.stack(table["y"].to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(got["cuda"], got["cpu"], rtol=1e-5, atol=1e-5)


def test_device_memory_is_let_go_at_stop_and_a_wrong_device_refused(coord):
    sess = cuda_session(id_outputs_model())
    with pytest.raises(ValueError, match="runs on cuda:0"):
        feeder.init_data_input_workers(sess, None, IdRows(10), 8, coordinator=coord, device="cuda:7")
    feeder.init_data_input_workers(sess, None, IdRows(10**6), 64, num_worker_threads=1, coordinator=coord,
                                   timeout=60)
    coord.start()
    feed = coord.feed("train")
    for _ in range(20):
        feed.run()
    ring = feed._runner.slots
    assert ring.device_bytes() > 0
    value = weakref.ref(ring._slots[0].inputs[0])
    coord.stop()
    gc.collect()
    assert ring.device_bytes() == 0 and value() is None
