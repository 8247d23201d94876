"""The PadRebatcher and Ragged alone (issue 29, items 3 and 4): every row at its place with its
length, masks exact, pads equal the value, shapes rounded up, each row's bytes written once, length
windows that sort and never lose or repeat a row."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feeder.padding import MAX_PIECES, ByteRing, PadInput, PadRebatcher
from feeder.ragged import Ragged, dense_as_ragged


def pad_input(index=0, value=0, fixed=(None,), mask_dtype=bool, name="ids"):
    return PadInput(index, name, value, fixed, f"{name}_mask", np.dtype(mask_dtype))


def make_rows(rng, n, start, trailing=(), max_len=9, vary_trailing=False):
    """Rows start..start+n-1: row k holds values 1000*k + 1, 1000*k + 2, ... (nothing is the pad)."""
    rows = []
    for k in range(start, start + n):
        length = int(rng.integers(0, max_len + 1))
        tail = tuple(int(rng.integers(1, 4)) for _ in trailing) if vary_trailing else trailing
        size = length * int(np.prod(tail, dtype=np.int64))
        rows.append((1000 * k + 1 + np.arange(size, dtype=np.int64)).reshape((length,) + tail))
    return rows


def as_form(rows, form, rng):
    """The same rows as a fetch function may hand them over."""
    if form == "list":
        return Ragged.from_rows(rows)
    if form == "ragged":
        return Ragged(np.concatenate(rows), np.cumsum([0] + [len(r) for r in rows]))
    if form == "shuffled":  # a Ragged whose rows lie here and there in its values (as after a shuffle)
        perm = rng.permutation(len(rows))
        inv = np.argsort(perm)
        stored = Ragged(np.concatenate([rows[i] for i in perm]), np.cumsum([0] + [len(rows[i]) for i in perm]))
        return stored[inv]
    raise AssertionError(form)


def check_batch(batch, rows_by_id, value, multiple, fixed=None, mask_at=2, varies=None):
    """``varies``: the axes of the rows on which rows of this rebatcher differed in the batches
    checked before (updated here): with ``multiple``, those axes (and the one axis of 1-d rows)
    are rounded up, the others keep the rows' one size (issue 34, item 3)."""
    ids_b, label, mask = batch[0], batch[1], batch[mask_at]
    assert mask.shape == ids_b.shape and mask.dtype == bool
    n = len(label)
    assert ids_b.shape[0] == n
    for r in range(n):
        row = rows_by_id[int(label[r])]
        region = (r,) + tuple(slice(0, d) for d in row.shape)
        assert np.array_equal(ids_b[region], row)
        expect = np.zeros(ids_b.shape[1:], bool)
        expect[region[1:]] = True
        assert np.array_equal(mask[r], expect)
    assert (ids_b[~mask] == value).all()
    shapes = np.array([rows_by_id[int(k)].shape for k in label]).reshape(n, ids_b.ndim - 1)
    varies = set() if varies is None else varies
    if n:
        varies.update(np.flatnonzero((shapes != shapes[0]).any(axis=0)).tolist())
    for j, d in enumerate(ids_b.shape[1:]):
        if fixed is not None and fixed[j] is not None:
            assert d == fixed[j]
        else:
            longest = int(shapes[:, j].max()) if n else 0
            m = (multiple or 1) if ids_b.ndim == 2 or j in varies else 1
            assert d == -(-longest // m) * m


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(0, 12), max_size=14), batch_size=st.integers(1, 9),
       multiple=st.sampled_from([None, 1, 3, 8]), window=st.sampled_from([None, 0, 1, 3]),
       forms=st.lists(st.sampled_from(["list", "ragged", "shuffled", "dense"]), min_size=14, max_size=14),
       value=st.sampled_from([0, -1, 7]), trailing=st.sampled_from([(), (2,), "vary"]), seed=st.integers(0, 99),
       ring=st.booleans())
def test_property_every_row_at_its_place_masks_exact_pads_and_shapes(sizes, batch_size, multiple, window, forms,
                                                                    value, trailing, seed, ring):
    rng = np.random.default_rng(seed)
    win = None if window is None else batch_size * max(1, window)
    rb = PadRebatcher(batch_size, [0, 0], [pad_input(value=value, fixed=(None,) * (1 if trailing == () else 2))],
                      multiple=multiple, window=win, ring=ByteRing(2) if ring else None)
    rows_by_id = {}
    start = 0
    batches = []
    varies = set()
    for size, form in zip(sizes, forms):
        rows = make_rows(rng, size, start, trailing=(2,) if trailing == "vary" else trailing,
                         vary_trailing=trailing == "vary")
        for k, r in enumerate(rows):
            rows_by_id[start + k] = r
        label = np.arange(start, start + size, dtype=np.int64)
        if trailing == "vary" and form in ("ragged", "shuffled"):
            form = "list"  # values + offsets cut rows along their first axis only
        if form == "dense":  # rows of one shape in this chunk: a plain array
            if not size:
                continue
            shape = rows[0].shape
            rows = [np.resize(r, shape) if r.shape != shape else r for r in rows]
            rows = [(1000 * (start + k) + 1 + np.arange(r.size)).reshape(shape) for k, r in enumerate(rows)]
            for k, r in enumerate(rows):
                rows_by_id[start + k] = r
            chunk = [np.stack(rows), label]
        else:
            chunk = [as_form(rows, form, rng) if rows else Ragged.from_rows([]), label]
        start += size
        rb.add(chunk)
        held_before = rb.pending_rows
        while (b := rb.pop()) is not None:
            assert len(b[1]) == batch_size
            check_batch(b, rows_by_id, value, multiple, varies=varies)
            batches.append([a.copy() for a in b])
        if win is not None:  # memory: the window, plus the chunk just added
            assert rb.pending_rows <= max(win, batch_size) + size + batch_size
        assert rb.pending_rows <= held_before
    rb.end_of_data()
    while (b := rb.pop()) is not None:
        assert len(b[1]) == batch_size
        check_batch(b, rows_by_id, value, multiple, varies=varies)
        batches.append([a.copy() for a in b])
    if (b := rb.flush()) is not None:
        assert 0 < len(b[1]) < batch_size
        check_batch(b, rows_by_id, value, multiple, varies=varies)
        batches.append(b)
    assert rb.pending_rows == 0 and rb.flush() is None
    seen = [int(k) for b in batches for k in b[1]]
    assert sorted(seen) == list(range(start))  # every row once
    if win is None:
        assert seen == list(range(start))  # without a window rows keep their order
    source_bytes = sum(r.nbytes for r in rows_by_id.values()) + 8 * start
    assert rb.copied_bytes == source_bytes  # each byte of each row written once, nothing else copied


def test_window_sorts_rows_by_length_and_cuts_padding():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(3.5, 1.0, 4096).astype(int), 1, 512)
    chunks = [[Ragged(np.ones(int(lengths[i:i + 64].sum()), np.int64), np.cumsum([0, *lengths[i:i + 64]])),
               np.arange(i, i + 64)] for i in range(0, 4096, 64)]

    def padded(window):
        rb = PadRebatcher(64, [0, 0], [pad_input()], window=window)
        for c in chunks:
            rb.add(c)
            while rb.pop() is not None:
                pass
        rb.end_of_data()
        while rb.pop() is not None:
            pass
        return rb.padded_elements, rb.real_elements

    plain, real = padded(None)
    windowed, real_w = padded(1024)
    assert real == real_w == lengths.sum()
    assert plain >= 3 * windowed  # the target: >= 3x fewer padded positions


def test_window_holds_rows_as_held_and_flushes_at_end():
    rb = PadRebatcher(2, [0, 0], [pad_input()], window=6)
    rows = [np.arange(1, n + 1) for n in (5, 1, 4, 2, 3)]
    rb.add([Ragged.from_rows(rows), np.arange(5)])
    assert rb.pending_rows == 5 and not rb.has_batch() and rb.pop() is None  # the window is not full
    rb.end_of_data()
    assert rb.has_batch()
    first, second = rb.pop(), rb.pop()
    # the oldest whole batches (rows 0-3, lengths 5 1 4 2) sorted: lengths 1, 2 then 4, 5
    assert sorted(first[1].tolist()) == [1, 3] and sorted(second[1].tolist()) == [0, 2]
    assert first[0].shape == (2, 2) and second[0].shape == (2, 5)
    assert rb.pop() is None and rb.pending_rows == 1
    last = rb.flush()  # the newest row, which made no whole batch
    assert last[1].tolist() == [4] and last[0].tolist() == [[1, 2, 3]]


def test_window_leaves_the_newest_rows_for_the_next_window():
    # No row waits for ever: what a window cannot cut into whole batches are its newest rows.
    rb = PadRebatcher(2, [0, 0], [pad_input()], window=4)
    rb.add([Ragged.from_rows([np.ones(9, np.int64)] * 5), np.arange(5)])
    got = [rb.pop()[1].tolist() for _ in range(2)]
    assert sorted(sum(got, [])) == [0, 1, 2, 3] and rb.pending_rows == 1


def test_fixed_axes_and_trailing_axes():
    # (frames, 3) rows padded along frames; a session fixing frames at 6 pads every batch to 6.
    rows = [np.arange(n * 3).reshape(n, 3) + 1 for n in (2, 5, 1)]
    rb = PadRebatcher(3, [0, 0], [pad_input(value=-1, fixed=(6, None))])
    rb.add([Ragged(np.concatenate(rows), [0, 2, 7, 8]), np.arange(3)])
    b = rb.pop()
    assert b[0].shape == (3, 6, 3) and b[2].shape == (3, 6, 3)
    check_batch(b, dict(enumerate(rows)), -1, None, fixed=(6, None))


def test_mask_dtype_and_position_before_the_row_keys():
    rb = PadRebatcher(2, [0, 0, 0], [pad_input(mask_dtype=np.int64)], keyed=True)
    keys = np.array([10, 11], np.int64)
    rb.add([Ragged.from_rows([np.array([1]), np.array([2, 3])]), np.array([0, 1]), keys])
    ids, label, mask, got_keys = rb.pop()
    assert mask.dtype == np.int64 and mask.tolist() == [[1, 0], [1, 1]]
    assert got_keys.tolist() == [10, 11] and ids.tolist() == [[1, 0], [2, 3]]


def test_two_padded_inputs_get_a_mask_each():
    a = PadInput(0, "src", 0, (None,), "src_mask", np.dtype(bool))
    b = PadInput(1, "tgt", -100, (None,), "tgt_mask", np.dtype(bool))
    rb = PadRebatcher(2, [0, 0], [a, b])
    rb.add([Ragged.from_rows([np.array([1, 2, 3]), np.array([4])]),
            Ragged.from_rows([np.array([5]), np.array([6, 7])])])
    src, tgt, src_mask, tgt_mask = rb.pop()
    assert src.tolist() == [[1, 2, 3], [4, 0, 0]] and tgt.tolist() == [[5, -100], [6, 7]]
    assert src_mask.sum() == 4 and tgt_mask.sum() == 3


def test_buffers_are_reused_whatever_the_shape_and_never_while_held():
    ring = ByteRing(2)
    rb = PadRebatcher(4, [0, 0], [pad_input()], ring=ring)
    rng = np.random.default_rng(1)
    for _ in range(50):
        rows = [np.ones(int(rng.integers(1, 30)), np.int64) for _ in range(4)]
        rb.add([Ragged.from_rows(rows), np.arange(4)])
        b = rb.pop()
        del b  # the consumer lets go: the next batch may use the same bytes
    assert ring.allocations <= 3 * 3  # a few sets (grown to the longest), not one per batch
    kept = []
    for i in range(5):
        rb.add([Ragged.from_rows([np.full(3, i, np.int64)] * 4), np.arange(4)])
        kept.append(rb.pop())
    assert [int(b[0][0, 0]) for b in kept] == [0, 1, 2, 3, 4]  # none overwritten while held


def test_set_batch_size_cuts_windowed_batches_again():
    rb = PadRebatcher(4, [0, 0], [pad_input()], window=8)
    rb.add([Ragged.from_rows([np.ones(k + 1, np.int64) for k in range(8)]), np.arange(8)])
    assert rb.has_batch()
    rb.pop()
    rb.set_batch_size(2)  # the batch of 4 already cut goes back, to be cut in 2s
    got = []
    rb.end_of_data()
    while (b := rb.pop()) is not None:
        assert len(b[1]) == 2
        got += b[1].tolist()
    assert len(got) == 4 and rb.pending_rows == 0 and rb.flush() is None  # the 4 rows not handed out, in 2s


def test_many_tiny_chunks_are_compacted():
    rb = PadRebatcher(10_000, [0, 0], [pad_input()], window=None)
    for i in range(MAX_PIECES + 5):
        rb.add([Ragged.from_rows([np.array([i, i])]), np.array([i])])
    assert len(rb._pending) <= MAX_PIECES
    rb.end_of_data()
    b = rb.flush()
    assert b[1].tolist() == list(range(MAX_PIECES + 5)) and (b[0][:, 0] == b[1]).all()


def test_pad_whole_pads_one_chunk_as_one_batch():
    rb = PadRebatcher(100, [0, 0], [pad_input(value=9)])
    b = rb.pad_whole([Ragged.from_rows([np.array([1]), np.array([1, 2, 3])]), np.array([0, 1])], 2)
    assert b[0].tolist() == [[1, 9, 9], [1, 2, 3]] and rb.pending_rows == 0


# ---- Ragged -----------------------------------------------------------------------------------
def test_ragged_views_and_indexing_copy_no_values():
    values = np.arange(10)
    r = Ragged(values, [0, 3, 3, 10])
    assert len(r) == 3 and [x.tolist() for x in r] == [[0, 1, 2], [], [3, 4, 5, 6, 7, 8, 9]]
    assert np.shares_memory(r.row(2), values)
    sub = r[np.array([2, 0])]
    assert sub.values is r.values and [x.tolist() for x in sub] == [[3, 4, 5, 6, 7, 8, 9], [0, 1, 2]]
    assert not sub.is_contiguous() and r[0:2].is_contiguous()
    assert r.nbytes == 10 * values.itemsize and sub.nbytes == 10 * values.itemsize
    frames = Ragged(np.zeros((7, 4), np.float32), [0, 2, 7])
    assert frames.shapes.tolist() == [[2, 4], [5, 4]] and frames.ndim == 3


@pytest.mark.parametrize("bad, error", [
    ((np.arange(3), [0, 2, 1]), ValueError), ((np.arange(3), [0, 4]), ValueError),
    ((np.arange(3), [[0, 1]]), ValueError), ((np.array(["a"], object), [0, 1]), TypeError)])
def test_ragged_refuses_bad_offsets(bad, error):
    with pytest.raises(error):
        Ragged(*bad)


def test_ragged_from_rows_refuses_mixed_rows():
    with pytest.raises(ValueError, match="row 1"):
        Ragged.from_rows([np.zeros(2), np.zeros((2, 2))])
    with pytest.raises(ValueError, match="row 1"):
        Ragged.from_rows([np.zeros(2, np.int64), np.zeros(2, np.int32)])


def test_dense_as_ragged_is_a_view():
    a = np.arange(12).reshape(3, 4)
    r = dense_as_ragged(a)
    assert np.shares_memory(r.values, a) and r.shapes.tolist() == [[4]] * 3


# ---- issue 34, item 3: pad_to_multiple_of rounds the axes along which rows vary ----------------------------------
def test_a_multiple_rounds_the_axes_rows_vary_along_and_keeps_those_they_agree_on():
    """Frames [L, 80] with pad_to_multiple_of=64 came out (n, 64, 128); images [H, W, 3] with 4
    channels. Rounded: rows of one axis (always), and an axis on which rows of the feed have
    differed, in this batch or an earlier one; an axis on which every row so far agreed keeps its size."""
    frames = [np.ones((n, 80), np.float32) for n in (10, 37, 5)]
    rb = PadRebatcher(3, [0, 0], [pad_input(fixed=(None, None))], multiple=64)
    rb.add([Ragged(np.concatenate(frames), np.cumsum([0, 10, 37, 5])), np.arange(3)])
    assert rb.pop()[0].shape == (3, 64, 80)
    images = [np.ones((h, w, 3), np.uint8) for h, w in ((30, 40), (50, 20))]
    rb = PadRebatcher(2, [0, 0], [pad_input(fixed=(None, None, None))], multiple=8)
    rb.add([Ragged.from_rows(images), np.arange(2)])
    assert rb.pop()[0].shape == (2, 56, 40, 3)
    # the same lengths in one batch: its axis is rounded once rows of the feed have differed on it...
    rb.add([Ragged.from_rows([np.ones((9, 13, 3), np.uint8)] * 2), np.arange(2)])
    assert rb.pop()[0].shape == (2, 16, 16, 3)
    # ... and, for rows of one axis (token ids), always
    rb = PadRebatcher(2, [0, 0], [pad_input()], multiple=8)
    rb.add([Ragged.from_rows([np.arange(1, 6)] * 2), np.arange(2)])
    ids, _, mask = rb.pop()
    assert ids.shape == mask.shape == (2, 8) and mask.sum() == 10
    # a batch before any row differed along an axis keeps its size there: nothing says it varies
    rb = PadRebatcher(2, [0, 0], [pad_input(fixed=(None, None))], multiple=8)
    rb.add([Ragged.from_rows([np.ones((5, 3))] * 2), np.arange(2)])
    assert rb.pop()[0].shape == (2, 5, 3)


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 12), max_size=12), batch_size=st.integers(1, 7),
       multiple=st.sampled_from([None, 4]), window=st.sampled_from([None, 2]), seed=st.integers(0, 99),
       order=st.randoms(use_true_random=False), keyed=st.booleans())
def test_property_pad_plans_executed_in_any_order_are_the_batches_pop_gives(sizes, batch_size, multiple, window,
                                                                           seed, order, keyed):
    """As the Rebatcher's (issue 33): a padded batch planned under the feed's lock and written later,
    in any order, is the batch pop() gives; the figures are counted when it is planned."""
    def make():
        return PadRebatcher(batch_size, [0, 0], [pad_input()], multiple=multiple,
                            window=None if window is None else batch_size * window, ring=ByteRing(2), keyed=keyed)

    popper, planner = make(), make()
    rng = np.random.default_rng(seed)
    expected, plans, start = [], [], 0
    for size in sizes:
        rows = make_rows(rng, size, start)
        label = np.arange(start, start + size, dtype=np.int64)
        start += size
        for rb in (popper, planner):
            rb.add([Ragged.from_rows(rows) if rows else Ragged.from_rows([]), label])
        while (b := popper.pop()) is not None:
            expected.append([a.copy() for a in b])
        while (p := planner.plan()) is not None:
            planner.buffers(p)
            plans.append(p)
    for rb in (popper, planner):
        rb.end_of_data()
    while (b := popper.pop()) is not None:
        expected.append([a.copy() for a in b])
    while (p := planner.plan()) is not None:
        planner.buffers(p)
        plans.append(p)
    if (b := popper.flush()) is not None:
        expected.append([a.copy() for a in b])
    if (p := planner.plan_flush()) is not None:
        planner.buffers(p, use_ring=False)
        plans.append(p)
    assert len(plans) == len(expected)
    got = [None] * len(plans)
    for i in order.sample(range(len(plans)), len(plans)):
        got[i] = [a.copy() for a in plans[i].execute()]
    for g, e in zip(got, expected):
        assert len(g) == len(e) and all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(g, e))
    for attr in ("copied_bytes", "real_elements", "padded_elements", "copied_batches"):
        assert getattr(planner, attr) == getattr(popper, attr), attr
