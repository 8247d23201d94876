"""The Rebatcher alone: exact batches, rows in order, nothing lost or duplicated, one copy per byte."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feeder.rebatcher import BufferRing, Rebatcher


def chunk(start, n, axis=0, width=3):
    """Rows start..start+n-1: ids as input 0, ids repeated across `width` as input 1 (batch axis `axis`)."""
    ids = np.arange(start, start + n, dtype=np.int64)
    wide = np.repeat(ids[:, None], width, axis=1).astype(np.float32)
    if axis == 1:
        wide = np.ascontiguousarray(wide.T)
    return [ids, wide]


def drain(rb, flush=True):
    out = []
    while (b := rb.pop()) is not None:
        out.append([a.copy() for a in b])
    if flush and (b := rb.flush()) is not None:
        out.append([a.copy() for a in b])
    return out


def test_exact_batches_across_chunks():
    rb = Rebatcher(4, [0, 0])
    rb.add(chunk(0, 3))
    assert rb.pop() is None
    rb.add(chunk(3, 6))
    batches = drain(rb, flush=False)
    assert [b[0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rb.pending_rows == 1
    assert rb.flush()[0].tolist() == [8]
    assert rb.pending_rows == 0 and rb.flush() is None


def test_whole_batch_inside_one_chunk_is_a_view_not_a_copy():
    rb = Rebatcher(4, [0, 0])
    c = chunk(0, 8)
    rb.add(c)
    b = rb.pop()
    assert np.shares_memory(b[0], c[0]) and np.shares_memory(b[1], c[1])
    assert rb.zero_copy_batches == 1 and rb.copied_bytes == 0


def test_spanning_batch_is_copied_once_into_a_reused_buffer():
    ring = BufferRing(2)
    rb = Rebatcher(4, [0, 0], ring)
    for i in range(20):
        rb.add(chunk(i * 3, 3))
        while rb.pop() is not None:
            pass  # the consumer lets go at once: the ring may reuse the buffer
    assert ring.allocations == 1  # each batch was dropped before the next: one buffer serves all
    assert rb.copied_bytes == rb.copied_batches * 4 * (8 + 12)


def test_held_batch_is_never_overwritten():
    ring = BufferRing(2)
    rb = Rebatcher(2, [0, 0], ring)
    kept = []
    for i in range(10):
        rb.add(chunk(i, 1))
        while (b := rb.pop()) is not None:
            kept.append(b)  # a consumer keeping every batch, like list(feed)
    assert [b[0].tolist() for b in kept] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert ring.allocations == 5


def test_view_of_batch_keeps_it_alive():
    ring = BufferRing(1)
    rb = Rebatcher(2, [0], ring)
    rb.add([np.array([0])]), rb.add([np.array([1])])
    first = rb.pop()[0][:1]  # only a view survives
    rb.add([np.array([2])]), rb.add([np.array([3])])
    rb.pop()
    assert first.tolist() == [0]


def test_batch_axis_one():
    rb = Rebatcher(5, [0, 1])
    rb.add(chunk(0, 3, axis=1))
    rb.add(chunk(3, 4, axis=1))
    b = rb.pop()
    assert b[0].tolist() == [0, 1, 2, 3, 4]
    assert b[1].shape == (3, 5) and b[1][0].tolist() == [0, 1, 2, 3, 4]
    assert b[1].flags.c_contiguous


def test_batch_axis_one_within_a_chunk_is_made_contiguous():
    rb = Rebatcher(2, [1])
    rb.add([np.arange(12).reshape(3, 4)])
    b = rb.pop()[0]
    assert b.flags.c_contiguous and b.tolist() == [[0, 1], [4, 5], [8, 9]]


def test_set_batch_size_keeps_pending_rows():
    rb = Rebatcher(4, [0, 0])
    rb.add(chunk(0, 6))
    assert rb.pop()[0].tolist() == [0, 1, 2, 3]
    rb.set_batch_size(3)
    rb.add(chunk(6, 4))
    assert [b[0].tolist() for b in drain(rb)] == [[4, 5, 6], [7, 8, 9]]


def test_drop_discards_pending():
    rb = Rebatcher(4, [0, 0])
    rb.add(chunk(0, 3))
    assert rb.pending_nbytes == 3 * (8 + 12)
    assert rb.drop() == 3 and rb.pending_rows == 0


def test_rejects_misaligned_chunk_and_bad_batch_size():
    rb = Rebatcher(4, [0, 0])
    with pytest.raises(ValueError, match="row counts differ"):
        rb.add([np.zeros(3), np.zeros(4)])
    with pytest.raises(ValueError, match="expected 2 arrays"):
        rb.add([np.zeros(3)])
    with pytest.raises(ValueError):
        Rebatcher(0, [0])
    with pytest.raises(ValueError):
        rb.set_batch_size(True)


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), max_size=30), batch_size=st.integers(1, 17),
       axis=st.sampled_from([0, 1]), ring=st.sampled_from([None, 1, 3]),
       resize_at=st.one_of(st.none(), st.integers(0, 29)), new_size=st.integers(1, 17))
def test_property_every_row_once_in_order(sizes, batch_size, axis, ring, resize_at, new_size):
    rb = Rebatcher(batch_size, [0, axis], BufferRing(ring) if ring else None)
    start, out = 0, []
    for i, n in enumerate(sizes):
        if resize_at == i:
            rb.set_batch_size(new_size)
        rb.add(chunk(start, n, axis=axis))
        start += n
        while (b := rb.pop()) is not None:
            assert b[0].shape[0] == rb.batch_size  # every full batch is exact
            ids = b[0].copy()
            wide = b[1] if axis == 0 else b[1].T
            assert (wide == ids[:, None]).all()  # rows of both inputs stayed aligned
            out.append(ids)
    tail = rb.flush()
    if tail is not None:
        assert 0 < tail[0].shape[0] < rb.batch_size
        out.append(tail[0].copy())
    got = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    assert got.tolist() == list(range(start))  # nothing lost, duplicated or reordered


def test_reorder_lets_a_whole_batch_overtake_short_pieces():
    rb = Rebatcher(4, [0, 0], reorder=True)
    rb.add(chunk(0, 1))           # a short piece, then an assembled batch, then another short piece
    whole = chunk(1, 4)
    rb.add(whole)
    rb.add(chunk(5, 3))
    b = rb.pop()
    assert b[0].tolist() == [1, 2, 3, 4] and np.shares_memory(b[0], whole[0])  # no copy
    assert rb.pop()[0].tolist() == [0, 5, 6, 7]  # the short pieces combine, in their order
    assert rb.pending_rows == 0


def test_without_reorder_rows_keep_their_order():
    rb = Rebatcher(4, [0, 0])
    rb.add(chunk(0, 1)), rb.add(chunk(1, 4)), rb.add(chunk(5, 3))
    assert [b[0].tolist() for b in drain(rb)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_take_pieces_up_to_a_limit_splits_without_copying():
    rb = Rebatcher(10, [0, 0])
    a, b = chunk(0, 3), chunk(3, 4)
    rb.add(a), rb.add(b)
    pieces = rb.take_pieces(5)
    assert [n for n, _ in pieces] == [3, 2]
    assert pieces[1][1][0].tolist() == [3, 4] and np.shares_memory(pieces[1][1][0], b[0])
    assert rb.pending_rows == 2 and rb.flush()[0].tolist() == [5, 6]


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_, np.complex64, np.uint8])
def test_concatenate_into_equals_numpy(dtype):
    from feeder.rebatcher import SMALL_COPY_BYTES, concatenate_into

    rng = np.random.default_rng(0)
    big_rows = SMALL_COPY_BYTES // (16 * np.dtype(dtype).itemsize) + 3  # one piece above the small-copy bound
    sizes = [1, 3, big_rows, 2]
    pieces = [(rng.standard_normal((n, 16)) * 100).astype(dtype) for n in sizes]
    pieces[1] = np.asfortranarray(pieces[1])  # not C-contiguous: copied by numpy
    out = np.empty((sum(sizes), 16), dtype)
    concatenate_into(out, pieces, 0)
    np.testing.assert_array_equal(out, np.concatenate(pieces))
    wide = [p.T for p in pieces]  # batch axis 1
    out1 = np.empty((16, sum(sizes)), dtype)
    concatenate_into(out1, wide, 1)
    np.testing.assert_array_equal(out1, np.concatenate(wide, axis=1))


def test_concatenate_into_object_arrays_keep_references():
    from feeder.rebatcher import concatenate_into

    pieces = [np.array(["a", "bb"], dtype=object), np.array(["ccc"], dtype=object)]
    out = np.empty(3, dtype=object)
    concatenate_into(out, pieces, 0)
    del pieces
    assert out.tolist() == ["a", "bb", "ccc"]


# ---- plan / execute (issue 33): the feed plans under its lock and writes outside it ------------------
@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), max_size=30), batch_size=st.integers(1, 17), axis=st.sampled_from([0, 1]),
       ring=st.booleans(), reorder=st.booleans(), order=st.randoms(use_true_random=False),
       flush=st.booleans())
def test_property_plans_executed_in_any_order_are_the_batches_pop_gives(sizes, batch_size, axis, ring, reorder,
                                                                       order, flush):
    """Plans made one after the other and executed later, in a random order (as several threads would),
    give exactly the batches pop() gives, in plan order; each plan's buffers are its own."""
    popper = Rebatcher(batch_size, [0, axis], BufferRing(2) if ring else None, reorder=reorder)
    planner = Rebatcher(batch_size, [0, axis], BufferRing(2) if ring else None, reorder=reorder)
    expected, plans, start = [], [], 0
    for n in sizes:
        popper.add(chunk(start, n, axis))
        planner.add(chunk(start, n, axis))
        start += n
        while (b := popper.pop()) is not None:
            expected.append([a.copy() for a in b])
        while (p := planner.plan()) is not None:
            planner.buffers(p)
            plans.append(p)
    if flush:
        if (b := popper.flush()) is not None:
            expected.append([a.copy() for a in b])
        if (p := planner.plan_flush()) is not None:
            planner.buffers(p, use_ring=False)
            plans.append(p)
    assert len(plans) == len(expected)
    assert planner.pending_rows == popper.pending_rows  # planned rows leave the pending rows at once
    got = [None] * len(plans)
    for i in order.sample(range(len(plans)), len(plans)):
        got[i] = [a.copy() for a in plans[i].execute()]
    for g, e in zip(got, expected):
        assert [a.tolist() for a in g] == [a.tolist() for a in e]
    outs = [id(a) for p in plans if p.out is not None for a in p.out]
    assert len(outs) == len(set(outs)), "two plans share a buffer"
    assert planner.copied_bytes == popper.copied_bytes
    assert planner.zero_copy_batches == popper.zero_copy_batches


def test_a_plan_holds_its_buffers_until_it_is_executed_and_dropped():
    ring = BufferRing(2)
    rb = Rebatcher(4, [0, 0], ring)
    for i in range(6):
        rb.add(chunk(i * 3, 3))
    plans = []
    while (p := rb.plan()) is not None:
        rb.buffers(p)
        plans.append(p)
    assert len(plans) == 4
    assert ring.allocations == 4  # none reused while a plan holds it
    assert [p.execute()[0].tolist() for p in reversed(plans)][::-1] == [list(range(k, k + 4)) for k in (0, 4, 8, 12)]
    with pytest.raises(RuntimeError, match="before it was given buffers"):
        rb.add(chunk(18, 4))
        rb.add(chunk(22, 1))
        unbuffered = rb.plan()
        rb.add(chunk(23, 3))
        rb.plan().execute()  # a view: needs no buffer
        unbuffered.execute()
