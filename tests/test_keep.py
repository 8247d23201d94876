"""keep=[names]: arrays carried with each batch, never bound to the session, and
run(..., with_batch=True) / runs(with_batch=True) returning the outputs with the batch's arrays,
so that outputs can be matched to their rows (issue 35, item 5)."""
from __future__ import annotations

import numpy as np
import pytest
from utils import workers

import feeder
from feeder.sources import ArraySource

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from models import LOGISTIC_STATE, linear_model, logistic_train_step, logistic_zero_state  # noqa: E402

DIM = 4


def session():
    return ort.InferenceSession(linear_model(in_dim=DIM), providers=["CPUExecutionProvider"])


def name_of(i: int) -> bytes:
    return f"file-{i}.txt".encode()


class Rows:
    """``n`` rows per worker in chunks of ``size`` (each worker numbers its own rows from
    ``worker_id * n``): x[i] = [i] * DIM, then the kept id[i] (int64) and name[i] (fixed-width
    bytes). The linear model's output s = sum(x) = DIM * i says which row an output row is."""

    def __init__(self, n: int, size: int = 5, as_dict: bool = False):
        self.n, self.size, self.as_dict = n, size, as_dict
        self.next = {}

    def __call__(self, worker_id, batch_size):
        start = self.next.get(worker_id, 0)
        if start >= self.n:
            raise StopIteration
        stop = min(self.n, start + self.size)
        self.next[worker_id] = stop
        ids = np.arange(start, stop) + worker_id * self.n
        x = np.repeat(ids[:, None], DIM, axis=1).astype(np.float32)
        names = np.array([name_of(i) for i in ids])  # dtype S11 or S12: widths differ from chunk to chunk
        if self.as_dict:
            return {"name": names, "x": x, "id": ids}
        return [x, ids, names]


def check_batch(outputs, batch):
    y, s = outputs
    assert set(batch) == {"x", "id", "name"}
    assert len(batch["id"]) == len(batch["name"]) == len(s) == len(y)
    np.testing.assert_array_equal(s, DIM * batch["id"].astype(np.float32))  # the outputs are these rows'
    assert batch["name"].tolist() == [name_of(i) for i in batch["id"].tolist()]
    assert batch["id"].dtype == np.int64 and batch["name"].dtype.kind == "S"


def test_kept_arrays_ride_with_each_batch_and_are_never_bound(coord, mode):
    feeder.init_data_input_workers(session(), ["x"], Rows(40), 8, coordinator=coord, keep=["id", "name"],
                                   **workers(mode, 2))
    with coord:
        feed = coord.feed("train")
        assert feed.kept_names == ["id", "name"] and feed.input_names == ["x", "id", "name"]
        seen = []
        for outputs, batch in feed.runs(with_batch=True):
            check_batch(outputs, batch)
            seen += batch["id"].tolist()
    wid = feed.worker_ids
    assert sorted(seen) == sorted(i + w * 40 for w in wid for i in range(40))


def test_next_batch_iteration_and_run_with_batch(coord):
    feeder.init_data_input_workers(session(), ["x"], Rows(30, as_dict=True), 6, coordinator=coord,
                                   keep=["id", "name"], num_worker_threads=1)
    with coord:
        feed = coord.feed("train")
        first = feed.next_batch()
        assert set(first) == {"x", "id", "name"} and first["id"].tolist() == list(range(6))
        outputs, batch = feed.run(with_batch=True)
        check_batch(outputs, batch)
        (s,) = feed.run(["s"])  # without with_batch: the outputs alone, as before
        assert s.shape == (6,)
        rest = list(feed)
    assert [b["id"].tolist() for b in rest] == [list(range(18, 24)), list(range(24, 30))]


def test_kept_columns_of_sources_with_ordered_and_resume(coord, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from feeder.sources import ParquetSource

    ids = np.arange(60)
    x = np.repeat(ids[:, None], DIM, axis=1).astype(np.float32)
    names = np.array([name_of(i) for i in ids])
    pq.write_table(pa.table({"x": list(x), "id": ids, "name": names.astype(str)}), tmp_path / "t.parquet",
                   row_group_size=7)

    def feed_on(c, source, state=None):
        feeder.init_data_input_workers(session(), ["x"], source, 8, coordinator=c, keep=["id", "name"],
                                       ordered=True, num_worker_threads=3, resume_from=state)
        c.start()
        return c.feed("train")

    def outputs(feed, n=None):
        got = []
        for k, (out, batch) in enumerate(feed.runs(with_batch=True)):
            np.testing.assert_array_equal(out[1], DIM * batch["id"].astype(np.float32))
            assert batch["name"].tolist() == [name_of(i).decode() for i in batch["id"].tolist()]
            got.append(batch["id"].tolist())
            if n is not None and k + 1 == n:
                break
        return got

    whole = outputs(feed_on(coord, ParquetSource(tmp_path, columns={"x": "x", "id": "id", "name": "name"})))
    coord.stop()
    assert sorted(sum(whole, [])) == list(range(60))
    # ordered=True: a resumed run delivers exactly the batches the uninterrupted one did after the checkpoint
    first = outputs(feed_on(coord, ParquetSource(tmp_path)), n=3)
    state = coord.state_dict("train")
    coord.stop()
    again = feeder.GlobalCoordinator()
    try:
        rest = outputs(feed_on(again, ParquetSource(tmp_path), state))
    finally:
        again.stop()
    assert first + rest == whole


def test_columns_that_leave_out_a_kept_array_are_refused_saying_to_map_it(coord, tmp_path):
    # A first-hour mistake: columns= maps the model's inputs only, keep= names an id column.
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from feeder.sources import ParquetSource

    ids = np.arange(10)
    pq.write_table(pa.table({"x": list(np.ones((10, DIM), np.float32)), "id": ids}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"missing \['id'\].*keep= are read like inputs: map them too"):
        feeder.init_data_input_workers(session(), ["x"], ParquetSource(tmp_path, columns={"x": "x"}), 8,
                                       coordinator=coord, keep=["id"])


def test_array_source_with_replicas_worker_processes_and_dont_rebatch(coord, mode):
    ids = np.arange(100)
    source = ArraySource({"x": np.repeat(ids[:, None], DIM, axis=1).astype(np.float32), "id": ids,
                          "name": np.array([name_of(i) for i in ids])}, block_rows=10)
    for _ in range(2):
        feeder.init_data_input_workers(session(), ["x"], source, 10, coordinator=coord, keep=["id", "name"],
                                       dont_rebatch=True, replica=True, **workers(mode, 1))
    seen = []
    with coord:
        for feed in coord.feeds("train"):
            outputs, batch = feed.run(with_batch=True)
            check_batch(outputs, batch)
            seen += batch["id"].tolist()
        for batch in coord.feeds("train")[0]:
            assert set(batch) == {"x", "id", "name"}
            seen += batch["id"].tolist()
        for batch in coord.feeds("train")[1]:
            seen += batch["id"].tolist()
    assert sorted(seen) == list(range(100))


def test_kept_arrays_beside_padding_and_a_length_window(coord):
    from test_pad_feed import RaggedRows, _session, expected_sums, mask_model

    # the model takes tokens and their mask; "id" is kept (before: only a model input could carry it)
    feeder.init_data_input_workers(_session(mask_model(with_id=False)), ["tokens"], RaggedRows(40), 8,
                                   num_worker_threads=2, coordinator=coord, pad={"tokens": 0}, length_window=16,
                                   keep=["id"])
    seen = []
    with coord:
        feed = coord.feed("train")
        assert feed.input_names == ["tokens", "id", "attention_mask"]
        for (out,), batch in feed.runs(with_batch=True):
            np.testing.assert_array_equal(out, expected_sums(batch["id"]))
            assert batch["attention_mask"].shape == batch["tokens"].shape
            seen += batch["id"].tolist()
    assert sorted(seen) == list(range(40))


def test_a_training_adapter_and_device_slots_leave_kept_arrays_unbound(coord):
    train = feeder.StatefulSession(ort.InferenceSession(logistic_train_step(DIM), providers=["CPUExecutionProvider"]),
                                   LOGISTIC_STATE, logistic_zero_state(DIM))

    def labelled(worker_id, batch_size):
        ids = np.arange(6)
        return [np.ones((6, DIM), np.float32), (ids % 2).astype(np.float32), ids]

    feeder.init_data_input_workers(train, ["x", "y"], labelled, 6, coordinator=coord, keep=["id"],
                                   num_worker_threads=1)
    feeder.init_data_input_workers(session(), ["x"], Rows(24), 6, coordinator=coord, keep=["id", "name"],
                                   num_worker_threads=1, input_source_name="staged", device="cpu:staged")
    with coord:
        (loss,), batch = coord.feed("train").run(["loss"], with_batch=True)
        assert np.isfinite(loss) and batch["id"].tolist() == list(range(6)) and train.steps == 1
        staged = list(coord.feed("staged").runs(with_batch=True))
    for outputs, b in staged:
        check_batch(outputs, b)
    assert sum(len(b["id"]) for _, b in staged) == 24


def test_kept_arrays_are_validated_like_inputs(coord):
    class Misaligned:
        def __call__(self, worker_id, batch_size):
            return [np.ones((4, DIM), np.float32), np.arange(3)]

    feeder.init_data_input_workers(session(), ["x"], Misaligned(), 4, coordinator=coord, keep=["id"])
    with coord:
        with pytest.raises(feeder.InputValidationError, match=r"input 'id'.*4 rows"):
            coord.feed("train").next_batch()


def test_a_kept_dtype_is_learned_from_the_first_chunk(coord):
    calls = []

    def fetch(worker_id, batch_size):
        calls.append(1)
        ids = np.arange(4, dtype=np.int64 if len(calls) == 1 else np.int32)
        return [np.ones((4, DIM), np.float32), ids]

    feeder.init_data_input_workers(session(), ["x"], fetch, 4, coordinator=coord, keep=["id"], num_worker_threads=1)
    with coord:
        feed = coord.feed("train")
        with pytest.raises(feeder.InputValidationError, match=r"input 'id'.*int64.*first chunk"):
            for _ in range(3):
                feed.next_batch()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(input_names=["x"], keep=["x"]), ValueError, r"session takes as inputs.*input_names"),
    (dict(input_names=None, keep=["x", "id"]), ValueError, r"\['x'\].*session takes as inputs"),
    (dict(input_names=["x"], keep="id"), TypeError, "list of names"),
    (dict(input_names=["x"], keep=["id", "id"]), ValueError, "duplicates"),
    (dict(input_names=["x"], keep=[3]), TypeError, "str"),
])
def test_bad_keep_is_refused_at_registration(coord, kwargs, error, match):
    with pytest.raises(error, match=match):
        feeder.init_data_input_workers(session(), fetch_fun=Rows(4), batch_size=4, coordinator=coord, **kwargs)
    assert not coord.feeds("train")


def test_keep_refuses_an_input_named_twice_and_a_mask(coord):
    with pytest.raises(ValueError, match="named in both input_names and keep"):
        feeder.init_data_input_workers(None, ["x", "id"], Rows(4), 4, coordinator=coord, keep=["id"])
    with pytest.raises(ValueError, match="masks that pad= makes"):
        feeder.init_data_input_workers(None, ["tokens"], Rows(4), 4, coordinator=coord, pad={"tokens": 0},
                                       keep=["tokens_mask"])
    # an id as an input of a session that has no such input: the error says what to do
    with pytest.raises(ValueError, match=r"keep=\['id'\]"):
        feeder.init_data_input_workers(session(), ["x", "id"], Rows(4), 4, coordinator=coord)
