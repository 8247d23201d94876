"""The CUDA runtime behind one small interface, and a stand-in for it that runs on the CPU.

:class:`CudaRuntime` calls the ``libcudart`` that ONNX Runtime's CUDA provider has already loaded
(opened with ``RTLD_NOLOAD``: feeder never loads a CUDA runtime of its own, and needs no package
for it), through ctypes, which releases the GIL for the length of every call: a thread waiting
on an event or copying lets the others run. The calls and their signatures are those measured on
an H100 (onnxruntime-gpu 1.31, CUDA 13): pinned host memory (``cudaHostAlloc``, portable), host
memory registered in place (``cudaHostRegister``, portable: a worker process's shared-memory
segment), a non-blocking stream, ``cudaMemcpyAsync`` host to device on it, events (recorded on
the stream, synchronised or queried from the host, timed).

:class:`StandIn` offers the same calls on the CPU: "device" memory is host memory (CPU OrtValues),
a copy is a ``memmove``, made at once or, with ``asynchronous=True``, in order on a thread of
the stream's own after an optional delay (so that a copy really is in flight while the caller
goes on). It can record every call, and it knows which copies are still in flight
(:meth:`StandIn.busy`), which is how the tests prove the ordering the device path promises
without a GPU; ``device="cpu:staged"`` runs the device path on it.

One trap, measured: memory unmapped while still registered breaks later allocations in the
process (``cudaHostAlloc`` fails with error 208, and so does ONNX Runtime's next run), so
registered memory is always unregistered before it is unmapped (``feeder.device.copies``).
"""
from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

SUCCESS = 0
NOT_READY = 600                # cudaErrorNotReady: an event or stream query, work still pending
MEMCPY_HOST_TO_DEVICE = 1      # cudaMemcpyHostToDevice
STREAM_NON_BLOCKING = 1        # cudaStreamNonBlocking: no implicit sync with the legacy default stream
EVENT_DEFAULT = 0              # timing enabled
EVENT_DISABLE_TIMING = 2       # cudaEventDisableTiming
HOST_ALLOC_PORTABLE = 1        # cudaHostAllocPortable
HOST_REGISTER_PORTABLE = 1     # cudaHostRegisterPortable


class CudaError(RuntimeError):
    """A CUDA runtime call failed: the call, the error code and the runtime's words for it."""

    def __init__(self, call: str, code: int, text: str):
        super().__init__(f"{call} failed: CUDA error {code} ({text})")
        self.call, self.code, self.text = call, code, text


class CudaRuntime:
    """The CUDA runtime the process has loaded, through ctypes (see the module docstring). Handles
    (streams, events) and addresses are ints. Every method raises :class:`CudaError` on failure,
    after clearing the thread's last error, so that a failed call here is never seen by ONNX
    Runtime's own checks later."""

    NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
    name = "cuda"

    def __init__(self, lib: Any, soname: str):
        self.soname = soname
        vp, sz, i, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint
        pvp = ctypes.POINTER(vp)

        def fn(name: str, args: Tuple[Any, ...], res: Any = ctypes.c_int) -> Any:
            f = getattr(lib, name)
            f.argtypes, f.restype = args, res
            return f

        self._host_alloc = fn("cudaHostAlloc", (pvp, sz, u))
        self._free_host = fn("cudaFreeHost", (vp,))
        self._host_register = fn("cudaHostRegister", (vp, sz, u))
        self._host_unregister = fn("cudaHostUnregister", (vp,))
        self._stream_create = fn("cudaStreamCreateWithFlags", (pvp, u))
        self._stream_destroy = fn("cudaStreamDestroy", (vp,))
        self._stream_synchronize = fn("cudaStreamSynchronize", (vp,))
        self._memcpy_async = fn("cudaMemcpyAsync", (vp, vp, sz, i, vp))
        self._event_create = fn("cudaEventCreateWithFlags", (pvp, u))
        self._event_destroy = fn("cudaEventDestroy", (vp,))
        self._event_record = fn("cudaEventRecord", (vp, vp))
        self._event_synchronize = fn("cudaEventSynchronize", (vp,))
        self._event_query = fn("cudaEventQuery", (vp,))
        self._event_elapsed = fn("cudaEventElapsedTime", (ctypes.POINTER(ctypes.c_float), vp, vp))
        self._set_device = fn("cudaSetDevice", (i,))
        self._error_string = fn("cudaGetErrorString", (i,), ctypes.c_char_p)
        self._last_error = fn("cudaGetLastError", ())
        self._devices = threading.local()  # the device each thread last set (cudaSetDevice is per thread)

    @classmethod
    def loaded(cls) -> Optional["CudaRuntime"]:
        """The CUDA runtime already loaded in this process (by ONNX Runtime's CUDA provider), or None."""
        mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
        for soname in cls.NAMES:
            try:
                lib = ctypes.CDLL(soname, mode=mode)
            except OSError:
                continue
            try:
                return cls(lib, soname)
            except AttributeError:  # not a CUDA runtime after all (a function missing)
                continue
        return None

    def _check(self, err: int, call: str) -> None:
        if err != SUCCESS:
            self._last_error()  # clear it: ONNX Runtime checks the last error after its own calls
            text = self._error_string(err)
            raise CudaError(call, err, text.decode(errors="replace") if text else "unknown")

    def set_device(self, index: int) -> None:
        """Make ``index`` the calling thread's device (once per thread and device)."""
        if getattr(self._devices, "index", None) != index:
            self._check(self._set_device(index), "cudaSetDevice")
            self._devices.index = index

    def host_alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check(self._host_alloc(ctypes.byref(ptr), nbytes, HOST_ALLOC_PORTABLE), "cudaHostAlloc")
        if not ptr.value:
            raise CudaError("cudaHostAlloc", -1, "returned no memory")
        return int(ptr.value)

    def free_host(self, ptr: int) -> None:
        self._check(self._free_host(ptr), "cudaFreeHost")

    def host_register(self, ptr: int, nbytes: int) -> None:
        self._check(self._host_register(ptr, nbytes, HOST_REGISTER_PORTABLE), "cudaHostRegister")

    def host_unregister(self, ptr: int) -> None:
        self._check(self._host_unregister(ptr), "cudaHostUnregister")

    def stream_create(self) -> int:
        s = ctypes.c_void_p()
        self._check(self._stream_create(ctypes.byref(s), STREAM_NON_BLOCKING), "cudaStreamCreateWithFlags")
        return int(s.value or 0)

    def stream_destroy(self, stream: int) -> None:
        self._check(self._stream_destroy(stream), "cudaStreamDestroy")

    def stream_synchronize(self, stream: int) -> None:
        self._check(self._stream_synchronize(stream), "cudaStreamSynchronize")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Copy ``nbytes`` from host ``src`` to device ``dst`` on ``stream`` (asynchronous from pinned
        or registered memory)."""
        self._check(self._memcpy_async(dst, src, nbytes, MEMCPY_HOST_TO_DEVICE, stream), "cudaMemcpyAsync")

    def event_create(self, timing: bool = True) -> int:
        e = ctypes.c_void_p()
        flags = EVENT_DEFAULT if timing else EVENT_DISABLE_TIMING
        self._check(self._event_create(ctypes.byref(e), flags), "cudaEventCreateWithFlags")
        return int(e.value or 0)

    def event_destroy(self, event: int) -> None:
        self._check(self._event_destroy(event), "cudaEventDestroy")

    def event_record(self, event: int, stream: int) -> None:
        self._check(self._event_record(event, stream), "cudaEventRecord")

    def event_synchronize(self, event: int) -> None:
        """Wait for the work before ``event`` on its stream (the GIL released meanwhile)."""
        self._check(self._event_synchronize(event), "cudaEventSynchronize")

    def event_query(self, event: int) -> bool:
        """Whether the work before ``event`` is done (never waits)."""
        err = self._event_query(event)
        if err == NOT_READY:
            self._last_error()  # (not an error, but the runtime records it as the last one)
            return False
        self._check(err, "cudaEventQuery")
        return True

    def event_elapsed_s(self, start: int, end: int) -> float:
        """Seconds between two completed timing events, as the device measured them."""
        ms = ctypes.c_float()
        self._check(self._event_elapsed(ctypes.byref(ms), start, end), "cudaEventElapsedTime")
        return float(ms.value) / 1000.0

    def device_buffer(self, ptr: int, nbytes: int) -> None:
        """(The stand-in checks copies against the device buffers it knows; the real runtime needs not.)"""


# ---- the stand-in ---------------------------------------------------------------------------------
class _Event:
    __slots__ = ("done", "at", "timing")

    def __init__(self, timing: bool):
        self.done = threading.Event()
        self.done.set()  # an event never recorded counts as complete, as in CUDA
        self.at = 0.0    # when the work before it completed (monotonic s)
        self.timing = timing


class _Stream:
    """A stand-in stream: operations run in order, at once or on a thread of its own."""

    def __init__(self, owner: "StandIn", handle: int):
        self.owner = owner
        self.ops: Deque[Tuple[Any, ...]] = deque()
        self.cond = threading.Condition()
        self.idle = True
        self.closed = False
        self.thread: Optional[threading.Thread] = None
        if owner.asynchronous:
            self.thread = threading.Thread(target=self._run, name=f"feeder:stand-in:stream-{handle}", daemon=True)
            self.thread.start()

    def submit(self, op: Tuple[Any, ...]) -> None:
        if self.thread is None:
            self.owner._execute(op)
            return
        with self.cond:
            self.ops.append(op)
            self.idle = False
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.ops and not self.closed:
                    self.idle = True
                    self.cond.notify_all()
                    self.cond.wait()
                if not self.ops and self.closed:
                    self.idle = True
                    self.cond.notify_all()
                    return
                op = self.ops[0]
            self.owner._execute(op)
            with self.cond:
                self.ops.popleft()

    def synchronize(self) -> None:
        if self.thread is None:
            return
        with self.cond:
            while self.ops or not self.idle:
                self.cond.wait(0.05)

    def close(self) -> None:
        self.synchronize()
        if self.thread is not None:
            with self.cond:
                self.closed = True
                self.cond.notify_all()
            self.thread.join(5.0)


class StandIn:
    """The CUDA runtime's calls on the CPU (see the module docstring).

    Args:
        asynchronous: Run each stream's copies on a thread of its own, in order (else at once, in
            the calling thread).
        delay_s: Seconds each copy waits before it is made (asynchronous only): a copy in flight
            for that long.
        tear_s: Copy the first half, wait this long, then the rest: a copy caught half-way shows
            as rows of two batches.
        record: Keep a list of every call (``calls``): ``(call, args, thread name)``.
    """

    name = "stand-in"

    def __init__(self, *, asynchronous: bool = False, delay_s: float = 0.0, tear_s: float = 0.0,
                 record: bool = False):
        self.asynchronous = asynchronous
        self.delay_s = delay_s
        self.tear_s = tear_s
        self.calls: Optional[List[Tuple[str, Tuple[Any, ...], str]]] = [] if record else None
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._streams: Dict[int, _Stream] = {}
        self._events: Dict[int, _Event] = {}
        self._host: Dict[int, Any] = {}          # host_alloc'd: address -> its ctypes buffer
        self.registered: Dict[int, int] = {}     # address -> bytes registered
        self.devices: Dict[int, int] = {}        # device buffers it was told of: address -> bytes
        self._in_flight: List[Tuple[int, int, int, int]] = []  # copies submitted, not made: (id, dst, src, n)
        self.copied_bytes = 0
        self.copies = 0
        # Called with (dst, src, nbytes) as each copy is made, before the memmove (tests check there
        # that nothing reads the destination, nor writes the source, at that moment).
        self.on_copy: Optional[Callable[[int, int, int], None]] = None
        self.violations: List[str] = []  # what the stand-in saw that a GPU would not forgive

    def _note(self, call: str, *args: Any) -> None:
        if self.calls is not None:
            self.calls.append((call, args, threading.current_thread().name))

    def _execute(self, op: Tuple[Any, ...]) -> None:
        if op[0] == "copy":
            _, cid, dst, src, n = op
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.on_copy is not None:
                self.on_copy(dst, src, n)
            if self.tear_s and n > 1:
                half = n // 2
                ctypes.memmove(dst, src, half)
                time.sleep(self.tear_s)
                ctypes.memmove(dst + half, src + half, n - half)
            else:
                ctypes.memmove(dst, src, n)
            with self._lock:
                self._in_flight = [c for c in self._in_flight if c[0] != cid]
                self.copied_bytes += n
                self.copies += 1
        elif op[0] == "record":
            ev = op[1]
            ev.at = time.monotonic()
            ev.done.set()

    # -- the interface ---------------------------------------------------------------------------
    def set_device(self, index: int) -> None:
        self._note("cudaSetDevice", index)

    def host_alloc(self, nbytes: int) -> int:
        buf = (ctypes.c_ubyte * max(1, nbytes))()
        ptr = ctypes.addressof(buf)
        with self._lock:
            self._host[ptr] = buf
        self._note("cudaHostAlloc", ptr, nbytes)
        return ptr

    def free_host(self, ptr: int) -> None:
        with self._lock:
            self._host.pop(ptr, None)
        self._note("cudaFreeHost", ptr)

    def host_register(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            if ptr in self.registered:
                self.violations.append(f"cudaHostRegister of {ptr:#x}, already registered")
            self.registered[ptr] = nbytes
        self._note("cudaHostRegister", ptr, nbytes)

    def host_unregister(self, ptr: int) -> None:
        with self._lock:
            n = self.registered.pop(ptr, None)
            if n is None:
                self.violations.append(f"cudaHostUnregister of {ptr:#x}, not registered")
            elif any(s < ptr + n and ptr < s + k for _, _, s, k in self._in_flight):
                self.violations.append(f"cudaHostUnregister of {ptr:#x} while a copy from it is in flight")
        self._note("cudaHostUnregister", ptr)

    def stream_create(self) -> int:
        handle = next(self._ids)
        with self._lock:
            self._streams[handle] = _Stream(self, handle)
        self._note("cudaStreamCreateWithFlags", handle)
        return handle

    def stream_destroy(self, stream: int) -> None:
        with self._lock:
            s = self._streams.pop(stream)
        s.close()
        self._note("cudaStreamDestroy", stream)

    def stream_synchronize(self, stream: int) -> None:
        self._streams[stream].synchronize()
        self._note("cudaStreamSynchronize", stream)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        with self._lock:
            if self.devices and not any(p <= dst and dst + nbytes <= p + k for p, k in self.devices.items()):
                self.violations.append(f"a copy of {nbytes} bytes to {dst:#x}, outside every device buffer")
            cid = next(self._ids)
            self._in_flight.append((cid, dst, src, nbytes))
        self._note("cudaMemcpyAsync", dst, src, nbytes, stream)
        self._streams[stream].submit(("copy", cid, dst, src, nbytes))

    def event_create(self, timing: bool = True) -> int:
        handle = next(self._ids)
        with self._lock:
            self._events[handle] = _Event(timing)
        self._note("cudaEventCreateWithFlags", handle, timing)
        return handle

    def event_destroy(self, event: int) -> None:
        with self._lock:
            self._events.pop(event, None)
        self._note("cudaEventDestroy", event)

    def event_record(self, event: int, stream: int) -> None:
        ev = self._events[event]
        ev.done.clear()
        self._note("cudaEventRecord", event, stream)
        self._streams[stream].submit(("record", ev))

    def event_synchronize(self, event: int) -> None:
        self._events[event].done.wait()
        self._note("cudaEventSynchronize", event)

    def event_query(self, event: int) -> bool:
        return self._events[event].done.is_set()

    def event_elapsed_s(self, start: int, end: int) -> float:
        a, b = self._events[start], self._events[end]
        if not (a.timing and b.timing):
            raise CudaError("cudaEventElapsedTime", 1, "an event without timing")
        return max(0.0, b.at - a.at)

    def device_buffer(self, ptr: int, nbytes: int) -> None:
        """Tell the stand-in of a device buffer: copies outside every one it knows are violations."""
        with self._lock:
            self.devices[ptr] = nbytes

    def forget_device_buffer(self, ptr: int) -> None:
        with self._lock:
            self.devices.pop(ptr, None)

    def busy(self, ptr: int, nbytes: int) -> bool:
        """Whether a copy submitted and not yet made reads or writes ``nbytes`` at ``ptr``."""
        with self._lock:
            return any((d < ptr + nbytes and ptr < d + n) or (s < ptr + nbytes and ptr < s + n)
                       for _, d, s, n in self._in_flight)
