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
from feeder.scoring.outputdir import LOCK_NAME, STATE_NAME, SUCCESS_NAME, OutputDir
from feeder.scoring.partwriter import PartWriter
from feeder.sources import ArraySource

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("onnx")

from models import (  # noqa: E402
    batch_mean_model,
    linear_model,
    save_with_external_data,
    session,
    shapes_model,
    two_input_model,
)
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
    """After a finished call: the parts, the state, the lock file and the completion marker, no
    temporary file."""
    names = our_files(output)
    assert names == sorted([f"part-{i:05d}.parquet" for i in range(parts)] + [STATE_NAME, LOCK_NAME, SUCCESS_NAME]), \
        names
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
overwrite = len(sys.argv) > 5 and sys.argv[5] == "overwrite"
if die.startswith("marker:"):  # die before or after the completion marker is written or removed
    from feeder.scoring.outputdir import OutputDir
    _, which, when = die.split(":")
    name = which + "_marker"
    real_marker = getattr(OutputDir, name)

    def dying_marker(self, *args, **kw):
        if when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        real_marker(self, *args, **kw)
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(OutputDir, name, dying_marker)
elif die != "no":  # die at the k-th os.replace or os.fsync, before or after it: inside a commit
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
r = feeder.predict(model, src, out, batch_size=16, keep=["id"], rows_per_file=250, replicas=2, progress=False,
                   overwrite=overwrite)
print("RESULT", r.rows, r.rows_computed, flush=True)
'''


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    return env


def _child(tmp_path, die="no", unit_s=0.05, overwrite=False):
    return subprocess.Popen([sys.executable, str(tmp_path / "child.py"), str(tmp_path / "out"),
                             str(tmp_path / "m.onnx"), die, str(unit_s), "overwrite" if overwrite else "no"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def _check_committed(output):
    """The invariant after any crash: the state reads, its parts exist whole, and its source state
    covers exactly as many rows as its parts hold."""
    state = json.loads((output / STATE_NAME).read_text())
    assert state["complete"] is False and not (output / SUCCESS_NAME).exists()
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


def _check_marker(output, n=6000):
    """The marker's invariant after any crash: ``_SUCCESS`` is there only beside a complete state
    whose parts are exactly the part files present and hold every row."""
    state = json.loads((output / STATE_NAME).read_text())
    if (output / SUCCESS_NAME).exists():
        assert state["complete"] is True and state["rows"] == n
        assert sorted(p["file"] for p in state["parts"]) == sorted(f for f in our_files(output)
                                                                   if f.startswith("part-"))
        assert pq.read_table(str(output)).num_rows == n
    return state


@pytest.mark.slow
def test_killed_around_the_completion_marker_it_marks_only_a_complete_output(tmp_path):
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "m.onnx").write_bytes(linear_model())
    out = tmp_path / "out"

    def run(die="no", overwrite=False):
        p = _child(tmp_path, die, overwrite=overwrite)
        stdout, err = p.communicate(timeout=120)
        if die == "no":
            assert p.returncode == 0, err
            return tuple(map(int, stdout.split("RESULT")[1].split()))
        assert p.returncode == -signal.SIGKILL, err
        return _check_marker(out)

    state = run("marker:write:before")  # the final state is written, the marker not yet
    assert state["complete"] is True and not (out / SUCCESS_NAME).exists()
    assert run() == (6000, 0) and (out / SUCCESS_NAME).exists()  # finished: the marker written, nothing computed
    (out / SUCCESS_NAME).unlink()
    state = run("marker:write:after")
    assert (out / SUCCESS_NAME).exists()
    # an overwriting run: the marker goes first, before its fresh state
    state = run("marker:remove:after", overwrite=True)
    assert state["complete"] is True and not (out / SUCCESS_NAME).exists()
    assert run() == (6000, 0) and (out / SUCCESS_NAME).exists()
    state = run("replace:1:after", overwrite=True)  # its fresh state, no part yet; the old parts still there
    assert state["parts"] == [] and not (out / SUCCESS_NAME).exists()
    assert [f for f in our_files(out) if f.startswith("part-")]
    assert run() == (6000, 6000)  # starts afresh (a state that commits no part), old parts deleted
    state = check_clean(out, len(json.loads((out / STATE_NAME).read_text())["parts"]))
    np.testing.assert_array_equal(read_sorted(out)["id"], np.arange(6000))


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


# ---- the model's identity: its external data files ------------------------------------------------------
def test_external_data_locations_are_found_where_onnx_finds_them_without_reading_the_tensors(tmp_path):
    import tracemalloc

    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    from feeder.scoring.modelid import _CHILDREN, external_data_locations, model_identity

    # the field numbers walked are onnx.proto's
    kinds = {"model": onnx.ModelProto, "graph": onnx.GraphProto, "node": onnx.NodeProto,
             "attribute": onnx.AttributeProto, "function": onnx.FunctionProto, "training": onnx.TrainingInfoProto,
             "sparse": onnx.SparseTensorProto, "tensor": onnx.TensorProto}
    for kind, fields in _CHILDREN.items():
        numbers = {f.number: f.message_type.name for f in kinds[kind].DESCRIPTOR.fields if f.message_type}
        for number, child in fields.items():
            assert numbers[number] == kinds[child].DESCRIPTOR.name, (kind, number)
    assert onnx.TensorProto.DESCRIPTOR.fields_by_name["external_data"].number == 13
    # tensors in the main graph, in a subgraph (If) and in a Constant node's attribute, in two files
    big = lambda v: numpy_helper.from_array(np.full((8, 8), v, np.float32), f"w{v}")  # noqa: E731
    then = helper.make_graph([helper.make_node("Constant", [], ["t"], value=big(2))], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [8, 8])])
    other = helper.make_graph([helper.make_node("Identity", ["w3"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [8, 8])], initializer=[big(3)])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["z"], then_branch=then, else_branch=other),
         helper.make_node("Add", ["z", "w1"], ["out"])], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [8, 8])], initializer=[big(1)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    path = tmp_path / "m.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0,
                    convert_attribute=True)
    want = [t.external_data[0].value for t in _get_all_tensors(onnx.load(str(path), load_external_data=False))
            if uses_external_data(t)]
    assert sorted(want) == ["w1", "w2", "w3"]
    assert sorted(external_data_locations(path.read_bytes())) == sorted(want)
    identity = model_identity(path=str(path))
    assert sorted(identity["external_data"]) == sorted(want)
    assert model_identity(path=str(path)) == identity  # stable
    # inline weights: nothing external, and the file is hashed in blocks, never held whole
    inline = tmp_path / "inline.onnx"
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["w"], ["o"])], "g", [],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, [8 << 20])],
        initializer=[numpy_helper.from_array(np.ones(8 << 20, np.float32), "w")]),
        opset_imports=[helper.make_opsetid("", 17)])
    inline.write_bytes(model.SerializeToString())
    del model
    tracemalloc.start()
    try:
        assert "external_data" not in model_identity(path=str(inline))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # a 32 MiB model
    with pytest.raises(ValueError):
        external_data_locations(b"\xff\xff\xff")


@pytest.mark.parametrize("given", ["path", "session"])
def test_retrained_external_weights_between_a_crash_and_the_resume_are_refused_naming_the_file(tmp_path, given):
    """A model saved with save_as_external_data: retraining rewrites its weights file and leaves
    its .onnx file as it was; the resume must be refused, naming the weights file."""
    n = 3000
    x = data(n)
    arrays = {"x": x, "id": np.arange(n)}
    model = tmp_path / "model" / "m.onnx"
    model.parent.mkdir()
    save_with_external_data(linear_model(seed=0), model, "weights.bin")
    graph_bytes = model.read_bytes()
    out = tmp_path / "out"

    def as_given():
        return str(model) if given == "path" else session(str(model))

    src = FailingArraySource(arrays, block_rows=100, fail_at=8, out=out, min_rows=300)
    with pytest.raises(FetchError):
        feeder.predict(as_given(), src, out, batch_size=50, keep=["id"], rows_per_file=100, replicas=1,
                       num_worker_threads=1, progress=False)
    state = json.loads((out / STATE_NAME).read_text())
    assert state["rows"] >= 300 and state["model"]["external_data"].keys() == {"weights.bin"}
    save_with_external_data(linear_model(seed=1), model, "weights.bin")  # retrained
    assert model.read_bytes() == graph_bytes
    again = FailingArraySource(arrays, block_rows=100, fail_at=10**9, out=out, min_rows=0)
    with pytest.raises(ValueError, match=r"model external data file 'weights\.bin': other contents than when the "
                                         r"output was written") as info:
        feeder.predict(as_given(), again, out, batch_size=50, keep=["id"], progress=False)
    assert "sha256" not in str(info.value)  # the .onnx file itself did not change
    save_with_external_data(linear_model(seed=0), model, "weights.bin")  # the weights it was written with
    result = feeder.predict(as_given(), again, out, batch_size=50, keep=["id"], progress=False)
    assert result.rows == n and result.rows_computed == n - state["rows"]
    got = read_sorted(out)
    np.testing.assert_allclose(got["y"], session(linear_model(seed=0)).run(None, {"x": x})[0], rtol=1e-6, atol=1e-6)


def test_a_file_that_is_not_an_onnx_model_is_a_value_error_naming_it(tmp_path):
    bad = tmp_path / "m.onnx"
    bad.write_text("not a model")
    with pytest.raises(ValueError, match=r"model '.*m\.onnx' cannot be loaded by onnxruntime"):
        feeder.predict(str(bad), ArraySource({"x": data(10)}), tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- the inputs' identity: size, modification time, footer (or contents) per file ------------------------
def write_features(path, x, ids, *, row_group_size=100):
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1]),
                             "id": pa.array(ids)}), str(path), row_group_size=row_group_size, compression="none",
                   use_dictionary=False)


class FailingParquetSource(feeder.sources.ParquetSource):
    """A ParquetSource whose reads fail, once ``out`` has ``min_rows`` committed, from the
    ``fail_at``-th on (the same type on both calls: it is part of the definition)."""

    fail_at = 10**9
    min_rows = 0
    out = None

    def _read(self, unit, rows, worker_id):
        self.reads = getattr(self, "reads", 0) + 1
        if self.reads >= self.fail_at:
            wait_until(lambda: json.loads((self.out / STATE_NAME).read_text())["rows"] >= self.min_rows, timeout=20,
                       what="committed rows")
            raise OSError("disk read failed")
        return super()._read(unit, rows, worker_id)


@pytest.mark.parametrize("identity", ["metadata", "content"])
def test_a_file_rewritten_with_the_same_size_and_statistics_is_refused_on_resume_naming_it(tmp_path, identity):
    n = 2000
    x = data(n)
    d = tmp_path / "data"
    d.mkdir()
    write_features(d / "a.parquet", x[:1000], np.arange(1000))
    write_features(d / "b.parquet", x[1000:], np.arange(1000, n))
    out = tmp_path / "out"
    src = FailingParquetSource(d, identity=identity)
    src.fail_at, src.min_rows, src.out = 6, 200, out
    with pytest.raises(FetchError):
        feeder.predict(session(linear_model()), src, out, batch_size=50, keep=["id"], rows_per_file=100,
                       replicas=1, num_worker_threads=1, progress=False)
    committed = json.loads((out / STATE_NAME).read_text())["rows"]
    assert committed >= 200
    fixed = x[1000:].copy()
    fixed[7] = fixed[7][::-1]  # one row corrected: its values reversed (the same size, the same statistics)
    size = (d / "b.parquet").stat().st_size
    write_features(d / "b.parquet", fixed, np.arange(1000, n))
    assert (d / "b.parquet").stat().st_size == size
    how = "only its modification time moved .*" if identity == "metadata" else "other contents"
    with pytest.raises(ValueError, match=rf"source files: 1 file\(s\) changed \({how}\): 'b\.parquet'") as info:
        feeder.predict(session(linear_model()), FailingParquetSource(d, identity=identity), out, batch_size=50,
                       keep=["id"], progress=False)
    assert "a.parquet" not in str(info.value)
    if identity == "metadata":
        assert "identity='content'" in str(info.value)
    # the same bytes again (copied back: a new modification time): content identity resumes
    write_features(d / "b.parquet", x[1000:], np.arange(1000, n))
    if identity == "metadata":
        with pytest.raises(ValueError, match=r"changed \(only its modification time moved .*\): 'b\.parquet'"):
            feeder.predict(session(linear_model()), FailingParquetSource(d), out, batch_size=50, keep=["id"],
                           progress=False)
        return
    result = feeder.predict(session(linear_model()), FailingParquetSource(d, identity=identity), out, batch_size=50,
                            keep=["id"], progress=False)
    assert result.rows == n and result.rows_computed == n - committed
    np.testing.assert_array_equal(read_sorted(out)["id"], np.arange(n))


def test_other_data_refusals_name_the_files_added_removed_and_changed_and_show_no_hash(tmp_path):
    n = 100
    d = tmp_path / "data"
    d.mkdir()
    for i in range(30):
        write_features(d / f"f{i:02d}.parquet", data(n, seed=i), np.arange(n) + n * i)
    out = tmp_path / "out"
    feeder.predict(session(linear_model()), feeder.sources.ParquetSource(d), out, keep=["id"], progress=False)
    (d / "f04.parquet").unlink()
    write_features(d / "f30.parquet", data(n, seed=30), np.arange(n) + 3000)
    write_features(d / "f07.parquet", data(50, seed=7), np.arange(50) + 700)
    with pytest.raises(ValueError) as info:
        feeder.predict(session(linear_model()), feeder.sources.ParquetSource(d), out, keep=["id"], progress=False)
    msg = str(info.value)
    assert "source files: 1 file(s) removed (the output has them, this call does not): 'f04.parquet'" in msg
    assert "1 file(s) added (this call has them, the output has not): 'f30.parquet'" in msg
    assert re.search(r"1 file\(s\) changed \(\d+ -> \d+ bytes, 100 -> 50 rows, .*\): 'f07\.parquet'", msg), msg
    assert not re.search(r"[0-9a-f]{16}", msg), msg  # no hash shown
    assert "..." not in msg and "pass overwrite=True to start afresh" in msg


# ---- outputs that are not one value per row ----------------------------------------------------------------
@pytest.mark.parametrize("keepdims", [0, 1])
def test_a_batch_reduction_output_is_refused_from_the_signature_before_anything_is_created(tmp_path, keepdims):
    with pytest.raises(ValueError, match=r"model output 'm' has shape \[(1, )?4\]: its first dimension is fixed at "
                                         r"[14] \(the batch dimension is free\), so it is not one value per row"):
        feeder.predict(session(batch_mean_model(keepdims=keepdims)), ArraySource({"x": data(100)}),
                       tmp_path / "out", batch_size=4)
    assert not (tmp_path / "out").exists()
    result = feeder.predict(session(batch_mean_model(keepdims=keepdims)), ArraySource({"x": data(100)}),
                            tmp_path / "out", batch_size=4, outputs=["y"], progress=False)
    assert result.rows == 100


@pytest.mark.parametrize("batch_size", [4, 5, 1])
def test_a_batch_reduction_the_signature_cannot_see_is_refused_at_the_first_batch_before_any_row_is_written(
        tmp_path, batch_size):
    """m's length is the symbolic "D" (4 here): at batch_size 4 its length equals the batch's, a
    coincidence that a check at one row count would let through."""
    runs = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def run(self, *args, **kw):
            runs.append(1)
            return self.inner.run(*args, **kw)

    sess = session(batch_mean_model(dim="D"))
    with pytest.raises(ValueError, match=r"model output 'm' is not one value per row: \d+ input rows gave it shape "
                                         r"\(4,\)"):
        feeder.predict(Counting(sess), ArraySource({"x": data(100)}), tmp_path / "out", batch_size=batch_size,
                       replicas=2, progress=False)
    assert not [f for f in our_files(tmp_path / "out") if "part-" in f]
    # per-row outputs of the same model pass; the check runs the model twice, on the first batch only
    runs.clear()
    result = feeder.predict(Counting(sess), ArraySource({"x": data(100), "id": np.arange(100)}), tmp_path / "out",
                            batch_size=batch_size, outputs=["y"], keep=["id"], replicas=2, progress=False)
    assert result.rows == 100 and len(runs) == 2
    np.testing.assert_allclose(read_sorted(tmp_path / "out")["y"], data(100) * 2)


# ---- a refused run leaves nothing that blocks the next -------------------------------------------------------
@pytest.mark.parametrize("bad", ["float64", "null", "rank"])
def test_a_run_refused_for_bad_data_does_not_block_the_run_after_the_data_is_fixed(tmp_path, bad):
    n = 500
    x = data(n)
    path = tmp_path / "in.parquet"
    if bad == "float64":
        write_features(path, x.astype(np.float64), np.arange(n))
    elif bad == "null":
        values = pa.array(x.reshape(-1), mask=np.arange(n * 4) == 1234)
        pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(values, 4), "id": pa.array(np.arange(n))}),
                       str(path), row_group_size=100)
    else:
        write_features(path, x.reshape(n, 2, 2).reshape(n, 4), np.arange(n))
        pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(
            pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 2), 2), "id": pa.array(np.arange(n))}),
            str(path), row_group_size=100)
    out = tmp_path / "out"
    with pytest.raises(InputValidationError):
        feeder.predict(session(linear_model()), feeder.sources.ParquetSource(path), out, batch_size=32, keep=["id"],
                       progress=False)
    assert not [f for f in our_files(out) if "part-" in f]
    write_features(path, x, np.arange(n))  # the data fixed: the same call now runs, without overwrite
    result = feeder.predict(session(linear_model()), feeder.sources.ParquetSource(path), out, batch_size=32,
                            keep=["id"], progress=False)
    assert (result.rows, result.rows_computed) == (n, n)
    check_clean(out, 1)


def test_a_state_that_commits_no_part_never_makes_a_call_refuse_other_data(tmp_path):
    """Killed (SIGKILL) after its first state and before its first part: the next call, with
    other data and another model, starts afresh rather than refusing."""
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "m.onnx").write_bytes(linear_model())
    p = _child(tmp_path, "replace:1:after")  # the first os.replace is the fresh state's
    _, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL, err
    state = json.loads((tmp_path / "out" / STATE_NAME).read_text())
    assert state["parts"] == [] and state["rows"] == 0
    n = 300
    result = feeder.predict(session(linear_model(out_dim=5)), ArraySource({"x": data(n, seed=9)}), tmp_path / "out",
                            progress=False)
    assert (result.rows, result.rows_computed) == (n, n)
    check_clean(tmp_path / "out", 1)


# ---- an input file that is not Parquet -----------------------------------------------------------------------
def test_a_truncated_or_non_parquet_input_file_is_named_at_creation_and_at_read(tmp_path):
    from feeder.sources import ParquetSource

    d = tmp_path / "data"
    d.mkdir()
    write_features(d / "good.parquet", data(300), np.arange(300))
    (d / "notes.parquet").write_text("not Parquet at all")
    with pytest.raises(ValueError, match=r"'.*notes\.parquet' is not a readable Parquet file"):
        ParquetSource(d)
    whole = (d / "good.parquet").read_bytes()
    (d / "notes.parquet").write_bytes(whole[:len(whole) // 2])  # truncated
    with pytest.raises(ValueError, match=r"'.*notes\.parquet' is not a readable Parquet file \(truncated, damaged or "
                                         r"not Parquet\)"):
        ParquetSource(d)
    (d / "notes.parquet").unlink()
    # damaged after the source was created, with its size and modification time kept: named at read
    src = ParquetSource(d)
    path = d / "good.parquet"
    st = path.stat()
    damaged = bytearray(whole)
    damaged[8:400] = b"\x07" * 392  # the first data page's header
    path.write_bytes(bytes(damaged))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(InputValidationError, match=r"Parquet file '.*good\.parquet', row group 0 cannot be read"):
        feeder.predict(session(linear_model()), src, tmp_path / "out", keep=["id"], progress=False)


# ---- an output folder inside the input folder ------------------------------------------------------------------
def test_an_output_folder_inside_the_input_folder_is_refused_on_every_call(tmp_path):
    from feeder.sources import ParquetSource

    d = tmp_path / "data"
    d.mkdir()
    write_features(d / "a.parquet", data(100), np.arange(100))
    for _ in range(2):  # two consecutive calls: the same refusal, nothing created
        with pytest.raises(ValueError, match=r"output '.*data/scores' is inside the input folder '.*data': the next "
                                             r"call would read the output's part files as input"):
            feeder.predict(session(linear_model()), ParquetSource(d), d / "scores", keep=["id"], progress=False)
        assert os.listdir(d) == ["a.parquet"]
    with pytest.raises(ValueError, match="is inside the input folder"):
        feeder.predict(session(linear_model()), ParquetSource(d), d, keep=["id"], progress=False)
    with pytest.raises(ValueError, match=r"input file '.*a\.parquet' is inside the output folder"):
        feeder.predict(session(linear_model()), ParquetSource(d / "a.parquet"), d, keep=["id"], progress=False)
    (tmp_path / "link").symlink_to(d)
    with pytest.raises(ValueError, match="is inside the input folder"):
        feeder.predict(session(linear_model()), ParquetSource(tmp_path / "link"), d / "scores", keep=["id"],
                       progress=False)
    assert feeder.predict(session(linear_model()), ParquetSource(d), tmp_path / "scores", keep=["id"],
                          progress=False).rows == 100


# ---- the completion marker ---------------------------------------------------------------------------------------
def test_success_marks_a_complete_output_only_and_a_stray_one_does_not_block(tmp_path):
    n = 4000
    x = data(n)
    sess = session(linear_model())
    arrays = {"x": x, "id": np.arange(n)}
    out = tmp_path / "out"
    out.mkdir()
    (out / SUCCESS_NAME).write_text("")  # stray, in an empty folder: no refusal, and gone once a run writes
    src = FailingArraySource(arrays, block_rows=100, fail_at=12, out=out, min_rows=600)
    with pytest.raises(FetchError):
        feeder.predict(sess, src, out, batch_size=16, keep=["id"], rows_per_file=300, replicas=2,
                       num_worker_threads=1, progress=False)
    assert not (out / SUCCESS_NAME).exists()
    (out / SUCCESS_NAME).write_text("")  # stray, beside a partial output: removed before any new part
    removed_first = []
    real = OutputDir.publish_part

    def publish(self, index, durable=True):
        removed_first.append(not (out / SUCCESS_NAME).exists())
        return real(self, index, durable)

    OutputDir.publish_part = publish
    try:
        again = FailingArraySource(arrays, block_rows=100, fail_at=10**9, out=out, min_rows=0)
        result = feeder.predict(sess, again, out, batch_size=16, keep=["id"], rows_per_file=300, progress=False)
    finally:
        OutputDir.publish_part = real
    assert result.rows == n and removed_first and all(removed_first)
    check_clean(out, len(result.files))
    # readers check it: present exactly when the state says complete
    assert json.loads((out / STATE_NAME).read_text())["complete"] is True
    # overwrite removes it before anything else, and writes it again at the end
    feeder.predict(sess, ArraySource({"x": x}), out, overwrite=True, progress=False)
    assert (out / SUCCESS_NAME).exists() and pq.read_table(str(out)).num_rows == n
    # a finished output whose marker a crash left out: the next call writes it, computing nothing
    (out / SUCCESS_NAME).unlink()
    assert feeder.predict(sess, ArraySource({"x": x}), out, progress=False).rows_computed == 0
    assert (out / SUCCESS_NAME).exists()


def test_an_output_whose_rows_follow_the_batch_size_is_refused_before_anything_is_written(tmp_path):
    # g = x @ x.T, [N, N]: one row per input row, but each row as wide as the batch. The check
    # compared row counts only; the short last batch then failed inside ONNX Runtime on the output
    # buffers bound for the others (found by an acceptance review).
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Transpose", ["x"], ["xt"]), helper.make_node("MatMul", ["x", "xt"], ["g"]),
         helper.make_node("Identity", ["x"], ["y"])], "gram",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("g", TensorProto.FLOAT, ["N", "N"]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    from models import _model

    sess = session(_model(graph))
    src = ArraySource({"x": np.ones((10, 4), np.float32), "id": np.arange(10)})
    with pytest.raises(ValueError, match=r"model output 'g' is not one value per row: its rows have shape \(4,\) "
                                         r"for one batch size and \(3,\) for another"):
        feeder.predict(sess, src, tmp_path / "out", keep=["id"], batch_size=4, progress=False)
    assert not [f for f in our_files(tmp_path / "out") if "part-" in f]
    result = feeder.predict(sess, src, tmp_path / "out", keep=["id"], outputs=["y"], batch_size=4, progress=False)
    assert result.rows == 10
