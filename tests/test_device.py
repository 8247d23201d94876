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
from utils import IdAndOne, Sharded, XOnly, workers  # noqa: E402

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

    def bind_input(self, name, device_type, device_id, element_type, shape, buffer_ptr):
        with self._owner._lock:
            self._owner.bound[(name, buffer_ptr)] += 1
        self._inner.bind_input(name, device_type, device_id, element_type, shape, buffer_ptr)


def slow_copies(runner, pause=0.0005):
    """Make the runner's copies to the device slow and torn, on a stream thread of their own: half
    the batch, a pause, the rest. A run reading a slot while it is written would see rows of two
    batches. (Before the feed starts: the stream is made at the first copy.)"""
    stand_in = feeder.device.StandIn(asynchronous=True, tear_s=pause)
    runner.transfer.runtime = runner.transfer.memory.runtime = stand_in
    return stand_in


def test_device_strings_are_parsed_and_refused_clearly():
    assert parse_device(None) is None
    assert parse_device("cpu") == Placement()
    assert parse_device("CUDA:1") == Placement("cuda", 1)
    assert parse_device(STAGED).on_device and not parse_device("cpu").on_device
    with pytest.raises(ValueError, match=r"'cpu', 'cpu:staged' \(the device path on the CPU\), 'cuda' or 'cuda:N'"):
        parse_device("gpu")
    with pytest.raises(ValueError, match=r"'cpu', 'cpu:staged' \(the device path on the CPU\), 'cuda' or 'cuda:N'"):
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
    value = weakref.ref(ring._slots[0].buffers[0])
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


# ---- the device path against a stand-in of the CUDA runtime (issue 33) --------------------------------
# A stand-in of the CUDA runtime (feeder.device.StandIn) under a "cpu:staged" feed: copies become
# memmoves made on a stream thread of its own, after a delay, and every call is recorded. What a GPU
# would not forgive is checked where it would happen: a run that starts before its copy is done, a copy
# into a slot that a run is reading, memory reused or unregistered while a copy still reads it.
from feeder.device import StandIn  # noqa: E402


def stand_in_under_feeds(monkeypatch, **options):
    """Every feed registered from now on copies through one recording, asynchronous stand-in."""
    stand_in = StandIn(asynchronous=True, record=True, **options)
    real = feeder.device.runtime_for
    monkeypatch.setattr(feeder.device, "runtime_for", lambda p: stand_in if p.staged else real(p))
    return stand_in


class CheckedSession(RecordingSession):
    """A RecordingSession that, at each run, checks with the stand-in that the inputs' copies are done,
    and marks the inputs' device memory as being read until the run returns (a copy into it meanwhile is
    a violation the stand-in reports)."""

    def __init__(self, inner, stand_in, delay=0.0):
        super().__init__(inner, delay)
        self.stand_in = stand_in
        self.reading = collections.Counter()  # addresses being read by a run
        self.violations = []
        stand_in.on_copy = self._on_copy

    def io_binding(self):
        return CheckedBinding(self._inner.io_binding(), self)

    def _on_copy(self, dst, src, n):
        with self._lock:
            if any(ptr < dst + n and dst < ptr + size for (ptr, size), k in self.reading.items() if k):
                self.violations.append(f"a copy into {dst:#x} while a run reads it")

    def run_with_iobinding(self, binding, run_options=None):
        inputs = list(binding.inputs.values())
        for ptr, size in inputs:
            if self.stand_in.busy(ptr, size):
                self.violations.append(f"a run started before the copy into {ptr:#x} was done")
        with self._lock:
            for key in inputs:
                self.reading[key] += 1
        try:
            super().run_with_iobinding(binding, run_options)
        finally:
            with self._lock:
                for key in inputs:
                    self.reading[key] -= 1


class CheckedBinding(RecordingBinding):
    def __init__(self, inner, owner):
        super().__init__(inner, owner)
        self.inputs = {}

    def bind_input(self, name, device_type, device_id, element_type, shape, buffer_ptr):
        self.inputs[name] = (buffer_ptr, int(np.prod(shape)) * np.dtype(element_type).itemsize)
        super().bind_input(name, device_type, device_id, element_type, shape, buffer_ptr)


def test_the_stand_in_copies_in_stream_order_and_its_events_tell_when():
    import ctypes

    s = StandIn(asynchronous=True, delay_s=0.05, record=True)
    stream, event = s.stream_create(), s.event_create()
    src, dst = np.arange(1000, dtype=np.int64), np.zeros(1000, np.int64)
    s.memcpy_async(dst.ctypes.data, src.ctypes.data, src.nbytes, stream)
    s.event_record(event, stream)
    assert s.busy(dst.ctypes.data, 8) and not s.event_query(event)  # in flight
    s.event_synchronize(event)
    assert s.event_query(event) and not s.busy(dst.ctypes.data, 8)
    assert (dst == src).all()
    s.host_unregister(ctypes.addressof(ctypes.c_int()))
    assert s.violations and "not registered" in s.violations[0]
    s.stream_destroy(stream)
    assert [c[0] for c in s.calls][:4] == ["cudaStreamCreateWithFlags", "cudaEventCreateWithFlags",
                                           "cudaMemcpyAsync", "cudaEventRecord"]


def test_a_copy_keeps_what_it_reads_until_its_event_and_close_waits_for_it():
    from feeder.device import DeviceMemory, SlotRing, Transfer

    ort = pytest.importorskip("onnxruntime")
    s = StandIn(asynchronous=True, delay_s=0.05)
    memory = DeviceMemory(Placement("cpu", 0, staged=True), ort, s)
    transfer = Transfer(memory)
    ring = SlotRing(memory, ["x"], 2)
    staging = memory.host_array((256,), np.float32)
    staging[:] = np.arange(256)
    assert memory.fast(staging)  # staging memory is what the device copies from fast
    slot = ring.acquire([staging.nbytes])
    ticket = transfer.copy(slot, [(staging,)])
    alive = weakref.ref(staging)
    del staging
    gc.collect()
    assert alive() is not None, "the memory a copy reads was let go before the copy was done"
    ticket.wait()
    gc.collect()
    assert alive() is None, "the memory a copy read was kept after the copy was done"
    assert np.array_equal(slot.buffers[0].numpy().view(np.float32)[:256], np.arange(256))
    other = np.ones(64, np.float32)
    transfer.copy(slot, [(other,)])  # in flight when the slot is let go (stop): its buffer must outlive it
    ptr = slot.ptrs[0]
    written = weakref.ref(slot.buffers[0])
    ring.close()
    del slot
    gc.collect()
    assert written() is not None, "a device buffer was let go while a copy into it was in flight"
    transfer.close()  # waits for the copy in flight
    assert not s.busy(ptr, 256) and s.copies == 2 and transfer.pending() == 0
    gc.collect()
    assert written() is None


@pytest.mark.parametrize("consumers", [1, 3])
def test_no_run_before_its_copy_and_no_slot_written_while_a_run_reads_it(monkeypatch, mode, consumers):
    """Copies made late (on the stand-in's stream thread, 2 ms each), runs that read late, threads or
    worker processes, one or three consumers: no run starts before its copy's event, no copy goes into a
    slot a run reads, every row once, and no violation seen by the stand-in."""
    stand_in = stand_in_under_feeds(monkeypatch, delay_s=0.002)
    coord = feeder.GlobalCoordinator(join_timeout=3.0)
    sess = CheckedSession(session(id_outputs_model()), stand_in, delay=0.0003)
    n = 1200
    feeder.init_data_input_workers(sess, ["x"], IdAndOne(Sharded(n, 2, sizes=(5, 16, 11))), 16, coordinator=coord,
                                   timeout=60, device=STAGED, **workers(mode, 2))
    seen, errors = [], []
    patterns = [[["a"], None], [["b", "c"], ["c"]], [None, ["c", "a", "b"]]][:consumers]
    with coord:
        feed = coord.feed("train")
        threads = [threading.Thread(target=consume_checking, args=(feed, p, seen, errors)) for p in patterns]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not sess.violations, sess.violations[:3]
    assert not errors, errors[0]
    assert sorted(seen) == list(range(n)), "rows lost or delivered twice"
    assert not stand_in.violations, stand_in.violations[:3]
    assert stand_in.copies > 0 and sess.runs == -(-n // 16) or sess.runs >= n // 16


def test_worker_processes_chunks_go_to_the_device_from_registered_shared_memory(monkeypatch):
    """Worker processes: each segment is registered before the first copy from it and unregistered
    before it is unmapped; every copy reads registered memory; a chunk's shared memory goes back to its
    worker only once the copy that read it is done; the parent copies no byte on the host, and the
    device gets every byte of every batch once."""
    from feeder.processes import shm

    stand_in = stand_in_under_feeds(monkeypatch, delay_s=0.001)
    log = []  # (what, address) in the order it happened, stand-in calls and unmaps together
    mmap_, munmap = shm._LIBC_MMAP

    def recording_munmap(addr, size):
        log.append(("munmap", addr, size))
        return munmap(addr, size)

    monkeypatch.setattr(shm, "_LIBC_MMAP", (mmap_, recording_munmap))
    real_register, real_unregister = stand_in.host_register, stand_in.host_unregister
    monkeypatch.setattr(stand_in, "host_register", lambda p, n: (log.append(("register", p, n)), real_register(p, n)))
    monkeypatch.setattr(stand_in, "host_unregister", lambda p: (log.append(("unregister", p, 0)), real_unregister(p)))
    real_copy = stand_in.memcpy_async

    def copy(dst, src, n, stream):
        log.append(("copy", src, n))
        return real_copy(dst, src, n, stream)

    monkeypatch.setattr(stand_in, "memcpy_async", copy)
    segments = {}  # control page id -> the worker's maps, to find a slot's memory when it is released
    real_release = shm.ControlPage.release
    early = []

    def release(page, slot):
        maps = segments.get(id(page))
        mem = maps.get(slot) if maps is not None else None
        if mem is not None:
            import ctypes

            if stand_in.busy(ctypes.addressof(mem), len(mem)):
                early.append(slot)
        return real_release(page, slot)

    monkeypatch.setattr(shm.ControlPage, "release", release)
    coord = feeder.GlobalCoordinator(join_timeout=3.0)
    n = 3000
    sess = session(id_outputs_model())
    feeder.init_data_input_workers(sess, ["x"], XOnly(Sharded(n, 2, sizes=(5, 16, 11, 40))), 16, coordinator=coord,
                                   timeout=60, device=STAGED, num_worker_processes=2)
    seen, delivered_bytes = [], 0
    with coord:
        feed = coord.feed("train")
        while True:
            for w in feed._fetchers._workers:
                if w.control is not None:
                    segments[id(w.control)] = w.maps
            try:
                (a,) = feed.run(["a"])
            except StopIteration:
                break
            seen.extend(a[:, 0].astype(int).tolist())
            delivered_bytes += a.shape[0] * 8
        assert feed._rebatcher.copied_bytes == 0, "the parent copied rows on the host"
        assert feed._rebatcher.zero_copy_batches == -(-n // 16)
    assert sorted(seen) == list(range(n))
    assert stand_in.copied_bytes == delivered_bytes, "a byte went to the device twice, or not at all"
    assert not early, f"slots given back to their worker while a copy read them: {early[:5]}"
    assert not stand_in.violations, stand_in.violations[:3]
    registered = {}  # address -> size, as the log goes
    for what, addr, size in log:
        if what == "register":
            registered[addr] = size
        elif what == "copy":
            assert any(p <= addr < p + k for p, k in registered.items()), "a copy from memory not registered"
        elif what == "unregister":
            registered.pop(addr)
        elif what == "munmap":
            assert addr not in registered, "a segment unmapped while still registered"
    assert any(w == "register" for w, _, _ in log) and not registered, "segments left registered after stop"


def test_fetcher_threads_coalesce_into_pinned_buffers_that_go_to_the_device_as_they_are(monkeypatch, coord):
    stand_in = stand_in_under_feeds(monkeypatch)
    feeder.init_data_input_workers(session(id_outputs_model()), ["x"], XOnly(Sharded(4000, 2, sizes=(2, 3))), 64,
                                   coordinator=coord, timeout=60, device=STAGED, num_worker_threads=2)
    seen = []
    with coord:
        feed = coord.feed("train")
        while True:
            try:
                (a,) = feed.run(["a"])
            except StopIteration:
                break
            seen.extend(a[:, 0].astype(int).tolist())
        rb = feed._rebatcher
        assert rb.zero_copy_batches >= 4000 // 64 - 4 and rb.copied_bytes <= 4 * 64 * 8  # the pieces left at the end
    assert sorted(seen) == list(range(4000))
    assert not stand_in.violations


def test_a_padded_feed_on_a_device_stops_allocating_device_memory(coord):
    """Slots take batches of any shape up to their capacity, bound by address with their shape: 125
    padded batches of changing lengths allocate a few device buffers, not one per new length."""
    from test_pad_feed import mask_model

    def row(k):  # lengths 1..40, here and there
        return k * 100 + 1 + np.arange((k * 7919) % 40 + 1, dtype=np.int64)

    chunks = iter(range(0, 1000, 5))

    def fetch(worker_id, batch_size):
        start = next(chunks)  # (StopIteration at the end)
        ids = np.arange(start, start + 5)
        return {"tokens": [row(int(k)) for k in ids], "id": ids}

    feeder.init_data_input_workers(session(mask_model("tokens_mask")), None, fetch, 8, num_worker_threads=1,
                                   coordinator=coord, pad={"tokens": 0}, device=STAGED)
    lengths = set()
    with coord:
        feed = coord.feed("train")
        while True:
            try:
                out, ids = feed.run()
            except StopIteration:
                break
            np.testing.assert_array_equal(out, np.array([row(int(k)).sum() for k in ids], np.float32))
            lengths.add(feed._runner.slots._slots[0].bound[0])
        m = feed.metrics()
    ring = feed._runner.slots
    assert m["batches"] == 125 and len(lengths) > 3
    # each of the ring's slots grows a few times at most (to the longest batch), whatever the lengths
    assert m["device_allocations"] <= 2 * ring.size * 3, (m["device_allocations"], len(lengths))
    gc.collect()
    assert feed.metrics()["device_bytes"] == 0  # let go at stop


def test_device_memory_figures(coord):
    feeder.init_data_input_workers(session(id_outputs_model()), None, IdRows(10**6), 16, num_worker_threads=1,
                                   coordinator=coord, device=STAGED, timeout=30)
    coord.start()
    feed = coord.feed("train")
    for _ in range(50):
        feed.run()
    m = feed.metrics()
    ring = feed._runner.slots
    assert m["device_bytes"] == ring.device_bytes() > 0
    assert m["device_allocations"] == ring.allocations + ring.one_offs, (ring.allocations, ring.one_offs)
    assert m["copy_s"] > 0 and feed.stage_times().copy_s == m["copy_s"]
    for _ in range(300):
        feed.run()
    # steady state allocates nothing: a buffer per slot at most (made as more batches are alive at once)
    assert feed.metrics()["device_allocations"] <= ring.size + ring.one_offs


def test_without_a_cuda_runtime_copies_go_through_update_inplace_and_the_log_says_so(monkeypatch, coord, caplog):
    monkeypatch.setattr(feeder.device, "runtime_for", lambda p: None)
    with caplog.at_level("INFO", logger="feeder"):
        feeder.init_data_input_workers(session(id_outputs_model()), None, IdRows(3000), 16, num_worker_threads=2,
                                       coordinator=coord, device=STAGED, timeout=30)
    assert sum("update_inplace" in r.getMessage() for r in caplog.records) == 1
    seen = []
    with coord:
        feed = coord.feed("train")
        assert not feed._runner.transfer.streamed
        while True:
            try:
                (c,) = feed.run(["c"])
            except StopIteration:
                break
            seen.extend((c - 1).astype(int).tolist())
    assert sorted(seen) == list(range(3000))


def test_stateful_session_copies_its_batches_on_its_stream(monkeypatch):
    from test_training import DIM, chunked, separable

    stand_in = stand_in_under_feeds(monkeypatch, delay_s=0.001)
    x, y = separable(1500, seed=3)
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
            figures = feed.metrics()
        results[device] = (losses, adapter.state())
    assert results["cpu"][0] == results[STAGED][0]
    assert stand_in.copies > 0 and not stand_in.violations
    assert figures["copy_s"] > 0 and figures["device_allocations"] > 0
    assert any(call == "cudaEventSynchronize" for call, _, _ in stand_in.calls)
    del adapter
    gc.collect()  # the adapter's stream (here a stand-in's thread) goes with the adapter


def test_a_trace_shows_fetch_assemble_copy_wait_and_run(tmp_path, coord, mode, monkeypatch):
    import json

    monkeypatch.setattr(feeder.feed, "PARALLEL_BYTES", 0)  # every batch written outside the lock: "assemble"
    feeder.init_data_input_workers(session(id_outputs_model()), ["x"], XOnly(Sharded(10**6, 2, sizes=(5, 16))), 16,
                                   coordinator=coord, timeout=60, device=STAGED, max_buffered_batches=8,
                                   **workers(mode, 2))
    path = tmp_path / "trace.json"
    coord.start()
    feed = coord.feed("train")
    for _ in range(5):
        feed.run()
    with feed.trace(path) as tracer:
        # At least 40 batches, and on until a fetch is seen: what was queued before the trace began
        # (8 chunks of at most 16 rows, plus the batches in flight) is drained long before 400.
        for n in range(400):
            feed.run()
            if n >= 39 and any(e.get("name") == "fetch" for e in tracer.events()):
                break
        with pytest.raises(feeder.FeederError, match="already"):
            with feed.trace(tmp_path / "two.json"):
                pass
    assert feed._trace.tracer is None and len(tracer.events()) > 40
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    # (worker processes' chunks go to the device from their shared memory: nothing is assembled on the host)
    assert {"fetch", "copy", "run"} | ({"assemble"} if mode == "threads" else set()) <= names, names
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in spans)
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert all(e["tid"] in threads for e in spans)
    assert any(name.endswith(":stream") for name in threads.values())
    if mode == "processes":
        assert any(":proc-" in name for name in threads.values())
    for _ in range(5):
        feed.run()  # no trace: nothing more recorded
    assert len(json.loads(path.read_text())["traceEvents"]) == len(events)


def test_the_cuda_runtime_binding_against_a_c_stand_in(tmp_path):
    """feeder.device.cudart.CudaRuntime, the ctypes binding used on a GPU, against a C library with the
    CUDA runtime's signatures (tests/cudart_stub.c, whose soname is libcudart.so.13): found already
    loaded (RTLD_NOLOAD, as after ONNX Runtime's CUDA provider loads the real one), the copy path of a
    Transfer end to end, registration, errors named and the runtime's last error cleared."""
    import ctypes
    import os
    import shutil
    import subprocess

    from feeder.device import DeviceMemory, SlotRing, Transfer
    from feeder.device.cudart import CudaError, CudaRuntime

    ort = pytest.importorskip("onnxruntime")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    if CudaRuntime.loaded() is not None or not NO_CUDA:
        # (the stub, once loaded, would be found where the CUDA provider looks for the real one)
        pytest.skip("the CUDA provider is installed here: the real runtime is tested in test_gpu.py")
    lib_path = tmp_path / "libcudart.so.13"
    src = os.path.join(os.path.dirname(__file__), "cudart_stub.c")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcudart.so.13", "-o", str(lib_path), src],
                   check=True)
    stub = ctypes.CDLL(str(lib_path), mode=os.RTLD_GLOBAL)
    stub.stub_copied.restype = ctypes.c_long
    runtime = CudaRuntime.loaded()
    assert runtime is not None and runtime.soname == "libcudart.so.13"
    memory = DeviceMemory(Placement("cpu", 0, staged=True), ort, runtime)
    transfer = Transfer(memory)
    ring = SlotRing(memory, ["x"], 2)
    staging = memory.host_array((3, 5), np.float32)  # pinned, through cudaHostAlloc
    assert isinstance(staging.base, feeder.device._HostBuffer) and memory.fast(staging)
    staging[:] = np.arange(15).reshape(3, 5)
    slot = ring.acquire([staging.nbytes + 4])
    pieces = (staging[:1], staging[1:])
    ticket = transfer.copy(slot, [pieces])
    ticket.wait()
    assert ticket.done and stub.stub_copied() == staging.nbytes and stub.stub_device() == 0
    assert np.array_equal(slot.buffers[0].numpy()[:staging.nbytes].view(np.float32), np.arange(15))
    assert transfer.copy_s == pytest.approx(0.00025)  # the events' elapsed time
    shared = np.zeros(4096, np.uint8)
    undo = memory.register(shared.ctypes.data, shared.nbytes)
    assert undo is not None and stub.stub_registered() == 1 and memory.fast(shared)
    undo()
    undo()  # once only
    assert stub.stub_registered() == 0 and not memory.fast(shared)
    with pytest.raises(CudaError, match=r"cudaHostRegister failed: CUDA error 1 \(invalid argument\)"):
        runtime.host_register(0, 0)
    assert stub.stub_last_error() == 0  # cleared: ONNX Runtime's own checks must not see it
    assert memory.register(0, 0) is None  # a segment that cannot be registered is staged instead
    transfer.close()
    del staging, pieces, ticket


def test_cuda_graph_bookkeeping_runs_each_slot_at_one_shape_and_never_moves_it(coord):
    """The CUDA-graph path (a graph per slot, for the first full batch shape it runs, its outputs in
    fixed buffers of its own) exercised on the CPU: the provider ignores gpu_graph_id, feeder's
    bookkeeping is the same. A slot that runs a graph keeps its addresses and its shape; the short last
    batch runs without a graph; outputs are right, host and device."""
    n = 16 * 60 + 5
    sess = session(id_outputs_model())
    feeder.init_data_input_workers(sess, None, IdRows(n), 16, num_worker_threads=2, coordinator=coord, timeout=60,
                                   device=STAGED)
    runner = coord.feed("train")._runner
    runner._graph = True
    addresses = {}
    seen = []
    with coord:
        feed = coord.feed("train")
        k = 0
        while True:
            outputs = "device" if k % 3 else "host"
            k += 1
            try:
                a, b = feed.run(["a", "b"], outputs=outputs)
            except StopIteration:
                break
            a, b = (o.numpy() if outputs == "device" else o for o in (a, b))
            np.testing.assert_array_equal(b, 2 * a)
            seen.extend(a[:, 0].astype(int).tolist())
            for slot in runner.slots._slots:
                if slot.graph_shapes is not None:
                    assert slot.graph_shapes == ((16, 2),)
                    first = addresses.setdefault(slot.index, tuple(slot.ptrs))
                    assert first == tuple(slot.ptrs), "a graph's slot moved"
    assert sorted(seen) == list(range(n))
    assert addresses, "no slot ran as a graph"
