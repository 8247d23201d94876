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
at most ``MAX_INFLIGHT`` chunks and ``MAX_INFLIGHT_BYTES`` in flight beyond it), the batch size, the go-ahead of
``num_worker_processes="auto"``, the stop flag, and one busy flag per slot, cleared by the
parent when the slot is free again. Each field has a single writer, and aligned 8-byte
stores are atomic on every platform CPython supports, so no lock is needed; a finalizer that
frees a slot can run in any thread, even in the middle of garbage collection.

*No descriptor per mapping.* ``mmap.mmap`` keeps its own duplicate of the descriptor it maps
until the mapping is closed (before Python 3.13's ``trackfd=False``), and a consumer that keeps
its batches keeps hundreds of slots mapped: that was one descriptor per kept batch, and
``EMFILE`` after about a thousand under the common limit of 1,024. So segments are mapped with
the C library's ``mmap`` (through ctypes), their descriptor is closed at once, and the memory
is an object whose finalizer unmaps it once nothing refers to it any more: numpy views keep it
(it is their base), so memory is unmapped only after the last view is gone.

*The parent trusts nothing a child's code could change.* A file mapped in the parent that the
child shrinks would kill the parent with SIGBUS at its next read. Segments are therefore
created with ``MFD_ALLOW_SEALING`` and sealed against shrinking (``F_SEAL_SHRINK``) before
their descriptor is sent, and the parent refuses (``SegmentError``, which fails the source
naming the worker) a segment that is not so sealed, not a memory file, or smaller than the
child says; offsets, sizes and dtypes of every chunk are checked against its segment too.
"""
from __future__ import annotations

import array
import ctypes
import math
import mmap
import os
import pickle
import select
import socket
import stat
import struct
import tempfile
import threading
import weakref
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..ragged import Ragged

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

# Control page layout: int64 fields, then one uint8 busy flag per slot. VERDICTS: how many of the
# child's fetch errors the parent has judged (tolerated, or the source failed and STOP is set).
ACKED, BATCH_SIZE, GO, STOP, VERDICTS = 0, 1, 2, 3, 4
FIELDS = 8
MAX_SLOTS = 1024        # slots per child (queued chunks + batches held by consumers + in flight)
CONTROL_BYTES = FIELDS * 8 + MAX_SLOTS
ALIGN = 64              # array offsets within a slot: cache-line aligned
GRANULE = 64 * 1024     # segment sizes are rounded up to this
MAX_INFLIGHT = 16        # chunks a child may have sent beyond those the parent has queued ...
MAX_INFLIGHT_BYTES = 8 << 20  # ... and bytes (one chunk at least): a few tiny batches absorb the parent's
                              # hiccups (4 in flight made children sleep: 0.84x of the serial loop, 16
                              # 1.0x), and big ones stay within what max_buffered_bytes intends
KEEP_FREE = 8           # free segments a child keeps for reuse; beyond twice that, the extra are given back


# Sealing (Linux): a segment sealed against shrinking cannot be made to fault in the parent.
SEALING = (hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING")
           and fcntl is not None and hasattr(fcntl, "F_ADD_SEALS"))


class SegmentError(ValueError):
    """A segment, or a chunk's layout in one, that the parent cannot safely use."""


def new_fd(size: int, name: str = "feeder") -> int:
    """A file descriptor of an anonymous, zero-filled file of ``size`` bytes, sealed against
    shrinking where the platform has seals (see the module docstring)."""
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None:
        fd = int(memfd_create(name, getattr(os, "MFD_CLOEXEC", 0) | (os.MFD_ALLOW_SEALING if SEALING else 0)))
    else:  # pragma: no cover - non-Linux: an unlinked temporary file is just as anonymous
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    try:
        os.ftruncate(fd, size)
        if SEALING:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def memory_device() -> Optional[int]:
    """The device number of this system's anonymous memory files (None where there are none):
    a segment on another device (say, hugetlbfs, which can fault for want of huge pages) is refused."""
    if not SEALING:
        return None
    fd = new_fd(0, "feeder-probe")
    try:
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


def check_segment(fd: int, size: int, device: Optional[int]) -> None:
    """SegmentError unless ``fd`` is a memory file of at least ``size`` bytes, on ``device``, sealed
    against shrinking. Where the platform has no seals there is nothing to check."""
    if not SEALING:
        return
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        st = os.fstat(fd)
    except OSError as e:
        raise SegmentError(f"a segment that is not a memory file that can be sealed ({e})") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise SegmentError("a segment that is not sealed against shrinking (F_SEAL_SHRINK)")
    if not stat.S_ISREG(st.st_mode) or (device is not None and st.st_dev != device):
        raise SegmentError("a segment that is not an anonymous memory file")
    if st.st_size < size:
        raise SegmentError(f"a segment of {st.st_size} bytes said to hold {size}")


def _libc_mmap() -> Optional[Tuple[Any, Any]]:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mmap_, munmap = libc.mmap, libc.munmap
    except (OSError, AttributeError):  # pragma: no cover - no C library to call
        return None
    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    munmap.restype = ctypes.c_int
    munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    return mmap_, munmap


_LIBC_MMAP = _libc_mmap()  # constant: the C library's mmap and munmap, or None
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_fd(fd: int, size: int, *, close: bool = True,
           register: Optional[Callable[[int, int], Optional[Callable[[], None]]]] = None) -> Any:
    """Map ``size`` bytes of ``fd`` shared and writable; closes ``fd`` unless ``close=False``.

    Returns an object exporting the memory as a buffer (numpy's ``frombuffer`` takes it and
    keeps it as the base of its arrays). No descriptor stays open for the mapping, and the
    memory is unmapped once the object is garbage, that is after its last view is gone.

    ``register(address, size)``, when given, is called once the memory is mapped (a device feed
    registers it with the CUDA runtime, ``feeder.device``); what it returns is called just before
    the memory is unmapped, never after (memory unmapped while registered breaks the CUDA runtime)."""
    try:
        if _LIBC_MMAP is None:  # pragma: no cover - keeps a descriptor per mapping
            return mmap.mmap(fd, size)
        mmap_, munmap = _LIBC_MMAP
        addr = mmap_(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
        mem = (ctypes.c_ubyte * size).from_address(addr)
        undo = register(addr, size) if register is not None else None
        # Not at exit: a daemon thread may still read a batch while the interpreter finalizes.
        weakref.finalize(mem, _unmap, munmap, addr, size, undo).atexit = False
        return mem
    finally:
        if close:
            os.close(fd)


def _unmap(munmap: Any, addr: int, size: int, before: Optional[Callable[[], None]]) -> None:
    """Unmap a segment, after what must come first (unregistering it from the CUDA runtime)."""
    if before is not None:
        before()
    munmap(addr, size)


def segment_size(nbytes: int) -> int:
    """A segment size holding ``nbytes`` with some room to grow, in whole granules."""
    want = max(nbytes + nbytes // 4, 1)
    return -(-want // GRANULE) * GRANULE


class ControlPage:
    """Typed views of a control page (see the module docstring)."""

    def __init__(self, mm: Any):
        if len(mm) < CONTROL_BYTES:
            raise SegmentError(f"a control page of {len(mm)} bytes, not {CONTROL_BYTES}")
        self.mm: Any = mm
        # memoryviews, not numpy arrays: an item costs ~30 ns instead of ~100 (read per fetch_fun call)
        self.fields = memoryview(np.frombuffer(mm, dtype=np.int64, count=FIELDS))  # type: ignore[arg-type]
        self.busy = memoryview(np.frombuffer(mm, dtype=np.uint8, count=MAX_SLOTS,  # type: ignore[arg-type]
                                             offset=FIELDS * 8))

    def release(self, slot: int) -> None:
        """Hand a slot back to the child (called by a finalizer: no lock, no system call)."""
        busy = self.busy
        try:
            busy[slot] = 0
        except ValueError:  # closed meanwhile (stop): the child is gone, nobody waits for the slot
            pass

    def close(self) -> None:
        """Let the page be unmapped now rather than when the garbage collector finds its owner
        (at stop: the child is gone). Finalizers of batches still held then do nothing."""
        for view in (self.fields, self.busy):
            view.release()
        self.mm = None


class Channel:
    """Small pickled messages both ways over a stream socket (a duplex ``multiprocessing``
    connection's), plus file descriptors attached to some of them. Sends from several threads are
    serialised by a lock; one thread receives.

    Framing is feeder's own rather than the connection's: multiprocessing's ``send_bytes`` and
    ``poll`` + ``recv_bytes`` cost about 10 us a message in Python and three system calls to
    receive it; here a message is one ``send`` (``sendmsg`` when it carries descriptors, which then
    travel with it) and a receive reads everything that has arrived with one ``recvmsg``, so a
    parent busy with its worker processes' batches makes one system call for several messages.
    A frame is its payload's length, how many descriptors came with it, and the pickled message.
    """

    def __init__(self, conn: Connection):
        self.conn = conn  # owns the socket's descriptor
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._sock.setblocking(True)
        self._fd = self._sock.fileno()
        self._lock = threading.Lock()
        self._buf = bytearray()  # received, not yet taken
        self._pos = 0            # where the next frame starts in _buf
        self._fds: Deque[int] = deque()  # descriptors received, not yet taken by a frame
        self._last_fds: List[int] = []   # those of the message recv() returned last
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLIN)

    def fileno(self) -> int:
        return self._fd

    def send(self, msg: Tuple[Any, ...], fds: Sequence[int] = (), timeout: Optional[float] = None) -> bool:
        """Send ``msg`` (with ``fds``); False if the lock was not had within ``timeout`` seconds."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        frame = _FRAME.pack(len(data), len(fds)) + data
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            sock = self._sock
            if fds:
                sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                sent = sock.send(frame)
            while sent < len(frame):
                sent += sock.send(memoryview(frame)[sent:])
        finally:
            self._lock.release()
        return True

    def buffered(self) -> bool:
        """A whole message has arrived and waits to be taken (no system call)."""
        buf, pos = self._buf, self._pos
        if len(buf) - pos < _FRAME.size:
            return False
        n: int = _FRAME.unpack_from(buf, pos)[0]
        return len(buf) - pos - _FRAME.size >= n

    def poll(self, timeout: float) -> bool:
        """True when a message (or the other side's end) can be read without waiting; waits up to
        ``timeout`` seconds for it."""
        if self.buffered():
            return True
        return bool(self._poller.poll(max(0, int(timeout * 1000 + 0.999))))

    def _fill(self) -> None:
        data, ancillary, flags, _ = self._sock.recvmsg(_RECV_BYTES, _ANCILLARY)
        for level, kind, cdata in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(cdata[:len(cdata) - len(cdata) % got.itemsize])
                self._fds.extend(got)
        if flags & _MSG_CTRUNC:
            raise OSError("descriptors sent over the channel were lost (too many at once)")
        if not data:
            raise EOFError("the other side closed the channel")
        if self._pos and self._pos == len(self._buf):
            self._buf, self._pos = bytearray(), 0
        self._buf += data

    def recv(self) -> Tuple[Any, ...]:
        """The next message, waiting for it (raises EOFError or OSError when the other side is gone)."""
        while not self.buffered():
            self._fill()
        n, nfds = _FRAME.unpack_from(self._buf, self._pos)
        start = self._pos + _FRAME.size
        msg: Tuple[Any, ...] = pickle.loads(memoryview(self._buf)[start:start + n])
        self._pos = start + n
        if self._pos > _COMPACT_BYTES:
            del self._buf[:self._pos]
            self._pos = 0
        for fd in self._last_fds:  # descriptors of an earlier message nobody took: not leaked
            os.close(fd)
        self._last_fds = [self._fds.popleft() for _ in range(min(nfds, len(self._fds)))]
        if len(self._last_fds) < nfds:
            raise OSError(f"a message came with {nfds} descriptor(s) of which {len(self._last_fds)} arrived")
        return msg

    def recv_fds(self, n: int) -> List[int]:
        """The ``n`` descriptors sent with the message just received (the caller closes them)."""
        fds, self._last_fds = self._last_fds, []
        if len(fds) != n:
            for fd in fds:
                os.close(fd)
            raise OSError(f"expected {n} descriptor(s) with the message, it came with {len(fds)}")
        return fds

    def close(self) -> None:
        for fd in list(self._fds) + self._last_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        self._last_fds = []
        self._sock.close()
        self.conn.close()


_FRAME = struct.Struct("<IB")   # payload bytes, descriptors that came with the message
_RECV_BYTES = 1 << 16           # what one receive reads at most
_ANCILLARY = socket.CMSG_SPACE(16 * array.array("i").itemsize)  # up to 16 descriptors at once
_COMPACT_BYTES = 1 << 16        # the receive buffer drops what was taken past this much
# A plain int: ``int & socket.MSG_CTRUNC`` builds an enum member on every receive (5% of a parent's
# time with two worker processes sending 3 MB batches, measured with py-spy).
_MSG_CTRUNC = int(getattr(socket, "MSG_CTRUNC", 0))


# A layout entry: ("shm", offset, dtype string, shape) for an array in the slot; ("ragged", offset,
# dtype string, values, rows offset, rows, rank) for the rows of a padded input (feeder.ragged): its
# values at offset, then at rows offset each row's start (int64) and each row's shape (rows x rank
# int64); or ("obj", array) for an object array, which is pickled with the message.
Layout = List[Tuple[Any, ...]]


class SegmentRing:
    """The child's segments: slots it writes chunks into, reused once the parent frees them."""

    def __init__(self, control: ControlPage):
        self.control = control
        self.maps: Dict[int, Any] = {}
        self.sizes: Dict[int, int] = {}

    def _free_slots(self) -> List[int]:
        busy = self.control.busy
        return [s for s in self.maps if not busy[s]]

    def acquire(self, nbytes: int) -> Tuple[Optional[int], List[int], List[int], Optional[int]]:
        """A slot of at least ``nbytes``: (slot, slots given back, new fd to send, its size), or
        (None, ...) when every slot is busy and no new one may be made (the caller waits). The
        caller closes the new fd once it is sent (the mapping does not need it)."""
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
        try:
            self.maps[slot] = map_fd(fd, size, close=False)
        except BaseException:
            os.close(fd)
            raise
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
        # Unmapped as soon as nothing refers to it (the writes into it are done: no view is left).
        del self.maps[slot]
        del self.sizes[slot]

    def view(self, slot: int, offset: int, dtype: np.dtype, shape: Tuple[int, ...]) -> np.ndarray:
        count = math.prod(shape)
        return np.frombuffer(self.maps[slot], dtype=dtype, count=count, offset=offset).reshape(shape)


def arrays_from_slot(mm: Any, layout: Layout, total: int) -> Tuple[Tuple[np.ndarray, ...], Optional[np.ndarray]]:
    """Views of a slot's arrays per ``layout``, and their common base (None if no array is in the slot):
    the slot is free once that base is garbage. SegmentError for a layout that does not fit the slot
    (the child's word is checked, never trusted: a bad offset would read outside the mapping)."""
    if total:
        if mm is None:
            raise SegmentError(f"a chunk of {total} bytes in no slot")
        if not 0 < total <= len(mm):
            raise SegmentError(f"a chunk of {total} bytes in a slot of {len(mm)}")
    base = np.frombuffer(mm, dtype=np.uint8, count=total) if total else None
    out: List[Any] = []
    for entry in layout:
        if entry[0] == "obj" and len(entry) == 2 and isinstance(entry[1], np.ndarray):
            out.append(entry[1])
            continue
        if entry[0] == "ragged" and len(entry) == 7:
            out.append(_ragged_from_slot(base, total, entry))
            continue
        if entry[0] != "shm" or len(entry) != 4:
            raise SegmentError(f"a layout entry that is neither an array in the slot nor a pickled one: {entry!r:.200}")
        _, offset, dtype, shape = entry
        try:
            dt = np.dtype(dtype)
            shape = tuple(int(d) for d in shape)
        except (TypeError, ValueError) as e:
            raise SegmentError(f"a layout entry with a bad dtype or shape: {entry!r:.200} ({e})") from None
        if dt.hasobject or any(d < 0 for d in shape) or not isinstance(offset, int):
            raise SegmentError(f"a layout entry that cannot lie in a slot: {entry!r:.200}")
        n = math.prod(shape) * dt.itemsize
        if not n:
            out.append(np.empty(shape, dt))
            continue
        if base is None or offset < 0 or offset + n > total:
            raise SegmentError(f"an array of {n} bytes at offset {offset} of a chunk of {total} bytes")
        out.append(base[offset:offset + n].view(dt).reshape(shape))
    return tuple(out), base


def _ragged_from_slot(base: Optional[np.ndarray], total: int, entry: Tuple[Any, ...]) -> Ragged:
    """The rows of a padded input from their slot; SegmentError unless every row lies within the
    values the child wrote (rows starting or ending elsewhere would make the parent read elsewhere)."""
    _, offset, dtype, count, rows_at, rows, rank = entry
    try:
        dt = np.dtype(dtype)
        count, rows, rank = int(count), int(rows), int(rank)
    except (TypeError, ValueError) as e:
        raise SegmentError(f"a layout entry with a bad dtype or size: {entry!r:.200} ({e})") from None
    if dt.hasobject or min(count, rows, rank - 1) < 0 or not isinstance(offset, int) or not isinstance(rows_at, int):
        raise SegmentError(f"a layout entry that cannot lie in a slot: {entry!r:.200}")
    n = count * dt.itemsize
    meta = rows * (1 + rank) * 8
    if base is None or min(offset, rows_at) < 0 or offset + n > total or rows_at + meta > total \
            or rows_at % 8:
        raise SegmentError(f"rows of {n} + {meta} bytes at offsets {offset}, {rows_at} of a chunk of {total} bytes")
    values = base[offset:offset + n].view(dt)
    starts = base[rows_at:rows_at + rows * 8].view(np.int64)
    shapes = base[rows_at + rows * 8:rows_at + meta].view(np.int64).reshape(rows, rank)
    sizes = shapes.prod(axis=1) if rows else shapes[:, 0]
    if rows and ((shapes < 0).any() or (starts < 0).any() or (starts + sizes > count).any()):
        raise SegmentError(f"rows that do not lie within their {count} values: {entry!r:.200}")
    return Ragged._make(values, starts, shapes)
