"""Batches on a device (a GPU) before the runtime asks: where a session runs, staging memory,
device buffers allocated once, and the ring of slots that reuses them.

Only about ONNX Runtime's devices (and, for pinned host memory, the CUDA runtime that ONNX
Runtime's CUDA provider has loaded); ``feeder.runtime`` uses it, nothing else does.

What ONNX Runtime's Python API offers for putting a batch on a GPU (1.31 / 1.32), and what this
module takes from it:

* ``OrtValue.ortvalue_from_shape_and_type(shape, dtype, "cuda", id)`` allocates device memory once;
  ``OrtValue.update_inplace(array)`` copies a host array into it (the address never changes, which
  is what ``enable_cuda_graph`` needs). As the binding's source reads, it holds the GIL for the
  whole copy, a ``cudaMemcpy`` on the legacy default stream (``benchmarks/gpu.py --probe``
  measures it): the copy of batch n+1 overlaps the run of batch n
  (which runs on the provider's own stream, with the GIL released) only because another thread
  makes it, and it delays the consumer's Python between runs by as long as it holds the GIL. So
  the copy should be short: from pinned host memory (51.5 GB/s on the H200 against 12.7 from
  pageable memory, see docs/gpu.md), which is why batches the rebatcher assembles are assembled in
  pinned memory (:class:`DeviceMemory.host_array`) and copied from there.
* Pinned host memory: the Python API has no "cuda_pinned" device any more (1.32 knows cpu, cuda,
  cann, dml, webgpu, gpu, npu); ``ortvalue_from_shape_and_type(..., memory_info=...)`` takes the
  HOST_ACCESSIBLE memory info of an ``OrtEpDevice``, which exists only for execution providers
  registered as plugin libraries with the environment. So pinned memory comes from the CUDA
  runtime itself (``cudaHostAlloc``, through ctypes, from the ``libcudart`` the CUDA provider has
  already loaded); where that fails, staging memory is ordinary (pageable) memory and the copy
  is slower, never wrong.
* ``onnxruntime.copy_tensors(src, dst, stream)`` with an ``OrtSyncStream`` from
  ``OrtEpDevice.create_sync_stream()`` is asynchronous, but it needs the provider's data
  transfer registered with the environment (on the CPU provider it says "Data transfer
  implementation between source and destination device was not found"), and Python has no way
  to make the run's stream wait for the copy's (no notifications or events in the Python API):
  an asynchronous copy could not be ordered before the run that reads it. Not used; to be
  measured on a GPU (benchmarks/gpu.py).
* ``IOBinding.bind_input(name, "cuda", id, dtype, shape, pointer)`` binds memory that another
  library owns (torch); feeder owns its device memory as OrtValues and binds those.

A feed's device slots (:class:`SlotRing`): a slot is a set of device buffers (one per input) of one
set of input shapes and dtypes, with its own IOBinding whose inputs are bound to them once. A
batch is copied into a free slot when it is made (ahead of the consumer) and the slot is free
again only once the run that read it has returned (``run_with_iobinding`` returns after the
provider synchronised), so no buffer is overwritten while a run may still read it. A batch that
finds no free slot (more batches alive than slots: several consumers) gets buffers of its own,
freed with it; so device memory is bounded by the slots plus the batches alive, and the ring is
dropped at stop.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

log = logging.getLogger("feeder")

# Providers that run on a CUDA device (their device_id option says which).
CUDA_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider", "NvTensorRTRTXExecutionProvider")
# The package that brings each GPU provider, for error messages.
PACKAGE_OF = {"CUDAExecutionProvider": "onnxruntime-gpu", "TensorrtExecutionProvider": "onnxruntime-gpu (and TensorRT)",
              "NvTensorRTRTXExecutionProvider": "onnxruntime-gpu"}


@dataclass(frozen=True)
class Placement:
    """Where a feed's batches go before they are run.

    ``kind`` is "cpu" or "cuda", ``index`` the device id. ``staged=True`` (only with "cpu") runs the
    device path (staging, slots, their reuse and order) with host memory standing in for the
    device: what CI and machines without a GPU test it with (``device="cpu:staged"``).
    """

    kind: str = "cpu"
    index: int = 0
    staged: bool = False

    @property
    def on_device(self) -> bool:
        """Whether batches go through the device path (staged copies into slots)."""
        return self.kind != "cpu" or self.staged

    def __str__(self) -> str:
        if self.kind == "cpu":
            return "cpu:staged" if self.staged else "cpu"
        return f"{self.kind}:{self.index}"


CPU = Placement()


def parse_device(device: Any) -> Optional[Placement]:
    """``None`` -> None (the session decides); "cpu", "cpu:staged", "cuda", "cuda:N" -> a Placement."""
    if device is None:
        return None
    if isinstance(device, Placement):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device must be None, 'cpu', 'cuda' or 'cuda:N', got {type(device).__name__}")
    text = device.strip().lower()
    if text == "cpu":
        return CPU
    if text == "cpu:staged":
        return Placement("cpu", 0, staged=True)
    kind, sep, index = text.partition(":")
    if kind == "cuda" and (not sep or index.isdigit()):
        return Placement("cuda", int(index) if sep else 0)
    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N' (N a device id), got {device!r}")


def available_providers() -> List[str]:
    """The execution providers the installed onnxruntime offers ([] without onnxruntime)."""
    try:
        import onnxruntime
    except ImportError:
        return []
    return list(onnxruntime.get_available_providers())


def _missing(asked: str, what: str) -> ValueError:
    have = available_providers()
    package = PACKAGE_OF.get(asked, "the onnxruntime package that has it")
    return ValueError(f"{what}: {asked} is not available in the installed onnxruntime (its providers: {have}); "
                      f"install {package} in place of onnxruntime (pip uninstall onnxruntime && "
                      f"pip install onnxruntime-gpu) on a machine with a GPU")


def check_device(placement: Placement, what: str = "device") -> None:
    """ValueError naming the available providers and the package to install when ``placement``
    needs a provider that the installed onnxruntime lacks."""
    if placement.kind == "cuda" and "CUDAExecutionProvider" not in available_providers():
        raise _missing("CUDAExecutionProvider", f"{what} {str(placement)!r}")


def providers_for(spec: Any) -> Optional[List[Any]]:
    """Providers for an InferenceSession from a short spec: None -> None (the default, see
    :func:`default_providers`); "cpu"; "cuda" or "cuda:N" (the CUDA provider on device N, the CPU
    provider for what it cannot run); or a list of provider names / (name, options) pairs, as
    ``onnxruntime.InferenceSession`` takes them. ValueError for a provider that is not installed."""
    if spec is None:
        return None
    if isinstance(spec, str):
        text = spec.strip()
        if text.lower() == "cpu":
            return ["CPUExecutionProvider"]
        if text.lower().startswith("cuda"):
            placement = parse_device(text)
            assert placement is not None
            check_device(placement, "provider")
            return [("CUDAExecutionProvider", {"device_id": str(placement.index)}), "CPUExecutionProvider"]
        spec = [text]
    if isinstance(spec, (list, tuple)):
        providers = list(spec)
        have = available_providers()
        for p in providers:
            name = p[0] if isinstance(p, (list, tuple)) and p else p
            if not isinstance(name, str):
                raise TypeError(f"providers must be provider names or (name, options) pairs, got {p!r}")
            if name not in have:
                raise _missing(name, "providers")
        return providers
    raise TypeError(f"providers must be None, 'cpu', 'cuda', 'cuda:N' or a list of providers, "
                    f"got {type(spec).__name__}")


def default_providers() -> List[str]:
    """What a session gets when no provider is asked for: the CUDA provider (then the CPU one) when
    the installed onnxruntime has it, else the CPU provider. TensorRT only when asked for (building
    its engines takes minutes)."""
    if "CUDAExecutionProvider" in available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def session_placement(session: Any) -> Placement:
    """Where ``session`` runs: its first provider, and that provider's ``device_id``. Anything that
    does not say (a training adapter, a test double) runs on the CPU."""
    inner = getattr(session, "session", session)  # adapters that wrap an InferenceSession
    try:
        providers = list(inner.get_providers())
    except Exception:  # not an InferenceSession
        return CPU
    if not providers or providers[0] not in CUDA_PROVIDERS:
        return CPU
    index = 0
    try:
        index = int(inner.get_provider_options().get(providers[0], {}).get("device_id", 0))
    except Exception:  # options that do not say: device 0, as the provider assumes
        pass
    return Placement("cuda", index)


def resolve(session: Any, device: Any) -> Placement:
    """The placement of a feed of ``session`` asked for with ``device`` (see init_data_input_workers)."""
    asked = parse_device(device)
    placed = session_placement(session)
    if asked is None:
        return placed
    check_device(asked)
    if asked.kind == "cuda":
        if placed.kind != "cuda":
            raise ValueError(f"device {str(asked)!r}: the session runs on {_first_provider(session)}; create it with "
                             f"providers=['CUDAExecutionProvider', 'CPUExecutionProvider'] to run it on the GPU")
        if placed.index != asked.index:
            raise ValueError(f"device {str(asked)!r}: the session runs on cuda:{placed.index} (its provider option "
                             f"device_id); batches must go where it runs")
    return asked


def _first_provider(session: Any) -> str:
    try:
        return str(list(session.get_providers())[0])
    except Exception:
        return "the CPU"


def cuda_graph_enabled(session: Any) -> bool:
    """Whether ``session`` captures CUDA graphs (the CUDA provider's ``enable_cuda_graph``)."""
    try:
        opts = session.get_provider_options().get("CUDAExecutionProvider", {})
    except Exception:
        return False
    return str(opts.get("enable_cuda_graph", "0")).lower() in ("1", "true")


# ---- memory ----------------------------------------------------------------------------------------
class _Cudart:
    """The CUDA runtime that onnxruntime's CUDA provider loaded (never another one: RTLD_NOLOAD)."""

    NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")

    def __init__(self) -> None:
        lib = None
        mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
        for name in self.NAMES:
            try:
                lib = ctypes.CDLL(name, mode=mode)
                break
            except OSError:
                continue
        if lib is None:
            raise OSError("no CUDA runtime (libcudart) is loaded in this process")
        self.host_alloc = lib.cudaHostAlloc
        self.host_alloc.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)
        self.host_alloc.restype = ctypes.c_int
        self.free_host = lib.cudaFreeHost
        self.free_host.argtypes = (ctypes.c_void_p,)
        self.free_host.restype = ctypes.c_int


class _HostBuffer:
    """Pinned host memory seen by numpy (``__array_interface__``): the arrays made from it keep it
    alive, and it is given back to the CUDA runtime once the last of them is gone."""

    def __init__(self, cudart: _Cudart, shape: Tuple[int, ...], dtype: np.dtype):
        nbytes = max(1, int(np.prod(shape)) * dtype.itemsize)
        ptr = ctypes.c_void_p()
        err = cudart.host_alloc(ctypes.byref(ptr), nbytes, 1)  # cudaHostAllocPortable
        if err != 0 or not ptr.value:
            raise MemoryError(f"cudaHostAlloc of {nbytes} bytes failed (error {err})")
        self.__array_interface__ = {"shape": tuple(shape), "typestr": dtype.str, "data": (ptr.value, False),
                                    "version": 3}
        weakref.finalize(self, cudart.free_host, ptr.value).atexit = False


class DeviceMemory:
    """Staging host memory, device buffers and the copy between them, for one placement."""

    def __init__(self, placement: Placement, ort: Any):
        self.placement = placement
        self._ort = ort
        self._cudart: Optional[_Cudart] = None
        self._pinned = placement.kind == "cuda"
        self._lock = threading.Lock()

    @property
    def device_type(self) -> str:
        """ONNX Runtime's name of the device ("cuda", or "cpu" for the staged CPU path)."""
        return "cuda" if self.placement.kind == "cuda" else "cpu"

    def host_array(self, shape: Tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised host array the device copies from fast (pinned memory on a GPU)."""
        dtype = np.dtype(dtype)
        if self._pinned and dtype.kind in "biufc":
            try:
                with self._lock:
                    if self._cudart is None:
                        self._cudart = _Cudart()
                return np.asarray(_HostBuffer(self._cudart, tuple(shape), dtype))
            except (OSError, MemoryError, AttributeError) as e:
                self._pinned = False
                log.info("feeder: no pinned host memory (%s); batches are staged in pageable memory, whose copies "
                         "to the device are slower", e)
        return np.empty(shape, dtype)

    def device_value(self, shape: Tuple[int, ...], dtype: Any) -> Any:
        """An uninitialised OrtValue on the device, allocated once and reused."""
        return self._ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.dtype(dtype), self.device_type,
                                                               self.placement.index)

    def to_device(self, array: np.ndarray, value: Any) -> None:
        """Copy ``array`` (C-contiguous, the value's dtype and element count) into ``value``."""
        value.update_inplace(array)

    def nbytes(self, value: Any) -> int:
        return int(value.tensor_size_in_bytes())


class Slot:
    """Device buffers for one batch (one per input) and the IOBinding they are bound to.

    ``index`` >= 0 for a slot of the ring (reused), -1 for buffers of one batch's own."""

    __slots__ = ("index", "key", "inputs", "binding", "busy", "outputs", "run_options")

    def __init__(self, index: int, key: Any, inputs: List[Any], binding: Any):
        self.index, self.key, self.inputs, self.binding = index, key, inputs, binding
        self.busy = True
        self.outputs: Dict[Any, List[Any]] = {}  # fixed device outputs by output list (CUDA graphs)
        self.run_options: Any = None  # its own RunOptions naming its CUDA graph (gpu_graph_id = index)

    def release(self) -> None:
        """Free for the next batch: the run that read it has returned (or it was never run)."""
        self.busy = False


def copy_value(src: Any, dst: Any) -> None:
    """Copy one OrtValue into another of the same type and size, across devices (ONNX Runtime 1.32's
    ``update_inplace`` takes an OrtValue; older ones only numpy, through which it then goes)."""
    try:
        dst.update_inplace(src)
    except TypeError:
        dst.update_inplace(src.numpy())


def slot_key(arrays: Sequence[np.ndarray]) -> Tuple[Tuple[Tuple[int, ...], str], ...]:
    return tuple((a.shape, a.dtype.str) for a in arrays)


class SlotRing:
    """Up to ``size`` slots, reused once released; see the module docstring. Thread-safe."""

    def __init__(self, memory: DeviceMemory, names: Sequence[str], size: int,
                 make_binding: Optional[Callable[[], Any]] = None):
        self.memory = memory
        self.names = list(names)
        self.size = size
        self._make_binding = make_binding
        self._slots: List[Slot] = []
        self._lock = threading.Lock()
        self.allocations = 0   # slots made for the ring
        self.one_offs = 0      # batches that found no free slot and got buffers of their own
        self._closed = False

    def _new(self, index: int, key: Any) -> Slot:
        inputs = [self.memory.device_value(shape, np.dtype(dtype)) for shape, dtype in key]
        binding = None
        if self._make_binding is not None:
            binding = self._make_binding()
            for name, value in zip(self.names, inputs):
                binding.bind_ortvalue_input(name, value)  # once: a slot's addresses never change
        return Slot(index, key, inputs, binding)

    def acquire(self, key: Any) -> Slot:
        """A slot for arrays of ``key`` (shapes and dtypes), marked busy: a free one of the ring, a
        new one while the ring has room (or in place of a free one of other shapes), else buffers
        for this batch alone."""
        with self._lock:
            free_other = None
            for slot in self._slots:
                if not slot.busy:
                    if slot.key == key:
                        slot.busy = True
                        return slot
                    free_other = slot if free_other is None else free_other
            if not self._closed and (len(self._slots) < self.size or free_other is not None):
                if len(self._slots) < self.size:
                    index = len(self._slots)
                    slot = self._new(index, key)
                    self._slots.append(slot)
                else:  # the batch size changed: a slot of the old shapes makes room
                    assert free_other is not None
                    index = free_other.index
                    slot = self._new(index, key)
                    self._slots[index] = slot
                self.allocations += 1
                return slot
            self.one_offs += 1
        if self.one_offs in (1, 100, 10_000):
            log.info("feeder: %d batch(es) found no free device slot (%d slots): more batches were alive than slots "
                     "(several consumers?); each got device buffers of its own", self.one_offs, self.size)
        return self._new(-1, key)

    def place(self, arrays: Sequence[np.ndarray]) -> Slot:
        """Copy ``arrays`` (C-contiguous) into a slot; returns it busy (release it after the run)."""
        slot = self.acquire(slot_key(arrays))
        try:
            for array, value in zip(arrays, slot.inputs):
                self.memory.to_device(array, value)
        except BaseException:
            slot.release()
            raise
        return slot

    def device_bytes(self) -> int:
        """Device memory the ring's slots hold, in bytes (batches' own buffers not counted)."""
        with self._lock:
            return sum(self.memory.nbytes(v) for s in self._slots for v in s.inputs)

    def slots(self) -> int:
        with self._lock:
            return len(self._slots)

    def close(self) -> None:
        """Drop every slot (at stop): device memory is freed once no batch refers to it any more."""
        with self._lock:
            self._closed = True
            self._slots = []
