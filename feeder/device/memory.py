"""Memory on both sides of a copy to the device: host memory the device copies from fast (pinned
staging, registered shared memory), device buffers allocated once, and the slots that reuse them.

* **Fast host memory.** The device copies asynchronously, at the link's speed, only from
  page-locked host memory: memory the CUDA runtime allocated pinned (``cudaHostAlloc``: staging
  buffers, :meth:`DeviceMemory.host_array`) or registered in place (``cudaHostRegister``: a worker
  process's shared-memory segment, :meth:`DeviceMemory.register`). :class:`HostRanges` knows which
  address ranges are such memory, so that the feed can tell, per batch, whether its rows can go to
  the device straight from where they are or must first be copied into staging memory. (Copying
  from other memory is never wrong, only slower and synchronous: the ranges are a hint, never a
  promise of safety; what keeps memory alive until its copy is done is the copy's ticket,
  ``feeder.device.transfer``.)
* **Slots** (:class:`SlotRing`): a slot is one device buffer per input, of a capacity in bytes,
  with an IOBinding of its own; a batch of any shape that fits is bound by address with its own
  shape (``IOBinding.bind_input(name, device, id, dtype, shape, address)``, rebound only when the
  shape changes), so padded and length-windowed feeds do not allocate device memory per new
  length. A slot is busy from the copy of a batch into it until the run that read it has returned.
  With CUDA graphs a slot runs the graph captured for its first full batch shape, at addresses that
  never change: it is never grown (a batch that does not fit takes another slot).
"""
from __future__ import annotations

import bisect
import logging
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .placement import Placement

log = logging.getLogger("feeder")


class HostRanges:
    """Address ranges of host memory the device copies from fast (pinned or registered). Thread-safe."""

    def __init__(self) -> None:
        self._starts: List[int] = []
        self._ends: List[int] = []
        self._lock = threading.Lock()

    def add(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, ptr)
            self._starts.insert(i, ptr)
            self._ends.insert(i, ptr + nbytes)

    def remove(self, ptr: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, ptr)
            if i < len(self._starts) and self._starts[i] == ptr:
                del self._starts[i]
                del self._ends[i]

    def holds(self, ptr: int, nbytes: int) -> bool:
        """Whether ``nbytes`` at ``ptr`` lie within one range."""
        starts = self._starts
        i = bisect.bisect_right(starts, ptr) - 1
        try:
            return i >= 0 and ptr + nbytes <= self._ends[i] and starts[i] <= ptr
        except IndexError:  # changed meanwhile (lock-free read): not known to be fast
            return False

    def __len__(self) -> int:
        return len(self._starts)


class _HostBuffer:
    """Pinned host memory seen by numpy (``__array_interface__``): the arrays made from it keep it
    alive, and it is given back to the CUDA runtime once the last of them is gone."""

    def __init__(self, runtime: Any, ranges: HostRanges, shape: Tuple[int, ...], dtype: np.dtype):
        nbytes = max(1, int(np.prod(shape)) * dtype.itemsize)
        ptr = runtime.host_alloc(nbytes)
        self.__array_interface__ = {"shape": tuple(shape), "typestr": dtype.str, "data": (ptr, False),
                                    "version": 3}
        ranges.add(ptr, nbytes)
        weakref.finalize(self, _free_host, runtime, ranges, ptr).atexit = False


def _free_host(runtime: Any, ranges: HostRanges, ptr: int) -> None:
    ranges.remove(ptr)
    try:
        runtime.free_host(ptr)
    except Exception:  # (a finalizer must not raise; the process may be shutting the runtime down)
        log.debug("feeder: cudaFreeHost failed", exc_info=True)


def address(a: np.ndarray) -> int:
    """The address of an array's first byte."""
    return int(a.__array_interface__["data"][0])


class DeviceMemory:
    """Staging host memory, device buffers and which host memory is fast, for one placement.

    ``runtime`` is the CUDA runtime (``feeder.device.cudart``: the real one or the stand-in) or None
    (no CUDA runtime reachable: staging is ordinary memory, nothing is registered).
    """

    def __init__(self, placement: Placement, ort: Any, runtime: Any = None):
        self.placement = placement
        self._ort = ort
        self.runtime = runtime
        self.ranges = HostRanges()
        self._pinned = runtime is not None
        self._said = False
        self.allocations = 0  # device buffers allocated so far
        self._device_bytes = 0
        self._lock = threading.Lock()

    @property
    def device_type(self) -> str:
        """ONNX Runtime's name of the device ("cuda", or "cpu" for the staged CPU path)."""
        return "cuda" if self.placement.kind == "cuda" else "cpu"

    @property
    def device_bytes(self) -> int:
        """Bytes of device buffers allocated here and alive now."""
        return self._device_bytes

    def host_array(self, shape: Tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised host array the device copies from fast (pinned memory on a GPU; on the
        stand-in, memory it treats as pinned)."""
        dtype = np.dtype(dtype)
        if self._pinned and dtype.kind in "biufc" and self.runtime is not None:
            try:
                self.runtime.set_device(self.placement.index)  # (per thread: allocations are the device's)
                return np.asarray(_HostBuffer(self.runtime, self.ranges, tuple(shape), dtype))
            except Exception as e:  # noqa: BLE001 - any failure: pageable memory, slower, never wrong
                self._pinned = False
                log.info("feeder: no pinned host memory (%s); batches are staged in pageable memory, whose copies "
                         "to the device are slower", e)
        return np.empty(shape, dtype)

    def fast(self, a: np.ndarray) -> bool:
        """Whether the device copies ``a`` (C-contiguous) asynchronously, at the link's speed."""
        return bool(self.ranges) and self.ranges.holds(address(a), a.nbytes)

    def register(self, ptr: int, nbytes: int) -> Optional[Callable[[], None]]:
        """Register ``nbytes`` of host memory at ``ptr`` with the CUDA runtime (a worker process's
        shared-memory segment, as the parent maps it); returns what unregisters it, to be called
        before the memory is unmapped (never after: see ``feeder.device.cudart``), or None when it
        could not be registered (copies from it are then staged)."""
        runtime = self.runtime
        if runtime is None:
            return None
        try:
            runtime.set_device(self.placement.index)
            runtime.host_register(ptr, nbytes)
        except Exception as e:  # noqa: BLE001
            if not self._said:
                self._said = True
                log.info("feeder: worker processes' shared memory could not be registered with the CUDA runtime "
                         "(%s); their chunks are copied into pinned staging memory first", e)
            return None
        self.ranges.add(ptr, nbytes)
        return _Unregister(runtime, self.ranges, ptr)

    def device_buffer(self, nbytes: int) -> Any:
        """An uninitialised device buffer of ``nbytes`` bytes (an OrtValue of uint8), allocated once
        and reused; ``data_ptr()`` is its address."""
        value = self._ort.OrtValue.ortvalue_from_shape_and_type([max(1, nbytes)], np.uint8, self.device_type,
                                                                 self.placement.index)
        with self._lock:
            self.allocations += 1
            self._device_bytes += nbytes
        ptr = value.data_ptr()
        if self.runtime is not None:
            self.runtime.device_buffer(ptr, max(1, nbytes))
        weakref.finalize(value, self._freed, nbytes, ptr).atexit = False
        return value

    def _freed(self, nbytes: int, ptr: int) -> None:
        with self._lock:
            self._device_bytes -= nbytes
        forget = getattr(self.runtime, "forget_device_buffer", None)
        if forget is not None:
            forget(ptr)

    def device_value(self, shape: Tuple[int, ...], dtype: Any) -> Any:
        """An uninitialised OrtValue of this shape and dtype on the device (CUDA graphs' fixed outputs)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        value = self._ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device_type,
                                                                 self.placement.index)
        with self._lock:
            self.allocations += 1
            self._device_bytes += nbytes
        weakref.finalize(value, self._freed, nbytes, 0).atexit = False
        return value


def copy_value(src: Any, dst: Any) -> None:
    """Copy one OrtValue into another of the same type and size, across devices (ONNX Runtime 1.32's
    ``update_inplace`` takes an OrtValue; older ones only numpy, through which it then goes)."""
    try:
        dst.update_inplace(src)
    except TypeError:
        dst.update_inplace(src.numpy())


class _Unregister:
    """Unregisters registered host memory, once (called before the memory is unmapped)."""

    __slots__ = ("runtime", "ranges", "ptr", "done")

    def __init__(self, runtime: Any, ranges: HostRanges, ptr: int):
        self.runtime, self.ranges, self.ptr, self.done = runtime, ranges, ptr, False

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        self.ranges.remove(self.ptr)
        try:
            self.runtime.host_unregister(self.ptr)
        except Exception:  # (called by a finalizer: must not raise)
            log.warning("feeder: cudaHostUnregister failed", exc_info=True)


class Slot:
    """Device buffers for one batch (one per input, each of a capacity in bytes) and the IOBinding
    its inputs are bound to (by address, with the batch's shape).

    ``index`` >= 0 for a slot of the ring (reused), -1 for buffers of one batch's own."""

    __slots__ = ("index", "buffers", "ptrs", "caps", "binding", "busy", "bound", "outputs", "run_options",
                 "graph_shapes", "ticket")

    def __init__(self, index: int, buffers: List[Any], binding: Any):
        self.index = index
        self.buffers = buffers
        self.ptrs = [int(b.data_ptr()) for b in buffers]
        self.caps = [int(b.shape()[0]) for b in buffers]
        self.binding = binding
        self.busy = True
        self.bound: List[Any] = [None] * len(buffers)  # per input: the (dtype, shape) bound now
        self.outputs: Dict[Any, List[Any]] = {}  # fixed device outputs by output list (CUDA graphs)
        self.run_options: Any = None  # its own RunOptions naming its CUDA graph (gpu_graph_id = index)
        self.graph_shapes: Any = None  # the input shapes its CUDA graph was captured with
        self.ticket: Any = None  # the copy into it last issued (feeder.device.transfer.Ticket)

    def release(self) -> None:
        """Free for the next batch: the run that read it has returned (or it was never run)."""
        self.busy = False

    def fits(self, nbytes: Sequence[int]) -> bool:
        return all(n <= c for n, c in zip(nbytes, self.caps))

    def bind_inputs(self, names: Sequence[str], arrays_meta: Sequence[Tuple[np.dtype, Tuple[int, ...]]],
                    device: Tuple[str, int]) -> None:
        """Bind each input by address with this batch's dtype and shape (only what changed: a
        slot of batches of one shape is bound once)."""
        binding = self.binding
        for i, (name, meta) in enumerate(zip(names, arrays_meta)):
            if self.bound[i] != meta:
                dtype, shape = meta
                binding.bind_input(name, device[0], device[1], dtype.type, list(shape), self.ptrs[i])
                self.bound[i] = meta


class SlotRing:
    """Up to ``size`` slots, reused once released; see the module docstring. Thread-safe.

    ``exact``: a slot's buffers hold exactly the batch's bytes (re-made when a batch of another size
    comes): what ``OrtValue.update_inplace``, the copy without a CUDA runtime, needs.
    """

    def __init__(self, memory: DeviceMemory, names: Sequence[str], size: int,
                 make_binding: Optional[Callable[[], Any]] = None, exact: bool = False):
        self.memory = memory
        self.names = list(names)
        self.size = size
        self.exact = exact
        self._make_binding = make_binding
        self._slots: List[Slot] = []
        self._lock = threading.Lock()
        self.allocations = 0   # slots made (or re-made, grown) for the ring
        self.one_offs = 0      # batches that found no free slot and got buffers of their own
        self._closed = False

    def _buffers(self, nbytes: Sequence[int], old: Optional[Slot] = None) -> List[Any]:
        """Buffers for these sizes, keeping those of ``old`` that fit; a grown one gets room to grow."""
        out = []
        for i, n in enumerate(nbytes):
            if old is not None and (old.caps[i] == n if self.exact else old.caps[i] >= n):
                out.append(old.buffers[i])
            else:
                grow = 0 if self.exact or old is None else n // 4  # padded batches: the next may be longer
                out.append(self.memory.device_buffer(n + grow))
        return out

    def _new(self, index: int, nbytes: Sequence[int], old: Optional[Slot] = None) -> Slot:
        binding = None
        if self._make_binding is not None:
            binding = old.binding if old is not None else self._make_binding()
        return Slot(index, self._buffers(nbytes, old), binding)

    def acquire(self, nbytes: Sequence[int], graph: bool = False) -> Slot:
        """A slot whose buffers hold ``nbytes`` (per input), marked busy: a free one that fits; a free
        one grown (never one that runs a CUDA graph: ``graph``); a new one while the ring has room;
        else buffers for this batch alone."""
        with self._lock:
            grow = None
            for slot in self._slots:
                if not slot.busy:
                    if (slot.caps == list(nbytes)) if self.exact else slot.fits(nbytes):
                        slot.busy = True
                        return slot
                    if grow is None and not (graph and slot.graph_shapes is not None):
                        grow = slot
            if not self._closed and (len(self._slots) < self.size or grow is not None):
                if len(self._slots) < self.size:
                    slot = self._new(len(self._slots), nbytes)
                    self._slots.append(slot)
                else:  # batches of other sizes: a free slot is re-made to fit them
                    assert grow is not None
                    slot = self._new(grow.index, nbytes, grow)
                    self._slots[grow.index] = slot
                self.allocations += 1
                return slot
            self.one_offs += 1
        if self.one_offs in (1, 100, 10_000):
            log.info("feeder: %d batch(es) found no free device slot (%d slots): more batches were alive than slots "
                     "(several consumers?); each got device buffers of its own", self.one_offs, self.size)
        return self._new(-1, nbytes)

    def device_bytes(self) -> int:
        """Device memory the ring's slots hold, in bytes (batches' own buffers not counted)."""
        with self._lock:
            return sum(c for s in self._slots for c in s.caps)

    def slots(self) -> int:
        with self._lock:
            return len(self._slots)

    def close(self) -> None:
        """Drop every slot (at stop): device memory is freed once no batch refers to it any more."""
        with self._lock:
            self._closed = True
            self._slots = []
