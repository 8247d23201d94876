"""Keep a GPU busy (issue 27): images/s of feeder and its peers on one workload, as ratios to the
model alone on device-resident inputs.

The workload: uint8 images [64, 3, 224, 224] (9.6 MB a batch) through a two-convolution stem,
fetched as 16-image slices of a pool (so a batch is assembled from 4 fetches). Columns, each run
for ``--seconds`` after a warm-up, in one process, one after the other:

- model alone, device inputs: IOBinding, the input already on the device (4 batches in turn), the
  output left there: the limit;
- session.run from host: ``session.run`` on host numpy batches (4 in turn);
- serial loop: fetch 4 slices, concatenate, ``session.run``;
- feeder, 2 / 4 / 8 threads, 4 / 8 processes: ``feed.run(outputs="device")`` (the output left on
  the device, as in the limit); "-host" columns with ``outputs="host"`` (numpy outputs);
- reference designs, written from feeder's own device code (``feeder.device``: its CUDA runtime
  interface, pinned staging, slots, a stream of its own), without feeder's feed around them:
  "ref-pin-4t": 4 threads fill reused pinned buffers, copies issued on an own stream one batch
  ahead into 4 slots, event wait, run; "ref-dma": slices already in pinned memory, each batch
  assembled by 4 asynchronous copies at offsets (no CPU copy); "ref-dma-shm": the same from a
  memfd mapping registered with the CUDA runtime (a worker process's shared memory). On the CPU
  provider they run on the stand-in of the CUDA runtime (copies are memmoves);
- hand loop, 2 copy threads: two Python threads copy the next batches into new device OrtValues
  (``ortvalue_from_numpy(x, "cuda", 0)``), the main thread binds and runs;
- hand loop, pinned + side stream: two Python threads fill 8 reused pinned torch buffers, the main
  thread issues each copy on a side CUDA stream one batch ahead and binds the device tensor's
  pointer (torch with CUDA only);
- DataLoader pin_memory: PyTorch ``DataLoader(num_workers=4, pin_memory=True)`` yielding whole
  batches, ``.to("cuda", non_blocking=True)`` issued one batch ahead, the pointer bound (torch only).

    python benchmarks/gpu.py                                 # on a GPU (onnxruntime-gpu), ~2 minutes
    python benchmarks/gpu.py --cuda-graph                    # feeder and the limit with enable_cuda_graph
    python benchmarks/gpu.py --probe                         # also: copy speeds, the GIL held by a copy
    python benchmarks/gpu.py --small --provider cpu          # anywhere: small images on the CPU provider
    python benchmarks/gpu.py --small --provider cpu --device cpu:staged   # feeder's device path on the CPU
    python benchmarks/gpu.py --small --provider cpu --device cpu:staged --columns feeder-2t \
        --trace benchmarks/results/trace-cpu-staged.json     # a trace of 30 batches (docs/gpu.md's picture)

Results go to ``benchmarks/results/gpu-<provider>.json`` (``--json``) with the date, the command,
the device and the versions, the images/s of each column, and ``targets``: the issue's ratios
(feeder with 4 threads and 4 processes against the model alone, ``session.run`` from host, the torch
side-stream loop and the DataLoader), each with its goal and whether it was met. Ratios carry over
between machines better than images/s.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import queue
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import feeder  # noqa: E402
from feeder.device import DeviceMemory, parse_device, providers_for  # noqa: E402


# ---- the workload ---------------------------------------------------------------------------------
class Slices:
    """``slice`` consecutive images of a pool of random uint8 images (the pool is made in the process
    that calls it, so worker processes each have their own and nothing big is pickled)."""

    def __init__(self, images: int, size: int, slice_: int, seed: int = 0):
        self.images, self.size, self.slice = images, size, slice_
        self.seed = seed
        self.pool: Optional[np.ndarray] = None
        self._rng: Optional[np.random.Generator] = None

    def _make(self, worker_id: int) -> None:
        rng = np.random.default_rng(self.seed + worker_id)
        self.pool = rng.integers(0, 256, (self.images, 3, self.size, self.size), dtype=np.uint8)
        self._rng = rng

    def __call__(self, worker_id: int, batch_size: int) -> List[np.ndarray]:
        if self.pool is None:
            self._make(worker_id)
        assert self._rng is not None and self.pool is not None
        start = int(self._rng.integers(0, self.images - self.slice))
        return [self.pool[start:start + self.slice]]

    def __getstate__(self) -> Dict[str, Any]:
        return {"images": self.images, "size": self.size, "slice": self.slice, "seed": self.seed, "pool": None,
                "_rng": None}


def stem_model(channels: int = 32) -> bytes:
    """uint8 [N, 3, H, W] -> /255 -> Conv 3x3 stride 2 -> Relu -> Conv 3x3 stride 2 -> Relu ->
    global average pool -> [N, 2 * channels]: a two-convolution stem."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((channels, 3, 3, 3)) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((2 * channels, channels, 3, 3)) * 0.05).astype(np.float32)
    nodes = [
        helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["xf", "scale"], ["xs"]),
        helper.make_node("Conv", ["xs", "w1"], ["c1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"]),
        helper.make_node("Flatten", ["p"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "stem", [helper.make_tensor_value_info("x", TensorProto.UINT8, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2 * channels])],
        [numpy_helper.from_array(np.array(1 / 255, np.float32), "scale"), numpy_helper.from_array(w1, "w1"),
         numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model.SerializeToString()


class Bench:
    def __init__(self, args: argparse.Namespace):
        import onnxruntime as ort

        self.ort = ort
        self.args = args
        self.model = stem_model()
        self.providers = providers_for(args.provider) or feeder.device.default_providers()
        self.session = self.make_session(graph=False)
        self.graph_session = self.make_session(graph=True) if args.cuda_graph else self.session
        self.placement = feeder.device.session_placement(self.session)
        self.dev = ("cuda" if self.placement.kind == "cuda" else "cpu", self.placement.index)
        self.fetch = Slices(args.pool, args.image, args.slice)
        self.batch = args.batch
        self.per_batch = args.batch // args.slice
        self.host = [np.concatenate([self.fetch(0, self.batch)[0] for _ in range(self.per_batch)]) for _ in range(4)]
        self.diagnoses: Dict[str, str] = {}
        self.traced = False

    def make_session(self, graph: bool) -> Any:
        ort = self.ort
        opts = ort.SessionOptions()
        providers: List[Any] = []
        for p in self.providers:
            name, options = (p[0], dict(p[1])) if isinstance(p, tuple) else (p, {})
            if graph and name == "CUDAExecutionProvider":
                options["enable_cuda_graph"] = "1"
            providers.append((name, options) if options else name)
        if self.args.provider in (None, "cpu") and "CUDAExecutionProvider" not in str(self.providers):
            opts.intra_op_num_threads = max(1, (os.cpu_count() or 2) - 1)  # leave a core to the fetchers
        return ort.InferenceSession(self.model, opts, providers=providers)

    def timed(self, step: Callable[[], int], label: str) -> float:
        """Images per second over --seconds of ``step()`` (which returns the images it ran), after
        --warmup seconds of it."""
        t_end = time.perf_counter() + self.args.warmup
        while time.perf_counter() < t_end:
            step()
        images = 0
        t0 = time.perf_counter()
        while True:
            images += step()
            elapsed = time.perf_counter() - t0
            if elapsed >= self.args.seconds:
                rate = images / elapsed
                print(f"  {label:<40} {rate:>12,.0f} images/s", file=sys.stderr, flush=True)
                return rate

    # ---- the columns ------------------------------------------------------------------------------
    def model_alone(self) -> float:
        sess = self.graph_session
        from_numpy = self.ort.OrtValue.ortvalue_from_numpy
        if self.args.cuda_graph:  # one input buffer: a captured graph replays its addresses
            values = [from_numpy(self.host[0], *self.dev)]
        else:
            values = [from_numpy(h, *self.dev) for h in self.host]
        binding = sess.io_binding()
        binding.bind_output("y", *self.dev)
        state = {"i": 0}

        def step() -> int:
            binding.bind_ortvalue_input("x", values[state["i"] % len(values)])
            state["i"] += 1
            sess.run_with_iobinding(binding)
            return self.batch
        return self.timed(step, "model alone, device inputs")

    def session_run(self) -> float:
        state = {"i": 0}

        def step() -> int:
            self.session.run(None, {"x": self.host[state["i"] % 4]})
            state["i"] += 1
            return self.batch
        return self.timed(step, "session.run from host")

    def serial(self) -> float:
        def step() -> int:
            x = np.concatenate([self.fetch(0, self.batch)[0] for _ in range(self.per_batch)])
            self.session.run(None, {"x": x})
            return self.batch
        return self.timed(step, "serial loop")

    def feeder(self, threads: int = 0, processes: int = 0, outputs: str = "device") -> float:
        coord = feeder.GlobalCoordinator()
        kind = {"num_worker_processes": processes} if processes else {"num_worker_threads": threads}
        feeder.init_data_input_workers(self.graph_session, ["x"], Slices(self.args.pool, self.args.image,
                                                                         self.args.slice),
                                       self.batch, coordinator=coord, timeout=120, log_interval=3600.0,
                                       device=self.args.device, **kind)
        label = f"feeder, {processes} processes" if processes else f"feeder, {threads} threads"
        label += f", outputs={outputs}"
        with coord:
            feed = coord.feed("train")

            def step() -> int:
                feed.run(outputs=outputs)
                return self.batch
            rate = self.timed(step, label)
            key = f"feeder-{processes}p" if processes else f"feeder-{threads}t"
            self.diagnoses[key + ("" if outputs == "device" else "-host")] = feed.diagnose()
            if self.args.trace and not self.traced:
                self.traced = True
                with feed.trace(self.args.trace):
                    for _ in range(30):
                        step()
                print(f"  trace of 30 batches written to {self.args.trace}", file=sys.stderr)
            return rate

    # ---- reference designs, from feeder's own device code (no feed around it) ---------------------------
    def _device_parts(self) -> Any:
        """feeder's CUDA runtime interface (the stand-in on the CPU provider), device memory, a transfer
        on an own stream, and 4 slots bound once, each with its binding and the output bound."""
        from feeder.device import DeviceMemory, Placement, SlotRing, StandIn, Transfer
        from feeder.device.cudart import CudaRuntime

        cuda = self.dev[0] == "cuda"
        placement = Placement("cuda", self.dev[1]) if cuda else Placement("cpu", 0, staged=True)
        runtime = CudaRuntime.loaded() if cuda else StandIn()
        if runtime is None:
            raise RuntimeError("no CUDA runtime is loaded in this process")
        memory = DeviceMemory(placement, self.ort, runtime)
        transfer = Transfer(memory)
        sess = self.graph_session

        def binding() -> Any:
            b = sess.io_binding()
            b.bind_output("y", *self.dev)
            return b

        ring = SlotRing(memory, ["x"], 4, make_binding=binding)
        shape = (self.batch, 3, self.args.image, self.args.image)
        slots = [ring.acquire([int(np.prod(shape))]) for _ in range(4)]
        for slot in slots:
            slot.bind_inputs(["x"], [(np.dtype(np.uint8), shape)], self.dev)
        return memory, transfer, slots, shape

    def _ref_loop(self, label: str, issue: Callable[[Any], Any], transfer: Any, slots: List[Any]) -> float:
        """Issue the copies of batch n+1, wait for batch n's, run it: the reference's consumer."""
        sess = self.graph_session
        state: Dict[str, Any] = {"i": 0}

        def next_copy() -> Any:
            slot = slots[state["i"] % len(slots)]
            state["i"] += 1
            return slot, issue(slot)

        state["next"] = next_copy()

        def step() -> int:
            slot, (ticket, done) = state["next"]
            state["next"] = next_copy()  # the next batch's copy, issued before this one runs
            ticket.wait()
            if done is not None:
                done()
            sess.run_with_iobinding(slot.binding)
            return self.batch
        try:
            return self.timed(step, label)
        finally:
            transfer.close()

    def ref_pinned_threads(self, k: int = 4) -> float:
        """K threads fill reused pinned buffers (numpy copies release the GIL); the consumer issues each
        batch's copy on an own stream one batch ahead into one of 4 slots, waits on its event, runs."""
        memory, transfer, slots, shape = self._device_parts()
        pinned = [memory.host_array(shape, np.uint8) for _ in range(8)]
        free: "queue.Queue[int]" = queue.Queue()
        filled: "queue.Queue[int]" = queue.Queue()
        for i in range(len(pinned)):
            free.put(i)
        stop = threading.Event()
        s = self.args.slice

        def filler(seed: int) -> None:
            fetch = Slices(self.args.pool, self.args.image, s, seed=seed)
            while not stop.is_set():
                try:
                    i = free.get(timeout=0.1)
                except queue.Empty:
                    continue
                for j in range(self.per_batch):
                    np.copyto(pinned[i][j * s:(j + 1) * s], fetch(0, self.batch)[0])
                filled.put(i)

        threads = [threading.Thread(target=filler, args=(11 + t,), daemon=True) for t in range(k)]
        for t in threads:
            t.start()

        def issue(slot: Any) -> Any:
            i = filled.get()
            return transfer.copy(slot, [(pinned[i],)]), lambda: free.put(i)
        try:
            return self._ref_loop(f"reference: {k} threads fill pinned buffers, own stream", issue, transfer,
                                  slots)
        finally:
            stop.set()
            for t in threads:
                t.join(5)

    def ref_dma(self, registered: bool = False) -> float:
        """Slices already in pinned (or registered) memory: each batch is 4 asynchronous copies at
        offsets into a slot, no CPU copy at all."""
        import mmap

        memory, transfer, slots, shape = self._device_parts()
        n, s = 32, self.args.slice
        chunk = (s, 3, self.args.image, self.args.image)
        keep: List[Any] = []
        if registered:
            size = n * int(np.prod(chunk))
            fd = os.memfd_create("feeder-gpu-bench")
            os.ftruncate(fd, size)
            mem = mmap.mmap(fd, size)
            os.close(fd)
            arr = np.frombuffer(mem, np.uint8)
            undo = memory.register(arr.ctypes.data, size)
            chunks = [arr[i * arr.size // n:(i + 1) * arr.size // n].reshape(chunk) for i in range(n)]
            keep += [mem, arr]
        else:
            chunks = [memory.host_array(chunk, np.uint8) for _ in range(n)]
        fetch = Slices(self.args.pool, self.args.image, s, seed=5)
        for c in chunks:
            np.copyto(c, fetch(0, self.batch)[0])
        rng = np.random.default_rng(5)

        def issue(slot: Any) -> Any:
            parts = tuple(chunks[int(rng.integers(0, n))] for _ in range(self.per_batch))
            return transfer.copy(slot, [parts]), None
        where = "registered shared memory" if registered else "pinned memory"
        label = f"reference: slices in {where}, copies at offsets"
        try:
            return self._ref_loop(label, issue, transfer, slots)
        finally:
            if registered:
                del chunks, arr
                if undo is not None:
                    undo()  # before the mapping goes (feeder.device.cudart: error 208 otherwise)
                keep.clear()

    def hand_copy_threads(self) -> float:
        """Two Python threads copy the next batches into new device OrtValues; this thread runs."""
        sess = self.session
        ready: "queue.Queue[Any]" = queue.Queue(maxsize=4)
        stop = threading.Event()
        from_numpy = self.ort.OrtValue.ortvalue_from_numpy
        fetch = Slices(self.args.pool, self.args.image, self.args.slice, seed=7)
        lock = threading.Lock()

        def copier() -> None:
            while not stop.is_set():
                with lock:
                    parts = [fetch(0, self.batch)[0] for _ in range(self.per_batch)]
                value = from_numpy(np.concatenate(parts), *self.dev)
                while not stop.is_set():
                    try:
                        ready.put(value, timeout=0.1)
                        break
                    except queue.Full:
                        pass

        threads = [threading.Thread(target=copier, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        binding = sess.io_binding()
        binding.bind_output("y", *self.dev)

        def step() -> int:
            binding.bind_ortvalue_input("x", ready.get())
            sess.run_with_iobinding(binding)
            return self.batch
        try:
            return self.timed(step, "hand loop, 2 copy threads")
        finally:
            stop.set()
            for t in threads:
                t.join(5)

    def hand_pinned_stream(self) -> Optional[float]:
        """Two threads fill 8 reused pinned torch buffers; copies on a side stream one batch ahead."""
        import torch

        if self.dev[0] != "cuda" or not torch.cuda.is_available():
            return None
        sess, n = self.session, 8
        shape = (self.batch, 3, self.args.image, self.args.image)
        pinned = [torch.empty(shape, dtype=torch.uint8).pin_memory() for _ in range(n)]
        device = [torch.empty(shape, dtype=torch.uint8, device=f"cuda:{self.dev[1]}") for _ in range(n)]
        free: "queue.Queue[int]" = queue.Queue()
        filled: "queue.Queue[int]" = queue.Queue()
        for k in range(n):
            free.put(k)
        stop = threading.Event()
        fetch = Slices(self.args.pool, self.args.image, self.args.slice, seed=9)
        lock = threading.Lock()

        def filler() -> None:
            while not stop.is_set():
                try:
                    k = free.get(timeout=0.1)
                except queue.Empty:
                    continue
                view = pinned[k].numpy()
                s = self.args.slice
                for j in range(self.per_batch):
                    with lock:
                        part = fetch(0, self.batch)[0]
                    np.copyto(view[j * s:(j + 1) * s], part)
                filled.put(k)

        threads = [threading.Thread(target=filler, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        side = torch.cuda.Stream(device=self.dev[1])
        binding = sess.io_binding()
        binding.bind_output("y", *self.dev)

        def issue() -> Any:
            k = filled.get()
            with torch.cuda.stream(side):
                device[k].copy_(pinned[k], non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            return k, event

        state = {"next": issue()}

        def step() -> int:
            k, event = state["next"]
            state["next"] = issue()  # the next batch's copy, issued before this batch runs
            event.synchronize()
            binding.bind_input("x", "cuda", self.dev[1], np.uint8, shape, device[k].data_ptr())
            sess.run_with_iobinding(binding)
            free.put(k)
            return self.batch
        try:
            return self.timed(step, "hand loop, pinned + side stream (torch)")
        finally:
            stop.set()
            for t in threads:
                t.join(5)

    def dataloader(self) -> Optional[float]:
        import torch

        cuda = self.dev[0] == "cuda" and torch.cuda.is_available()
        loader = torch.utils.data.DataLoader(_batches(self.args.pool, self.args.image, self.args.slice, self.batch),
                                             batch_size=None, num_workers=4, pin_memory=cuda,
                                             multiprocessing_context="fork")
        held = {"it": iter(loader)}  # cleared at the end: that shuts the workers down
        sess = self.session
        binding = sess.io_binding()
        binding.bind_output("y", *self.dev)
        shape = (self.batch, 3, self.args.image, self.args.image)

        def fetch_next() -> Any:
            t = next(held["it"])
            return t.to(f"cuda:{self.dev[1]}", non_blocking=True) if cuda else t

        state = {"next": fetch_next()}

        def step() -> int:
            t = state["next"]
            state["next"] = fetch_next()  # the next batch's copy, issued before this one runs
            if cuda:
                torch.cuda.current_stream().synchronize()
            binding.bind_input("x", self.dev[0], self.dev[1], np.uint8, shape, t.data_ptr())
            sess.run_with_iobinding(binding)
            return self.batch
        try:
            return self.timed(step, f"DataLoader(num_workers=4, pin_memory={cuda})")
        finally:
            held.clear()
            state.clear()

    # ---- probes -------------------------------------------------------------------------------------
    def probe(self) -> Dict[str, Any]:
        """Copy speeds (pageable and pinned staging, update_inplace) and how long a copy keeps the GIL
        from another thread; whether copy_tensors works here."""
        out: Dict[str, Any] = {}
        x = self.host[0]
        mem = DeviceMemory(self.placement if self.placement.kind == "cuda" else parse_device("cpu:staged"),
                           self.ort)
        dst = mem.device_value(x.shape, x.dtype)
        pinned = mem.host_array(x.shape, x.dtype)
        np.copyto(pinned, x)
        out["staging is pinned"] = type(pinned.base).__name__ == "_HostBuffer"
        for label, src in (("pageable", x), ("staging", pinned)):
            dst.update_inplace(src)
            t0 = time.perf_counter()
            for _ in range(20):
                dst.update_inplace(src)
            out[f"update_inplace from {label}, GB/s"] = 20 * x.nbytes / (time.perf_counter() - t0) / 1e9
        for label, src in (("none", None), ("pageable", x), ("staging", pinned)):
            out[f"GIL: 99.9th percentile of another thread's gaps while copying from {label}, us"] = _gil_wait(dst, src)
        try:
            self.ort.copy_tensors([self.ort.OrtValue.ortvalue_from_numpy(pinned)], [dst], None)
            out["copy_tensors"] = "works"
        except Exception as e:  # what the next GPU session needs to know
            out["copy_tensors"] = f"{type(e).__name__}: {e}"
        for k, v in out.items():
            print(f"  probe: {k}: {v}", file=sys.stderr)
        return out


def _batches(images: int, size: int, slice_: int, batch: int) -> Any:
    """An iterable torch dataset of whole batches (4 slices each), for the DataLoader column (its
    workers are forked: the class need not be importable)."""
    import torch

    class Batches(torch.utils.data.IterableDataset):  # type: ignore[misc]
        def __iter__(self) -> Any:
            info = torch.utils.data.get_worker_info()
            wid = info.id if info is not None else 0
            fetch = Slices(images, size, slice_)
            while True:
                parts = [fetch(wid, batch)[0] for _ in range(batch // slice_)]
                yield torch.from_numpy(np.concatenate(parts))

    return Batches()


def _gil_wait(dst: Any, src: Optional[np.ndarray], seconds: float = 0.5) -> float:
    """The 99.9th percentile of the gaps between a Python loop's iterations while another thread
    copies ``src`` to ``dst`` without pause (a copy that holds the GIL shows as gaps of its length)."""
    stop = threading.Event()

    def copier() -> None:
        while not stop.is_set():
            dst.update_inplace(src)

    t = threading.Thread(target=copier, daemon=True)
    if src is not None:
        t.start()
    gaps = []
    last = time.perf_counter()
    end = last + seconds
    while last < end:
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    stop.set()
    if src is not None:
        t.join(5)
    return float(np.percentile(np.array(gaps), 99.9) * 1e6)


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", default=None, help="cpu, cuda or cuda:N (default: the GPU where installed)")
    ap.add_argument("--device", default=None, help="feeder's device= (default: the session's; cpu:staged to try "
                                                   "the device path on the CPU)")
    ap.add_argument("--small", action="store_true", help="small images (64 px, batch 8 of 2-image slices), for "
                                                         "the CPU provider")
    ap.add_argument("--cuda-graph", action="store_true", help="the limit and feeder with enable_cuda_graph")
    ap.add_argument("--probe", action="store_true", help="also measure copy speeds and the GIL a copy holds")
    ap.add_argument("--seconds", type=float, default=5.0, help="measuring time per column")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of each column before measuring")
    ap.add_argument("--columns", nargs="*", help="a subset of the column keys (see COLUMNS)")
    ap.add_argument("--json", default=None, help="results file (default benchmarks/results/gpu-<provider>.json)")
    ap.add_argument("--trace", default=None, help="write a trace of 30 batches of the first feeder column there "
                                                  "(feed.trace: open it in ui.perfetto.dev)")
    args = ap.parse_args(argv)
    args.batch, args.image, args.slice, args.pool = (8, 64, 2, 256) if args.small else (64, 224, 16, 1024)
    try:
        bench = Bench(args)
    except ValueError as e:
        ap.error(str(e))
    have_torch = importlib.util.find_spec("torch") is not None
    columns: Dict[str, Callable[[], Optional[float]]] = {
        "limit": bench.model_alone, "host": bench.session_run, "serial": bench.serial,
        "feeder-2t": lambda: bench.feeder(threads=2), "feeder-4t": lambda: bench.feeder(threads=4),
        "feeder-8t": lambda: bench.feeder(threads=8), "feeder-4p": lambda: bench.feeder(processes=4),
        "feeder-8p": lambda: bench.feeder(processes=8),
        "feeder-4t-host": lambda: bench.feeder(threads=4, outputs="host"),
        "feeder-4p-host": lambda: bench.feeder(processes=4, outputs="host"),
        "ref-pin-4t": bench.ref_pinned_threads, "ref-dma": bench.ref_dma,
        "ref-dma-shm": lambda: bench.ref_dma(registered=True),
        "hand-2t": bench.hand_copy_threads,
        "hand-pinned": bench.hand_pinned_stream if have_torch else (lambda: None),
        "dataloader": bench.dataloader if have_torch else (lambda: None),
    }
    wanted = args.columns or list(columns)
    unknown = [k for k in wanted if k not in columns]
    if unknown:
        ap.error(f"unknown columns {unknown}; columns: {list(columns)}")
    print(f"{device_name()}, {bench.session.get_providers()[0]}, batch {args.batch} x 3 x {args.image}^2 uint8 "
          f"({bench.host[0].nbytes / 1e6:.1f} MB), slices of {args.slice}", file=sys.stderr)
    rates: Dict[str, Optional[float]] = {}
    errors: Dict[str, str] = {}
    for key in wanted:
        try:
            rates[key] = columns[key]()
        except Exception as e:  # noqa: BLE001 - one column's failure is a result, the others still run
            rates[key] = None
            errors[key] = f"{type(e).__name__}: {e}"
            print(f"  {key:<40} failed: {errors[key]}", file=sys.stderr)
            continue
        if rates[key] is None:
            why = "torch is not installed" if not have_torch else "needs torch with CUDA"
            errors[key] = f"skipped: {why}"
            print(f"  {key:<40} skipped ({why})", file=sys.stderr)
    probe = bench.probe() if args.probe else None
    limit = rates.get("limit")
    host = rates.get("host")
    lines = ["| column | images/s | x model alone on device inputs | x session.run from host |", "|---|---|---|---|"]
    for key, rate in rates.items():
        if rate is None:
            lines.append(f"| {key} | {errors.get(key, 'skipped')} | - | - |")
            continue
        r1 = f"{rate / limit:.2f}" if limit else "-"
        r2 = f"{rate / host:.2f}" if host else "-"
        lines.append(f"| {key} | {rate:,.0f} | {r1} | {r2} |")
    print("\n".join(lines))
    found = targets(rates, args.cuda_graph)
    for name, t in found.items():
        print(f"  target {name}: {t['ratio']:.2f} (goal >= {t['goal']}){'' if t['met'] else '  NOT MET'}",
              file=sys.stderr)
    import onnxruntime

    meta = {"date": datetime.date.today().isoformat(), "command": "python benchmarks/gpu.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "device": device_name(),
        "provider": bench.session.get_providers()[0], "feeder device": str(bench.placement) if args.device is None
        else args.device, "cuda_graph": args.cuda_graph, "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__, "python": platform.python_version(), "seconds": args.seconds,
        "batch": args.batch, "image": args.image, "slice": args.slice, "cpu_count": os.cpu_count()}
    path = args.json or os.path.join(HERE, "results", f"gpu-{'cuda' if bench.dev[0] == 'cuda' else 'cpu'}"
                                                      f"{'-small' if args.small else ''}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "images_per_s": rates, "ratios_to_limit": {
            k: round(v / limit, 3) for k, v in rates.items() if v is not None and limit and k != "limit"},
            "targets": found, "errors": errors, "diagnose": bench.diagnoses, "probe": probe}, f, indent=2)
    print(f"written to {path}", file=sys.stderr)
    return 0


# The issue's targets (issue 33): feeder with 4 threads and 4 processes against each reference.
TARGETS = [
    ("feeder-4t / limit", "feeder-4t", "limit", 0.92), ("feeder-4p / limit", "feeder-4p", "limit", 0.92),
    ("feeder-4t-host / limit", "feeder-4t-host", "limit", 0.92),
    ("feeder-4p-host / limit", "feeder-4p-host", "limit", 0.92),
    ("feeder-4t / session.run from host", "feeder-4t", "host", 2.5),
    ("feeder-4p / session.run from host", "feeder-4p", "host", 2.5),
    ("feeder-4t / torch pinned side-stream loop", "feeder-4t", "hand-pinned", 1.3),
    ("feeder-4p / torch pinned side-stream loop", "feeder-4p", "hand-pinned", 1.3),
    ("feeder-4t / DataLoader(pin_memory=True)", "feeder-4t", "dataloader", 7.0),
    ("feeder-4p / DataLoader(pin_memory=True)", "feeder-4p", "dataloader", 7.0),
]


def targets(rates: Dict[str, Optional[float]], cuda_graph: bool) -> Dict[str, Dict[str, Any]]:
    """Each target whose two columns ran: the ratio, the goal, whether it was met. (With
    ``--cuda-graph`` the same ratios are those of enable_cuda_graph: "the same or better".)"""
    out = {}
    for name, num, den, goal in TARGETS:
        a, b = rates.get(num), rates.get(den)
        if a and b:
            ratio = a / b
            out[name + (" (enable_cuda_graph)" if cuda_graph else "")] = {
                "ratio": round(ratio, 3), "goal": goal, "met": ratio >= goal}
    return out


if __name__ == "__main__":
    sys.exit(main())
