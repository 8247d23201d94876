"""Batches on a device (a GPU) before the runtime asks.

* ``placement``: where a session runs and where its batches go (devices, providers);
* ``cudart``: the CUDA runtime behind one small interface (the one ONNX Runtime's CUDA provider
  loaded, through ctypes), and a stand-in for it on the CPU (tests, ``device="cpu:staged"``);
* ``memory``: host memory the device copies from fast (pinned staging, registered shared memory),
  device buffers allocated once, and the slots that reuse them for batches of any shape;
* ``transfer``: the copies themselves, on a CUDA stream of the feed's own, with an event per
  batch that the consumer waits on just before the run.

How a batch gets to the device (``docs/gpu.md`` says it for users): the feed plans the batch under
its lock (``feeder.rebatcher``), its bytes are written into pinned staging memory by one of several
threads outside the lock (``feeder.assembly``) unless they already lie in memory the device copies
from fast (a worker process's registered shared memory, a fetcher's pinned coalescing buffer), then
``cudaMemcpyAsync`` on the feed's stream puts them into a device slot at their offsets; the consumer
waits on the batch's event (the GIL released) and runs. ``feeder.runtime`` makes those copies;
the rest of feeder asks this package only where a session runs (``placement``: the argument
checks, ``feeder.predict``, ``feeder bench``). It imports nothing of feeder's.
"""
from .cudart import CudaError, CudaRuntime, StandIn
from .memory import DeviceMemory, HostRanges, Slot, SlotRing, _HostBuffer, copy_value
from .placement import (
    CPU,
    CUDA_PROVIDERS,
    PACKAGE_OF,
    Placement,
    available_providers,
    check_device,
    cuda_graph_enabled,
    default_providers,
    parse_device,
    providers_for,
    resolve,
    session_placement,
)
from .transfer import Ticket, Transfer

__all__ = [
    "CPU", "CUDA_PROVIDERS", "PACKAGE_OF", "Placement", "available_providers", "check_device", "cuda_graph_enabled",
    "default_providers", "parse_device", "providers_for", "resolve", "session_placement",
    "CudaError", "CudaRuntime", "StandIn", "DeviceMemory", "HostRanges", "Slot", "SlotRing", "_HostBuffer",
    "Ticket", "Transfer", "copy_value", "runtime_for",
]


def runtime_for(placement: Placement) -> object:
    """The CUDA runtime a feed on ``placement`` copies with: the one the process has loaded (the
    CUDA provider loads it when its session is made) for a CUDA device, None where none is reachable
    (copies then go through ``update_inplace``); the stand-in for ``cpu:staged``. Tests replace this
    function to put a recording, asynchronous stand-in under a feed."""
    if placement.kind == "cuda":
        return CudaRuntime.loaded()
    if placement.staged:
        return StandIn()
    return None
