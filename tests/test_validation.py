"""Bad chunks: each raises InputValidationError in the consumer naming source, worker, input,
what was expected and what came; safe casts with cast=True (issue 4)."""
from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

from models import linear_model, session, string_identity_model, two_input_model  # noqa: E402
from utils import Const, workers  # noqa: E402

import feeder  # noqa: E402

GOOD_A = np.ones((3, 4), np.float32)
GOOD_K = np.zeros((3, 1), np.int64)


def failing_source(coord, chunk, sess=None, names=None, mode="threads", **kw):
    """Register a single worker returning ``chunk``, start, and return the error a consumer sees."""
    sess = session(two_input_model()) if sess is None else sess
    feeder.init_data_input_workers(sess, names, Const(chunk), 3, input_source_name="scoring",
                                   coordinator=coord, timeout=10, **workers(mode, 1), **kw)
    coord.start()
    feed = coord.feed("scoring")
    with pytest.raises(feeder.InputValidationError) as info:
        feed.next_batch()
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, feeder.FeederError)
    msg = str(err)
    assert "source 'scoring'" in msg and f"worker {feed.worker_ids[0]}" in msg
    # sticky: every later call raises it again
    with pytest.raises(feeder.InputValidationError):
        feed.next_batch()
    return msg


def test_missing_input_name(coord):
    msg = failing_source(coord, {"a": GOOD_A})
    assert "'k'" in msg and "missing" in msg


def test_unknown_input_name(coord):
    msg = failing_source(coord, {"a": GOOD_A, "k": GOOD_K, "extra": GOOD_K})
    assert "'extra'" in msg and "unknown" in msg


def test_wrong_number_of_arrays(coord, mode):
    msg = failing_source(coord, [GOOD_A, GOOD_K, GOOD_K], mode=mode)
    assert "expected 2 arrays" in msg and "got 3" in msg and "['a', 'k']" in msg


def test_non_array(coord):
    msg = failing_source(coord, [GOOD_A.tolist(), GOOD_K])
    assert "input 'a'" in msg and "numpy array" in msg and "list" in msg


def test_bare_array_instead_of_a_list(coord):
    msg = failing_source(coord, GOOD_A, sess=session(linear_model()))
    assert "input 'x'" in msg and "wrap it" in msg


def test_object_dtype(coord):
    obj = np.empty((3, 1), dtype=object)
    obj[:] = 1
    msg = failing_source(coord, [GOOD_A, obj])
    assert "input 'k'" in msg and "object" in msg and "int64" in msg


def test_a_none_in_an_object_array_is_a_null_said_so(coord, mode):
    # It was "expected a numeric array ... object arrays are accepted only for string inputs" for a
    # string array with a None in it, and a string input let the None through.
    obj = np.array([[1], [None], [3]], dtype=object)
    msg = failing_source(coord, [GOOD_A, obj], mode=mode)
    assert "input 'k'" in msg and "expected dtype int64 without nulls" in msg and "a null (None) in row 1" in msg


class StringsThenNone:
    def __init__(self):
        self.calls = 0

    def __call__(self, worker_id, batch_size):
        self.calls += 1
        return [np.array(["a", "b"] if self.calls == 1 else ["c", None], dtype=object)]


def test_a_none_among_strings_is_a_null_once_the_input_is_known_to_be_strings(coord):
    feeder.init_data_input_workers(None, ["s"], StringsThenNone(), 2, coordinator=coord, timeout=10,
                                   num_worker_threads=1)
    coord.start()
    feed = coord.feed("train")
    with pytest.raises(feeder.InputValidationError, match=r"input 's': expected strings without nulls, got a null "
                                                          r"\(None\) in row 1"):
        for _ in range(2):  # (the first batch may or may not be handed out before the failure)
            assert feed.next_batch()["s"].tolist() == ["a", "b"]


class PathsWithNone:
    def __init__(self):
        self.calls = 0

    def __call__(self, worker_id, batch_size):
        self.calls += 1
        if self.calls > 2:
            raise StopIteration
        return [np.ones((2, 1), np.float32), np.array(["a", "b"] if self.calls == 1 else ["c", None], dtype=object)]


def test_a_kept_array_may_hold_none_it_is_never_bound(coord):
    feeder.init_data_input_workers(None, ["x"], PathsWithNone(), 2, coordinator=coord, timeout=10,
                                   num_worker_threads=1, keep=["path"])
    with coord:
        assert [b["path"].tolist() for b in coord.feed("train")] == [["a", "b"], ["c", None]]


def test_mismatched_row_counts(coord, mode):
    msg = failing_source(coord, [GOOD_A, np.zeros((5, 1), np.int64)], mode=mode)
    assert "input 'k'" in msg and "3 rows" in msg and "5 rows" in msg


def test_wrong_dtype(coord, mode):
    msg = failing_source(coord, [GOOD_A.astype(np.float64), GOOD_K], mode=mode)
    assert "input 'a'" in msg and "expected dtype float32" in msg and "got dtype float64" in msg
    assert "cast=True" in msg


def test_wrong_rank(coord):
    msg = failing_source(coord, [np.ones((3, 4, 1), np.float32), GOOD_K])
    assert "input 'a'" in msg and "rank 2" in msg and "rank 3" in msg


def test_wrong_fixed_dimension(coord):
    msg = failing_source(coord, [np.ones((3, 5), np.float32), GOOD_K])
    assert "input 'a'" in msg and "dim 1 = 4" in msg and "(3, 5)" in msg


def test_wrong_fixed_batch_dimension_with_dont_rebatch(coord):
    msg = failing_source(coord, [np.ones((3, 4), np.float32)], sess=session(linear_model(batch=8)),
                         dont_rebatch=True)
    assert "input 'x'" in msg and "dim 0 = 8" in msg


def test_unsafe_cast_still_raises(coord, mode):
    msg = failing_source(coord, [GOOD_A, np.zeros((3, 1), np.float32)], cast=True, mode=mode)
    assert "input 'k'" in msg and "int64" in msg and "float32" in msg


def test_narrowing_cast_out_of_range_raises(coord):
    big = np.array([[0], [1], [2**40]], dtype=np.int64)
    from feeder.validation import ChunkValidator, InputSpec

    v = ChunkValidator("s", ["k"], [0], [InputSpec("k", np.dtype(np.int32), (None, 1))], cast=True,
                       dont_rebatch=False)
    assert v([np.array([[1], [2]], np.int64)], 0)[0].dtype == np.int32
    with pytest.raises(feeder.InputValidationError, match="values that fit int32"):
        v([big], 0)


def test_cast_true_converts_safe_casts_in_the_fetcher(coord, mode):
    sess = session(two_input_model())
    fetch = Const([np.ones((3, 4), np.float64), np.arange(3, dtype=np.int32)[:, None]])
    feeder.init_data_input_workers(sess, None, fetch, 4, cast=True, coordinator=coord, timeout=10, **workers(mode, 2))
    coord.start()
    batch = coord.feed("train").next_batch()
    assert batch["a"].dtype == np.float32 and batch["k"].dtype == np.int64
    (out,) = coord.feed("train").run()
    assert out.shape == (4, 4)


def test_sessionless_source_checks_against_its_first_chunk(coord):
    calls = iter(range(10))

    def fetch(worker_id, batch_size):
        return [np.zeros((2, 3), np.float32 if next(calls) == 0 else np.float64)]

    feeder.init_data_input_workers(None, ["x"], fetch, 2, num_worker_threads=1, coordinator=coord, timeout=10)
    coord.start()
    feed = coord.feed("train")
    with pytest.raises(feeder.InputValidationError, match="input 'x'.*float32 like the source's first chunk"):
        for _ in range(5):
            feed.next_batch()


def test_sessionless_shape_change_between_chunks(coord):
    calls = iter(range(10))

    def fetch(worker_id, batch_size):
        return [np.zeros((2, 3 if next(calls) == 0 else 4), np.float32)]

    feeder.init_data_input_workers(None, ["x"], fetch, 2, num_worker_threads=1, coordinator=coord, timeout=10)
    coord.start()
    with pytest.raises(feeder.InputValidationError, match=r"input 'x'.*\(\?, 3\).*\(2, 4\)"):
        for _ in range(5):
            coord.feed("train").next_batch()


def test_dont_rebatch_sessionless_allows_varying_shapes(coord):
    calls = iter(range(10**6))

    def fetch(worker_id, batch_size):
        return [np.zeros((2, 3 + next(calls) % 2), np.float32)]

    feeder.init_data_input_workers(None, ["x"], fetch, 2, num_worker_threads=1, dont_rebatch=True,
                                   coordinator=coord, timeout=10)
    coord.start()
    assert {coord.feed("train").next_batch()["x"].shape[1] for _ in range(4)} == {3, 4}


def test_zero_dimensional_array(coord):
    msg = failing_source(coord, [np.ones((), np.float32)], sess=session(linear_model()))
    assert "input 'x'" in msg and "rank" in msg


def test_zero_dimensional_array_after_good_chunks(coord):
    calls = iter(range(10))

    def fetch(worker_id, batch_size):
        return [np.ones((2, 3), np.float32) if next(calls) < 2 else np.ones((), np.float32)]

    feeder.init_data_input_workers(None, ["x"], fetch, 2, num_worker_threads=1, coordinator=coord, timeout=10)
    coord.start()
    with pytest.raises(feeder.InputValidationError, match="input 'x'.*rank"):
        for _ in range(5):
            coord.feed("train").next_batch()


@pytest.mark.parametrize("src, dst, value", [
    (np.int64, np.float16, 70000),      # above float16's max, 65504
    (np.float64, np.float32, 1e39),     # above float32's max
    (np.float64, np.float32, -1e39),
    (np.float32, np.float16, 1e5),
])
def test_cast_never_turns_a_finite_value_infinite(src, dst, value):
    """Issue 9, defect 3: integer targets were range-checked, float targets were not."""
    from feeder.validation import ChunkValidator, InputSpec

    v = ChunkValidator("s", ["x"], [0], [InputSpec("x", np.dtype(dst), (None, 1))], cast=True, dont_rebatch=False)
    ok = v([np.array([[1], [2]], src)], 0)[0]
    assert ok.dtype == dst and ok.tolist() == [[1], [2]]
    with pytest.raises(feeder.InputValidationError, match=f"input 'x'.*finite values that fit {np.dtype(dst)}"):
        v([np.array([[1], [value]], src)], 0)


@pytest.mark.parametrize("src, dst, exact", [(np.int64, np.float32, 2**24), (np.int32, np.float32, 2**24),
                                             (np.uint64, np.float64, 2**53), (np.int64, np.float16, 2**11)])
def test_cast_refuses_integers_the_float_input_cannot_hold_exactly(src, dst, exact):
    # cast=True converts "when the values fit": 2**24 + 1 became float32 2**24, an id or a count
    # silently changed. Integers up to 2**(mantissa bits + 1) in magnitude pass.
    from feeder.validation import ChunkValidator, InputSpec

    v = ChunkValidator("s", ["x"], [0], [InputSpec("x", np.dtype(dst), (None, 1))], cast=True, dont_rebatch=False)
    lo = 0 if np.dtype(src).kind == "u" else -exact
    ok = v([np.array([[lo], [exact]], src)], 3)[0]
    assert ok.dtype == dst and ok.tolist() == [[lo], [exact]]
    with pytest.raises(feeder.InputValidationError,
                       match=rf"source 's', worker 3, input 'x'.*integers {np.dtype(dst)} holds exactly.*{exact + 1}"):
        v([np.array([[1], [exact + 1]], src)], 3)
    assert v([np.array([[1], [2]], np.int16)], 3)[0].dtype == dst  # small integers of any type pass


def test_cast_of_padded_integer_rows_that_hold_no_value_converts_them():
    # The range checks took min() of no values: "zero-size array to reduction operation minimum".
    from feeder.ragged import Ragged
    from feeder.validation import ChunkValidator, InputSpec

    spec = InputSpec("x", np.dtype(np.float32), (None, None), pad=0)
    v = ChunkValidator("s", ["x"], [0], [spec], cast=True, dont_rebatch=False)
    for chunk in ([np.zeros(0, np.int64), np.zeros(0, np.int64)], np.zeros((2, 0), np.int64)):
        out = v((chunk,), 0)[0]
        assert out.dtype == np.float32 and len(out) == 2 and not (out.sizes().sum() if isinstance(out, Ragged)
                                                                    else out.size)
    spec = InputSpec("x", np.dtype(np.int32), (None, None), pad=0)
    v = ChunkValidator("s", ["x"], [0], [spec], cast=True, dont_rebatch=False)
    assert v(([np.zeros(0, np.int64)],), 0)[0].dtype == np.int32


def test_cast_keeps_infinities_and_nans_that_were_there():
    from feeder.validation import ChunkValidator, InputSpec

    v = ChunkValidator("s", ["x"], [0], [InputSpec("x", np.dtype(np.float32), (None, 1))], cast=True,
                       dont_rebatch=False)
    out = v([np.array([[np.inf], [-np.inf], [np.nan], [1.5]], np.float64)], 0)[0]
    assert np.isposinf(out[0, 0]) and np.isneginf(out[1, 0]) and np.isnan(out[2, 0]) and out[3, 0] == 1.5


def _consume_until_error(feeds, seconds=5.0):
    """Take batches from every feed in threads until each raises; returns (batches, errors)."""
    import threading

    got, errors, lock = [], [], threading.Lock()

    def consume(feed):
        try:
            for _ in range(10_000):
                b = feed.next_batch(timeout=seconds)
                with lock:
                    got.append(b)
        except feeder.FeederError as e:
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=consume, args=(f,)) for f in feeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got, errors


def test_replicas_share_one_validator_and_never_mix_dtypes(coord):
    """Issue 9, defect 1: each replica learned its own dtype, so feed A rebatched int64 chunks that
    only B had accepted: batches of both dtypes, 2**40 + 5 wrapped to 5, then a dead enqueuer."""
    big = 2**40 + 5

    def fetch_a(worker_id, batch_size):
        return [np.full((3, 1), 7, np.int32)]

    def fetch_b(worker_id, batch_size):
        return [np.full((3, 1), big, np.int64)]

    feeder.init_data_input_workers(None, ["k"], fetch_a, 4, num_worker_threads=1, input_source_name="s",
                                   coordinator=coord, timeout=5)
    feeder.init_data_input_workers(None, ["k"], fetch_b, 4, num_worker_threads=1, input_source_name="s",
                                   coordinator=coord, timeout=5)
    coord.start()
    got, errors = _consume_until_error(coord.feeds("s"))
    assert len({b["k"].dtype for b in got}) <= 1, "one source handed out batches of two dtypes"
    values = {int(v) for b in got for v in b["k"].ravel()}
    assert values <= {7} or values <= {big}, f"values from a chunk of the other dtype: {sorted(values)[:5]}"
    assert errors and all(isinstance(e, feeder.InputValidationError) for e in errors)
    assert "like the source's first chunk" in str(errors[0]) and "input 'k'" in str(errors[0])


def test_a_sessionless_replica_is_held_to_the_other_replicas_session(coord):
    """Issue 9, defect 1: with A on a float32 session and B sessionless sending float64, A's run()
    raised ONNX Runtime's own 'Unexpected input data type'."""
    sess = session(linear_model())

    def fetch_a(worker_id, batch_size):
        return [np.ones((3, 4), np.float32)]

    def fetch_b(worker_id, batch_size):
        return [np.ones((3, 4), np.float64)]

    feeder.init_data_input_workers(sess, None, fetch_a, 4, num_worker_threads=1, coordinator=coord, timeout=5)
    feeder.init_data_input_workers(None, ["x"], fetch_b, 4, num_worker_threads=1, coordinator=coord, timeout=5)
    b_worker = coord.feeds("train")[1].worker_ids[0]
    coord.start()
    a, b = coord.feeds("train")
    with pytest.raises(feeder.InputValidationError, match=f"worker {b_worker}, input 'x'.*float32.*float64"):
        for _ in range(100):
            a.run()
    with pytest.raises(feeder.InputValidationError):
        b.next_batch()


def test_replicas_whose_sessions_disagree_are_refused_at_registration(coord):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["N", 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    double_sess = session(model.SerializeToString())
    fetch = lambda w, b: [np.ones((3, 4), np.float32)]  # noqa: E731
    feeder.init_data_input_workers(session(linear_model()), None, fetch, 4, coordinator=coord)
    with pytest.raises(ValueError, match="input 'x'.*float32.*float64.*replicas"):
        feeder.init_data_input_workers(double_sess, None, fetch, 4, coordinator=coord)
    with pytest.raises(ValueError, match="cast"):
        feeder.init_data_input_workers(None, ["x"], fetch, 4, coordinator=coord, cast=True)
    _ = onnx


def test_batch_buffers_never_cast_silently():
    from feeder.rebatcher import Rebatcher

    rb = Rebatcher(4, [0])
    rb.add([np.ones((2, 1), np.int32)])
    rb.add([np.full((2, 1), 2**40 + 5, np.int64)])
    with pytest.raises(TypeError):
        rb.pop()


@pytest.mark.parametrize("inputs", [1, 2])
def test_a_pickled_validator_keeps_its_fast_path(inputs):
    """Worker processes get the source's validator by pickle; its fast path compares dtypes by
    identity, so unpickled dtypes must be numpy's own objects again or every chunk is checked in full."""
    import pickle

    from feeder.validation import ChunkValidator, InputSpec

    names = ["x", "y"][:inputs]
    v = ChunkValidator("train", names, [0] * inputs, [InputSpec(n) for n in names], cast=False, dont_rebatch=False)
    chunk = [np.ones((4, 8), np.float32), np.zeros(4, np.int64)][:inputs]
    v.check(chunk, 0)  # learns dtype and shape
    assert v._fast is not None
    copy = pickle.loads(pickle.dumps(v))
    full = []
    original = ChunkValidator.__call__
    try:
        ChunkValidator.__call__ = lambda self, c, w: full.append(w) or original(self, c, w)
        arrays, rows = copy.check(chunk, 0)
    finally:
        ChunkValidator.__call__ = original
    assert rows == 4 and full == []


def test_object_arrays_of_strings_make_a_string_input_without_a_session(coord, mode):
    """The contract: an object dtype is bad "other than for a string input". Without a session the
    source's first chunk decides: an object array holding only str is a string input (Ray Data
    hands string columns so); one holding anything else is refused."""
    names = np.array([f"s{i}" for i in range(3)], dtype=object)
    feeder.init_data_input_workers(None, ["a", "t"], Const([GOOD_A, names]), 4, coordinator=coord, timeout=10,
                                   **workers(mode, 1))
    coord.start()
    batch = coord.feed("train").next_batch()
    assert list(batch["t"]) == ["s0", "s1", "s2", "s0"] and batch["a"].shape == (4, 4)


def test_object_arrays_of_anything_else_are_still_refused_without_a_session(coord, mode):
    mixed = np.array(["s", 1, 2.0], dtype=object)
    feeder.init_data_input_workers(None, ["a", "t"], Const([GOOD_A, mixed]), 4, coordinator=coord, timeout=10,
                                   **workers(mode, 1))
    coord.start()
    with pytest.raises(feeder.InputValidationError, match="input 't'.*object"):
        coord.feed("train").next_batch()


class _Texts:
    """Chunks of 3 strings, each chunk ``make(call)``: text that grows from call to call."""

    def __init__(self, make):
        self.make, self.calls = make, 0

    def __call__(self, worker_id, batch_size):
        self.calls += 1
        return [self.make([f"w{self.calls}-{j}" + "x" * (3 * self.calls) + "\u00e9" for j in range(3)])]


@pytest.mark.parametrize("form", ["bytes", "object bytes", "str", "object str"])
def test_a_string_session_input_reads_bytes_as_their_utf8_text(coord, mode, form):
    """ONNX Runtime read a bytes array (dtype S) as text running from one value into the next
    ('w2-0xxxxxxw2-1...'), and a bytes object as its repr ("b'cat'"): the feed decodes them."""
    make = {"bytes": lambda t: np.array([x.encode() for x in t]),
            "object bytes": lambda t: np.array([x.encode() for x in t], dtype=object),
            "str": np.array, "object str": lambda t: np.array(t, dtype=object)}[form]
    sess = session(string_identity_model())
    feeder.init_data_input_workers(sess, ["s"], _Texts(make), 4, coordinator=coord, timeout=10, **workers(mode, 1))
    with coord:
        feed = coord.feed("train")
        for _ in range(4):
            (out,), batch = feed.run(with_batch=True)
            assert list(out) == [str(x) for x in batch["s"]]
            assert all(x.startswith("w") and x.endswith("\u00e9") and x.count("w") == 1 for x in out), list(out)


@pytest.mark.parametrize("chunk, got", [
    (np.array([b"ok", b"\xff\xfe"]), "bytes that are not UTF-8 in row 1"),
    (np.array(["ok", b"\xff"], dtype=object), "bytes that are not UTF-8 in row 1"),
    (np.array(["ok", "fine", 7], dtype=object), "int 7 in row 2"),
    (np.array(["ok", 2.5], dtype=object), "float 2.5 in row 1"),
])
def test_a_string_session_input_refuses_what_is_not_text_naming_the_row(coord, mode, chunk, got):
    sess = session(string_identity_model())
    feeder.init_data_input_workers(sess, ["s"], Const([chunk]), 4, input_source_name="scoring", coordinator=coord,
                                   timeout=10, **workers(mode, 1))
    coord.start()
    with pytest.raises(feeder.InputValidationError) as info:
        coord.feed("scoring").next_batch()
    msg = str(info.value)
    assert "source 'scoring'" in msg and "input 's'" in msg and got in msg, msg


def test_without_a_session_bytes_stay_bytes(coord):
    feeder.init_data_input_workers(None, ["s"], Const([np.array([b"a", b"bc", b"d"])]), 4, coordinator=coord,
                                   timeout=10, num_worker_threads=1)
    with coord:
        batch = coord.feed("train").next_batch()
    assert batch["s"].dtype.kind == "S" and list(batch["s"]) == [b"a", b"bc", b"d", b"a"]


@pytest.mark.parametrize("column, got", [
    (np.array([b"\xff", b"d"]), "bytes that are not UTF-8 in row 1"),
    (np.array([5, "d"], dtype=object), "int 5 in row 1"),
    (np.array([None, "d"], dtype=object), "a null (None) in row 1"),
])
def test_a_string_input_batched_on_axis_1_names_the_row_along_that_axis(coord, column, got):
    chunk = np.empty((2, 2), dtype=object if column.dtype == object else "S2")
    chunk[:, 0] = [b"a", b"c"] if chunk.dtype.kind == "S" else ["a", "c"]
    chunk[:, 1] = column
    sess = session(string_identity_model((2, "N")))
    feeder.init_data_input_workers(sess, ["s"], Const([chunk]), 2, batch_columns=[1], coordinator=coord,
                                   timeout=10, num_worker_threads=1)
    coord.start()
    with pytest.raises(feeder.InputValidationError, match=re.escape(got)):
        coord.feed("train").next_batch()
