"""source.map(fn) and source.filter(pred): in the fetch path, row keys kept, filtered rows counted
and recorded as done, every promise of the wrapped source kept (issue 29, item 1)."""
from __future__ import annotations

import json
import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from utils import CountingSource, workers

import feeder
from feeder.errors import FetchError, InputValidationError
from feeder.sources import ArraySource
from feeder.sources.base import SKIP
from feeder.sources.transform import TransformedSource


def run(source, inputs=("x", "id"), *, workers_=2, procs=0, replicas=1, ordered=False, batch_size=16, take=None,
        resume=None, timeout=30.0):
    """Consume a source with a private coordinator: (batches as dicts, state, metrics of the first feed)."""
    coord = feeder.GlobalCoordinator(join_timeout=3.0)
    try:
        for _ in range(replicas):
            kw = dict(num_worker_processes=procs) if procs else dict(num_worker_threads=workers_)
            feeder.init_data_input_workers(None, list(inputs), source, batch_size, coordinator=coord,
                                           ordered=ordered, resume_from=resume, **kw)
        coord.start()
        feeds = coord.feeds("train")
        got, live, i = [], list(feeds), 0
        while live and (take is None or len(got) < take):
            f = live[i % len(live)]
            try:
                got.append({k: v.copy() for k, v in f.next_batch(timeout=timeout).items()})
                i += 1
            except StopIteration:
                live.remove(f)
        state = coord.state_dict("train")
        json.dumps(state)
        metrics = feeds[0].metrics()
        return got, state, metrics
    finally:
        coord.stop()


def ids_of(batches, key="id"):
    return [int(v) for b in batches for v in b[key]]


def table(n):
    return {"x": np.arange(n, dtype=np.float32).reshape(n, 1), "id": np.arange(n, dtype=np.int64)}


def not_every_third(d):
    return d["id"] % 3 != 0


# ---- every kept row once, the filtered ones counted ---------------------------------------------------------
def test_map_and_filter_deliver_every_kept_row_once_and_count_the_filtered(mode):
    n = 3000
    src = ArraySource(table(n), shuffle=True, seed=2, block_rows=97)
    mapped = src.map(lambda d: {"x": d["x"] * 2, "id": d["id"], "unused": d["id"] + 1}).filter(not_every_third)
    got, state, m = run(mapped, **({"procs": 2} if mode == "processes" else {}))
    ids = ids_of(got)
    kept = [i for i in range(n) if i % 3]
    assert sorted(ids) == kept
    x = np.concatenate([b["x"] for b in got]).ravel()
    np.testing.assert_array_equal(x, np.array(ids, np.float32) * 2)  # the map ran, rows and keys stayed together
    filtered = n - len(kept)
    assert m["rows_filtered"] == filtered and m["source_rows_filtered"] == filtered
    assert m["transform_s"] > 0 and m["rows"] == len(kept)
    # done: delivered or filtered, one range; counted apart
    assert state["delivered"] == [[0, n]]
    assert state["rows_delivered"] == len(kept) and state["rows_filtered"] == filtered


def test_a_chain_is_one_wrapper_with_its_steps_in_order():
    src = ArraySource(table(10))
    calls = []
    chain = (src.map(lambda d: (calls.append("m1"), {"x": d["x"] + 1, "id": d["id"]})[1])
             .filter(lambda d: (calls.append("f"), d["id"] > 2)[1])
             .map(lambda d: (calls.append("m2"), {"x": d["x"] * 10, "id": d["id"]})[1]))
    assert isinstance(chain, TransformedSource) and chain.wrapped is src
    assert [kind for kind, _ in chain.steps] == ["map", "filter", "map"]
    got, state, _ = run(chain, workers_=1)
    assert calls == ["m1", "f", "m2"]
    assert ids_of(got) == list(range(3, 10))
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in got]).ravel(), (np.arange(3, 10) + 1) * 10)
    assert [s[0] for s in state["definition"]["transforms"]] == ["map", "filter", "map"]


def test_the_functions_see_columns_without_the_row_keys_and_a_unit_all_filtered_is_skipped():
    seen = []
    src = ArraySource(table(100), block_rows=10)

    def pred(d):
        seen.append(sorted(d))
        return d["id"] >= 50  # the first five units are all dropped

    chain = src.filter(pred)
    got, state, m = run(chain, workers_=1)
    assert seen and all(s == ["id", "x"] for s in seen)
    assert ids_of(got) == list(range(50, 100)) and m["rows_filtered"] == 50
    assert state["delivered"] == [[0, 100]]
    # a unit whose rows all go is SKIP: nothing, no warning, no empty chunk
    bound = ArraySource(table(10), block_rows=10).filter(lambda d: d["id"] < 0)
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(None, ["x", "id"], bound, 4, num_worker_threads=1, coordinator=coord)
    with coord:
        assert list(coord.feed("train")) == []
        assert coord.feed("train").metrics()["empty_chunks"] == 0


def test_worker_processes_run_lambdas_and_closures(tmp_path):
    scale = 3.0
    src = ArraySource(table(500), block_rows=50).map(lambda d: {"x": d["x"] * scale, "id": d["id"]})
    got, _, m = run(src, procs=2)
    assert sorted(ids_of(got)) == list(range(500))
    x = np.concatenate([b["x"] for b in got]).ravel()
    np.testing.assert_array_equal(x, np.array(ids_of(got), np.float32) * 3)
    assert m["transform_s"] > 0


# ---- checkpoints ----------------------------------------------------------------------------------------
def test_a_resume_reads_neither_delivered_nor_filtered_rows_again(mode):
    n = 4000
    kw = {"procs": 2} if mode == "processes" else {}

    def make():
        return ArraySource(table(n), shuffle=True, seed=7, block_rows=100).filter(not_every_third)

    before, state, m1 = run(make(), take=20, **kw)
    assert state["rows_delivered"] == 20 * 16
    after, end, m2 = run(make(), resume=state, **kw)
    ids = ids_of(before) + ids_of(after)
    assert Counter(ids) == Counter(i for i in range(n) if i % 3)
    # every row was filtered once over both runs: none of the first run's filtered rows was read again
    assert state["rows_filtered"] + m2["rows_filtered"] == n // 3 + 1 == end["rows_filtered"]
    assert end["delivered"] == [[0, n]] and end["rows_delivered"] == len(ids)


def test_a_state_with_filtered_rows_stays_small():
    """Filtered keys are recorded as done when fetched: the state has holes only in the units in
    flight, never one per filtered row."""
    n = 60_000
    src = ArraySource(table(n), block_rows=1000).filter(lambda d: (d["id"] * 7919) % 10 < 5)  # half, scattered
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(None, ["x", "id"], src, 64, num_worker_threads=2, coordinator=coord,
                                   max_buffered_batches=4)
    with coord:
        feed = coord.feed("train")
        for _ in range(200):
            feed.next_batch(timeout=10)
        state = coord.state_dict("train")
    assert state["rows_filtered"] > 10_000
    assert len(state["delivered"]) < 2000  # units in flight only (a few, of 1000 rows, half filtered)


def test_a_state_of_the_source_without_its_steps_is_refused_naming_them():
    src = ArraySource(table(100))
    _, plain, _ = run(src, take=1)
    with pytest.raises(ValueError, match=r"transforms: the state has None, this source \[\['filter', "):
        run(ArraySource(table(100)).filter(not_every_third), resume=plain)
    _, filtered, _ = run(ArraySource(table(100)).filter(not_every_third), take=1)
    with pytest.raises(ValueError, match=r"transforms: the state has \[\['filter', .*not_every_third'\]\], this "
                                         r"source \[\['filter', .*not_every_third'\], \['map'"):
        run(ArraySource(table(100)).filter(not_every_third).map(lambda d: d), resume=filtered)
    with pytest.raises(ValueError, match="sample: the state has other contents"):  # the wrapped source is checked too
        other = {"x": np.ones((100, 1), np.float32), "id": np.arange(100)}
        run(ArraySource(other).filter(not_every_third), resume=filtered)


def test_an_ordered_resume_gives_the_batches_of_an_uninterrupted_run(mode):
    """Units dropped whole take their turn in the round-robin (SKIP), so an ordered run's chunks keep the
    order of the units, and a resume after the filtered keys were recorded continues it exactly."""
    n = 2400
    kw = {"procs": 3} if mode == "processes" else {"workers_": 3}

    def make():
        src = ArraySource(table(n), shuffle=True, seed=3, block_rows=60)
        return src.filter(lambda d: ((d["id"] // 60) % 4 != 1) & (d["id"] % 7 != 0)).map(
            lambda d: {"x": d["x"] + 0.5, "id": d["id"]})

    full, _, _ = run(make(), ordered=True, batch_size=25, **kw)
    for take in (3, 17):
        before, state, _ = run(make(), ordered=True, batch_size=25, take=take, **kw)
        after, _, _ = run(make(), ordered=True, batch_size=25, resume=state, **kw)
        assert [b["id"].tolist() for b in before + after] == [b["id"].tolist() for b in full]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 150), block=st.integers(1, 40), bs=st.integers(1, 20), workers_=st.integers(1, 3),
       replicas=st.integers(1, 2), shuffle=st.booleans(), epochs=st.integers(1, 2), ordered=st.booleans(),
       keep=st.floats(0, 1), mask_seed=st.integers(0, 1000), cut=st.floats(0, 1), seed=st.integers(0, 3))
def test_exactly_once_under_random_filters_across_a_checkpoint(n, block, bs, workers_, replicas, shuffle, epochs,
                                                               ordered, keep, mask_seed, cut, seed):
    rng = np.random.default_rng(mask_seed)
    keeps = rng.random(n) < keep  # the same rows dropped in every epoch and run

    def make():
        src = ArraySource(table(n), shuffle=shuffle, seed=seed, epochs=epochs, block_rows=block)
        return src.filter(lambda d: keeps[d["id"]])

    want = Counter({i: epochs for i in range(n) if keeps[i]})
    full, full_state, _ = run(make(), workers_=workers_, replicas=replicas, ordered=ordered, batch_size=bs)
    assert Counter(ids_of(full)) == want
    assert full_state["rows_delivered"] == sum(want.values())
    assert full_state.get("rows_filtered", 0) == (n - int(keeps.sum())) * epochs
    assert full_state["delivered"] == ([[0, n * epochs]] if n else [])
    take = int(cut * len(full))
    before, state, _ = run(make(), workers_=workers_, replicas=replicas, ordered=ordered, batch_size=bs, take=take)
    after, end, _ = run(make(), workers_=workers_, replicas=replicas, ordered=ordered, batch_size=bs, resume=state)
    assert Counter(ids_of(before) + ids_of(after)) == want
    assert end["delivered"] == full_state["delivered"] and end.get("rows_filtered", 0) == full_state.get(
        "rows_filtered", 0)
    if ordered and replicas == 1:
        assert [b["id"].tolist() for b in before + after] == [b["id"].tolist() for b in full]


# ---- what the functions must return ----------------------------------------------------------------------
def drop_a_row(d):
    return {"x": d["x"][1:], "id": d["id"][1:]}


@pytest.mark.parametrize("procs", [0, 2])
def test_a_map_that_changes_the_row_count_names_source_worker_and_function(procs):
    with pytest.raises(InputValidationError, match=r"source 'train', worker \d: input 'x': map function "
                                                   r"test_transform\.drop_a_row returned 99 rows \(shape \(99, 1\)\) "
                                                   r"for a chunk of 100 rows"):
        run(ArraySource(table(300), block_rows=100).map(drop_a_row), procs=procs)


def test_what_the_functions_return_is_checked_naming_them():
    def runs(chain, inputs=("x", "id")):
        return run(chain, inputs)

    with pytest.raises(InputValidationError, match=r"worker 0: input 'x': the steps \.map\(.*<lambda>.*\) made no 'x' "
                                                   r"\(they made \['y'\]\); the source's inputs are \['x', 'id'\]"):
        runs(ArraySource(table(50)).map(lambda d: {"y": d["x"]}))
    with pytest.raises(InputValidationError, match=r"map function .*<lambda> \(test_transform\.py:\d+\) returned "
                                                   r"list; it must return a dict"):
        runs(ArraySource(table(50)).map(lambda d: [d["x"], d["id"]]))
    with pytest.raises(InputValidationError, match=r"input 'x': map function .* returned int for it; it must "
                                                   r"return numpy arrays"):
        runs(ArraySource(table(50)).map(lambda d: {"x": 3, "id": d["id"]}))
    with pytest.raises(InputValidationError, match=r"input 'x': map function .* returned 49 rows \(list\) for a "
                                                   r"chunk of 50 rows"):
        runs(ArraySource(table(50)).map(lambda d: {"x": list(d["x"])[1:], "id": d["id"]}))
    # a list of rows has the right count: the validator judges it (not a padded input here: refused)
    with pytest.raises(InputValidationError, match=r"worker 0, input 'x': expected a numpy array"):
        runs(ArraySource(table(50)).map(lambda d: {"x": list(d["x"]), "id": d["id"]}))
    with pytest.raises(InputValidationError, match=r"filter predicate .* returned int64 values of shape \(50,\) for "
                                                   r"a chunk of 50 rows; it must return a bool mask"):
        runs(ArraySource(table(50)).filter(lambda d: d["id"] % 2))
    with pytest.raises(InputValidationError, match=r"returned bool values of shape \(\)"):
        runs(ArraySource(table(50)).filter(lambda d: True))


def failing_map(d):
    raise KeyError("no such column")


def test_an_exception_in_a_function_is_a_fetch_error_with_it_as_cause_and_the_step_noted():
    with pytest.raises(FetchError, match="fetch_fun raised KeyError") as info:
        run(ArraySource(table(50)).map(failing_map))
    cause = info.value.__cause__
    assert isinstance(cause, KeyError)
    assert any("test_transform.failing_map" in note for note in getattr(cause, "__notes__", []))


def test_inputs_without_a_map_must_be_columns_and_a_list_array_source_cannot_be_transformed():
    with pytest.raises(ValueError, match=r"ArraySource has no column\(s\) \['z'\] for the input\(s\)"):
        run(ArraySource(table(10)).filter(not_every_third), inputs=("z",))
    with pytest.raises(TypeError, match="give them as a dict"):
        ArraySource([np.arange(10)]).map(lambda d: d)
    with pytest.raises(TypeError, match="map needs a callable"):
        ArraySource(table(10)).map("x")
    # inputs are chosen from the columns: those not fed are left out
    got, _, _ = run(ArraySource(table(10)).filter(not_every_third), inputs=("id",))
    assert sorted(got[0]) == ["id"]


def test_an_identity_map_returning_its_input_costs_no_check():
    src = ArraySource(table(10)).map(lambda d: d)
    got, _, _ = run(src)
    assert ids_of(got) == list(range(10))


# ---- figures --------------------------------------------------------------------------------------------
def test_diagnose_shows_the_functions_time_apart_from_reading(coord):
    import time

    def slow(d):
        time.sleep(0.002)
        return d

    src = ArraySource(table(2000), block_rows=50).map(slow).filter(not_every_third)
    feeder.init_data_input_workers(None, ["x", "id"], src, 64, num_worker_threads=1, coordinator=coord)
    coord.start()
    list(coord.feed("train"))
    text = coord.feed("train").diagnose()
    assert "map/filter functions" in text and "rows filtered" in text
    m = coord.feed("train").metrics()
    assert m["transform_s"] >= 40 * 0.002 * 0.9 and m["transform_s"] <= m["fetch_s"]
    assert "then map test_transform." in text  # the source's description names the steps


def test_a_fetch_functions_counters_reach_metrics_in_threads_and_processes(mode):
    """The transport issue 28's retries use: whatever keys feeder_counters reports are in metrics()."""
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(None, ["x"], CountingSource(chunks=5), 4, coordinator=coord,
                                   **workers(mode, 2))
    with coord:
        feed = coord.feed("train")
        assert len(list(feed)) == 10
        m = feed.metrics()
    assert m["retries"] == 10.0 and m["rows_filtered"] == 0.0


def test_skip_pickles_as_itself():
    import pickle

    assert pickle.loads(pickle.dumps(SKIP)) is SKIP


def test_a_source_and_a_map_of_it_cannot_both_be_registered(coord):
    src = ArraySource(table(10))
    feeder.init_data_input_workers(None, ["x", "id"], src, 4, coordinator=coord)
    with pytest.raises(ValueError, match="already feeds source 'train' through another object"):
        feeder.init_data_input_workers(None, ["x", "id"], src.filter(not_every_third), 4, coordinator=coord,
                                       input_source_name="other")
    chain = src.map(lambda d: d)
    with pytest.raises(ValueError, match="through another object"):
        feeder.init_data_input_workers(None, ["x", "id"], chain, 4, coordinator=coord)


def test_a_bound_chain_of_module_level_functions_pickles_with_plain_pickle():
    import pickle

    from feeder.sources.base import SourceBinding

    chain = ArraySource(table(50), block_rows=10).filter(not_every_third)
    chain.feeder_validate(("x", "id"), None)
    chain.feeder_bind(SourceBinding("s", ((0,),), ("x", "id"), False, on_filtered=lambda rows, keys: None))
    copy = pickle.loads(pickle.dumps(chain))
    first = copy(0, 8)
    assert first[1].tolist() == [1, 2, 4, 5, 7, 8] and first[2].tolist() == first[1].tolist()
    assert copy.feeder_filtered_keys((0,)).tolist() == [0, 3, 6, 9]  # no sink in the copy: kept for the report


def test_a_filter_keeps_rows_of_columns_that_are_lists_of_rows_by_row_number():
    from feeder.sources.transform import _rows_of

    mask = np.array([True, False, True])
    rows = [np.arange(1), np.arange(2), np.arange(3)]
    assert [len(r) for r in _rows_of(rows, mask)] == [1, 3]
    assert _rows_of(np.arange(3), mask).tolist() == [0, 2]

    class ByNumber:  # as feeder's Ragged: indexed by an array of row numbers
        def __getitem__(self, idx):
            return idx.tolist()

    assert _rows_of(ByNumber(), mask) == [0, 2]


def test_a_wrapper_answers_what_feeder_asks_a_source_with_the_wrapped_sources_answer():
    src = ArraySource(table(10))
    src.feeder_shard_record = lambda: {"world": 2, "ranks": [1]}  # as a sharded source would say
    chain = src.filter(not_every_third)
    assert chain.feeder_shard_record() == {"world": 2, "ranks": [1]}
    with pytest.raises(AttributeError):
        getattr(chain, "not_a_feeder_attribute")  # noqa: B009


# ---- issue 34: the edges ------------------------------------------------------------------------------------
def add_one_in_place(d):
    d["x"] += 1
    return d


def zero_the_first_id_in_place(d):
    d["id"][0] = 0
    return d["id"] >= 0


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("step", ["map", "filter"])
def test_a_function_that_writes_into_its_columns_fails_at_once_and_never_changes_the_data(shuffle, step):
    """Item 1: the columns a step gets are read-only views (an unshuffled ArraySource's chunk is a
    view of the user's arrays, which later epochs read again): a write is an InputValidationError
    naming the function and saying to copy, whatever max_fetch_errors says; the data is as given."""
    x, ids = np.zeros((64, 1), np.float32), np.arange(64, dtype=np.int64)
    before_x, before_ids = x.copy(), ids.copy()
    src = ArraySource({"x": x, "id": ids}, shuffle=shuffle, epochs=3, block_rows=16)
    src = src.map(add_one_in_place) if step == "map" else src.filter(zero_the_first_id_in_place)
    coord = feeder.GlobalCoordinator(join_timeout=3.0)
    feeder.init_data_input_workers(None, ["x", "id"], src, 16, num_worker_threads=2, coordinator=coord,
                                   max_fetch_errors=5)
    name = "add_one_in_place" if step == "map" else "zero_the_first_id_in_place"
    with coord, pytest.raises(InputValidationError, match=rf"source 'train', worker \d: .*{name}, a step of "
                                                          rf"ArraySource.*wrote into a column it was given .*read-only"
                                                          rf".*write into a copy") as e:
        for _ in coord.feed("train"):
            pass
    assert isinstance(e.value.__cause__, ValueError)
    np.testing.assert_array_equal(x, before_x)
    np.testing.assert_array_equal(ids, before_ids)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_map_that_makes_new_arrays_gives_every_epoch_the_same_rows_and_leaves_the_data(shuffle):
    x = np.zeros((64, 1), np.float32)
    src = ArraySource({"x": x, "id": np.arange(64)}, shuffle=shuffle, epochs=3, block_rows=16)
    got, _, _ = run(src.map(lambda d: {"x": d["x"] + 1, "id": d["id"]}))
    assert Counter(ids_of(got)) == Counter({i: 3 for i in range(64)})
    assert all((b["x"] == 1).all() for b in got)
    assert not x.any()


def test_transformed_source_refuses_a_plain_fetch_function_when_created():
    """Item 12: TransformedSource wraps the ready-made sources only (it names columns and carries
    their row keys); a plain fetch function is a TypeError at creation, not an AttributeError later."""
    def fetch(worker_id, batch_size):
        return [np.zeros((4, 1), np.float32)]

    with pytest.raises(TypeError, match=r"TransformedSource wraps a source of feeder.sources .*got function"):
        TransformedSource(fetch, [("map", lambda d: d)])


def every_tenth_hashed(d):
    return (d["id"] * 2654435761) % 10 != 3  # drops one row in ten, scattered


def test_a_state_stays_a_few_ranges_while_filtered_rows_run_ahead_of_the_consumer():
    """Item 7: with a 10% filter, the fetchers run far ahead of a consumer that takes 10 batches:
    the filtered keys ahead of it wait loose (feeder.rowkeys) and join the state once they touch
    what was delivered, so a state is a handful of ranges, cheap to take, and still exact."""
    n = 200_000
    src = ArraySource(table(n), block_rows=4096).filter(every_tenth_hashed)
    coord = feeder.GlobalCoordinator(join_timeout=3.0)
    feeder.init_data_input_workers(None, ["x", "id"], src, 256, num_worker_threads=2, coordinator=coord)
    with coord:
        feed = coord.feed("train")
        before = [feed.next_batch(timeout=10)["id"].copy() for _ in range(10)]
        deadline = time.monotonic() + 30
        while feed.metrics()["source_rows_filtered"] < 10_000 and time.monotonic() < deadline:
            time.sleep(0.01)  # (not synchronisation: the fetchers running ahead is what is measured)
        ahead = feed.metrics()["source_rows_filtered"]
        state = coord.state_dict("train")
    assert ahead >= 10_000, "the fetchers did not run ahead of the consumer"
    assert len(state["delivered"]) <= 8, state["delivered"][:20]
    assert len(json.dumps(state)) < 2000
    delivered = sorted(int(i) for b in before for i in b)
    assert state["rows_delivered"] == 2560 == len(delivered)
    after, end, _ = run(ArraySource(table(n), block_rows=4096).filter(every_tenth_hashed), batch_size=256,
                        resume=state)
    kept = [i for i in range(n) if (i * 2654435761) % 10 != 3]
    assert sorted(delivered + ids_of(after)) == kept
    assert end["delivered"] == [[0, n]] and end["rows_delivered"] == len(kept)
    assert end["rows_filtered"] == n - len(kept)


@pytest.mark.ledger_may_fail  # (its last lines record a key twice on purpose)
def test_filtered_keys_wait_loose_until_they_touch_what_is_done():
    from feeder.rowkeys import SETTLE_RUN, KeyLedger

    class Batch:
        def __init__(self, k):
            self.keys = np.asarray(k, dtype=np.int64)

    ledger = KeyLedger("t")
    ledger.record_filtered(np.array([3, 7, 20]))                 # lone keys ahead of any delivery
    ledger.record_filtered(np.arange(100, 100 + SETTLE_RUN))     # a unit the filter emptied
    ranges, filtered = ledger.snapshot()
    assert ranges.tolist() == [[100, 100 + SETTLE_RUN]] and filtered == SETTLE_RUN
    assert ledger.loose_filtered == 3
    ledger.record(Batch([0, 1, 2, 4, 5, 6]))                     # 3 lies between delivered keys, 7 beside them
    ranges, filtered = ledger.snapshot()
    assert ranges.tolist() == [[0, 8], [100, 100 + SETTLE_RUN]] and filtered == SETTLE_RUN + 2
    assert ledger.loose_filtered == 1
    ranges, filtered = ledger.snapshot(loose=True)              # every key recorded (the ledger's checks)
    assert ranges.tolist() == [[0, 8], [20, 21], [100, 100 + SETTLE_RUN]] and filtered == SETTLE_RUN + 3
    ledger.settle()                                              # the end of the data: nothing left to wait for
    ranges, filtered = ledger.snapshot()
    assert ranges.tolist() == [[0, 8], [20, 21], [100, 100 + SETTLE_RUN]] and filtered == SETTLE_RUN + 3
    assert ledger.loose_filtered == 0 and ledger.duplicates == 0
    ledger.record_filtered(np.array([5]))                        # a key recorded twice is still counted
    ledger.snapshot()
    assert ledger.duplicates == 1


LAMBDA_FILE = '''
import numpy as np
{blank}
keep = lambda d: d["id"] % {modulus} != 0
scale = {scale}
double = lambda d: {{"x": d["x"] * scale, "id": d["id"]}}
'''


def _functions(tmp_path, name, blank="", modulus=3, scale=2):
    """The lambdas of a module file: the same text at other lines (``blank``), or other code."""
    import importlib.util
    path = tmp_path / f"{name}.py"
    path.write_text(LAMBDA_FILE.format(blank=blank, modulus=modulus, scale=scale))
    spec = importlib.util.spec_from_file_location("train_steps", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_function_is_recorded_by_its_code_not_by_where_it_sits(tmp_path):
    """Item 8: a comment added above a lambda (the same code at other lines) resumes; a changed
    body, constant or captured value is refused, naming the step whose code differs."""
    def make(m):
        return ArraySource(table(400), block_rows=50).filter(m.keep).map(m.double)

    first = _functions(tmp_path, "a")
    before, state, _ = run(make(first), take=3, workers_=1)
    assert state["definition"]["transforms"] == [["filter", "train_steps.<lambda>"], ["map", "train_steps.<lambda>"]]
    moved = _functions(tmp_path, "b", blank="# a comment\n# and another\n\n")
    assert moved.keep.__code__.co_firstlineno != first.keep.__code__.co_firstlineno
    after, _, _ = run(make(moved), resume=state)
    assert sorted(ids_of(before) + ids_of(after)) == [i for i in range(400) if i % 3]
    with pytest.raises(ValueError, match=r"transforms_code step 1 \(filter train_steps.<lambda>\): the state has "
                                         r"other contents than this source"):
        run(make(_functions(tmp_path, "c", modulus=4)), resume=state)
    # a value a function captures is part of what it is
    def closing(t):
        return lambda d: d["id"] % t != 0

    _, closed, _ = run(ArraySource(table(400), block_rows=50).filter(closing(3)), take=1, workers_=1)
    run(ArraySource(table(400), block_rows=50).filter(closing(3)), resume=closed)
    with pytest.raises(ValueError, match=r"transforms_code step 1 \(filter .*closing.<locals>.<lambda>\)"):
        run(ArraySource(table(400), block_rows=50).filter(closing(4)), resume=closed)


def test_a_state_of_an_earlier_feeder_that_named_lambdas_by_their_line_still_resumes(tmp_path):
    m = _functions(tmp_path, "a")
    src = ArraySource(table(400), block_rows=50).filter(m.keep)
    before, state, _ = run(src, take=3, workers_=1)
    old = json.loads(json.dumps(state))
    del old["definition"]["transforms_code"]
    old["definition"]["transforms"] = [["filter", "train_steps.<lambda> (a.py:4)"]]
    after, _, _ = run(ArraySource(table(400), block_rows=50).filter(m.keep), resume=old)
    assert sorted(ids_of(before) + ids_of(after)) == [i for i in range(400) if i % 3]


def test_a_function_digest_is_its_code_defaults_and_captured_values():
    from functools import partial

    from feeder.sources.functionid import function_digest

    def compile_at(text, line):
        scope = {}
        exec(compile("\n" * line + text, f"f{line}.py", "exec"), scope)
        return scope["f"]

    body = "def f(d, k=2):\n    def inner(x):\n        return x * k + 1\n    return inner(d['x'])\n"
    same = {function_digest(compile_at(body, line)) for line in (0, 5, 40)}
    assert len(same) == 1
    assert function_digest(compile_at(body.replace("k=2", "k=3"), 0)) not in same       # a default
    assert function_digest(compile_at(body.replace("+ 1", "+ 2"), 0)) not in same       # a nested function's code

    def fact(n):
        return 1 if n < 2 else n * fact(n - 1)  # refers to itself through its closure
    assert function_digest(fact) == function_digest(fact)

    class Scaler:
        def __call__(self, d):
            return d

        def method(self, d):
            return d

    assert function_digest(Scaler()) is None                      # not inspectable: its name stands for it
    assert function_digest(Scaler().method) == function_digest(Scaler().method)
    assert function_digest(partial(fact, 3)) != function_digest(partial(fact, 4))
    tables = [np.arange(5), np.arange(5) + 1]
    assert function_digest(lambda d, t=tables[0]: t) != function_digest(lambda d, t=tables[1]: t)
