"""The named chunk queue alone: FIFO and ordered modes, end of data, the byte bound, the ledger."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from feeder.chunkqueue import CLOSED, EMPTY, END, Chunk, ChunkQueue
from feeder.errors import Failure, FetchError


def chunk(worker, rows, width=1):
    return Chunk(worker, (np.zeros((rows, width), np.float32),), rows)


def test_fifo_end_only_after_every_worker_ended_and_queue_drained():
    q = ChunkQueue("s", 4)
    q.register_workers([0, 1])
    assert q.put(chunk(0, 2), 0.1) is True
    q.worker_ended(0)
    assert q.get(0.01).rows == 2
    assert q.get(0.01) is EMPTY  # worker 1 still alive
    q.put(chunk(1, 3), 0.1)
    q.worker_ended(1)
    assert q.get(0.01).rows == 3
    assert q.get(0.01) is END and q.get(0.01) is END


def test_put_times_out_when_full_and_close_wakes_everyone():
    q = ChunkQueue("s", 1)
    q.register_workers([0])
    assert q.put(chunk(0, 1), 0.1) is True
    assert q.put(chunk(0, 1), 0.02) is EMPTY
    results = []
    t = threading.Thread(target=lambda: results.append(q.put(chunk(0, 1), 30)))
    t.start()
    assert q.close() == (1, 1)
    t.join(2)
    assert not t.is_alive() and results == [CLOSED]
    assert q.get(0.01) is CLOSED and q.rows_discarded == 1 and q.qsize() == 0


def test_ordered_round_robin_skips_ended_workers():
    q = ChunkQueue("s", 8, ordered=True)
    q.register_workers([0, 1, 2])
    q.put(chunk(2, 1), 0.1)
    q.put(chunk(1, 1), 0.1)
    assert q.get(0.01) is EMPTY  # worker 0's turn, nothing from it yet
    q.put(chunk(0, 1), 0.1)
    assert [q.get(0.01).worker_id for _ in range(3)] == [0, 1, 2]
    q.worker_ended(0)
    q.put(chunk(2, 1), 0.1)
    assert q.get(0.01) is EMPTY  # worker 1's turn
    q.put(chunk(1, 1), 0.1)
    assert [q.get(0.01).worker_id for _ in range(2)] == [1, 2]
    q.worker_ended(1), q.worker_ended(2)
    assert q.get(0.01) is END


def test_byte_bound_blocks_until_rows_are_delivered_or_a_consumer_starves():
    q = ChunkQueue("s", 100, max_bytes=100)
    q.register_workers([0])
    assert q.put(chunk(0, 20), 0.1) is True  # 80 bytes
    assert q.put(chunk(0, 10), 0.02) is EMPTY  # would be 120 > 100, and the enqueuer has work queued
    q.get(0.01)
    # taken is not delivered, so 80 bytes are still held; with no feed registered nobody waits
    assert q.put(chunk(0, 10), 0.02) is EMPTY
    q.delivered(20, 80)
    assert q.put(chunk(0, 10), 0.1) is True and q.put(chunk(0, 5), 0.1) is True  # 40 + 20 bytes fit


def test_byte_bound_in_ordered_mode_lets_in_the_chunk_whose_turn_it_is():
    q = ChunkQueue("s", 100, ordered=True, max_bytes=100)
    q.register_workers([0, 1])
    q.add_holder(lambda: 0, starved=lambda: True)  # a consumer waits with nothing ready
    assert q.put(chunk(1, 25), 0.1) is True  # 100 bytes, worker 1 ran ahead
    assert q.put(chunk(1, 1), 0.02) is EMPTY
    assert q.put(chunk(0, 1), 0.1) is True  # worker 0's turn: over the bound, but let in
    assert [q.get(0.01).worker_id for _ in range(2)] == [0, 1]


def test_oversized_chunk_goes_through_alone():
    q = ChunkQueue("s", 100, max_bytes=10)
    q.register_workers([0])
    assert q.put(chunk(0, 50), 0.1) is True


def test_failure_is_sticky_first_wins_and_get_returns_promptly():
    q = ChunkQueue("s", 4)
    q.register_workers([0])
    first = Failure(FetchError("first"), ValueError("a"))
    q.fail(first)
    q.fail(Failure(FetchError("second")))
    assert q.failure is first
    assert q.get(5) is EMPTY  # does not sit out the timeout
    with pytest.raises(FetchError, match="first") as info:
        first.raise_()
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.ledger_may_fail
def test_ledger_check_catches_lost_rows(ledger_always_balances):
    q = ChunkQueue("s", 4)
    q.register_workers([0])
    held = {"rows": 0}
    q.add_holder(lambda: held["rows"])
    q.put(chunk(0, 5), 0.1)
    q.get(0.01)
    held["rows"] = 5
    assert q.check_ledger("test") is True
    held["rows"] = 2  # three rows vanished
    assert q.check_ledger("test") is False
    assert ledger_always_balances.bad and "'s'" in ledger_always_balances.bad[0]


def test_ordered_queue_never_holds_more_chunks_than_its_bound():
    """Issue 9, defect 6: each worker had at least one slot, so 4 workers held 4 chunks in a
    queue of 1. Now only the worker whose turn it is may take the last free slot."""
    q = ChunkQueue("s", 1, ordered=True)
    q.register_workers([0, 1, 2, 3])
    assert [q.put(chunk(w, 1), 0.01) for w in (3, 2, 1)] == [EMPTY, EMPTY, EMPTY]
    assert q.put(chunk(0, 1), 0.01) is True and q.qsize() == 1
    assert q.put(chunk(1, 1), 0.01) is EMPTY
    assert q.get(0.01).worker_id == 0
    assert q.put(chunk(2, 1), 0.01) is EMPTY  # worker 1's turn now
    assert q.put(chunk(1, 1), 0.01) is True and q.qsize() == 1


def test_ordered_queue_keeps_a_slot_for_the_worker_whose_turn_it_is():
    q = ChunkQueue("s", 3, ordered=True)
    q.register_workers([0, 1, 2])
    assert q.put(chunk(1, 1), 0.01) is True and q.put(chunk(2, 1), 0.01) is True
    assert q.put(chunk(2, 1), 0.01) is EMPTY  # the last slot is worker 0's
    assert q.put(chunk(0, 1), 0.01) is True and q.qsize() == 3
    assert [q.get(0.01).worker_id for _ in range(3)] == [0, 1, 2]
    q.worker_ended(0)  # an ended worker's turn is skipped: the last slot is worker 1's
    assert q.put(chunk(2, 1), 0.01) is True and q.put(chunk(2, 1), 0.01) is True
    assert q.put(chunk(2, 1), 0.01) is EMPTY and q.put(chunk(1, 1), 0.01) is True
    assert [q.get(0.01).worker_id for _ in range(2)] == [1, 2] and q.get(0.01) is EMPTY  # 1's turn again


def test_byte_bound_counts_ready_batches_and_is_not_exceeded_when_nobody_waits():
    """Issue 9, defect 2: the queue admitted a chunk whenever it was empty, however much the
    feeds held in ready batches, so bounds of 64-256 KiB held 384 KiB. Over the bound, a chunk
    is let in only for a consumer that waits with nothing ready (else leftover rows could
    deadlock), or when the source holds nothing at all (a chunk larger than the bound)."""
    q = ChunkQueue("s", 100, max_bytes=100)
    q.register_workers([0])
    waiting = {"starved": False}
    q.add_holder(lambda: 0, starved=lambda: waiting["starved"])
    assert q.put(chunk(0, 20), 0.1) is True  # 80 bytes
    q.get(0.01)  # now in a feed, not yet delivered: still held
    assert q.put(chunk(0, 10), 0.02) is EMPTY
    waiting["starved"] = True  # a consumer waits and its feed has nothing ready
    assert q.put(chunk(0, 10), 0.02) is True
    assert q.put(chunk(0, 10), 0.02) is EMPTY  # the queue has something for it now
