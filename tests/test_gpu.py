"""The device path on a real GPU (issues 27 and 33). Runs only where onnxruntime-gpu and a CUDA device
are present (``pytest -m gpu tests/test_gpu.py``, or ``bash benchmarks/gpu_checks.sh``); skipped, with
the reason, everywhere else. The same code runs on the CPU provider, against a stand-in of the CUDA
runtime, in test_device.py.

Numerics: the CUDA provider computes MatMul and Conv in TF32 by default (a 10-bit mantissa: relative
differences near 1e-3 from the CPU's float32, measured 2.0e-3 on an H100). Tests that compare outputs
with the CPU's exactly make their session with ``use_tf32=0``; one test keeps the default and says
why its tolerance is what it is."""
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
    assert all(v.device_name() == "cuda" for s in feed._runner.slots._slots for v in s.buffers)
    assert feed._runner.transfer.streamed, "copies did not go on a stream (no CUDA runtime found? see the log)"
    if mode == "processes":  # from registered shared memory to the device: no host copy in the parent
        assert feed._rebatcher.copied_bytes == 0


def test_device_inputs_keep_their_addresses_and_every_copy_comes_from_pinned_memory(coord):
    """The copies to the device are asynchronous only from pinned (or registered) memory: every one of
    them must come from there (a fetcher's pinned coalescing buffer, or the feed's pinned staging)."""
    sess = RecordingSession(cuda_session(id_outputs_model()))
    feeder.init_data_input_workers(sess, None, IdRows(10**7, max_rows=12), 64, num_worker_threads=2,
                                   coordinator=coord, timeout=60)
    transfer = coord.feed("train")._runner.transfer
    runtime, fast = transfer.runtime, transfer.memory.ranges
    assert runtime is not None and runtime.name == "cuda", "no CUDA runtime found in the process"
    sources = []
    real = runtime.memcpy_async

    def memcpy_async(dst, src, nbytes, stream):
        sources.append(fast.holds(src, nbytes))
        return real(dst, src, nbytes, stream)

    runtime.memcpy_async = memcpy_async
    coord.start()
    feed = coord.feed("train")
    for _ in range(300):
        (a,) = feed.run(["a"])
        assert a.shape == (64, 2)
    ring = feed._runner.slots
    addresses = {addr for _, addr in sess.bound}
    assert sum(sess.bound.values()) == len(addresses) <= ring.allocations + ring.one_offs
    assert ring.allocations <= feed._runner.ring_size
    assert len(sources) >= 300 and all(sources), \
        f"{sources.count(False)} of {len(sources)} copies came from pageable memory (cudaHostAlloc failed? see the log)"


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
    fp32 = [("CUDAExecutionProvider", {"device_id": "0", "use_tf32": "0"}), "CPUExecutionProvider"]
    got = {}
    for name, providers in (("cpu", "cpu"), ("cuda-fp32", fp32), ("cuda", "cuda")):
        feeder.predict(str(model), ArraySource({"x": x, "id": np.arange(n)}), tmp_path / name, keep=["id"],
                       batch_size=128, providers=providers, progress=False)
        table = pq.read_table(str(tmp_path / name)).sort_by("id")
        got[name] = np.stack(table["y"].to_numpy(zero_copy_only=False))
    # Every row written once, where it belongs, with the CPU's values when the GPU computes in float32.
    np.testing.assert_allclose(got["cuda-fp32"], got["cpu"], rtol=1e-5, atol=1e-5)
    # With the provider's default (TF32 for MatMul: 10 bits of mantissa, relative error up to about
    # 2**-11 per product, summed over 4 terms here), differences of a few 1e-3 are the hardware's.
    np.testing.assert_allclose(got["cuda"], got["cpu"], rtol=1e-2, atol=1e-2)


def test_worker_processes_segments_are_registered_and_later_pinned_allocations_still_work(coord):
    """Each segment is registered with the CUDA runtime and unregistered before it is unmapped: after a
    feed of worker processes has stopped (its segments unmapped), pinned memory can still be had and the
    session still runs (error 208, "resource already mapped", otherwise)."""
    sess = cuda_session(id_outputs_model())
    n = 4000
    feeder.init_data_input_workers(sess, ["x"], XOnly(Sharded(n, 2, sizes=(5, 16, 11))), 16, coordinator=coord,
                                   timeout=60, num_worker_processes=2)
    with coord:
        feed = coord.feed("train")
        seen = []
        while True:
            try:
                (a,) = feed.run(["a"])
            except StopIteration:
                break
            seen.extend(a[:, 0].astype(int).tolist())
        assert len(feed._runner.transfer.memory.ranges) > 0  # segments registered
        assert feed._rebatcher.copied_bytes == 0  # straight from shared memory to the device
    assert sorted(seen) == list(range(n))
    import gc

    gc.collect()  # segments unmapped (each unregistered first)
    c2 = feeder.GlobalCoordinator(join_timeout=3.0)
    feeder.init_data_input_workers(sess, None, IdRows(5000), 64, num_worker_threads=2, coordinator=c2, timeout=60)
    with c2:
        feed = c2.feed("train")
        staging = feed._runner.slots.memory.host_array((1024,), np.uint8)
        from feeder.device import _HostBuffer

        assert isinstance(staging.base, _HostBuffer), "pinned memory could not be had after segments were unmapped"
        rows = sum(feed.run(["a"])[0].shape[0] for _ in range(20))
        assert rows == 20 * 64


def test_a_padded_feed_on_cuda_stops_allocating_device_memory(coord):
    from test_pad_feed import mask_model

    def row(k):
        return k * 100 + 1 + np.arange((k * 7919) % 40 + 1, dtype=np.int64)

    chunks = iter(range(0, 1000, 5))

    def fetch(worker_id, batch_size):
        start = next(chunks)
        ids = np.arange(start, start + 5)
        return {"tokens": [row(int(k)) for k in ids], "id": ids}

    feeder.init_data_input_workers(cuda_session(mask_model("tokens_mask")), None, fetch, 8, num_worker_threads=1,
                                   coordinator=coord, pad={"tokens": 0})
    with coord:
        feed = coord.feed("train")
        while True:
            try:
                out, ids = feed.run()
            except StopIteration:
                break
            np.testing.assert_array_equal(out, np.array([row(int(k)).sum() for k in ids], np.float32))
        m = feed.metrics()
    assert m["batches"] == 125 and m["device_allocations"] <= 2 * feed._runner.slots.size * 3, m


def test_a_trace_on_cuda_has_the_copies_on_the_stream(coord, tmp_path):
    import json

    feeder.init_data_input_workers(cuda_session(id_outputs_model()), None, IdRows(10**7, max_rows=40), 256,
                                   num_worker_threads=2, coordinator=coord, timeout=60)
    coord.start()
    feed = coord.feed("train")
    for _ in range(10):
        feed.run(outputs="device")
    with feed.trace(tmp_path / "t.json"):
        for _ in range(50):
            feed.run(outputs="device")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    copies = [e for e in events if e["ph"] == "X" and e["name"] == "copy"]
    assert len(copies) >= 40 and all(e["dur"] >= 0 for e in copies)
    assert feed.stage_times().copy_s > 0


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
    value = weakref.ref(ring._slots[0].buffers[0])
    coord.stop()
    gc.collect()
    assert ring.device_bytes() == 0 and value() is None
