"""pad=, pad_to_multiple_of= and length_window= through whole feeds (issue 29, items 3 and 4): the
forms a fetch function hands ragged rows over in, threads and worker processes, sessions that take
a mask (or not), Parquet list columns, exactly-once and resume with a length window, and the
errors, each naming source, worker and input."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from utils import workers

import feeder
from feeder.ragged import Ragged

IR_VERSION, OPSET = 10, 17


def row_values(k):
    """Row k: its length is k % 7 (0 included), its values k * 100 + 1, + 2, ..."""
    return k * 100 + 1 + np.arange(k % 7, dtype=np.int64)


class RaggedRows:
    """A finite source of ``n`` rows in chunks of 1-5 rows, handed over in ``form``: "list" (a list
    of arrays), "object" (an object array of arrays), "ragged" (values + offsets) or "mixed"."""

    def __init__(self, n, form="list", sizes=(3, 1, 5, 2, 4)):
        self.n, self.form, self.sizes = n, form, sizes
        self._next = 0
        self._calls = 0
        self._lock = threading.Lock()

    def __call__(self, worker_id, batch_size):
        with self._lock:
            if self._next >= self.n:
                raise StopIteration
            size = min(self.sizes[self._calls % len(self.sizes)], self.n - self._next)
            start, self._next, self._calls = self._next, self._next + size, self._calls + 1
        ids = np.arange(start, start + size)
        rows = [row_values(int(k)) for k in ids]
        form = self.form if self.form != "mixed" else ("list", "object", "ragged")[start % 3]
        if form == "object":
            holder = np.empty(size, object)
            holder[:] = rows
            rows = holder
        elif form == "ragged":
            rows = feeder.Ragged(np.concatenate(rows), np.cumsum([0] + [len(r) for r in rows]))
        return {"tokens": rows, "id": ids}


def check(batch, value=0, multiple=None, mask="tokens_mask"):
    tokens, ids, m = batch["tokens"], batch["id"], batch[mask]
    assert m.shape == tokens.shape
    for r, k in enumerate(ids.tolist()):
        row = row_values(k)
        assert tokens[r, :len(row)].tolist() == row.tolist()
        assert m[r].astype(bool).tolist() == [True] * len(row) + [False] * (tokens.shape[1] - len(row))
    assert (tokens[~m.astype(bool)] == value).all()
    longest = max((k % 7 for k in ids.tolist()), default=0)
    assert tokens.shape[1] == -(-longest // (multiple or 1)) * (multiple or 1)
    return ids.tolist()


@pytest.mark.parametrize("form", ["list", "object", "ragged", "mixed"])
def test_each_form_of_ragged_rows_is_padded_with_its_mask(coord, form):
    feeder.init_data_input_workers(None, ["tokens", "id"], RaggedRows(60, form), 8, num_worker_threads=2,
                                   coordinator=coord, pad={"tokens": -1}, pad_to_multiple_of=4)
    seen = []
    with coord:
        feed = coord.feed("train")
        assert feed.input_names == ["tokens", "id", "tokens_mask"]
        for batch in feed:
            assert list(batch) == ["tokens", "id", "tokens_mask"] and batch["tokens_mask"].dtype == bool
            seen += check(batch, -1, 4)
        m = feed.metrics()
    assert sorted(seen) == list(range(60))
    assert m["row_elements"] == sum(k % 7 for k in range(60)) and m["padded_elements"] > 0


class ShardedRows:
    """Rows k with k % 2 == worker id (workers 0 and 1), in chunks of 1-5, in every form in turn;
    no lock, so that worker processes can have it."""

    def __init__(self, n, sizes=(3, 1, 5, 2, 4)):
        self.n, self.sizes = n, sizes
        self.pos = {}

    def __call__(self, worker_id, batch_size):
        start, calls = self.pos.get(worker_id, (0, 0))
        mine = np.arange(worker_id, self.n, 2)[start:start + self.sizes[calls % len(self.sizes)]]
        if not len(mine):
            raise StopIteration
        self.pos[worker_id] = (start + len(mine), calls + 1)
        rows = [row_values(int(k)) for k in mine]
        form = ("list", "object", "ragged")[calls % 3]
        if form == "object":
            holder = np.empty(len(rows), object)
            holder[:] = rows
            rows = holder
        elif form == "ragged":
            rows = feeder.Ragged(np.concatenate(rows), np.cumsum([0] + [len(r) for r in rows]))
        return [rows, mine]


def test_worker_processes_send_ragged_rows_through_shared_memory(coord, mode):
    feeder.init_data_input_workers(None, ["tokens", "id"], ShardedRows(80), 8, coordinator=coord,
                                   pad={"tokens": 0}, length_window=32, **workers(mode, 2))
    seen = []
    with coord:
        for batch in coord.feed("train"):
            seen += check(batch)
    assert sorted(seen) == list(range(80))


def tokens_of_ids(cols):
    """A map that makes ragged rows: the tokens of each row id (rows of 0-6 values)."""
    return {"tokens": [row_values(int(k)) for k in cols["id"]], "id": cols["id"]}


@pytest.mark.parametrize("with_mask", [False, True])
def test_a_map_may_make_the_ragged_rows_of_a_padded_input(coord, mode, with_mask):
    # The registration's inputs gain the masks that padding makes; the map is asked only for what
    # the fetch returns (it used to be asked for "tokens_mask" too: InputValidationError).
    from feeder.sources import ArraySource

    src = ArraySource({"id": np.arange(90)}, shuffle=True, seed=4).map(tokens_of_ids)
    session = _session(mask_model("tokens_mask" if with_mask else None))
    feeder.init_data_input_workers(session, None, src, 8, coordinator=coord, pad={"tokens": 0}, length_window=24,
                                   **workers(mode, 2))
    seen = []
    with coord:
        feed = coord.feed("train")
        assert feed.input_names == ["tokens", "id", "tokens_mask"]
        out, ids = feed.run()
        np.testing.assert_array_equal(out, expected_sums(ids))
        seen += ids.tolist()
        for batch in feed:
            seen += check(batch)
    assert sorted(seen) == list(range(90))


def test_the_chunk_from_a_worker_process_arrives_as_values_and_offsets():
    # What crosses the process boundary: one values array and the rows' starts and shapes, in the
    # slot (never a pickled list of rows).
    from feeder.processes import shm
    from feeder.processes.child import _write_rows

    rows = [np.arange(n, dtype=np.int64) + 10 * n for n in (3, 0, 2)]
    parts = [Ragged.from_rows(rows[:2]), Ragged(np.arange(5, dtype=np.int64), [1, 3])]
    values = np.zeros(5, np.int64)
    starts = np.zeros(3, np.int64)
    _write_rows(values, starts, parts)
    assert values.tolist() == [30, 31, 32, 1, 2] and starts.tolist() == [0, 3, 3]
    slot = np.zeros(256, np.uint8)
    slot[:40].view(np.int64)[:] = values
    slot[64:88].view(np.int64)[:] = starts
    slot[88:112].view(np.int64)[:] = [3, 0, 2]
    (got,), _ = shm.arrays_from_slot(slot, [("ragged", 0, "<i8", 5, 64, 3, 1)], 112)
    assert isinstance(got, Ragged) and [r.tolist() for r in got] == [[30, 31, 32], [], [1, 2]]
    assert np.shares_memory(got.values, slot)
    slot[64:72].view(np.int64)[:] = 4  # a row said to start past its values: refused, never read
    with pytest.raises(shm.SegmentError, match="within"):
        shm.arrays_from_slot(slot, [("ragged", 0, "<i8", 5, 64, 3, 1)], 112)


def test_without_pad_ragged_rows_stay_an_error_naming_source_worker_input(coord):
    feeder.init_data_input_workers(None, ["tokens", "id"], RaggedRows(10, "list"), 4, num_worker_threads=1,
                                   coordinator=coord, input_source_name="text")
    with coord, pytest.raises(feeder.InputValidationError,
                              match=r"source 'text', worker 0, input 'tokens'.*name the input in pad="):
        coord.feed("text").next_batch(timeout=10)


class BadRows:
    def __init__(self, rows):
        self.rows = rows

    def __call__(self, worker_id, batch_size):
        return {"tokens": self.rows, "id": np.arange(len(self.rows))}


@pytest.mark.parametrize("rows, cast, match", [
    ([np.zeros(2, np.float64), np.zeros(3, np.float64)], False, r"expected dtype int64.*cast=True"),
    ([np.zeros(2, np.int64), np.zeros((3, 2), np.int64)], False, r"one dtype and rank"),
    ([np.zeros((2, 2), np.int64), np.zeros((3, 2), np.int64)], False, r"rows of rank 1"),
    ([np.array(["a", "b"]), np.array(["c"])], False, r"numeric rows"),
    ([np.zeros(9, np.int64), np.zeros(3, np.int64)], False, r"at most 8 along axis 1"),
    ([np.full(2, 2**40, np.int64), np.zeros(3, np.int64)], True, r"values that fit int32"),
])
def test_bad_padded_rows_are_refused_naming_source_worker_input(coord, rows, cast, match):
    session = _session(mask_model(dtype="int64" if "int32" not in match else "int32", length=8))
    feeder.init_data_input_workers(session, ["tokens", "id"], BadRows(rows), 2, num_worker_threads=1,
                                   coordinator=coord, pad={"tokens": 0}, cast=cast, input_source_name="bad")
    with coord, pytest.raises(feeder.InputValidationError, match=r"source 'bad', worker 0, input 'tokens'"):
        try:
            coord.feed("bad").next_batch(timeout=10)
        except feeder.InputValidationError as e:
            import re
            assert re.search(match, str(e)), str(e)
            raise


def test_cast_applies_to_padded_rows(coord):
    session = _session(mask_model(dtype="int32"))
    rows = [np.arange(1, 4, dtype=np.int64), np.arange(1, 2, dtype=np.int64)]
    feeder.init_data_input_workers(session, ["tokens", "id"], BadRows(rows), 2, num_worker_threads=1,
                                   coordinator=coord, pad={"tokens": 0}, cast=True)
    with coord:
        batch = coord.feed("train").next_batch(timeout=10)
    assert batch["tokens"].dtype == np.int32 and batch["tokens"].tolist() == [[1, 2, 3], [1, 0, 0]]


def test_a_pad_value_the_dtype_cannot_hold_is_refused(coord):
    rows = [np.arange(3, dtype=np.uint8), np.arange(2, dtype=np.uint8)]
    feeder.init_data_input_workers(None, ["tokens", "id"], BadRows(rows), 2, num_worker_threads=1,
                                   coordinator=coord, pad={"tokens": -1}, input_source_name="u8")
    with coord, pytest.raises(feeder.InputValidationError, match=r"input 'tokens'.*holds the pad value -1"):
        coord.feed("u8").next_batch(timeout=10)
    with pytest.raises(ValueError, match="does not fit its dtype int64"):
        feeder.init_data_input_workers(_session(mask_model()), ["tokens", "id"], BadRows(rows), 2,
                                       coordinator=feeder.GlobalCoordinator(), pad={"tokens": 0.5})


# ---- sessions: the mask fed by name -----------------------------------------------------------
def mask_model(mask="attention_mask", dtype="int64", mask_dtype=None, length=None, with_id=True):
    """out[n] = sum(tokens[n] * mask[n]) as float, from inputs tokens [N, L] and mask [N, L] (and id [N])."""
    from onnx import TensorProto, helper

    t = {"int64": TensorProto.INT64, "int32": TensorProto.INT32, "float": TensorProto.FLOAT,
         "bool": TensorProto.BOOL}
    nodes = [helper.make_node("Cast", ["tokens"], ["tf"], to=TensorProto.FLOAT)]
    inputs = [helper.make_tensor_value_info("tokens", t[dtype], ["N", length or "L"])]
    if mask is not None:
        nodes += [helper.make_node("Cast", [mask], ["mf"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", ["tf", "mf"], ["prod"])]
        inputs.append(helper.make_tensor_value_info(mask, t[mask_dtype or dtype], ["N", length or "L"]))
    nodes.append(helper.make_node("ReduceSum", ["prod" if mask else "tf", "axes"], ["out"], keepdims=0))
    if with_id:
        inputs.append(helper.make_tensor_value_info("id", TensorProto.INT64, ["N"]))
        nodes.append(helper.make_node("Identity", ["id"], ["id_out"]))
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N"])]
    if with_id:
        outputs.append(helper.make_tensor_value_info("id_out", TensorProto.INT64, ["N"]))
    graph = helper.make_graph(nodes, "masked_sum", inputs, outputs,
                              initializer=[helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model.SerializeToString()


def _session(model):
    import onnxruntime as ort
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def expected_sums(ids):
    return np.array([row_values(k).sum() for k in ids], np.float32)


@pytest.mark.parametrize("mask, mask_dtype", [("attention_mask", "int64"), ("tokens_mask", "float"),
                                              ("tokens_mask", "bool")])
def test_input_names_none_with_a_session_that_takes_the_mask(coord, mask, mask_dtype):
    pytest.importorskip("onnx")
    session = _session(mask_model(mask, mask_dtype=mask_dtype))
    feeder.init_data_input_workers(session, None, RaggedRows(40), 8, num_worker_threads=2, coordinator=coord,
                                   pad={"tokens": 0}, length_window=16)
    with coord:
        feed = coord.feed("train")
        assert feed.input_names == ["tokens", "id", mask]
        rows = []
        while True:
            try:
                out, ids = feed.run()
            except StopIteration:
                break
            np.testing.assert_array_equal(out, expected_sums(ids))
            rows += ids.tolist()
    assert sorted(rows) == list(range(40))


def test_a_session_without_a_mask_input_runs_and_next_batch_still_has_the_mask(coord):
    pytest.importorskip("onnx")
    session = _session(mask_model(mask=None))
    feeder.init_data_input_workers(session, None, RaggedRows(16), 8, num_worker_threads=1, coordinator=coord,
                                   pad={"tokens": 0})
    with coord:
        feed = coord.feed("train")
        out, ids = feed.run()
        np.testing.assert_array_equal(out, expected_sums(ids))
        batch = feed.next_batch()
        assert batch["tokens_mask"].dtype == bool and batch["tokens_mask"].shape == batch["tokens"].shape


def test_a_session_that_fixes_the_length_gets_every_batch_at_that_length(coord):
    pytest.importorskip("onnx")
    session = _session(mask_model(length=8))
    feeder.init_data_input_workers(session, None, RaggedRows(24), 8, num_worker_threads=1, coordinator=coord,
                                   pad={"tokens": 0})
    with coord:
        feed = coord.feed("train")
        for batch in feed:
            assert batch["tokens"].shape == (8, 8) and batch["attention_mask"].shape == (8, 8)


def test_mask_names_rule_and_override():
    from feeder.api import _mask_names
    from feeder.validation import InputSpec

    def specs(*names):
        return [InputSpec(n) for n in names]

    assert _mask_names({"ids": 0}, None, None) == {"ids": "ids_mask"}
    assert _mask_names({"input_ids": 0}, None, specs("input_ids", "attention_mask")) == {"input_ids": "attention_mask"}
    assert _mask_names({"input_ids": 0, "decoder_input_ids": 0}, None,
                       specs("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")) \
        == {"input_ids": "attention_mask", "decoder_input_ids": "decoder_attention_mask"}
    assert _mask_names({"x": 0}, None, specs("x", "x_mask", "attention_mask")) == {"x": "x_mask"}
    assert _mask_names({"input_values": 0.0}, None, specs("input_values", "attention_mask")) \
        == {"input_values": "attention_mask"}
    assert _mask_names({"a": 0, "b": 0}, None, specs("a", "b", "attention_mask")) == {"a": "a_mask", "b": "b_mask"}
    assert _mask_names({"ids": 0}, {"ids": "input_mask"}, specs("ids", "input_mask")) == {"ids": "input_mask"}
    with pytest.raises(ValueError, match="clash"):
        _mask_names({"a": 0, "b": 0}, {"a": "m", "b": "m"}, None)


def test_a_listed_mask_is_not_fetched(coord):
    feeder.init_data_input_workers(None, ["tokens", "tokens_mask", "id"], RaggedRows(8), 8, num_worker_threads=1,
                                   coordinator=coord, pad={"tokens": 0})
    with coord:
        check(coord.feed("train").next_batch(timeout=10))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(length_window=64), ValueError, "need pad="),
    (dict(pad_to_multiple_of=8), ValueError, "need pad="),
    (dict(pad={"tokens": 0}, length_window=4), ValueError, "must be >= batch_size"),
    (dict(pad={"tokens": 0}, length_window=64, dont_rebatch=True), ValueError, "dont_rebatch"),
    (dict(pad={"nope": 0}), ValueError, r"pad names \['nope'\]"),
    (dict(pad={"tokens": "0"}), TypeError, "must be a number"),
    (dict(pad=[0]), TypeError, "non-empty dict"),
    (dict(pad={"tokens": 0}, pad_to_multiple_of=0), ValueError, "pad_to_multiple_of must be >= 1"),
    (dict(pad={"tokens": 0}, batch_columns=[1, 0]), ValueError, "batch axis must be 0"),
    (dict(pad={"tokens": 0}, mask_names={"id": "m"}), ValueError, "not padded"),
    (dict(mask_names={"tokens": "m"}), ValueError, "needs pad="),
])
def test_bad_padding_arguments_are_refused_at_registration(kwargs, error, match):
    with pytest.raises(error, match=match):
        feeder.init_data_input_workers(None, ["tokens", "id"], RaggedRows(8), 8,
                                       coordinator=feeder.GlobalCoordinator(), **kwargs)


def test_dont_rebatch_pads_each_chunk_as_its_own_batch(coord):
    feeder.init_data_input_workers(None, ["tokens", "id"], RaggedRows(15, sizes=(5,)), 8, num_worker_threads=1,
                                   coordinator=coord, pad={"tokens": 0}, dont_rebatch=True)
    with coord:
        sizes = [len(check(b)) for b in coord.feed("train")]
    assert sizes == [5, 5, 5]


def test_last_batch_drop_with_a_window_counts_the_rows_dropped(coord):
    feeder.init_data_input_workers(None, ["tokens", "id"], RaggedRows(45), 8, num_worker_threads=2,
                                   coordinator=coord, pad={"tokens": 0}, length_window=16, last_batch="drop")
    with coord:
        feed = coord.feed("train")
        seen = [k for b in feed for k in check(b)]
        assert len(seen) == 40 and len(set(seen)) == 40
        assert feed.source.ledger()["rows_dropped"] == 5


def test_ordered_with_a_window_gives_the_same_batches_every_run():
    def run():
        coord = feeder.GlobalCoordinator()
        feeder.init_data_input_workers(None, ["tokens", "id"], PerWorkerRows(), 4, num_worker_threads=3,
                                       coordinator=coord, pad={"tokens": 0}, length_window=12, ordered=True)
        with coord:
            return [check(b) for b in coord.feed("train")]

    first = run()
    assert first == run() and sorted(sum(first, [])) == list(range(60))


class PerWorkerRows:
    """Worker w serves rows w*20 .. w*20+19, 3 at a time (workers 0-2)."""

    def __init__(self):
        self.pos = {}

    def __call__(self, worker_id, batch_size):
        start = self.pos.get(worker_id, worker_id * 20)
        stop = min(start + 3, worker_id * 20 + 20)
        if start >= stop:
            raise StopIteration
        self.pos[worker_id] = stop
        ids = np.arange(start, stop)
        return [[row_values(int(k)) for k in ids], ids]


def test_max_buffered_bytes_counts_the_rows_bytes_not_the_padded_ones(coord):
    # Padded batches are bigger than their rows: delivery releases the bytes the rows came with, so
    # the bound neither drifts nor deadlocks.
    feeder.init_data_input_workers(None, ["tokens", "id"], RaggedRows(400), 8, num_worker_threads=2,
                                   coordinator=coord, pad={"tokens": 0}, pad_to_multiple_of=64,
                                   max_buffered_bytes=4096)
    with coord:
        feed = coord.feed("train")
        n = sum(len(b["id"]) for b in feed)
        assert n == 400 and feed.source.bytes_held == 0


# ---- Parquet: a ragged list<int64> column feeds a padded input ------------------------------
@pytest.fixture
def ragged_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    n = 600
    table = pa.table({"tokens": pa.array([row_values(k).tolist() for k in range(n)], pa.list_(pa.int64())),
                      "id": np.arange(n)})
    path = tmp_path / "text.parquet"
    pq.write_table(table, path, row_group_size=50)
    return path, n


def test_to_numpy_gives_values_and_offsets_without_copying():
    pa = pytest.importorskip("pyarrow")
    from feeder.sources.arrow import to_numpy

    arr = pa.array([[1, 2, 3], [], [4], [5, 6]], pa.list_(pa.int64()))
    r = to_numpy(arr, "c")
    assert isinstance(r, Ragged) and [x.tolist() for x in r] == [[1, 2, 3], [], [4], [5, 6]]
    buf = np.frombuffer(arr.values.buffers()[1], np.int64)
    assert np.shares_memory(r.values, buf)  # the column's own values: no per-row loop, no copy
    sliced = to_numpy(arr.slice(2, 2), "c")
    assert [x.tolist() for x in sliced] == [[4], [5, 6]]
    assert to_numpy(pa.array([[1, 2], [3, 4]]), "c").shape == (2, 2)  # equal lengths: an array, as before
    with pytest.raises(feeder.InputValidationError, match="one level"):
        to_numpy(pa.array([[[1], [2, 3]], [[4]]]), "c")
    with pytest.raises(feeder.InputValidationError, match="null"):
        to_numpy(pa.array([[1, None], [2]]), "c")


@pytest.mark.parquet
def test_a_ragged_parquet_column_feeds_a_padded_input_exactly_once(coord, ragged_parquet, mode):
    from feeder.sources import ParquetSource

    path, n = ragged_parquet
    src = ParquetSource(str(path), shuffle=True, seed=3)
    feeder.init_data_input_workers(None, ["tokens", "id"], src, 16, coordinator=coord, pad={"tokens": 0},
                                   length_window=64, **workers(mode, 2))
    with coord:
        seen = [k for b in coord.feed("train") for k in check(b)]
    assert sorted(seen) == list(range(n))


@pytest.mark.parquet
def test_a_shuffle_window_mixes_ragged_rows_of_a_parquet_list_column(coord, tmp_path, mode):
    # The window holds a padded input's rows one by one (a Ragged, or a plain array when a row
    # group's rows happen to agree); it used to fail every fetch with a TypeError.
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from feeder.sources import ParquetSource

    n = 420  # row group g of 30 rows: rows of 3 values in even groups, of k % 7 values in odd ones
    lengths = [3 if (k // 30) % 2 == 0 else k % 7 for k in range(n)]
    rows = [[k * 100 + 1 + j for j in range(length)] for k, length in enumerate(lengths)]
    pq.write_table(pa.table({"tokens": pa.array(rows, pa.list_(pa.int64())), "id": np.arange(n)}),
                   str(tmp_path / "t.parquet"), row_group_size=30)
    src = ParquetSource(str(tmp_path / "t.parquet"), shuffle=True, seed=2, shuffle_window=150)
    feeder.init_data_input_workers(None, ["tokens", "id"], src, 16, coordinator=coord, pad={"tokens": -1},
                                   **workers(mode, 2))
    seen = []
    groups = set()
    with coord:
        for batch in coord.feed("train"):
            ids = batch["id"].tolist()
            for r, k in enumerate(ids):
                m = batch["tokens_mask"][r].astype(bool)
                assert batch["tokens"][r][m].tolist() == rows[k] and (batch["tokens"][r][~m] == -1).all()
            groups.add(len({k // 30 for k in ids}))
            seen += ids
    assert sorted(seen) == list(range(n))
    assert max(groups) > 1  # batches mix row groups


@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_ordered_resume_of_a_window_of_ragged_rows_gives_the_uninterrupted_runs_batches(tmp_path, mode):
    # The replayed windows read their rows again: a padded input's as rows of different lengths
    # (a Ragged), or as a plain array where a row group's rows happen to agree.
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from feeder.sources import ParquetSource

    n = 420
    lengths = [3 if (k // 30) % 2 == 0 else k % 7 for k in range(n)]
    rows = [[k * 100 + 1 + j for j in range(length)] for k, length in enumerate(lengths)]
    pq.write_table(pa.table({"tokens": pa.array(rows, pa.list_(pa.int64())), "id": np.arange(n)}),
                   str(tmp_path / "t.parquet"), row_group_size=30)

    def batches(take=None, resume=None):
        coord = feeder.GlobalCoordinator(join_timeout=3.0)
        src = ParquetSource(str(tmp_path / "t.parquet"), shuffle=True, seed=2, shuffle_window=150)
        feeder.init_data_input_workers(None, ["tokens", "id"], src, 16, coordinator=coord, pad={"tokens": -1},
                                       ordered=True, resume_from=resume, **workers(mode, 2))
        got = []
        with coord:
            feed = coord.feed("train")
            for b in feed:
                got.append({k: v.tolist() for k, v in b.items()})
                if len(got) == take:
                    break
            return got, coord.state_dict("train")

    whole, _ = batches()
    assert sorted(k for b in whole for k in b["id"]) == list(range(n))
    for take in (3, 11):
        before, state = batches(take)
        after, _ = batches(resume=state)
        assert before + after == whole, take


def test_the_window_holds_rows_of_different_shapes_row_by_row():
    from feeder.sources.window import ShuffleWindow

    w = ShuffleWindow(100, np.random.default_rng(0))
    w.add([np.arange(6).reshape(3, 2), np.arange(3)])  # rows of one shape: held as an array at first
    w.add([Ragged.from_rows([np.array([7]), np.array([8, 9, 10])]), np.arange(3, 5)])
    w.add([np.full((2, 4), 5), np.arange(5, 7)])
    got = w.take(7)
    assert isinstance(got[0], Ragged) and sorted(got[1].tolist()) == list(range(7))
    by_key = {int(k): row.tolist() for k, row in zip(got[1], got[0])}
    assert by_key == {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [7], 4: [8, 9, 10], 5: [5] * 4, 6: [5] * 4}


@pytest.mark.parquet
@pytest.mark.parametrize("window", [None, 96])
def test_resume_with_padding_and_a_window_is_exactly_once(ragged_parquet, window):
    # Rows held in the window when the state is taken were not delivered: the resumed run gives them.
    from feeder.sources import ParquetSource

    path, n = ragged_parquet

    def register(coord, resume=None):
        src = ParquetSource(str(path), shuffle=True, seed=5)
        feeder.init_data_input_workers(None, ["tokens", "id"], src, 16, num_worker_threads=2, coordinator=coord,
                                       pad={"tokens": 0}, length_window=window, resume_from=resume)

    first = feeder.GlobalCoordinator()
    register(first)
    with first:
        feed = first.feed("train")
        before = [k for _ in range(7) for k in check(feed.next_batch(timeout=10))]
        state = json.loads(json.dumps(first.state_dict("train")))
    assert state["rows_delivered"] == len(before) == 7 * 16
    second = feeder.GlobalCoordinator()
    register(second, state)
    with second:
        after = [k for b in second.feed("train") for k in check(b)]
    assert sorted(before + after) == list(range(n))


# ---- issue 34 ------------------------------------------------------------------------------------------------------
def test_frames_are_rounded_along_their_length_only(coord):
    """Item 3, through a feed without a session: frames [L, 80], pad_to_multiple_of=64 gave (8, 64, 128)."""
    rng = np.random.default_rng(0)

    def fetch(worker_id, batch_size):
        return {"frames": [np.ones((int(n), 80), np.float32) for n in rng.integers(1, 60, size=8)],
                "id": np.arange(8)}

    feeder.init_data_input_workers(None, ["frames", "id"], fetch, 8, num_worker_threads=1, coordinator=coord,
                                   pad={"frames": 0.0}, pad_to_multiple_of=64)
    with coord:
        batch = coord.feed("train").next_batch(timeout=10)
    assert batch["frames"].shape == batch["frames_mask"].shape == (8, 64, 80)


@pytest.fixture
def nested_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    # list<list<int64>>: every row holds two lists, of different lengths from row to row
    rows = [[[k] * (1 + k % 3), [k, k]] for k in range(8)]
    pq.write_table(pa.table({"tokens": pa.array(rows, pa.list_(pa.list_(pa.int64()))), "id": np.arange(8)}),
                   str(tmp_path / "nested.parquet"), row_group_size=2)
    return tmp_path / "nested.parquet"


@pytest.mark.parquet
@pytest.mark.parametrize("pad", [{"tokens": 0}, None])
def test_a_list_of_lists_of_different_lengths_is_bad_data_naming_the_column(coord, nested_parquet, pad):
    """Item 2: it failed with "'Ragged' object has no attribute 'reshape'" as a FetchError, and with
    max_fetch_errors=5 its row groups were skipped (0 of 8 rows, no error)."""
    from feeder.sources import ParquetSource

    feeder.init_data_input_workers(None, ["tokens", "id"], ParquetSource(str(nested_parquet)), 4,
                                   num_worker_threads=1, coordinator=coord, pad=pad, max_fetch_errors=5)
    with coord, pytest.raises(feeder.InputValidationError, match=r"column 'tokens' \(input 'tokens'\) of .*"
                                                                 r"nested.parquet', row group 0: lists whose values "
                                                                 r"are lists of different lengths"):
        list(coord.feed("train"))


def test_a_column_named_like_a_mask_is_refused_at_registration(coord):
    """Item 10: a data column 'tokens_mask' beside pad={"tokens": 0} was silently taken for the mask
    ("ArraySource has arrays ['tokens_mask'] for no input"); mask_names={"tokens": "id"} silently
    removed the input 'id'; a plain fetch function failed at its first chunk without a word of the mask."""
    from feeder.sources import ArraySource, ParquetSource  # noqa: F401

    tokens = np.ones((8, 3), np.int64)
    data = {"tokens": tokens, "tokens_mask": np.ones((8, 3), bool), "id": np.arange(8)}
    with pytest.raises(ValueError, match=r"pad= makes a mask 'tokens_mask' for padded input 'tokens', and the "
                                         r"ArraySource has a column 'tokens_mask'.*mask_names=\{'tokens': "
                                         r"'tokens_pad_mask'\}"):
        feeder.init_data_input_workers(None, ["tokens", "tokens_mask", "id"], ArraySource(data), 4,
                                       coordinator=coord, pad={"tokens": 0})
    with pytest.raises(ValueError, match=r"mask_names names a mask 'id' for padded input 'tokens', and the "
                                         r"ArraySource has a column 'id'"):
        feeder.init_data_input_workers(None, ["tokens", "id"], ArraySource({"tokens": tokens, "id": np.arange(8)}),
                                       4, coordinator=coord, pad={"tokens": 0}, mask_names={"tokens": "id"})
    with pytest.raises(ValueError, match=r"mask_names names the mask of padded input 'tokens' 'id', which "
                                         r"input_names also lists.*never fetched"):
        feeder.init_data_input_workers(None, ["tokens", "id"], RaggedRows(8), 4, coordinator=coord,
                                       pad={"tokens": 0}, mask_names={"tokens": "id"})
    # renamed, the column is data and the mask has its own name
    feeder.init_data_input_workers(None, ["tokens", "tokens_mask", "id"], ArraySource(data), 4, coordinator=coord,
                                   pad={"tokens": 0}, mask_names={"tokens": "pad_mask"})
    with coord:
        batch = coord.feed("train").next_batch(timeout=10)
    assert sorted(batch) == ["id", "pad_mask", "tokens", "tokens_mask"] and batch["tokens_mask"].dtype == bool


class WithOwnMask(RaggedRows):
    def __call__(self, worker_id, batch_size):
        chunk = super().__call__(worker_id, batch_size)
        chunk["tokens_mask"] = np.ones(len(chunk["id"]), bool)
        return chunk


def test_a_fetch_function_returning_a_masks_name_is_told_which_mask_it_is(coord):
    feeder.init_data_input_workers(None, ["tokens", "tokens_mask", "id"], WithOwnMask(8), 4, num_worker_threads=1,
                                   coordinator=coord, pad={"tokens": 0})
    with coord, pytest.raises(feeder.InputValidationError, match=r"unknown \['tokens_mask'\], 'tokens_mask' is the "
                                                                 r"name of the mask pad= makes for input 'tokens'.*"
                                                                 r"mask_names=\{'tokens': 'tokens_pad_mask'\}"):
        coord.feed("train").next_batch(timeout=10)


@pytest.mark.parquet
@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_ordered_resume_rounds_the_axes_the_first_run_had_seen_vary(tmp_path, mode):
    # Rows [L, 2]: L is rounded to pad_to_multiple_of once rows have differed along it, in this batch
    # or an earlier one. A resumed run must know about the earlier ones (the state carries them), or
    # its batches after the checkpoint come out (4, 5, 2) where the uninterrupted run's were (4, 8, 2).
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from feeder.sources import ParquetSource

    lengths = [3, 3, 3, 3, 3, 5, 3, 3, 5, 5, 5, 5, 2, 2, 2, 2]
    frames = [[[k * 10 + j, 1] for j in range(n)] for k, n in enumerate(lengths)]
    path = str(tmp_path / "f.parquet")
    pq.write_table(pa.table({"id": np.arange(16), "frames": pa.array(frames, pa.list_(pa.list_(pa.int64(), 2)))}),
                   path, row_group_size=4)

    def run(take=None, resume=None):
        coord = feeder.GlobalCoordinator(join_timeout=3.0)
        feeder.init_data_input_workers(None, ["id", "frames"], ParquetSource(path), 4, coordinator=coord,
                                       ordered=True, pad={"frames": 0}, pad_to_multiple_of=8, resume_from=resume,
                                       **workers(mode, 1))
        got = []
        with coord:
            for b in coord.feed("train"):
                got.append((b["frames"].shape, b["id"].tolist(), b["frames"].tolist()))
                if len(got) == take:
                    break
            return got, json.loads(json.dumps(coord.state_dict("train")))

    whole, end_state = run()
    assert [s for s, _, _ in whole] == [(4, 3, 2), (4, 8, 2), (4, 8, 2), (4, 8, 2)]
    assert end_state["pad_varies"] == {"frames": [0]}
    for take in (1, 2, 3):
        before, state = run(take)
        assert ("pad_varies" in state) == (take >= 2), state  # rows first differed in the second batch
        after, _ = run(resume=state)
        assert before + after == whole, take


def test_merge_states_keeps_every_ranks_rounding_history_and_a_bad_one_is_refused():
    from feeder.sources import ArraySource, merge_states
    from feeder.sources.state import pad_varies_of

    coord = feeder.GlobalCoordinator()
    src = ArraySource({"x": np.arange(8)})
    feeder.init_data_input_workers(None, ["x"], src, 4, coordinator=coord, num_worker_threads=1)
    with coord:
        list(coord.feed("train"))
        base = coord.state_dict("train")
    states = []
    for rank, varies in enumerate([{"frames": [0]}, {"frames": [1], "audio": [0]}]):
        st = dict(base, pad_varies=varies, shard={"world": 2, "ranks": [rank]})
        states.append(st)
    merged = merge_states(states)
    assert merged["pad_varies"] == {"frames": [0, 1], "audio": [0]}
    for bad in ({"frames": ["0"]}, {"frames": [True]}, {"frames": [-1]}, [0]):
        with pytest.raises(ValueError, match="pad_varies"):
            pad_varies_of({"pad_varies": bad})
    coord2 = feeder.GlobalCoordinator()
    with pytest.raises(ValueError, match="pad_varies"):
        feeder.init_data_input_workers(None, ["x"], ArraySource({"x": np.arange(8)}), 4, coordinator=coord2,
                                       resume_from=dict(base, pad_varies=[0]))
    assert coord2.sources == [] and not coord2.feeds("train")  # refused before anything was registered


def test_a_state_never_has_a_batchs_rows_without_the_rounding_history_it_left():
    """Keys and history were recorded in two steps, and a state read them in two: a checkpoint
    taken from another thread as a batch was popped could pair batch k's rows with the history
    after batch k-1 (its resume then shaped batches otherwise). 1 state in 20 did, at a short
    switch interval."""
    import sys
    import types

    from feeder.sources.rowkeys import KeyLedger, source_state

    ledger, n, stop = KeyLedger("t"), 3000, threading.Event()
    expected = {k: {"f": list(range(k // 40 + 1))} for k in range(n)}  # the history after batch k
    bad = []

    def checkpoints():
        while not stop.is_set():
            state = source_state("t", ledger, None)
            rows = state["rows_delivered"]
            if rows and state.get("pad_varies") != expected[rows // 4 - 1]:
                bad.append((rows, state.get("pad_varies")))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    reader = threading.Thread(target=checkpoints)
    try:
        reader.start()
        for k in range(n):
            ledger.record(types.SimpleNamespace(keys=np.arange(4 * k, 4 * k + 4), pad_varies=expected[k]))
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(old)
    assert not bad, bad[:3]
