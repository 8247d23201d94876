"""feeder.predict with map and filter (filtered rows committed as done), in input order, with
[N, 1] outputs squeezed and sequence-of-maps outputs refused (issue 29, items 1 and 2)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import feeder
from feeder.errors import FetchError
from feeder.scoring.outputdir import STATE_NAME, SUCCESS_NAME
from feeder.sources import ArraySource

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("onnx")

from models import linear_model, session, zipmap_classifier_model  # noqa: E402
from utils import wait_until  # noqa: E402

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def data(n, dim=4, seed=0):
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def in_part_order(output):
    """The output's rows as they are in its parts, parts in order: {column: array}."""
    state = json.loads((Path(output) / STATE_NAME).read_text())
    tables = [pq.read_table(str(Path(output) / p["file"])) for p in state["parts"]]
    table = pa.concat_tables(tables) if tables else None
    out = {}
    for name in table.column_names:
        arr = table[name].combine_chunks()
        shape = []
        while pa.types.is_fixed_size_list(arr.type):
            shape.append(arr.type.list_size)
            arr = arr.flatten()
        out[name] = arr.to_numpy(zero_copy_only=False).reshape((table.num_rows,) + tuple(shape))
    return out


def kept_by_five(d):
    return d["id"] % 5 != 0


class FailingSource(ArraySource):
    """Reads fail from the ``fail_at``-th on, once ``out`` has ``min_rows`` committed (waiting for
    them; with ``delay`` set, a read instead sleeps that long and fails only once they are there:
    an ordered source must not have a worker wait, its turn would stall the others)."""

    fail_at = 10**9
    min_rows = 0
    out = None
    delay = 0.0

    def _committed(self):
        return json.loads((self.out / STATE_NAME).read_text())["rows"]

    def _read(self, unit, rows, worker_id):
        self.reads = getattr(self, "reads", 0) + 1
        if self.delay:
            time.sleep(self.delay)
            if self.reads >= self.fail_at and self._committed() >= self.min_rows:
                raise OSError("disk read failed")
        elif self.reads >= self.fail_at:
            wait_until(lambda: self._committed() >= self.min_rows, timeout=20, what="committed rows")
            raise OSError("disk read failed")
        return super()._read(unit, rows, worker_id)


# ---- filtered rows are done -----------------------------------------------------------------------------
def test_filtered_rows_are_committed_as_done_and_the_output_completes(tmp_path):
    n = 2000
    x = data(n)
    sess = session(linear_model())
    src = ArraySource({"x": x, "id": np.arange(n)}, shuffle=True, seed=1, block_rows=64)
    chain = src.map(lambda d: {"x": d["x"] * 2, "id": d["id"]}).filter(kept_by_five)
    result = feeder.predict(sess, chain, tmp_path / "out", batch_size=32, keep=["id"], rows_per_file=500,
                            replicas=2, progress=False)
    kept = np.array([i for i in range(n) if i % 5])
    assert result.rows == result.rows_computed == len(kept)
    state = json.loads((tmp_path / "out" / STATE_NAME).read_text())
    assert state["complete"] and state["rows"] == len(kept) and state["rows_filtered"] == n // 5
    assert state["source"]["delivered"] == [[0, n]] and state["source"]["rows_filtered"] == n // 5
    assert state["source"]["rows_delivered"] == len(kept)
    got = in_part_order(tmp_path / "out")
    order = np.argsort(got["id"])
    np.testing.assert_array_equal(got["id"][order], kept)
    np.testing.assert_allclose(got["y"][order], sess.run(None, {"x": x[kept] * 2})[0], rtol=1e-6, atol=1e-6)
    again = feeder.predict(sess, chain, tmp_path / "out", batch_size=32, keep=["id"], progress=False)
    assert (again.rows, again.rows_computed) == (len(kept), 0)


def test_a_failed_call_with_a_filter_resumes_reading_neither_committed_nor_filtered_rows(tmp_path):
    n = 4000
    x = data(n)
    sess = session(linear_model())
    out = tmp_path / "out"

    def make(fail_at, min_rows):
        src = FailingSource({"x": x, "id": np.arange(n)}, block_rows=100, shuffle=True, seed=4)
        src.fail_at, src.min_rows, src.out = fail_at, min_rows, out
        return src, src.filter(kept_by_five)

    _, chain = make(12, 500)
    with pytest.raises(FetchError):
        feeder.predict(sess, chain, out, batch_size=16, keep=["id"], rows_per_file=250, replicas=2,
                       num_worker_threads=1, progress=False)
    state = json.loads((out / STATE_NAME).read_text())
    assert state["rows"] >= 500 and state["rows_filtered"] > 0
    assert state["source"]["rows_delivered"] == state["rows"]
    inner, chain = make(10**9, 0)
    result = feeder.predict(sess, chain, out, batch_size=16, keep=["id"], rows_per_file=250, progress=False)
    kept = [i for i in range(n) if i % 5]
    assert result.rows == len(kept) and result.rows_computed == len(kept) - state["rows"]
    # what was committed or filtered before was not read again
    assert inner.reads * 100 <= n - state["rows"] - state["rows_filtered"] + 100 * 4
    got = in_part_order(out)
    assert sorted(got["id"].tolist()) == kept


def test_an_output_of_the_source_without_its_filter_is_refused_naming_the_steps(tmp_path):
    n = 300
    src = lambda: ArraySource({"x": data(n), "id": np.arange(n)})  # noqa: E731
    feeder.predict(session(linear_model()), src(), tmp_path / "out", keep=["id"], progress=False)
    with pytest.raises(ValueError, match=r"source transforms: the output has None, this call \[\['filter'"):
        feeder.predict(session(linear_model()), src().filter(kept_by_five), tmp_path / "out", keep=["id"],
                       progress=False)


def test_a_model_input_a_filter_chain_lacks_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match=r"model input\(s\) \['x'\] are not inputs of the ArraySource"):
        feeder.predict(session(linear_model()), ArraySource({"z": data(10)}).filter(lambda d: d["z"][:, 0] > 0),
                       tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- in input order --------------------------------------------------------------------------------------
@pytest.mark.parametrize("procs", [0, 2])
def test_ordered_writes_rows_in_input_order_with_several_replicas(tmp_path, procs):
    n = 3000
    x = data(n)
    sess = session(linear_model())
    src = ArraySource({"x": x, "id": np.arange(n)}, block_rows=70).filter(kept_by_five)
    kw = dict(num_worker_processes=procs) if procs else dict(num_worker_threads=3)
    result = feeder.predict(sess, src, tmp_path / "out", batch_size=16, keep=["id"], rows_per_file=333,
                            replicas=3, ordered=True, progress=False, **kw)
    kept = np.array([i for i in range(n) if i % 5])
    assert result.rows == len(kept) and len(result.files) == -(-len(kept) // 333)
    got = in_part_order(tmp_path / "out")
    np.testing.assert_array_equal(got["id"], kept)
    np.testing.assert_allclose(got["y"], sess.run(None, {"x": x[kept]})[0], rtol=1e-6, atol=1e-6)
    state = json.loads((tmp_path / "out" / STATE_NAME).read_text())
    assert state["options"]["ordered"] is True
    # an ordered output is continued only in order (and an unordered one only unordered)
    with pytest.raises(ValueError, match="option ordered: the output has True, this call has none"):
        feeder.predict(sess, src, tmp_path / "out", keep=["id"], progress=False)


def test_an_ordered_output_resumed_after_a_failure_stays_in_order(tmp_path):
    n = 4000
    x = data(n)
    sess = session(linear_model())
    out = tmp_path / "out"
    src = FailingSource({"x": x, "id": np.arange(n)}, block_rows=100)
    src.fail_at, src.min_rows, src.out, src.delay = 10, 600, out, 0.02
    with pytest.raises(FetchError):
        feeder.predict(sess, src, out, batch_size=16, keep=["id"], rows_per_file=200, replicas=2, ordered=True,
                       progress=False)
    committed = json.loads((out / STATE_NAME).read_text())["rows"]
    assert 600 <= committed < n
    np.testing.assert_array_equal(in_part_order(out)["id"], np.arange(committed))  # a prefix, in order
    again = FailingSource({"x": x, "id": np.arange(n)}, block_rows=100)
    result = feeder.predict(sess, again, out, batch_size=16, keep=["id"], rows_per_file=200, replicas=2, ordered=True,
                            progress=False)
    assert result.rows == n and result.rows_computed == n - committed
    np.testing.assert_array_equal(in_part_order(out)["id"], np.arange(n))


# ---- outputs ----------------------------------------------------------------------------------------------
def test_squeeze_writes_an_n_by_1_output_as_a_plain_column(tmp_path):
    n = 500
    x = data(n)
    sess = session(linear_model(out_dim=1))
    feeder.predict(sess, ArraySource({"x": x, "id": np.arange(n)}), tmp_path / "a", keep=["id"], progress=False)
    assert pq.read_schema(str(tmp_path / "a" / "part-00000.parquet")).field("y").type.equals(
        pa.list_(pa.float32(), 1))
    feeder.predict(sess, ArraySource({"x": x, "id": np.arange(n)}), tmp_path / "b", keep=["id"], squeeze=True,
                   ordered=True, progress=False)
    schema = pq.read_schema(str(tmp_path / "b" / "part-00000.parquet"))
    assert schema.field("y").type == pa.float32() and schema.field("s").type == pa.float32()
    np.testing.assert_allclose(in_part_order(tmp_path / "b")["y"], sess.run(None, {"x": x})[0][:, 0], rtol=1e-6)


def test_a_sequence_of_maps_output_is_refused_before_anything_saying_to_convert_with_zipmap_false(tmp_path):
    sess = session(zipmap_classifier_model())
    with pytest.raises(ValueError, match=r"model output 'output_probability' is a seq\(map\(int64,tensor\(float\)\)\): "
                                         r"a sequence of maps.*zipmap=False.*or leave this output out with "
                                         r"outputs=\['label'\]"):
        feeder.predict(sess, ArraySource({"x": data(10)}), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert feeder.predict(sess, ArraySource({"x": data(10)}), tmp_path / "out", outputs=["label"],
                          progress=False).rows == 10


# ---- killed with SIGKILL, then called again: a map and a filter -----------------------------------------
CHILD = r'''
import sys, time
import numpy as np
import feeder
from feeder.sources import ArraySource


class SlowSource(ArraySource):
    def _read(self, unit, rows, worker_id):
        time.sleep(float(sys.argv[3]))
        return super()._read(unit, rows, worker_id)


out, model, unit_s, ordered = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "ordered"
n = 6000
x = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)
src = SlowSource({"x": x, "id": np.arange(n)}, shuffle=not ordered, seed=1, block_rows=97)
chain = src.map(lambda d: {"x": d["x"] * 2, "id": d["id"]}).filter(lambda d: d["id"] % 5 != 0)
r = feeder.predict(model, chain, out, batch_size=16, keep=["id"], rows_per_file=250, replicas=2, progress=False,
                   ordered=ordered)
print("RESULT", r.rows, r.rows_computed, flush=True)
'''


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.slow
@pytest.mark.parametrize("order", ["unordered", "ordered"])
def test_killed_at_random_moments_a_map_and_filter_output_completes_with_every_kept_row_once(tmp_path, order):
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "m.onnx").write_bytes(linear_model())
    out = tmp_path / "out"
    rng = random.Random(2029 + len(order))

    def child(unit_s):
        return subprocess.Popen([sys.executable, str(tmp_path / "child.py"), str(out), str(tmp_path / "m.onnx"),
                                 str(unit_s), order], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_env())

    committed = [0]
    for _ in range(3):
        p = child(0.15)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p.poll() is None:
            try:
                if json.loads((out / STATE_NAME).read_text())["rows"] > committed[-1]:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
        p.kill()
        _, err = p.communicate(timeout=30)
        assert p.returncode == -signal.SIGKILL, f"the run ended before it was killed: {err}"
        state = json.loads((out / STATE_NAME).read_text())
        assert not (out / SUCCESS_NAME).exists() and state["complete"] is False
        assert state["source"]["rows_delivered"] == state["rows"] == sum(p["rows"] for p in state["parts"])
        covered = sum(b - a for a, b in state["source"]["delivered"])
        assert covered == state["rows"] + state.get("rows_filtered", 0)
        if order == "ordered":  # what is committed is a prefix of the kept rows, in order
            ids = in_part_order(out)["id"] if state["parts"] else np.zeros(0)
            np.testing.assert_array_equal(ids, [i for i in range(6000) if i % 5][:len(ids)])
        committed.append(state["rows"])
    assert committed[-1] > 0
    p = child(0.0)
    stdout, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    rows, computed = map(int, stdout.split("RESULT")[1].split())
    kept = [i for i in range(6000) if i % 5]
    assert rows == len(kept) and computed == len(kept) - committed[-1]
    got = in_part_order(out)
    if order == "ordered":
        assert got["id"].tolist() == kept
    order_ = np.argsort(got["id"])
    assert got["id"][order_].tolist() == kept
    x = np.random.default_rng(0).standard_normal((6000, 4)).astype(np.float32)
    np.testing.assert_allclose(got["y"][order_], session(linear_model()).run(None, {"x": x[kept] * 2})[0],
                               rtol=1e-6, atol=1e-6)
    state = json.loads((out / STATE_NAME).read_text())
    assert state["complete"] and (out / SUCCESS_NAME).exists() and state["rows_filtered"] == 1200


# ---- issue 34 ---------------------------------------------------------------------------------------------------
def every_tenth_hashed(d):
    return (d["id"] * 2654435761) % 10 != 3  # drops one row in ten, scattered


def test_the_outputs_state_stays_a_few_ranges_while_filtered_rows_run_ahead_of_the_commits(tmp_path):
    """Item 7: a state committed with each part held every filtered key fetched so far, ahead of
    the rows committed: a range per filtered row. Loose until they touch committed rows, they stay
    out of it (and are read and filtered again after a crash)."""
    n = 40_000
    x = data(n)
    out = tmp_path / "out"
    src = FailingSource({"x": x, "id": np.arange(n)}, block_rows=500)
    src.fail_at, src.min_rows, src.out = 40, 2_000, out
    with pytest.raises(FetchError):
        feeder.predict(session(linear_model()), src.filter(every_tenth_hashed), out, batch_size=64, keep=["id"],
                       rows_per_file=1_000, replicas=1, num_worker_threads=1, progress=False)
    state = json.loads((out / STATE_NAME).read_text())
    assert state["rows"] >= 2_000
    assert len(state["source"]["delivered"]) <= 4, state["source"]["delivered"][:10]
    covered = sum(b - a for a, b in state["source"]["delivered"])
    assert covered == state["rows"] + state["source"].get("rows_filtered", 0)
    again = FailingSource({"x": x, "id": np.arange(n)}, block_rows=500)
    result = feeder.predict(session(linear_model()), again.filter(every_tenth_hashed), out, batch_size=64,
                            keep=["id"], rows_per_file=1_000, progress=False)
    kept = [i for i in range(n) if (i * 2654435761) % 10 != 3]
    assert result.rows == len(kept) and sorted(pq.read_table(str(out))["id"].to_pylist()) == kept
    final = json.loads((out / STATE_NAME).read_text())
    assert final["source"]["delivered"] == [[0, n]] and final["rows_filtered"] == n - len(kept)


LAMBDAS = '''
{blank}
keep = lambda d: d["id"] % {modulus} != 0
'''


def _module(tmp_path, name, blank="", modulus=5):
    import importlib.util
    path = tmp_path / f"{name}.py"
    path.write_text(LAMBDAS.format(blank=blank, modulus=modulus))
    spec = importlib.util.spec_from_file_location("score_steps", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_output_continues_after_a_comment_is_added_above_its_lambda(tmp_path):
    """Item 8: the lambda's line was part of the output's definition, so only overwrite=True got past
    an unrelated edit, recomputing everything; its code is what counts."""
    n = 600
    x = data(n)

    def src(m):
        return ArraySource({"x": x, "id": np.arange(n)}, block_rows=50).filter(m.keep)

    first = feeder.predict(session(linear_model()), src(_module(tmp_path, "a")), tmp_path / "out", keep=["id"],
                           progress=False)
    moved = _module(tmp_path, "b", blank="# a comment\n\n")
    again = feeder.predict(session(linear_model()), src(moved), tmp_path / "out", keep=["id"], progress=False)
    assert (again.rows, again.rows_computed) == (first.rows, 0)
    with pytest.raises(ValueError, match=r"source transforms_code step 1 \(filter score_steps.<lambda>\): the output "
                                         r"has other contents than this call"):
        feeder.predict(session(linear_model()), src(_module(tmp_path, "c", modulus=4)), tmp_path / "out",
                       keep=["id"], progress=False)
