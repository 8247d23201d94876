"""ParquetSource on files written here with pyarrow: row groups, files, list and string columns,
nulls, missing columns, empty files, and resume."""
from __future__ import annotations

import re
import sys
from collections import Counter

import numpy as np
import pytest

import feeder

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from feeder.sources import ParquetSource  # noqa: E402

pytestmark = pytest.mark.parquet  # .ci/run runs these against the declared minimum pyarrow too


def write(path, lo, hi, row_group_size):
    ids = np.arange(lo, hi)
    n = len(ids)
    emb = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 6).astype(np.float32)), 3)
    img = pa.FixedSizeListArray.from_arrays(emb, 2)  # nested: (n, 2, 3)
    tensor_type = pa.fixed_shape_tensor(pa.int32(), (2, 2))
    tensor = pa.ExtensionArray.from_storage(
        tensor_type, pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 4).astype(np.int32)), 4))
    table = pa.table({
        "id": pa.array(ids, pa.int64()),
        "score": pa.array(ids.astype(np.float64) / 2),
        "img": img,
        "tensor": tensor,
        "pair": pa.array([[int(i), int(i)] for i in ids], pa.list_(pa.int64())),  # variable lists, all of length 2
        "name": pa.array([f"row{i}" for i in ids]),
        "flag": pa.array(ids % 2 == 0),
        "unused": pa.array([None] * n, pa.float32()),  # nulls in a column nobody reads are fine
    })
    pq.write_table(table, path, row_group_size=row_group_size, compression="zstd")
    return n


@pytest.fixture
def files(tmp_path):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    write(d / "a.parquet", 0, 100, 17)
    write(d / "sub" / "b.parquet", 100, 130, 50)
    write(d / "c.parquet", 130, 130, 10)  # empty
    write(d / "d.parquet", 130, 175, 9)
    return d


INPUTS = ["id", "score", "img", "tensor", "pair", "name", "flag"]


def consume(source, *, inputs=INPUTS, workers=3, ordered=False, batch_size=16, take=None, resume=None, replicas=1,
            processes=0, **options):
    coord = feeder.GlobalCoordinator(join_timeout=3.0)
    try:
        for _ in range(replicas):
            feeder.init_data_input_workers(None, inputs, source, batch_size, num_worker_threads=workers,
                                           coordinator=coord, ordered=ordered, resume_from=resume,
                                           **({"num_worker_processes": processes} if processes else {}), **options)
        coord.start()
        got, live, i = [], list(coord.feeds("train")), 0
        while live and (take is None or len(got) < take):
            f = live[i % len(live)]
            try:
                got.append({k: v.copy() for k, v in f.next_batch(timeout=20).items()})
                i += 1
            except StopIteration:
                live.remove(f)
        return got, coord.state_dict("train")
    finally:
        coord.stop()


def test_every_row_of_every_file_and_row_group_once_per_epoch_with_its_columns(files):
    src = ParquetSource(files, shuffle=True, seed=4, epochs=2)
    assert len(src) == 175 and len(src.files) == 4
    got, state = consume(src, replicas=2)
    ids = np.concatenate([b["id"] for b in got])
    assert Counter(ids.tolist()) == Counter({i: 2 for i in range(175)})
    b = got[0]
    ids0 = b["id"]
    np.testing.assert_array_equal(b["score"], ids0 / 2)
    assert b["img"].shape == (len(ids0), 2, 3) and b["img"].dtype == np.float32
    np.testing.assert_array_equal(b["img"][:, 1, 2], ids0)
    assert b["tensor"].shape == (len(ids0), 2, 2) and b["tensor"].dtype == np.int32
    np.testing.assert_array_equal(b["tensor"][:, 1, 1], ids0)
    assert b["pair"].shape == (len(ids0), 2)
    assert b["name"].dtype.kind == "U" and b["name"].tolist() == [f"row{i}" for i in ids0]
    assert b["flag"].dtype == np.bool_ and (b["flag"] == (ids0 % 2 == 0)).all()
    assert state["rows_delivered"] == 350 and state["delivered"] == [[0, 350]]


def test_columns_map_inputs_to_columns_and_only_those_are_read(files, monkeypatch):
    src = ParquetSource([files / "a.parquet", files / "d.parquet"], columns={"x": "score", "key": "id"})
    read = []
    orig = pq.ParquetFile.read_row_group

    def spy(self, i, columns=None, **kw):
        read.append(tuple(columns))
        return orig(self, i, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    got, _ = consume(src, inputs=["key", "x"])
    ids = np.concatenate([b["key"] for b in got])
    assert sorted(ids.tolist()) == list(range(100)) + list(range(130, 175))
    assert set(read) == {("id", "score")}
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in got]), ids / 2)


def test_ordered_resume_gives_the_same_batches_as_an_uninterrupted_run(files):
    def make():
        return ParquetSource(files, shuffle=True, seed=9, epochs=2)

    full, _ = consume(make(), inputs=["id", "name"], ordered=True, batch_size=12)
    before, state = consume(make(), inputs=["id", "name"], ordered=True, batch_size=12, take=11)
    after, _ = consume(make(), inputs=["id", "name"], ordered=True, batch_size=12, workers=2, resume=state)
    assert [b["id"].tolist() for b in before + after] == [b["id"].tolist() for b in full]
    assert [b["name"].tolist() for b in before + after] == [b["name"].tolist() for b in full]


@pytest.mark.parametrize("processes", [0, 3])
def test_ordered_resume_with_a_shuffle_window_gives_the_same_batches_as_an_uninterrupted_run(files, processes):
    # The windows started empty on resume: every row came once, but not in the uninterrupted run's
    # batches. Now each worker's window is replayed to the checkpoint and its rows read again.
    def make():
        return ParquetSource(files, shuffle=True, seed=9, epochs=2, shuffle_window=60)

    full, _ = consume(make(), ordered=True, batch_size=12)
    assert sorted(np.concatenate([b["id"] for b in full]).tolist()) == sorted(list(range(175)) * 2)
    for take in ([1, 4, 17, 28] if not processes else [9]):
        before, state = consume(make(), ordered=True, batch_size=12, take=take, processes=processes)
        after, _ = consume(make(), ordered=True, batch_size=12, resume=state, processes=processes)
        for name in INPUTS:
            assert [b[name].tolist() for b in before + after] == [b[name].tolist() for b in full], (take, name)
            # and the same dtypes: a string column's width was the width the window had grown to
            assert [b[name].dtype for b in before + after] == [b[name].dtype for b in full], (take, name)


def test_ordered_resume_with_a_window_gives_strings_the_width_of_the_uninterrupted_run(tmp_path):
    # A window's string buffer widens to the longest value of every unit it read, and draws had
    # that width: a resumed window, rebuilt from the rows it held, gave narrower batches (<U3 for
    # <U40). Now a draw has the width of its own rows, however the window was filled.
    n = 400
    names = [("L" * 40 if i < 50 else f"s{i}") for i in range(n)]
    pq.write_table(pa.table({"id": np.arange(n), "s": names}), tmp_path / "t.parquet", row_group_size=50)

    def make():
        return ParquetSource(tmp_path / "t.parquet", shuffle=True, seed=0, shuffle_window=100)

    full, _ = consume(make(), inputs=["id", "s"], ordered=True, batch_size=16, workers=2)
    for take in (5, 13, 20):
        before, state = consume(make(), inputs=["id", "s"], ordered=True, batch_size=16, workers=2, take=take)
        after, _ = consume(make(), inputs=["id", "s"], ordered=True, batch_size=16, workers=2, resume=state)
        assert [(b["s"].tolist(), b["s"].dtype) for b in before + after] == \
            [(b["s"].tolist(), b["s"].dtype) for b in full], take


def test_a_state_from_other_files_or_columns_is_refused(files, tmp_path):
    _, state = consume(ParquetSource(files), inputs=["id"], take=2)
    coord = feeder.GlobalCoordinator()
    with pytest.raises(ValueError, match="files"):
        feeder.init_data_input_workers(None, ["id"], ParquetSource(files / "a.parquet"), 8, coordinator=coord,
                                       resume_from=state)
    with pytest.raises(ValueError, match="columns"):
        feeder.init_data_input_workers(None, ["id"], ParquetSource(files, columns={"id": "score"}), 8,
                                       coordinator=coord, resume_from=state)
    with pytest.raises(ValueError, match="seed"):
        feeder.init_data_input_workers(None, ["id"], ParquetSource(files, seed=3), 8, coordinator=coord,
                                       resume_from=state)


def write_scores(path, scores, row_group_size=10):
    pq.write_table(pa.table({"id": pa.array(np.arange(len(scores)), pa.int64()), "score": scores}), path,
                   row_group_size=row_group_size)


def write_reversed_row(path, scores, row):
    """``scores`` with one row's values reversed (a list column): the same size, the same column
    statistics, other data."""
    vecs = np.stack([scores, scores + 1, scores + 2], axis=1)
    vecs[row] = vecs[row][::-1]
    pq.write_table(pa.table({"id": pa.array(np.arange(len(scores)), pa.int64()),
                             "score": pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1)), 3)}), path,
                   row_group_size=10, compression="none", use_dictionary=False)


def test_a_state_of_other_data_with_the_same_files_and_row_groups_is_refused_naming_the_file(tmp_path):
    """Other dtypes or other values under the same names and row groups: the message names the
    file and says what changed (its size, its footer: schema, row groups, the used columns'
    statistics). With the default identity ("metadata") a file whose modification time moved is
    another file, even when written again with the same contents (this test asserted, before
    issue 26, that such a file resumed: it is now refused, and identity="content" resumes it)."""
    path = tmp_path / "s.parquet"
    write_scores(path, np.arange(30.0))
    before, state = consume(ParquetSource(path), inputs=["id", "score"], take=1, batch_size=4)
    coord = feeder.GlobalCoordinator()
    write_scores(path, np.arange(30.0).astype(np.float32) * 3)  # float32, other values, same row groups
    with pytest.raises(ValueError, match=r"files: 1 file\(s\) changed \(\d+ -> \d+ bytes, other schema, row groups "
                                         r"or column statistics in its footer, modification time moved\): "
                                         r"'s\.parquet'; dtypes: the state has \{'id': 'int64', 'score': "
                                         r"'double'\}, this source \{'id': 'int64', 'score': 'float'\}"):
        feeder.init_data_input_workers(None, ["id", "score"], ParquetSource(path), 8, coordinator=coord,
                                       resume_from=state)
    write_scores(path, np.arange(30.0) + 0.5)  # float64 again, one value more in each: other stats
    with pytest.raises(ValueError, match=r"1 file\(s\) changed \((\d+ -> \d+ bytes, )?other schema, row groups or "
                                         r"column statistics in its footer, modification time moved\): "
                                         r"'s\.parquet'") as info:
        feeder.init_data_input_workers(None, ["id", "score"], ParquetSource(path), 8, coordinator=coord,
                                       resume_from=state)
    assert "dtypes" not in str(info.value)
    write_scores(path, np.arange(30.0))  # the same data written again: only its modification time moved
    with pytest.raises(ValueError, match=r"1 file\(s\) changed \(only its modification time moved \(touched or "
                                         r"copied\? a checkpoint written with identity='content' compares contents "
                                         r"instead\)\): 's\.parquet'"):
        feeder.init_data_input_workers(None, ["id", "score"], ParquetSource(path), 8, coordinator=coord,
                                       resume_from=state)


def test_identity_content_resumes_on_a_copy_and_refuses_other_bytes_of_the_same_size_and_statistics(tmp_path):
    path = tmp_path / "v.parquet"
    scores = np.arange(30.0)
    write_reversed_row(path, scores, row=None)  # vecs[None] reverses nothing
    before, state = consume(ParquetSource(path, identity="content"), inputs=["id", "score"], take=1, batch_size=4)
    assert state["definition"]["identity"] == "content"
    assert state["definition"]["files"][0]["version"].startswith("sha256:")
    coord = feeder.GlobalCoordinator()
    size = path.stat().st_size
    write_reversed_row(path, scores, row=3)  # one row corrected: the same size and statistics
    assert path.stat().st_size == size
    with pytest.raises(ValueError, match=r"files: 1 file\(s\) changed \(other contents\): 'v\.parquet'"):
        feeder.init_data_input_workers(None, ["id", "score"], ParquetSource(path, identity="content"), 8,
                                       coordinator=coord, resume_from=state)
    # ... which the default identity refuses too (its modification time moved), naming it
    _, meta_state = consume(ParquetSource(path), inputs=["id", "score"], take=1, batch_size=4)
    write_reversed_row(path, scores, row=None)
    with pytest.raises(ValueError, match=r"1 file\(s\) changed \(only its modification time moved .*\): "
                                         r"'v\.parquet'"):
        feeder.init_data_input_workers(None, ["id", "score"], ParquetSource(path), 8, coordinator=coord,
                                       resume_from=meta_state)
    # the same bytes copied elsewhere (another modification time): content identity resumes
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "v.parquet").write_bytes(path.read_bytes())
    rest, end = consume(ParquetSource(copy / "v.parquet", identity="content"), inputs=["id", "score"], resume=state,
                        batch_size=4)
    assert sorted(np.concatenate([b["id"] for b in before + rest]).tolist()) == list(range(30))
    assert end["rows_delivered"] == 30
    # a state of one identity is not resumed by a source of the other: it cannot be checked
    with pytest.raises(ValueError, match="identity: the state has 'content', this source 'metadata'"):
        feeder.init_data_input_workers(None, ["id", "score"], ParquetSource(path), 8, coordinator=coord,
                                       resume_from=state)
    with pytest.raises(ValueError, match="identity must be one of"):
        ParquetSource(path, identity="mtime")
    with pytest.raises(TypeError, match="identity must be one of"):
        ParquetSource(path, identity=None)


def test_a_state_names_the_files_added_removed_and_changed(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    for i in range(14):
        write_scores(d / f"f{i:02d}.parquet", np.arange(20.0) + i)
    _, state = consume(ParquetSource(d), inputs=["id", "score"], take=1, batch_size=4)
    (d / "f03.parquet").unlink()
    for i in range(14, 27):
        write_scores(d / f"f{i:02d}.parquet", np.arange(20.0) + i)
    write_scores(d / "f05.parquet", np.arange(10.0))
    with pytest.raises(ValueError) as info:
        feeder.init_data_input_workers(None, ["id", "score"], ParquetSource(d), 8,
                                       coordinator=feeder.GlobalCoordinator(), resume_from=state)
    msg = str(info.value)
    assert "1 file(s) removed (the state has them, this source does not): 'f03.parquet'" in msg
    assert ("13 file(s) added (this source has them, the state has not): 'f14.parquet', 'f15.parquet', "
            "'f16.parquet', 'f17.parquet', 'f18.parquet', 'f19.parquet', 'f20.parquet', 'f21.parquet', "
            "'f22.parquet', 'f23.parquet' and 3 more") in msg
    assert re.search(r"1 file\(s\) changed \(\d+ -> \d+ bytes, 20 -> 10 rows, .*\): 'f05\.parquet'", msg), msg
    assert "..." not in msg


def test_a_file_that_changed_after_the_source_was_created_is_named(tmp_path, coord):
    path = tmp_path / "s.parquet"
    write_scores(path, np.arange(20.0))
    src = ParquetSource(path)
    write_scores(path, np.arange(10.0))  # rewritten between creation and start()
    feeder.init_data_input_workers(None, ["id", "score"], src, 4, coordinator=coord)
    with pytest.raises(ValueError, match=r"file '.*s\.parquet' changed since the ParquetSource was created "
                                         r"\(.* bytes, row groups of \[10, 10\] -> \[10\] rows\)"):
        coord.start()
    # and after start(): the first read of it says so, an InputValidationError (bad data, never skipped)
    from feeder.sources.base import SourceBinding
    write_scores(path, np.arange(20.0))
    src = ParquetSource(path)
    src.feeder_validate(("id", "score"), None)
    src.feeder_bind(SourceBinding("train", ((0,),), ("id", "score"), True, None))
    write_scores(path, np.arange(20.0) * 2)
    with pytest.raises(feeder.InputValidationError, match=r"file '.*s\.parquet' changed since the ParquetSource"):
        src(0, 4)
    # A file written again with the same contents (a new mtime only) is a change under the default
    # identity (before issue 26 it was accepted): the message says so and names the way out ...
    write_scores(path, np.arange(20.0))
    src.feeder_release()
    with pytest.raises(ValueError, match=r"s\.parquet' changed since the ParquetSource was created \(its "
                                         r"modification time moved, its size and footer did not: .*"
                                         r"identity='content'"):
        src.feeder_bind(SourceBinding("train", ((0,),), ("id", "score"), True, None))
    # ... and not under identity="content", which compares the bytes when the time stamp moved
    src = ParquetSource(path, identity="content")
    src.feeder_validate(("id", "score"), None)
    write_scores(path, np.arange(20.0))
    src.feeder_bind(SourceBinding("train", ((0,),), ("id", "score"), True, None))
    assert src(0, 4)[0].tolist() == list(range(10))
    write_reversed_row(path, np.arange(20.0), row=None)
    src = ParquetSource(path, identity="content")
    src.feeder_validate(("id", "score"), None)
    write_reversed_row(path, np.arange(20.0), row=2)  # other bytes, the same size and footer
    with pytest.raises(ValueError, match=r"s\.parquet' changed since the ParquetSource was created \(other "
                                         r"contents\)"):
        src.feeder_bind(SourceBinding("train", ((0,),), ("id", "score"), True, None))


@pytest.mark.parametrize("processes", [0, 2], ids=["threads", "processes"])
def test_a_null_in_a_used_column_is_an_input_validation_error_naming_it(tmp_path, processes):
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"x": pa.array([1.0, None, 3.0] * 10), "ok": pa.array(np.arange(30.0))}), path,
                   row_group_size=10)
    got, _ = consume(ParquetSource(path), inputs=["ok"], processes=processes)
    assert sum(len(b["ok"]) for b in got) == 30
    with pytest.raises(feeder.InputValidationError, match="column 'x'.*null"):
        consume(ParquetSource(path), inputs=["x"], processes=processes)
    # bad data is not a transient failure: max_fetch_errors does not skip it
    with pytest.raises(feeder.InputValidationError, match="column 'x'.*null"):
        consume(ParquetSource(path), inputs=["x"], processes=processes, max_fetch_errors=5)
    lists = tmp_path / "list_nulls.parquet"
    pq.write_table(pa.table({"v": pa.array([[1.0, None]] * 4, pa.list_(pa.float64(), 2))}), lists)
    with pytest.raises(feeder.InputValidationError, match="column 'v'.*null"):
        consume(ParquetSource(lists), inputs=["v"])


def test_a_missing_column_is_a_value_error_naming_it(files):
    with pytest.raises(ValueError, match="'nope'"):
        ParquetSource(files, columns={"x": "nope"})
    src = ParquetSource(files)
    with pytest.raises(ValueError, match="'nope'"):
        feeder.init_data_input_workers(None, ["id", "nope"], src, 8, coordinator=feeder.GlobalCoordinator())
    with pytest.raises(ValueError, match="missing"):
        feeder.init_data_input_workers(None, ["id", "x"], ParquetSource(files, columns={"id": "id"}), 8,
                                       coordinator=feeder.GlobalCoordinator())


def test_empty_files_end_the_source_at_once(tmp_path):
    path = tmp_path / "empty.parquet"
    write(path, 0, 0, 10)
    src = ParquetSource(path, epochs=None)
    assert len(src) == 0
    got, state = consume(src, inputs=["id"])
    assert got == [] and state["rows_delivered"] == 0
    with pytest.raises((FileNotFoundError, ValueError)):
        ParquetSource(tmp_path / "absent.parquet")


def test_columns_convert_with_what_pyarrow_14_has(monkeypatch):
    """pyarrow 14 (the declared minimum) has no string views (16): every other type converts."""
    from feeder.sources.parquet import to_numpy
    for name in ("is_string_view", "is_binary_view"):
        monkeypatch.delattr(pa.types, name, raising=False)
    assert to_numpy(pa.chunked_array([pa.array([1, 2, 3])]), "x").tolist() == [1, 2, 3]
    assert to_numpy(pa.array(["a", "b"]), "s").tolist() == ["a", "b"]
    assert to_numpy(pa.array([b"a"]), "b").tolist() == [b"a"]
    assert to_numpy(pa.array([True, False]), "f").tolist() == [True, False]


def test_without_pyarrow_creating_one_says_what_to_install(monkeypatch, files):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"feeder\[parquet\]"):
        ParquetSource(files)


def test_numeric_and_fixed_size_list_columns_are_not_copied(files):
    from feeder.sources.base import SourceBinding
    src = ParquetSource(files / "a.parquet", columns={"score": "score", "img": "img", "name": "name"})
    src.feeder_validate(("score", "img", "name"), None)
    src.feeder_bind(SourceBinding("train", ((0,),), ("score", "img", "name"), False, None))
    score, img, name, keys = src(0, 8)
    assert not score.flags.owndata and not score.flags.writeable  # a view of Arrow's buffer
    assert not img.flags.owndata and img.shape == (17, 2, 3)
    assert name.dtype.kind == "U" and keys.tolist() == list(range(17))


@pytest.mark.skipif("num_worker_processes" not in __import__("inspect").signature(
    feeder.init_data_input_workers).parameters, reason="worker processes (issue 10) are not on this branch")
def test_parquet_source_in_worker_processes(files):
    src = ParquetSource(files, shuffle=True, epochs=2)
    coord = feeder.GlobalCoordinator(join_timeout=3.0)
    try:
        feeder.init_data_input_workers(None, ["id", "name", "img"], src, 16, num_worker_processes=2, coordinator=coord)
        coord.start()
        got = list(coord.feed("train"))
    finally:
        coord.stop()
    ids = np.concatenate([b["id"] for b in got])
    assert Counter(ids.tolist()) == Counter({i: 2 for i in range(175)})
    assert all(b["name"].tolist() == [f"row{i}" for i in b["id"]] for b in got)


def test_a_state_of_an_earlier_feeder_is_refused_saying_so_and_showing_no_hash(tmp_path):
    """States written before issue 26 record files as [name, rows] and hashes of all footers."""
    path = tmp_path / "s.parquet"
    write_scores(path, np.arange(30.0))
    _, state = consume(ParquetSource(path), inputs=["id", "score"], take=1, batch_size=4)
    old = dict(state["definition"])
    old.pop("identity")
    old["files"] = [["s.parquet", 30]]
    old["row_groups"], old["footers"] = "0123456789abcdef", "fedcba9876543210"
    with pytest.raises(ValueError) as info:
        feeder.init_data_input_workers(None, ["id", "score"], ParquetSource(path), 8,
                                       coordinator=feeder.GlobalCoordinator(),
                                       resume_from={**state, "definition": old})
    msg = str(info.value)
    assert ("files: 1 file(s) changed (no size or version recorded (a state of an earlier version of feeder)): "
            "'s.parquet'") in msg
    assert "row_groups: the state has a hash, this source has none" in msg
    assert not re.search(r"[0-9a-f]{16}", msg), msg


# ---- tabular data: scalar columns stacked, [N, 1] inputs, map and filter (issue 29) -------------------------
def write_features(path, n, k=5, *, dtype=np.float64, names=None, row_group_size=64, seed=0):
    """``k`` scalar columns named f0.. (or ``names``) in the schema order given, plus ``id``; the
    values of f<j> in row i are i + j / 10."""
    names = names or [f"f{j}" for j in range(k)]
    cols = {name: pa.array((np.arange(n) + int(name[1:]) / 10).astype(dtype)) for name in names}
    cols["id"] = pa.array(np.arange(n, dtype=np.int64))
    pq.write_table(pa.table(cols), str(path), row_group_size=row_group_size)


def expected_stack(ids, cols):
    return np.stack([ids + int(c[1:]) / 10 for c in cols], axis=1)


def test_scalar_columns_stack_into_one_input_in_the_order_given_and_globs_in_schema_order(tmp_path):
    write_features(tmp_path / "t.parquet", 300, names=["f10", "f2", "f1", "g0"])
    src = ParquetSource(tmp_path / "t.parquet", columns={"X": ["f2", "g0", "f1"], "id": "id"}, shuffle=True, seed=1)
    got, state = consume(src, inputs=["X", "id"])
    X = np.concatenate([b["X"] for b in got])
    ids = np.concatenate([b["id"] for b in got])
    assert X.shape == (300, 3) and X.dtype == np.float64 and sorted(ids.tolist()) == list(range(300))
    np.testing.assert_array_equal(X, expected_stack(ids, ["f2", "g0", "f1"]))  # shuffled rows: the gather path
    assert state["definition"]["columns"] == {"X": ["f2", "g0", "f1"], "id": "id"}
    globbed = ParquetSource(tmp_path / "t.parquet", columns={"X": "f*", "Y": ["g0", "f1?"], "id": "id"})
    assert globbed.columns == {"X": ["f10", "f2", "f1"], "Y": ["g0", "f10"], "id": "id"}  # the schema's order
    got, _ = consume(globbed, inputs=["X", "Y", "id"], workers=1)
    ids = np.concatenate([b["id"] for b in got])
    np.testing.assert_array_equal(np.concatenate([b["X"] for b in got]), expected_stack(ids, ["f10", "f2", "f1"]))


def test_bad_stacks_are_refused_naming_the_column(tmp_path):
    write_features(tmp_path / "t.parquet", 50)
    with pytest.raises(ValueError, match=r"the pattern 'h\*' \(input 'X'\) matches no column"):
        ParquetSource(tmp_path / "t.parquet", columns={"X": "h*"})
    with pytest.raises(ValueError, match=r"input 'X' names column\(s\) \['f1'\] more than once"):
        ParquetSource(tmp_path / "t.parquet", columns={"X": ["f1", "f*"]})
    with pytest.raises(ValueError, match=r"column\(s\) \['nope'\] not in"):
        ParquetSource(tmp_path / "t.parquet", columns={"X": ["f1", "nope"]})
    with pytest.raises(TypeError, match=r"columns\['X'\] must be a column name or a non-empty list"):
        ParquetSource(tmp_path / "t.parquet", columns={"X": []})
    table = pa.table({"a": pa.array(np.arange(4.0)), "v": pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(8)), 2),
                      "s": pa.array(["p", "q", "r", "t"])})
    pq.write_table(table, str(tmp_path / "m.parquet"))
    # Refused when the source is created, from the file's schema (issue 34, item 12: it used to
    # be refused only at the first read), naming the input, the column and its type.
    for col, what in (("v", r"fixed_size_list<\w+: double>\[2\]"), ("s", "string")):
        with pytest.raises(ValueError, match=rf"input 'X' stacks column '{col}', which is {what} in .*m.parquet'"
                                             rf": a stacked input takes scalar numeric columns; name it alone"):
            ParquetSource(tmp_path / "m.parquet", columns={"X": ["a", col]})
    assert ParquetSource(tmp_path / "m.parquet", columns={"X": ["a"], "s": "s"}).columns == {"X": ["a"], "s": "s"}


@pytest.fixture
def onnx_models():
    pytest.importorskip("onnx")
    import models
    return models


def test_float64_columns_stack_into_a_float32_input_with_cast_converted_as_they_are_copied(tmp_path, onnx_models):
    write_features(tmp_path / "t.parquet", 400, k=4)
    sess = onnx_models.session(onnx_models.linear_model(in_dim=4))
    src = ParquetSource(tmp_path / "t.parquet", columns={"x": "f*"})
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(sess, ["x"], src, 64, num_worker_threads=1, coordinator=coord, cast=True)
    with coord:
        ys = [coord.feed("train").run() for _ in range(6)]
    x = expected_stack(np.arange(384), ["f0", "f1", "f2", "f3"]).astype(np.float32)
    np.testing.assert_allclose(np.concatenate([y[0] for y in ys]), sess.run(None, {"x": x})[0], rtol=1e-6)
    # The source made float32 itself, in one pass: what it returns is what the session takes.
    src._targets, src._as_column = {"x": np.dtype(np.float32)}, set()
    chunk = src._read(0, np.arange(64), 0)
    assert chunk[0].dtype == np.float32 and chunk[0].flags.c_contiguous
    # without cast=True the validator refuses float64, naming the remedy
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(sess, ["x"], ParquetSource(tmp_path / "t.parquet", columns={"x": "f*"}), 64,
                                   num_worker_threads=1, coordinator=coord)
    with coord, pytest.raises(feeder.InputValidationError, match=r"dtype float32, got dtype float64 \(cast=True"):
        coord.feed("train").run()


def test_a_cast_that_would_overflow_is_refused_naming_the_column(tmp_path, onnx_models):
    big = np.ones(10)
    big[3] = 1e39
    pq.write_table(pa.table({"a": pa.array(np.ones(10)), "b": pa.array(big), "c": pa.array(np.ones(10)),
                             "d": pa.array(np.ones(10))}), str(tmp_path / "t.parquet"))
    sess = onnx_models.session(onnx_models.linear_model(in_dim=4))
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(sess, ["x"], ParquetSource(tmp_path / "t.parquet", columns={"x": ["a", "b", "c",
                                                                                                    "d"]}),
                                   5, num_worker_threads=1, coordinator=coord, cast=True)
    with coord, pytest.raises(feeder.InputValidationError, match=r"column 'b' \(input 'x'\) .*finite values that do "
                                                                 r"not fit float32"):
        coord.feed("train").run()


def test_a_scalar_column_feeds_an_n_by_1_input_reshaped_without_a_copy(tmp_path, onnx_models):
    write_features(tmp_path / "t.parquet", 200, k=3, dtype=np.float32, names=["f1", "f2", "f3"])
    sess = onnx_models.session(onnx_models.column_inputs_model(("a", "b", "c")))
    src = ParquetSource(tmp_path / "t.parquet", columns={"a": "f1", "b": "f2", "c": "f3"})
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(sess, None, src, 50, num_worker_threads=1, coordinator=coord)
    with coord:
        ys = np.concatenate([coord.feed("train").run()[0] for _ in range(4)])
    ids = np.arange(200)
    want = (ids + 0.1) * 1 + (ids + 0.2) * 2 + (ids + 0.3) * 3
    np.testing.assert_allclose(ys[:, 0], want, rtol=1e-5)
    chunk = src._read(0, np.arange(64), 0)
    assert chunk[0].shape == (64, 1) and chunk[0].base is not None  # a view of the column, not a copy


@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_a_filter_keeps_the_n_by_1_reshape_and_the_stacking_cast(tmp_path, onnx_models, mode):
    # A filter passes the columns on as they are: what the session declares for them still reaches
    # the ParquetSource under it (scalar columns used to arrive rank 1, refused for [N, 1] inputs).
    from utils import workers

    write_features(tmp_path / "t.parquet", 200, k=3, dtype=np.float32, names=["f1", "f2", "f3"])
    sess = onnx_models.session(onnx_models.column_inputs_model(("a", "b", "c")))
    src = ParquetSource(tmp_path / "t.parquet", columns={"a": "f1", "b": "f2", "c": "f3"})
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(sess, None, src.filter(lambda d: d["a"][:, 0] >= 100), 25, coordinator=coord,
                                   **workers(mode, 2))
    with coord:
        ys = np.concatenate([coord.feed("train").run()[0] for _ in range(4)])
    ids = np.sort(np.round((ys[:, 0] - 1.4) / 6).astype(int))  # y = 6 id + 1.4
    assert ids.tolist() == list(range(100, 200))
    # float64 columns stacked under a filter are cast as they are copied (cast=True), as without it
    write_features(tmp_path / "x.parquet", 256, k=4)
    src = ParquetSource(tmp_path / "x.parquet", columns={"x": "f*"}).filter(lambda d: d["x"][:, 0] >= 0)
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(onnx_models.session(onnx_models.linear_model(in_dim=4)), ["x"], src, 32,
                                   coordinator=coord, cast=True, **workers(mode, 2))
    with coord:
        assert sum(len(coord.feed("train").run()[0]) for _ in range(8)) == 256
        assert src.wrapped._targets == {"x": np.dtype(np.float32)}


def test_map_over_a_parquet_source_without_columns_sees_every_column(tmp_path):
    write_features(tmp_path / "t.parquet", 120, k=3)
    seen = []

    def fn(d):
        seen.append(sorted(d))
        return {"total": d["f0"] + d["f1"] + d["f2"], "id": d["id"]}

    src = ParquetSource(tmp_path / "t.parquet", shuffle=True).map(fn).filter(lambda d: d["id"] % 2 == 0)
    got, state = consume(src, inputs=["total", "id"], workers=2)
    ids = np.concatenate([b["id"] for b in got])
    assert sorted(ids.tolist()) == list(range(0, 120, 2)) and state["rows_filtered"] == 60
    np.testing.assert_allclose(np.concatenate([b["total"] for b in got]), 3 * ids + 0.3)
    assert seen and all(s == ["f0", "f1", "f2", "id"] for s in seen)
