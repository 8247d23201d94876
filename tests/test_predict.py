"""feeder.predict and `feeder predict`: every row exactly once into Parquet, across crashes too."""
from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import feeder
from feeder.errors import FetchError, InputValidationError
from feeder.scoring.outputdir import LOCK_NAME, STATE_NAME, OutputDir
from feeder.scoring.partwriter import PartWriter
from feeder.sources import ArraySource

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("onnx")

from models import linear_model, session, shapes_model, two_input_model  # noqa: E402
from utils import wait_until  # noqa: E402

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def data(n: int, dim: int = 4, seed: int = 0):
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def read_sorted(output, by="id"):
    """The output as {column: numpy array}, rows sorted by the kept id column."""
    table = pq.read_table(str(output))
    order = np.argsort(table[by].to_numpy())
    return {name: _column(table[name])[order] for name in table.column_names}


def _column(col):
    """A Parquet column back as an n-d numpy array (fixed-size lists become axes)."""
    arr = col.combine_chunks()
    shape = []
    while pa.types.is_fixed_size_list(arr.type):
        shape.append(arr.type.list_size)
        arr = arr.flatten()
    values = arr.to_numpy(zero_copy_only=False)
    return values.reshape((len(col),) + tuple(shape))


def our_files(output):
    return sorted(os.listdir(output))


def check_clean(output, parts):
    """After a finished call: the parts, the state and the lock file, no temporary file."""
    names = our_files(output)
    assert names == sorted([f"part-{i:05d}.parquet" for i in range(parts)] + [STATE_NAME, LOCK_NAME]), names
    state = json.loads((Path(output) / STATE_NAME).read_text())
    assert state["complete"] is True
    return state


# ---- every row once, equal to session.run -------------------------------------------------------------
@pytest.mark.parametrize("n,replicas,batch_size,rows_per_file",
                         [(2500, 1, 64, 3000), (600, 2, 16, 7), (2500, 2, 100, 100_000)])
def test_every_row_is_written_once_and_equals_session_run(tmp_path, n, replicas, batch_size, rows_per_file):
    x = data(n)
    sess = session(linear_model())
    src = ArraySource({"x": x, "id": np.arange(n) * 10}, shuffle=True, seed=3, block_rows=97)
    result = feeder.predict(sess, src, tmp_path / "out", batch_size=batch_size, keep=["id"], replicas=replicas,
                            rows_per_file=rows_per_file, progress=False)
    parts = -(-n // rows_per_file)
    assert (result.rows, result.rows_computed, len(result.files)) == (n, n, parts)
    assert result.files == [str(tmp_path / "out" / f"part-{i:05d}.parquet") for i in range(parts)]
    assert [pq.read_metadata(f).num_rows for f in result.files] == [rows_per_file] * (parts - 1) + [
        n - rows_per_file * (parts - 1)]
    got = read_sorted(tmp_path / "out")
    np.testing.assert_array_equal(got["id"], np.arange(n) * 10)
    want_y, want_s = sess.run(None, {"x": x})
    np.testing.assert_allclose(got["y"], want_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["s"], want_s, rtol=1e-6, atol=1e-6)
    assert pq.read_table(str(tmp_path / "out")).column_names == ["id", "y", "s"]  # kept first, then outputs
    state = check_clean(tmp_path / "out", parts)
    assert state["source"]["rows_delivered"] == n and state["rows"] == n


def test_output_ranks_and_dtypes_are_kept_and_read_back_by_parquet_source(tmp_path):
    n = 300
    x = data(n)
    sess = session(shapes_model())
    feeder.predict(sess, ArraySource({"x": x, "id": np.arange(n)}), tmp_path / "out", batch_size=32, keep="id",
                   progress=False)
    table = pq.read_table(str(tmp_path / "out"))
    assert table.schema.field("grid").type.equals(pa.list_(pa.list_(pa.float32(), 2), 2))
    assert table.schema.field("label").type == pa.int64()
    assert table.schema.field("half").type.equals(pa.list_(pa.float16(), 4))
    got = read_sorted(tmp_path / "out")
    grid, label, half = sess.run(None, {"x": x})
    np.testing.assert_array_equal(got["grid"], grid)
    np.testing.assert_array_equal(got["label"], label)
    np.testing.assert_array_equal(got["half"], half)
    # ... and as n-d arrays again through feeder's own Parquet reader
    from feeder.sources import ParquetSource
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(None, ["grid", "id"], ParquetSource(str(tmp_path / "out")), 1000,
                                   coordinator=coord)
    with coord:
        (batch,) = list(coord.feed("train"))
    assert batch["grid"].shape == (n, 2, 2)
    np.testing.assert_array_equal(batch["grid"][np.argsort(batch["id"])], grid)


def test_parquet_source_with_string_ids_and_two_model_inputs(tmp_path):
    n = 1000
    a = data(n)
    k = np.arange(n, dtype=np.int64).reshape(n, 1) % 7
    paths = np.array([f"file-{i:04d}.bin" for i in range(n)])
    table = pa.table({"a": pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), 4),
                      "k": pa.FixedSizeListArray.from_arrays(pa.array(k.reshape(-1)), 1),
                      "path": pa.array(paths), "unused": pa.array(np.zeros(n))})
    pq.write_table(table, str(tmp_path / "in.parquet"), row_group_size=150)
    from feeder.sources import ParquetSource
    sess = session(two_input_model())
    result = feeder.predict(sess, ParquetSource(str(tmp_path / "in.parquet")), tmp_path / "out", batch_size=64,
                            keep=["path"], rows_per_file=400, replicas=2, progress=False)
    assert result.rows == n and len(result.files) == 3
    got = read_sorted(tmp_path / "out", by="path")
    assert got["path"].tolist() == paths.tolist()
    np.testing.assert_allclose(got["out"], sess.run(None, {"a": a, "k": k})[0], rtol=1e-6)


def test_a_fixed_batch_dimension_pads_the_short_last_batch_and_drops_nothing(tmp_path):
    n = 10
    x = data(n)
    sess = session(linear_model(batch=4))
    result = feeder.predict(sess, ArraySource({"x": x, "id": np.arange(n)}), tmp_path / "out", batch_size=4,
                            keep=["id"], replicas=2, progress=False)
    assert result.rows == n
    got = read_sorted(tmp_path / "out")
    np.testing.assert_allclose(got["y"], session(linear_model()).run(None, {"x": x})[0], rtol=1e-6)
    with pytest.raises(ValueError, match="fixed at 4 rows; pass batch_size=4"):
        feeder.predict(sess, ArraySource({"x": x, "id": np.arange(n)}), tmp_path / "other", batch_size=8,
                       keep=["id"])
    assert not (tmp_path / "other").exists()


def test_a_model_path_and_worker_processes(tmp_path):
    n = 3000
    x = data(n)
    model = tmp_path / "m.onnx"
    model.write_bytes(linear_model())
    result = feeder.predict(str(model), ArraySource({"x": x, "id": np.arange(n)}, block_rows=100), tmp_path / "out",
                            batch_size=50, keep=["id"], num_worker_processes=2, replicas=2, progress=False)
    assert result.rows == n
    got = read_sorted(tmp_path / "out")
    np.testing.assert_allclose(got["y"], session(linear_model()).run(None, {"x": x})[0], rtol=1e-6, atol=1e-6)
    state = json.loads((tmp_path / "out" / STATE_NAME).read_text())
    assert len(state["model"]["sha256"]) == 64


# ---- finished, resumed, overwritten ----------------------------------------------------------------------
def test_a_finished_output_returns_at_once_without_touching_it(tmp_path):
    n = 500
    x = data(n)
    sess = session(linear_model())
    first = feeder.predict(sess, ArraySource({"x": x, "id": np.arange(n)}), tmp_path / "out", batch_size=32,
                           keep=["id"], rows_per_file=200, progress=False)
    before = {name: os.stat(tmp_path / "out" / name).st_mtime_ns for name in our_files(tmp_path / "out")}
    again = feeder.predict(sess, ArraySource({"x": x, "id": np.arange(n)}), tmp_path / "out", batch_size=64,
                           keep=["id"], rows_per_file=50, progress=False)
    assert (again.rows, again.rows_computed, again.files) == (n, 0, first.files)
    assert again.seconds < 1.0
    assert {name: os.stat(tmp_path / "out" / name).st_mtime_ns for name in our_files(tmp_path / "out")} == before


def test_more_epochs_continue_a_finished_output_and_fewer_are_refused(tmp_path):
    n = 300
    x = data(n)
    sess = session(linear_model())
    arrays = {"x": x, "id": np.arange(n)}
    assert feeder.predict(sess, ArraySource(arrays), tmp_path / "out", keep=["id"], progress=False).rows == n
    more = feeder.predict(sess, ArraySource(arrays, epochs=2), tmp_path / "out", keep=["id"], progress=False)
    assert (more.rows, more.rows_computed) == (2 * n, n)
    assert sorted(read_sorted(tmp_path / "out")["id"].tolist()) == sorted(list(range(n)) * 2)
    with pytest.raises(ValueError, match="holds 600 rows, more than this source's 300"):
        feeder.predict(sess, ArraySource(arrays), tmp_path / "out", keep=["id"], progress=False)


class FailingArraySource(ArraySource):
    """An ArraySource whose ``fail_at``-th read waits until the output in ``out`` has ``min_rows``
    committed, then fails (so that a failure finds committed parts, whatever the timing)."""

    def __init__(self, *args, fail_at: int, out: Path, min_rows: int, **kw):
        super().__init__(*args, **kw)
        self.fail_at, self.out, self.min_rows = fail_at, out, min_rows
        self.reads = 0

    def _committed(self):
        try:
            return json.loads((self.out / STATE_NAME).read_text())["rows"]
        except (OSError, ValueError):
            return 0

    def _read(self, unit, rows, worker_id):
        self.reads += 1
        if self.reads >= self.fail_at:
            wait_until(lambda: self._committed() >= self.min_rows, timeout=20, what="committed rows")
            raise OSError("disk read failed")
        return super()._read(unit, rows, worker_id)


def test_a_failed_call_leaves_a_resumable_output_and_the_next_call_computes_only_the_rest(tmp_path):
    n = 4000
    x = data(n)
    sess = session(linear_model())
    arrays = {"x": x, "id": np.arange(n)}
    src = FailingArraySource(arrays, block_rows=100, fail_at=12, out=tmp_path / "out", min_rows=600, shuffle=True,
                             seed=5)
    with pytest.raises(FetchError) as info:
        feeder.predict(sess, src, tmp_path / "out", batch_size=16, keep=["id"], rows_per_file=300, replicas=2,
                       num_worker_threads=1, progress=False)
    assert isinstance(info.value.__cause__, OSError)
    state = json.loads((tmp_path / "out" / STATE_NAME).read_text())
    assert state["complete"] is False and 0 < state["rows"] < n
    assert not [f for f in our_files(tmp_path / "out") if f.endswith(".tmp")]
    again = FailingArraySource(arrays, block_rows=100, fail_at=10**9, out=tmp_path / "out", min_rows=0, shuffle=True,
                               seed=5)  # the same source definition (its type is part of it), not failing
    result = feeder.predict(sess, again, tmp_path / "out", batch_size=16, keep=["id"], rows_per_file=300,
                            progress=False)
    assert result.rows == n and result.rows_computed == n - state["rows"]
    got = read_sorted(tmp_path / "out")
    np.testing.assert_array_equal(got["id"], np.arange(n))
    np.testing.assert_allclose(got["y"], sess.run(None, {"x": x})[0], rtol=1e-6, atol=1e-6)


def test_another_model_source_or_options_is_refused_naming_what_differs_and_overwrite_starts_afresh(tmp_path):
    n = 400
    x = data(n)
    out = tmp_path / "out"
    src = lambda seed=0: ArraySource({"x": data(n, seed=seed), "id": np.arange(n)})  # noqa: E731
    feeder.predict(session(linear_model()), src(), out, batch_size=32, keep=["id"], rows_per_file=150,
                   progress=False)
    before = {name: (out / name).read_bytes() for name in our_files(out)}
    differs = "another source definition or model: model outputs y: the output has ['tensor(float)', ['N', 3]], " \
              "this call ['tensor(float)', ['N', 5]]"
    with pytest.raises(ValueError, match=re.escape(differs)):
        feeder.predict(session(linear_model(out_dim=5)), src(), out, keep=["id"], progress=False)
    with pytest.raises(ValueError, match="model sha256"):  # same signature, other weights
        feeder.predict(session(linear_model(seed=1)), src(), out, keep=["id"], progress=False)
    with pytest.raises(ValueError, match="source sample: the output has"):  # other data, same shapes
        feeder.predict(session(linear_model()), src(seed=1), out, keep=["id"], progress=False)
    with pytest.raises(ValueError, match="option outputs: the output has \\['y', 's'\\], this call \\['y'\\]"):
        feeder.predict(session(linear_model()), src(), out, keep=["id"], outputs=["y"], progress=False)
    assert {name: (out / name).read_bytes() for name in our_files(out)} == before  # nothing of it lost
    result = feeder.predict(session(linear_model(out_dim=5)), src(), out, keep=["id"], outputs=["y"],
                            rows_per_file=1000, overwrite=True, progress=False)
    assert (result.rows, result.rows_computed, len(result.files)) == (n, n, 1)
    check_clean(out, 1)
    assert read_sorted(out)["y"].shape == (n, 5)
    np.testing.assert_allclose(read_sorted(out)["y"], session(linear_model(out_dim=5)).run(None, {"x": x})[0],
                               rtol=1e-6, atol=1e-6)


# ---- bad input: a clear ValueError before anything runs --------------------------------------------------
def test_a_model_input_the_source_lacks(tmp_path):
    with pytest.raises(ValueError, match=r"model input\(s\) \['x'\] are not inputs of the ArraySource"):
        feeder.predict(session(linear_model()), ArraySource({"z": data(10)}), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_output_name_the_model_lacks(tmp_path):
    with pytest.raises(ValueError, match=r"outputs \['nope'\] are not outputs of the model"):
        feeder.predict(session(linear_model()), ArraySource({"x": data(10)}), tmp_path / "out", outputs=["y", "nope"])
    assert not (tmp_path / "out").exists()


def test_a_kept_input_the_source_lacks(tmp_path):
    with pytest.raises(ValueError, match=r"keep names \['id'\], which are not inputs"):
        feeder.predict(session(linear_model()), ArraySource({"x": data(10)}), tmp_path / "out", keep=["id"])
    from feeder.sources import ParquetSource
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(data(10).reshape(-1)), 4)}),
                   str(tmp_path / "in.parquet"))
    with pytest.raises(ValueError, match=r"column\(s\) \['id'\] not in"):
        feeder.predict(session(linear_model()), ParquetSource(str(tmp_path / "in.parquet")), tmp_path / "out",
                       keep=["id"])
    assert not (tmp_path / "out").exists()


def test_a_plain_fetch_function_lacking_an_input_fails_at_its_first_chunk_before_the_model_runs(tmp_path):
    calls = []

    class Counting:
        """The model, counting its runs."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def run_with_iobinding(self, *args):
            calls.append(1)
            return self.inner.run_with_iobinding(*args)

    def fetch(worker_id, batch_size):
        return {"z": data(4)}

    with pytest.raises(InputValidationError, match="missing \\['x'\\]"):
        feeder.predict(Counting(session(linear_model())), fetch, tmp_path / "out", progress=False)
    assert calls == [] and [f for f in our_files(tmp_path / "out") if f.startswith("part-")] == []


def test_an_output_directory_holding_other_files_is_refused_and_left_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files that feeder.predict did not write \(\['notes.txt'\]\)"):
        feeder.predict(session(linear_model()), ArraySource({"x": data(10)}), out, overwrite=True)
    assert our_files(out) == ["notes.txt"]
    (out / "notes.txt").unlink()
    (out / "part-00000.parquet").write_bytes(b"someone else's")  # a Spark output, say: no state of ours
    with pytest.raises(ValueError, match="holds part files .* but no _feeder_predict.json"):
        feeder.predict(session(linear_model()), ArraySource({"x": data(10)}), out, overwrite=True)
    assert (out / "part-00000.parquet").read_bytes() == b"someone else's"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        feeder.predict(session(linear_model()), ArraySource({"x": data(10)}), tmp_path / "file")


def test_an_endless_source_is_refused(tmp_path):
    with pytest.raises(ValueError, match="endless"):
        feeder.predict(session(linear_model()), ArraySource({"x": data(10)}, epochs=None), tmp_path / "out")


def test_a_fetch_function_without_row_keys_writes_but_cannot_resume(tmp_path):
    n = 300
    x = data(n)

    class Plain:
        def __init__(self):
            self.pos = 0
            self.lock = threading.Lock()

        def __call__(self, worker_id, batch_size):
            with self.lock:
                lo = self.pos
                self.pos += 37
            if lo >= n:
                raise StopIteration
            return {"x": x[lo:lo + 37], "id": np.arange(lo, min(n, lo + 37))}

    sess = session(linear_model())
    result = feeder.predict(sess, Plain(), tmp_path / "out", batch_size=16, keep=["id"], progress=False)
    assert result.rows == n
    got = read_sorted(tmp_path / "out")
    np.testing.assert_array_equal(got["id"], np.arange(n))
    state = check_clean(tmp_path / "out", 1)
    assert state["resumable"] is False and state["source"] is None
    with pytest.raises(ValueError, match="without row keys, so it cannot be continued"):
        feeder.predict(sess, Plain(), tmp_path / "out", keep=["id"])
    assert feeder.predict(sess, Plain(), tmp_path / "out", keep=["id"], overwrite=True, progress=False).rows == n


def test_two_calls_on_one_output_cannot_interleave(tmp_path):
    holder = OutputDir(tmp_path / "out")
    holder.open()
    try:
        with pytest.raises(ValueError, match="being written by another feeder.predict call"):
            feeder.predict(session(linear_model()), ArraySource({"x": data(10)}), tmp_path / "out")
    finally:
        holder.close()
    assert feeder.predict(session(linear_model()), ArraySource({"x": data(10)}), tmp_path / "out",
                          progress=False).rows == 10


def test_without_pyarrow_predict_says_which_extra_to_install(tmp_path):
    code = ("import sys; sys.modules['pyarrow'] = None\n"
            "import feeder\n"
            "try:\n"
            "    feeder.predict('m.onnx', lambda w, b: None, 'out')\n"
            "except ImportError as e:\n"
            "    assert \"pip install 'onnx-feeder[parquet]'\" in str(e), e\n"
            "else:\n"
            "    raise AssertionError('no ImportError')\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=_env())


# ---- progress and logs ----------------------------------------------------------------------------------
def test_progress_bar_when_forced_and_diagnosis_at_info(tmp_path, capfd, caplog):
    pytest.importorskip("tqdm")
    n = 1000
    with caplog.at_level(logging.INFO, logger="feeder"):
        feeder.predict(session(linear_model()), ArraySource({"x": data(n)}), tmp_path / "a", batch_size=50,
                       replicas=2, progress=True)
    err = capfd.readouterr().err
    assert "feeder.predict" in err and "1.00k/1.00k" in err and "row/s" in err
    diagnoses = [r.getMessage() for r in caplog.records if r.getMessage().startswith("feeder.predict replica")]
    assert len(diagnoses) == 2 and all("Figures:" in d for d in diagnoses)
    feeder.predict(session(linear_model()), ArraySource({"x": data(n)}), tmp_path / "b", progress=None)
    assert capfd.readouterr().err == ""  # stderr is not a terminal here: no bar


# ---- the writer: many replicas at once --------------------------------------------------------------------
def test_writer_keeps_every_row_when_replicas_wait_for_buffers_together(tmp_path, monkeypatch):
    """Two replicas wait for a free buffer while the writer is behind; the first to get one fills
    it partly; the second must fill that same buffer, not take the next free one in its place (the
    rows in the first were lost that way)."""
    import feeder.scoring.partwriter as partwriter

    monkeypatch.setattr(partwriter, "BUFFERS", 2)
    gates = {0: threading.Event(), 1: threading.Event()}  # the writer waits in these parts' commits
    committed = []

    def on_commit(part, keys, final):
        if part is not None:
            gate = gates.get(int(part.name[5:10]))
            if gate is not None:
                assert gate.wait(10)
            committed.append(keys)

    writer = PartWriter(OutputDir(tmp_path), ["v"], rows_per_file=10, first_part=0, on_commit=on_commit, keyed=True,
                        durable=False)

    def add(first, n):
        keys = np.arange(first, first + n, dtype=np.int64)
        writer.add([keys.astype(np.float64)], keys)

    for b in range(3):  # part 0 is in its commit, parts 1 and 2 fill both buffers
        add(10 * b, 10)
    waiting = [threading.Thread(target=add, args=(100 * r, 7)) for r in (1, 2)]
    for t in waiting:
        t.start()
    time.sleep(0.3)  # both replicas now wait for a buffer
    gates[0].set()   # part 1 is written and its buffer freed: one replica fills 7 of its 10 rows
    wait_until(lambda: writer.rows_added == 37, what="the first replica's rows")
    time.sleep(0.1)
    gates[1].set()   # part 2's buffer is freed too
    for t in waiting:
        t.join(10)
    writer.finish()
    keys = np.sort(np.concatenate(committed))
    assert keys.tolist() == list(range(30)) + list(range(100, 107)) + list(range(200, 207))
    table = pq.read_table(str(tmp_path))
    assert sorted(table["v"].to_numpy().astype(np.int64).tolist()) == keys.tolist()


# ---- killed with SIGKILL, then called again ---------------------------------------------------------------
CHILD = r'''
import os, signal, sys, time
import numpy as np
import feeder
from feeder.sources import ArraySource



UNIT_S = float(sys.argv[4]) if len(sys.argv) > 4 else 0.05


class SlowSource(ArraySource):
    """Reading takes a while (UNIT_S a unit, 62 units, 4 fetchers: about 0.8 s in all at 50 ms),
    so that a run outlasts the random moment it is killed at on any machine."""

    def _read(self, unit, rows, worker_id):
        time.sleep(UNIT_S)
        return super()._read(unit, rows, worker_id)


out, model, die = sys.argv[1], sys.argv[2], sys.argv[3]
n = 6000
x = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)
src = SlowSource({"x": x, "id": np.arange(n)}, shuffle=True, seed=1, block_rows=97)
if die != "no":  # die at the k-th os.replace or os.fsync, before or after it: inside a commit
    what, k, when = die.split(":")
    k = int(k)
    real = getattr(os, what)
    calls = [0]

    def dying(*args):
        calls[0] += 1
        if calls[0] == k and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        got = real(*args)
        if calls[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return got

    setattr(os, what, dying)
r = feeder.predict(model, src, out, batch_size=16, keep=["id"], rows_per_file=250, replicas=2, progress=False)
print("RESULT", r.rows, r.rows_computed, flush=True)
'''


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    return env


def _child(tmp_path, die="no", unit_s=0.05):
    return subprocess.Popen([sys.executable, str(tmp_path / "child.py"), str(tmp_path / "out"),
                             str(tmp_path / "m.onnx"), die, str(unit_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())


def _check_committed(output):
    """The invariant after any crash: the state reads, its parts exist whole, and its source state
    covers exactly as many rows as its parts hold."""
    state = json.loads((output / STATE_NAME).read_text())
    assert state["complete"] is False
    for p in state["parts"]:
        assert (output / p["file"]).stat().st_size == p["bytes"]
        assert pq.read_metadata(str(output / p["file"])).num_rows == p["rows"]
    assert state["source"]["rows_delivered"] == state["rows"] == sum(p["rows"] for p in state["parts"])
    return state["rows"]


@pytest.mark.slow
def test_killed_at_random_moments_and_inside_commits_the_output_completes_with_every_row_once(tmp_path):
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "m.onnx").write_bytes(linear_model())
    out = tmp_path / "out"
    rng = random.Random(20261124)
    committed = []
    # inside commits: after a part's rename (state not yet written), before a state's rename, in an fsync
    for die in (f"replace:{rng.randint(2, 6)}:after", f"replace:{rng.randint(3, 8)}:before",
                f"fsync:{rng.randint(2, 9)}:before"):
        p = _child(tmp_path, die)
        _, err = p.communicate(timeout=120)
        assert p.returncode == -signal.SIGKILL, err
        committed.append(_check_committed(out))
    # from outside, at random moments once a run is under way
    for _ in range(2):
        before = committed[-1]
        # Slower reading (about 3 s for the whole table), so that what is left after the earlier
        # kills still outlasts the moment it is killed at: a run that finished first tests nothing.
        p = _child(tmp_path, unit_s=0.2)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p.poll() is None:
            state = json.loads((out / STATE_NAME).read_text())
            if state["rows"] > before:
                break
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.2))
        p.kill()
        _, err = p.communicate(timeout=30)
        assert p.returncode == -signal.SIGKILL, f"the run ended before it was killed: {err}"
        committed.append(_check_committed(out))
    assert committed[-1] > 0
    p = _child(tmp_path)
    stdout, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    rows, computed = map(int, stdout.split("RESULT")[1].split())
    assert rows == 6000 and computed == 6000 - committed[-1] < 6000
    state = json.loads((out / STATE_NAME).read_text())
    check_clean(out, len(state["parts"]))
    # the same output as an uninterrupted run, and as session.run
    n = 6000
    x = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)
    src = ArraySource({"x": x, "id": np.arange(n)}, shuffle=True, seed=1, block_rows=97)
    feeder.predict(str(tmp_path / "m.onnx"), src, tmp_path / "whole", batch_size=16, keep=["id"], rows_per_file=250,
                   progress=False)
    got, whole = read_sorted(out), read_sorted(tmp_path / "whole")
    np.testing.assert_array_equal(got["id"], np.arange(n))
    np.testing.assert_array_equal(whole["id"], np.arange(n))
    np.testing.assert_allclose(got["y"], whole["y"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got["s"], whole["s"], rtol=1e-6, atol=1e-7)
    want_y, _ = session(linear_model()).run(None, {"x": x})
    np.testing.assert_allclose(got["y"], want_y, rtol=1e-6, atol=1e-6)


# ---- the command line --------------------------------------------------------------------------------------
def test_the_command_line(tmp_path):
    n = 700
    x = data(n)
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 4),
                             "id": pa.array(np.arange(n))}), str(tmp_path / "in.parquet"), row_group_size=100)
    (tmp_path / "m.onnx").write_bytes(linear_model())
    cmd = [sys.executable, "-m", "feeder", "predict", str(tmp_path / "m.onnx"), str(tmp_path / "in.parquet"),
           str(tmp_path / "out"), "--batch-size", "32", "--keep", "id", "--outputs", "y"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith(f"{n} rows written, {n} computed, ") and line.endswith(" rows/s"), line
    got = read_sorted(tmp_path / "out")
    assert sorted(got) == ["id", "y"]
    np.testing.assert_allclose(got["y"], session(linear_model()).run(None, {"x": x})[0], rtol=1e-6, atol=1e-6)
    again = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert again.returncode == 0 and again.stdout.startswith(f"{n} rows written, 0 computed, "), again.stderr
    bad = subprocess.run(cmd[:-1] + ["nope"], capture_output=True, text=True, env=_env(), timeout=120)
    assert bad.returncode == 2 and "outputs ['nope'] are not outputs of the model" in bad.stderr
