"""Shared memory between a worker process and its parent: segments, the control page, the channel.

Array bytes never travel through a pipe. The child writes each chunk once into a *segment*
(a slot of its ring) and sends the parent a few hundred bytes of metadata: slot, offsets,
shapes, dtypes. The parent makes numpy views onto the segment; the slot is handed back when
the last view of it is gone (``weakref.finalize`` on the views' common base array), so a
batch that lies in one slot reaches the consumer without any copy.

Segments are anonymous files (``os.memfd_create``; elsewhere an unlinked temporary file):
they have no name in ``/dev/shm``, so nothing can leak there, however a process dies; the
kernel frees the memory once the last process that maps it has unmapped it or exited. The
child creates them (it knows the sizes it needs) and passes each descriptor to the parent
once, over the channel (``SCM_RIGHTS``).

The *control page* (one small segment per child, created by the child too) carries what must
not cost a system call per chunk: the parent's count of chunks it has queued (the child keeps
at most ``MAX_INFLIGHT`` chunks in flight beyond it), the batch size, the go-ahead of
``num_worker_processes="auto"``, the stop flag, and one busy flag per slot, cleared by the
parent when the slot is free again. Each field has a single writer, and aligned 8-byte
stores are atomic on every platform CPython supports, so no lock is needed; a finalizer that
frees a slot can run in any thread, even in the middle of garbage collection.
"""
from __future__ import annotations

import math
import mmap
import os
import pickle
import socket
import tempfile
import threading
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

# Control page layout: int64 fields, then one uint8 busy flag per slot.
ACKED, BATCH_SIZE, GO, STOP = 0, 1, 2, 3
FIELDS = 8
MAX_SLOTS = 1024        # slots per child (queued chunks + batches held by consumers + in flight)
CONTROL_BYTES = FIELDS * 8 + MAX_SLOTS
ALIGN = 64              # array offsets within a slot: cache-line aligned
GRANULE = 64 * 1024     # segment sizes are rounded up to this
MAX_INFLIGHT = 4        # chunks a child may have sent beyond those the parent has queued
KEEP_FREE = 8           # free segments a child keeps for reuse; beyond twice that, the extra are given back


def new_fd(size: int, name: str = "feeder") -> int:
    """A file descriptor of an anonymous, zero-filled file of ``size`` bytes."""
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None:
        fd = int(memfd_create(name, getattr(os, "MFD_CLOEXEC", 0)))
    else:  # pragma: no cover - non-Linux: an unlinked temporary file is just as anonymous
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, size)
    return fd


def map_fd(fd: int, size: int) -> mmap.mmap:
    """Map ``size`` bytes of ``fd`` shared and writable, then close ``fd`` (the mapping keeps the file)."""
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def segment_size(nbytes: int) -> int:
    """A segment size holding ``nbytes`` with some room to grow, in whole granules."""
    want = max(nbytes + nbytes // 4, 1)
    return -(-want // GRANULE) * GRANULE


class ControlPage:
    """Typed views of a control page (see the module docstring)."""

    def __init__(self, mm: mmap.mmap):
        self.mm = mm
        # memoryviews, not numpy arrays: an item costs ~30 ns instead of ~100 (read per fetch_fun call)
        view = memoryview(mm)
        self.fields = view[:FIELDS * 8].cast("q")
        self.busy = view[FIELDS * 8:FIELDS * 8 + MAX_SLOTS]

    def release(self, slot: int) -> None:
        """Hand a slot back to the child (called by a finalizer: no lock, no system call)."""
        self.busy[slot] = 0


class Channel:
    """Small pickled messages both ways over a duplex ``multiprocessing`` connection, plus file
    descriptors attached to some of them. Sends from several threads are serialised by a lock;
    one thread receives."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None

    def _socket(self) -> socket.socket:
        if self._sock is None:
            self._sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        return self._sock

    def send(self, msg: Tuple[Any, ...], fds: Sequence[int] = (), timeout: Optional[float] = None) -> bool:
        """Send ``msg`` (and ``fds`` right after it); False if the lock was not had within ``timeout``."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            self.conn.send_bytes(data)
            if fds:
                reduction.sendfds(self._socket(), list(fds))
        finally:
            self._lock.release()
        return True

    def poll(self, timeout: float) -> bool:
        return self.conn.poll(timeout)

    def recv(self) -> Tuple[Any, ...]:
        """The next message (raises EOFError or OSError when the other side is gone)."""
        msg: Tuple[Any, ...] = pickle.loads(self.conn.recv_bytes())
        return msg

    def recv_fds(self, n: int) -> List[int]:
        """The ``n`` descriptors sent with the message just received."""
        fds: List[int] = list(reduction.recvfds(self._socket(), n))
        return fds

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self.conn.close()


# A layout entry: ("shm", offset, dtype string, shape) for an array in the slot, or ("obj", array)
# for an object array, which is pickled with the message.
Layout = List[Tuple[Any, ...]]


class SegmentRing:
    """The child's segments: slots it writes chunks into, reused once the parent frees them."""

    def __init__(self, control: ControlPage):
        self.control = control
        self.maps: Dict[int, mmap.mmap] = {}
        self.sizes: Dict[int, int] = {}

    def _free_slots(self) -> List[int]:
        busy = self.control.busy
        return [s for s in self.maps if not busy[s]]

    def acquire(self, nbytes: int) -> Tuple[Optional[int], List[int], List[int], Optional[int]]:
        """A slot of at least ``nbytes``: (slot, slots given back, new fd to send, its size), or
        (None, ...) when every slot is busy and no new one may be made (the caller waits)."""
        free = self._free_slots()
        fitting = [s for s in free if self.sizes[s] >= nbytes]
        dropped: List[int] = []
        if fitting:
            slot = min(fitting, key=lambda s: self.sizes[s])
            self.control.busy[slot] = 1
            return slot, dropped, [], None
        if free:  # too small: replace the biggest free one (keeps the ring small)
            slot = max(free, key=lambda s: self.sizes[s])
            self._close(slot)
            dropped.append(slot)
        elif len(self.maps) >= MAX_SLOTS:
            return None, dropped, [], None
        else:
            slot = next(s for s in range(MAX_SLOTS) if s not in self.maps)
        size = segment_size(nbytes)
        fd = new_fd(size, f"feeder-slot-{slot}")
        self.maps[slot] = mmap.mmap(fd, size)
        self.sizes[slot] = size
        self.control.busy[slot] = 1
        return slot, dropped, [fd], size

    def trim(self) -> List[int]:
        """Give back free segments beyond KEEP_FREE; returns their slots (the parent unmaps them)."""
        free = self._free_slots()
        if len(free) <= 2 * KEEP_FREE:  # hysteresis: a burst of releases must not cost new segments next
            return []
        extra = sorted(free, key=lambda s: self.sizes[s])[:len(free) - KEEP_FREE]
        for s in extra:
            self._close(s)
        return extra

    def _close(self, slot: int) -> None:
        mm = self.maps.pop(slot)
        self.sizes.pop(slot)
        try:
            mm.close()
        except BufferError:  # a view still exists (it cannot: writes are done); let GC have it
            pass

    def view(self, slot: int, offset: int, dtype: np.dtype, shape: Tuple[int, ...]) -> np.ndarray:
        count = math.prod(shape)
        return np.frombuffer(self.maps[slot], dtype=dtype, count=count, offset=offset).reshape(shape)


def arrays_from_slot(mm: Optional[mmap.mmap], layout: Layout,
                     total: int) -> Tuple[Tuple[np.ndarray, ...], Optional[np.ndarray]]:
    """Views of a slot's arrays per ``layout``, and their common base (None if no array is in the slot):
    the slot is free once that base is garbage."""
    base = np.frombuffer(mm, dtype=np.uint8, count=total) if total and mm is not None else None
    out: List[np.ndarray] = []
    for entry in layout:
        if entry[0] == "obj":
            out.append(entry[1])
            continue
        _, offset, dtype, shape = entry
        dt = np.dtype(dtype)
        n = math.prod(shape) * dt.itemsize
        assert base is not None
        out.append(base[offset:offset + n].view(dt).reshape(shape))
    return tuple(out), base
