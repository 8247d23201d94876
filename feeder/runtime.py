"""Everything that knows about ONNX Runtime: signatures, OrtValues, IOBinding, running.

onnxruntime is imported lazily, so the rest of feeder works (with ``session=None``)
where it is not installed.

Facts this module is built on (measured with onnxruntime 1.31 on CPU):

* ``OrtValue.ortvalue_from_numpy`` is zero-copy for a C-contiguous array; the array must
  outlive the OrtValue, so a :class:`PreparedBatch` keeps both.
* ``run_with_iobinding`` releases the GIL and is safe on a shared session, but one
  ``IOBinding`` used from two threads crashes the process: bindings are per thread.
"""
from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from . import device as devices
from .device import (
    CPU,
    DeviceMemory,
    Placement,
    SlotRing,
    Transfer,
    copy_value,
    cuda_graph_enabled,
    default_providers,
    parse_device,
    providers_for,
    resolve,
    session_placement,
)
from .device.transfer import sources_of
from .errors import FeederError
from .rebatcher import BufferRing
from .validation import InputSpec

_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int8)": np.int8, "tensor(int16)": np.int16, "tensor(int32)": np.int32, "tensor(int64)": np.int64,
    "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64, "tensor(bool)": np.bool_,
}


def import_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as e:  # pragma: no cover - exercised only where onnxruntime is absent
        raise FeederError("onnxruntime is not installed; pip install onnxruntime") from e
    return onnxruntime


def is_session(obj: Any) -> bool:
    """Anything with an ONNX Runtime style input signature can be fed."""
    return callable(getattr(obj, "get_inputs", None))


def input_specs(session: Any) -> List[InputSpec]:
    """The session's (data) inputs as InputSpecs, in the session's order."""
    specs = []
    for arg in session.get_inputs():
        type_str = getattr(arg, "type", None) or ""
        shape = getattr(arg, "shape", None)
        dims = None
        if shape is not None:
            dims = tuple(d if isinstance(d, int) and d >= 0 else None for d in shape)
        is_string = type_str == "tensor(string)"
        dtype = None if is_string else _ORT_TYPES.get(type_str)
        specs.append(InputSpec(arg.name, np.dtype(dtype) if dtype is not None else None, dims, is_string))
    return specs


def intra_op_threads(session: Any) -> Optional[int]:
    """The session's intra-op thread setting (0: ONNX Runtime's default, all cores), or None
    when it cannot be told (a training adapter, or an older onnxruntime)."""
    inner = getattr(session, "session", session)  # StatefulSession wraps an InferenceSession
    try:
        return int(inner.get_session_options().intra_op_num_threads)
    except Exception:  # not an InferenceSession: nothing to advise about
        return None


def output_names(session: Any) -> List[str]:
    return [o.name for o in session.get_outputs()]


class PreparedBatch:
    """A batch ready for the runtime: the numpy arrays and, for IOBinding, their OrtValues and an
    IOBinding with them bound (``binding``), with its outputs bound to reused buffers
    (``outputs``) once their shapes are known (see :class:`Runner`). On a device feed, ``slot`` is
    the device slot (``feeder.device.Slot``) the batch was copied into, busy until it was run, and
    ``ticket`` the copy to wait on before the run (``feeder.device.Ticket``).

    A batch whose rows went to the device straight from where they lay (a worker process's
    shared memory: ``pieces``, per input the arrays whose bytes make it, ``meta`` its dtypes and
    shapes) has no host array of those inputs until asked (:meth:`as_dict` writes them)."""

    __slots__ = ("names", "arrays", "ortvalues", "rows", "nbytes", "keys", "binding", "outputs", "output_names",
                 "output_where", "shape_key", "slot", "unfed", "ticket", "pieces", "meta")

    def __init__(self, names: Sequence[str], arrays: Sequence[Any], rows: int,
                 ortvalues: Optional[List[Any]] = None, nbytes: Optional[int] = None):
        self.names = names
        self.arrays = arrays
        self.rows = rows
        self.nbytes = sum(a.nbytes for a in arrays) if nbytes is None else nbytes
        self.ortvalues = ortvalues
        self.keys: Optional[np.ndarray] = None  # the row keys of a keyed source (feeder.rowkeys)
        self.binding: Any = None                # an IOBinding with this batch bound (Runner.prepare)
        self.outputs: Optional[List[np.ndarray]] = None  # the buffers its outputs are bound to, if any
        self.output_names: Optional[List[str]] = None    # the outputs bound
        self.output_where = "host"              # where they are bound: "host" buffers or "device" values
        self.shape_key: Any = None              # the input shapes: what the output shapes were learned for
        self.slot: Any = None                   # its device slot (feeder.device.Slot), on a device feed
        self.unfed: Optional[Dict[str, np.ndarray]] = None  # arrays the session takes not (a pad mask it lacks)
        self.ticket: Any = None                 # its copy to the device (feeder.device.Ticket)
        self.pieces: Optional[List[Tuple[np.ndarray, ...]]] = None  # per input: the pieces copied straight
        self.meta: Optional[List[Tuple[np.dtype, Tuple[int, ...]]]] = None  # per input: dtype and shape

    def host_arrays(self) -> Sequence[np.ndarray]:
        """The batch's arrays on the host, written now from its pieces where it has none."""
        if self.pieces is not None and any(a is None for a in self.arrays):
            arrays = list(self.arrays)
            assert self.meta is not None
            for i, (a, parts, (dtype, shape)) in enumerate(zip(arrays, self.pieces, self.meta)):
                if a is None:
                    out = np.empty(shape, dtype)
                    np.concatenate(parts, axis=0, out=out)
                    arrays[i] = out
            self.arrays = arrays
        return self.arrays

    def as_dict(self) -> Dict[str, np.ndarray]:
        out = dict(zip(self.names, self.host_arrays()))
        if self.unfed:
            out.update(self.unfed)
        return out

    def release(self) -> None:
        """Give its device slot back (after its run, or when it is handed out without one)."""
        slot, self.slot = self.slot, None
        if slot is not None:
            slot.release()


# ONNX Runtime's words for a preallocated output of the wrong shape: the outputs of this model
# depend on the data, not only on the input shapes, so they cannot be bound ahead.
_SHAPE_MISMATCH = ("shape mismatch", "re-use buffer", "reuse buffer")
# Input shapes whose output shapes a Runner remembers: batches of one size (and a short last one)
# need a few; chunks passed on as they come (dont_rebatch) of ever new sizes must not grow it forever.
MAX_TEMPLATES = 64
# Output lists (and input shapes) whose buffer rings a Runner keeps at once: consumers asking for a
# few different output lists each reuse theirs; beyond this, the least recently made ring goes.
MAX_OUTPUT_RINGS = 8
OUTPUT_PLACES = ("host", "device")
Template = Tuple[List[Tuple[int, ...]], List[np.dtype]]  # output shapes and dtypes, in output order
STATEFUL_SLOTS = 6  # device slots of a StatefulSession (batches prepared ahead of its steps, all its feeds)


class Runner:
    """Runs batches through one session for one feed.

    ``prepare`` runs when a batch is made, ahead of the consumer, in whichever thread moves
    batches into the feed's ready queue (the enqueuer, a producer's pump or a consumer that found
    nothing ready; always under the feed's pump lock, one batch at a time): OrtValues wrap the batch's
    arrays (no copy) and, for an InferenceSession, an IOBinding from a small pool gets them bound,
    with every output bound too: to buffers of a reused ring (``BufferRing``: a buffer set is
    reused once nobody holds the arrays ``run`` returned from it) when the output shapes for these
    input shapes are known, else to ONNX Runtime's allocator. ``run``, in the consumer thread, is
    then one ``run_with_iobinding`` call: the consumer does per batch what it would do to run the
    model alone. Output shapes are learned from a run with ONNX Runtime allocating them (the first
    batch of each input shape); a model whose output shapes depend on the data (ONNX Runtime
    refuses a bound buffer) has its outputs allocated by ONNX Runtime from then on. An IOBinding is
    used by one thread at a time (handed over with its batch; two threads on one IOBinding crash).

    On a device (``placement.on_device``: a session on a GPU provider, or ``device="cpu:staged"``)
    ``prepare`` copies the batch into a device slot (``feeder.device.SlotRing``) whose IOBinding has
    its inputs bound once, so the consumer's run finds its inputs on the device at addresses that
    do not change from run to run; the slot is given back once the run has returned. Batches the
    rebatcher assembles are assembled in the slots' staging memory (:attr:`host_allocator`: pinned
    on a GPU), so each byte is still copied once on the host. With ``enable_cuda_graph`` each slot
    runs its own CUDA graph (``gpu_graph_id`` = its index), its outputs bound to device buffers of
    its own; a batch of other shapes (the short last one) runs without a graph.

    Sessions that are not InferenceSessions (training adapters) implement
    ``run_batch(batch: PreparedBatch, output_names, run_options) -> list`` themselves, and
    optionally ``prepare_batch(batch)``, called as ``prepare`` is (in any thread, under the feed's
    pump lock, one batch at a time, in batch order). An exception from it fails the source
    (``Feed._prepare_failed``).
    """

    def __init__(self, session: Any, input_names: Sequence[str], ring_size: int = 6,
                 placement: Optional[Placement] = None):
        self.session = session
        self.input_names = list(input_names)
        self._custom = callable(getattr(session, "run_batch", None))
        specs = {s.name: s for s in input_specs(session)}
        self._use_binding = (not self._custom and callable(getattr(session, "io_binding", None))
                             and not any(specs[n].is_string for n in self.input_names if n in specs))
        self._ort: Any = import_onnxruntime() if self._use_binding else None
        self._all_outputs: List[str] = [] if self._custom else output_names(session)
        # What the consumer last asked for: the enqueuer binds these outputs ahead, in this place.
        self._want: List[str] = list(self._all_outputs)
        self._want_where = "host"
        self._bindings: Deque[Any] = deque()  # free IOBindings, handed back by consumers after a run
        # (input shapes, output names) -> the outputs' (shapes, dtypes), learned from a run; None: ORT allocates
        self._templates: Dict[Any, Optional[Template]] = {}
        self._bind_ahead = True  # False once the model showed output shapes that depend on the data
        # Output buffers: a ring per output list and input shapes, so that consumers asking for
        # different outputs do not start each other's ring afresh. Taken by whoever prepares a
        # batch (under the feed's pump lock) and by a consumer rebinding other outputs (no lock):
        # a BufferRing is not thread-safe, so every take holds this lock.
        self._ring_size = ring_size
        self._out_rings: Dict[Any, BufferRing] = {}
        self._out_lock = threading.Lock()
        self._dropped_allocations = 0  # those of rings dropped (output_allocations)
        # Batch arrays the session has no input for (the mask of a padded input, for the caller of
        # next_batch()): kept with the batch, never bound.
        self._unfed = {n for n in self.input_names if n not in specs} if specs else set()
        self.placement = placement if placement is not None else CPU
        self.slots: Optional[SlotRing] = None
        self.transfer: Optional[Transfer] = None
        self._graph = False
        if self._use_binding and self.placement.on_device:
            memory = DeviceMemory(self.placement, self._ort, devices.runtime_for(self.placement))
            self.transfer = Transfer(memory)
            fed = [n for n in self.input_names if n not in self._unfed]
            # Without a CUDA runtime, update_inplace copies: it wants buffers of the batch's exact size.
            self.slots = SlotRing(memory, fed, ring_size, make_binding=session.io_binding,
                                  exact=not self.transfer.streamed)
            self._graph = cuda_graph_enabled(session)
        self._out_device = (self.slots.memory.device_type if self.slots is not None else "cpu",
                            self.placement.index)

    @property
    def prepares_in_order(self) -> bool:
        """Whether :meth:`prepare` must see batches one at a time, in their order (a session
        adapter's own ``prepare_batch`` was promised that); else any thread prepares any batch, and
        several at once."""
        return self._custom

    @property
    def ring_size(self) -> int:
        return self._ring_size

    @ring_size.setter
    def ring_size(self, size: int) -> None:
        with self._out_lock:
            self._ring_size = size
            for ring in self._out_rings.values():
                ring.size = size
        if self.slots is not None:
            self.slots.size = size

    @property
    def host_allocator(self) -> Optional[Callable[[Tuple[int, ...], Any], np.ndarray]]:
        """Where the feed's rebatcher should assemble batches: memory the device copies from fast
        (None: ordinary memory). A custom adapter may offer its own (``host_allocator``)."""
        if self.slots is not None:
            return self.slots.memory.host_array
        alloc = getattr(self.session, "host_allocator", None) if self._custom else None
        return alloc if callable(alloc) else None

    @property
    def host_register(self) -> Optional[Callable[[int, int], Optional[Callable[[], None]]]]:
        """Registers a worker process's shared-memory segment with the CUDA runtime as it is mapped
        (``feeder.device.DeviceMemory.register``); None off a device, or where copies are not on a
        stream (a custom adapter may offer its own: ``host_register``)."""
        if self.transfer is not None:
            return self.transfer.memory.register if self.transfer.streamed else None
        reg = getattr(self.session, "host_register", None) if self._custom else None
        return reg if callable(reg) else None

    @property
    def device_outputs(self) -> bool:
        """Whether ``run(..., outputs="device")`` can return OrtValues (an InferenceSession bound
        through IOBinding); training adapters and string inputs return numpy only."""
        return not self._custom and self._use_binding

    def check_outputs(self, outputs: str) -> None:
        """ValueError for an ``outputs`` this runner cannot give."""
        if outputs not in OUTPUT_PLACES:
            raise ValueError(f"outputs must be 'host' or 'device', got {outputs!r}")
        if outputs == "device" and not self.device_outputs:
            raise ValueError("outputs='device': this session's outputs come back as numpy arrays only "
                             "(outputs='host'); 'device' needs an onnxruntime.InferenceSession with numeric inputs")

    @property
    def output_allocations(self) -> int:
        """Output buffer sets allocated so far (a consumer that drops its outputs before its next
        run lets them be reused: steady state allocates none)."""
        with self._out_lock:
            return self._dropped_allocations + sum(r.allocations for r in self._out_rings.values())

    def close(self) -> None:
        """At stop: let go of the device slots and pooled bindings (device memory is freed once no
        batch a consumer still runs refers to it), once the copies in flight are done (what they
        read must outlive them: a chunk's shared memory is unregistered and unmapped after)."""
        if self.transfer is not None:
            self.transfer.close()
        if self.slots is not None:
            self.slots.close()
        self._bindings.clear()

    # ---- the device path (feeder.device) ---------------------------------------------------------
    def direct(self, parts: Sequence[Sequence[np.ndarray]]) -> bool:
        """Whether a batch of these pieces (per input, in order) goes to the device straight from
        where they lie, with no host copy: each piece in memory the device copies from fast (a worker
        process's registered shared memory, a pinned buffer), contiguous, along axis 0."""
        transfer = self.transfer
        if transfer is None or not transfer.streamed or self._unfed or len(parts) != len(self.input_names):
            return False
        fast = transfer.memory.fast
        for pieces in parts:
            for a in pieces:
                if not a.flags.c_contiguous or not fast(a):
                    return False
        return True

    def stages(self, views: Sequence[np.ndarray]) -> bool:
        """Whether a batch handed on as views of one chunk should be copied into staging memory first:
        on a stream, copies from pageable memory are synchronous and a quarter as fast."""
        transfer = self.transfer
        return transfer is not None and transfer.streamed and not self.direct([(v,) for v in views])

    def device_figures(self) -> Dict[str, float]:
        """device_bytes (device memory held now), device_allocations (device buffers allocated so far),
        copy_s (seconds the device spent copying batches); zeros off a device."""
        transfer = self.transfer
        if transfer is None and self._custom:  # a StatefulSession's own (shared by its feeds)
            transfer = getattr(self.session, "_transfer", None)
        if transfer is None:
            return {"device_bytes": 0.0, "device_allocations": 0.0, "copy_s": 0.0}
        memory = transfer.memory
        return {"device_bytes": float(memory.device_bytes), "device_allocations": float(memory.allocations),
                "copy_s": float(transfer.copy_s)}

    def _place(self, batch: PreparedBatch) -> None:
        """Copy the batch into a device slot (asynchronously, on a stream) and bind its inputs there
        with the batch's shapes; the ticket to wait on goes with the batch."""
        assert self.slots is not None and self.transfer is not None
        if batch.pieces is not None:
            sources: List[Tuple[np.ndarray, ...]] = list(batch.pieces)
        else:
            sources = sources_of(batch.arrays)
            batch.meta = [(a.dtype, a.shape) for a in batch.arrays]
        assert batch.meta is not None
        nbytes = [sum(p.nbytes for p in parts) for parts in sources]
        slot = self.slots.acquire(nbytes, graph=self._graph)
        try:
            batch.ticket = self.transfer.copy(slot, sources)
            slot.bind_inputs(batch.names, batch.meta, self._out_device)
        except BaseException:
            slot.release()
            raise
        batch.slot = slot
        batch.shape_key = tuple(shape for _, shape in batch.meta)

    def _take_outputs(self, key: Any, template: "Template") -> List[np.ndarray]:
        """A set of output buffers for ``template`` that nobody holds (any thread may ask)."""
        with self._out_lock:
            ring = self._out_rings.get(key)
            if ring is None:
                if len(self._out_rings) >= MAX_OUTPUT_RINGS:  # the oldest goes; its holders keep theirs
                    oldest = next(iter(self._out_rings))
                    self._dropped_allocations += self._out_rings.pop(oldest).allocations
                ring = self._out_rings[key] = BufferRing(self._ring_size)
            return ring.take(template[0], template[1])

    def prepare(self, batch: PreparedBatch) -> PreparedBatch:
        if self._unfed and batch.unfed is None:
            batch.unfed = {n: a for n, a in zip(batch.names, batch.arrays) if n in self._unfed}
            fed = [(n, a) for n, a in zip(batch.names, batch.arrays) if n not in self._unfed]
            batch.names, batch.arrays = [n for n, _ in fed], [a for _, a in fed]
        if self._custom:
            prepare = getattr(self.session, "prepare_batch", None)
            if prepare is not None:
                prepare(batch)
        elif self._use_binding:
            if self.slots is None:
                arrays = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in batch.arrays]
                from_numpy = self._ort.OrtValue.ortvalue_from_numpy
                batch.ortvalues = [from_numpy(a) for a in arrays]
                try:
                    binding = self._bindings.popleft()
                except IndexError:
                    binding = self.session.io_binding()
                for name, ov in zip(batch.names, batch.ortvalues):
                    binding.bind_ortvalue_input(name, ov)
                key = batch.shape_key = tuple(a.shape for a in arrays)
            else:
                self._place(batch)  # the copy to the device, ahead of the run
                binding = batch.slot.binding
                key = batch.shape_key
            try:
                self._bind_outputs(binding, batch, list(self._want), key, self._want_where)
            except BaseException:
                batch.release()
                raise
            batch.binding = binding
        return batch

    def _bind_outputs(self, binding: Any, batch: PreparedBatch, names: List[str], key: Any, where: str) -> None:
        """Bind ``names`` to reused buffers of the shapes learned for ``key``, or to ORT's allocator;
        ``where="device"``: to values ONNX Runtime allocates on the device for this run alone (the
        caller owns them). A slot running a CUDA graph has fixed device outputs of its own."""
        binding.clear_binding_outputs()
        batch.output_names = names
        batch.output_where = where
        batch.outputs = None
        tkey = (key, tuple(names))
        template = self._templates.get(tkey) if self._bind_ahead else None
        if where == "host" and not self._graph:  # the common case first
            self._bind_host_outputs(binding, batch, names, tkey, template)
            return
        slot = batch.slot
        if self._graph and slot is not None and slot.index >= 0 and template is not None \
                and slot.graph_shapes in (None, key):
            # A CUDA graph per slot, for the first full shape it runs: its addresses never change.
            slot.graph_shapes = key
            fixed = slot.outputs.get(tuple(names))
            if fixed is None:
                assert self.slots is not None
                fixed = slot.outputs[tuple(names)] = [self.slots.memory.device_value(shape, dtype)
                                                      for shape, dtype in zip(*template)]
            for name, value in zip(names, fixed):
                binding.bind_ortvalue_output(name, value)
            if where == "host":
                batch.outputs = self._take_outputs(tkey, template)
            return
        if where == "device":
            for name in names:
                binding.bind_output(name, *self._out_device)
            return
        self._bind_host_outputs(binding, batch, names, tkey, template)

    def _bind_host_outputs(self, binding: Any, batch: PreparedBatch, names: List[str], tkey: Any,
                           template: Optional["Template"]) -> None:
        """Bind ``names`` to host buffers of a reused ring when their shapes are known for these
        input shapes (``template``), else to ONNX Runtime's allocator (the run teaches the shapes)."""
        if template is None:
            for name in names:
                binding.bind_output(name)
            return
        outs = self._take_outputs(tkey, template)
        from_numpy = self._ort.OrtValue.ortvalue_from_numpy
        for name, buf in zip(names, outs):
            binding.bind_ortvalue_output(name, from_numpy(buf))
        batch.outputs = outs

    def run(self, batch: PreparedBatch, output_names: Optional[Sequence[str]], run_options: Any,
            outputs: str = "host") -> List[Any]:
        if self._custom or not self._use_binding:
            if outputs != "host":
                self.check_outputs(outputs)
            if self._custom:
                return list(self.session.run_batch(batch, output_names, run_options))
            names = list(output_names) if output_names is not None else self._all_outputs
            return list(self.session.run(names, dict(zip(batch.names, batch.arrays)), run_options))
        binding = batch.binding
        if binding is None:  # not prepared by an enqueuer (a batch made by hand)
            self.prepare(batch)
            binding = batch.binding
        # No names means every output, in the session's order, whatever an earlier call asked for.
        asked = self._all_outputs if output_names is None else output_names
        if asked != batch.output_names or outputs != batch.output_where:
            names = list(asked)
            if names != batch.output_names or outputs != batch.output_where:
                if outputs not in OUTPUT_PLACES:
                    self.check_outputs(outputs)
                self._want, self._want_where = names, outputs  # batches prepared from now on bind these
                self._bind_outputs(binding, batch, names, batch.shape_key, outputs)
        slot = batch.slot
        try:
            if batch.ticket is not None:
                batch.ticket.wait()  # its copy to the device (the feed's consumer waited already)
            options = run_options
            if slot is not None and self._graph:
                options = self._graph_options(slot, run_options, batch)
            try:
                self.session.run_with_iobinding(binding, options)
            except Exception as e:
                if batch.outputs is None or not any(w in str(e).lower() for w in _SHAPE_MISMATCH):
                    raise
                # Output shapes that depend on the data: let ONNX Runtime allocate them from now on.
                self._bind_ahead = False
                self._bind_outputs(binding, batch, batch.output_names or self._all_outputs, batch.shape_key,
                                   batch.output_where)
                self.session.run_with_iobinding(binding, options)
            bound = batch.outputs
            if bound is not None and not self._graph:  # host buffers bound ahead: the common case
                return list(bound)
            return self._outputs(binding, batch)
        finally:
            batch.binding = None
            if slot is None:
                self._bindings.append(binding)  # for the enqueuer's next batch (it rebinds everything)
            else:
                batch.release()  # the run has returned: nothing reads the slot's buffers any more

    def _outputs(self, binding: Any, batch: PreparedBatch) -> List[Any]:
        slot = batch.slot
        fixed = slot.outputs.get(tuple(batch.output_names or ())) if self._graph and slot is not None \
            and slot.graph_shapes == batch.shape_key else None
        if fixed is not None:  # a CUDA graph's own outputs: copied out, the graph keeps its buffers
            if batch.output_where == "device":
                assert self.slots is not None
                mem = self.slots.memory
                got = []
                for value in fixed:
                    own = mem.device_value(tuple(value.shape()), _ORT_TYPES[value.data_type()])
                    copy_value(value, own)
                    got.append(own)
                return got
            outs = batch.outputs
            assert outs is not None
            from_numpy = self._ort.OrtValue.ortvalue_from_numpy
            for buf, value in zip(outs, fixed):
                copy_value(value, from_numpy(buf))
            return list(outs)
        if batch.output_where == "device":
            got = binding.get_outputs()
            binding.clear_binding_outputs()  # a next run of this binding must not write into what the caller owns
            return list(got)
        outputs = batch.outputs
        if outputs is None:
            outputs = binding.copy_outputs_to_cpu()
            self._learn(batch, outputs)
        return list(outputs)

    def _graph_options(self, slot: Any, run_options: Any, batch: PreparedBatch) -> Any:
        """Run options naming the slot's CUDA graph (-1, no graph, for a batch of its own or one
        whose outputs are not bound to fixed buffers yet). The caller's own options get the entry."""
        fixed = slot.index >= 0 and slot.graph_shapes == batch.shape_key and tuple(batch.output_names or ()) in \
            slot.outputs
        graph_id = str(slot.index if fixed else -1)
        if run_options is not None:
            run_options.add_run_config_entry("gpu_graph_id", graph_id)
            return run_options
        if not fixed:
            options = self._ort.RunOptions()
            options.add_run_config_entry("gpu_graph_id", graph_id)
            return options
        if slot.run_options is None:
            slot.run_options = self._ort.RunOptions()
            slot.run_options.add_run_config_entry("gpu_graph_id", graph_id)
        return slot.run_options

    def _learn(self, batch: PreparedBatch, outputs: List[Any]) -> None:
        """Remember the output shapes of these input shapes, so later batches bind buffers ahead."""
        key = (batch.shape_key, tuple(batch.output_names or ()))
        if key in self._templates or not self._bind_ahead or len(self._templates) >= MAX_TEMPLATES:
            return
        if all(isinstance(o, np.ndarray) and o.dtype.kind in "biufc" for o in outputs):
            self._templates[key] = ([tuple(o.shape) for o in outputs], [o.dtype for o in outputs])
        else:  # strings, sequences, maps: ORT allocates them
            self._templates[key] = None


# ---- training session adapters ----------------------------------------------------------------
class _Arg:
    """An input or output description shaped like onnxruntime's NodeArg (name, type, shape)."""

    __slots__ = ("name", "type", "shape")

    def __init__(self, name: str, type: Optional[str] = None, shape: Optional[List[Any]] = None):
        self.name, self.type, self.shape = name, type, shape

    def __repr__(self) -> str:
        return f"_Arg({self.name!r}, {self.type!r}, {self.shape!r})"


_NUMPY_TO_ORT = {np.dtype(v): k for k, v in _ORT_TYPES.items()}


class StatefulSession:
    """A train-step graph on a plain ``onnxruntime.InferenceSession``, its state kept in OrtValues.

    A train-step graph takes the data batch plus the model state (weights, optimizer moments,
    step counter) and returns the loss plus the updated state. ``state`` maps each state output
    to the state input it replaces; ``initial_state`` gives every state input's first value
    (inputs named there but not updated by any output stay constant: weights of an evaluation
    graph, say). Between steps the state never goes through numpy: each step's output buffers
    become the next step's inputs (a swap, no copy; on a GPU provider, no host round trip).

    Fed with ``feeder.init_data_input_workers(adapter, ...)``: ``get_inputs()`` lists only the
    data inputs, so fetchers supply those and are validated against them; ``feed.run(["loss"])``
    runs one step and returns what was asked (any non-state output, or a state output's new
    value). Steps are serialised by a lock, so several feeds may share one adapter.

    ``device`` / ``device_id`` place the state and the batches: "cpu", or "cuda" ("cuda:N") for a
    session on the CUDA provider. On a device, batches get there as an inference feed's do
    (``feeder.device``): each is copied when it is made (``prepare_batch``, ahead of the step, by
    whichever thread makes it) into device buffers allocated once and reused (a few slots, each
    free again once its step has run), from staging memory the rebatcher assembles them in
    (pinned on a GPU). "cpu:staged" runs that path with host memory standing in for the device.
    The slots (``STATEFUL_SLOTS``, shared by every feed of the adapter) live as long as the adapter,
    as its state does.

    Args:
        session: The ``onnxruntime.InferenceSession`` of the train-step graph.
        state: ``{state output: the state input it replaces}``, e.g. ``{"W_new": "W"}``.
        initial_state: ``{state input: numpy array}``, the first value of every state input;
            inputs named here that no output replaces are held constant.
        device: Where the state and the batches live: ``"cpu"``, ``"cuda"`` / ``"cuda:N"`` with
            a CUDA provider, or ``"cpu:staged"``.
        device_id: The device's index, for ``"cuda"``.

    Raises:
        ValueError: A state output or input the session lacks, two outputs replacing one input,
            an initial value for a name that is not an input, or a device the installed
            onnxruntime lacks (naming the package to install).
    """

    def __init__(self, session: Any, state: Mapping[str, str],
                 initial_state: Optional[Mapping[str, np.ndarray]] = None, *,
                 device: str = "cpu", device_id: int = 0):
        self._ort = import_onnxruntime()
        self.session = session
        placement = parse_device(device)
        if placement is None:
            raise TypeError("device must be 'cpu', 'cuda' or 'cuda:N', not None")
        if placement.kind == "cuda" and ":" not in device:
            placement = Placement("cuda", int(device_id))
        placement = resolve(session, placement)
        self.placement = placement
        self.device = "cuda" if placement.kind == "cuda" else "cpu"  # ONNX Runtime's device names
        self.device_id = placement.index
        # Device slots for the batches, and their copies on a stream of the adapter's own
        # (feeder.device): shared by every feed of this adapter.
        self._slots: Optional[SlotRing] = None
        self._transfer: Optional[Transfer] = None
        if placement.on_device:
            memory = DeviceMemory(placement, self._ort, devices.runtime_for(placement))
            self._transfer = Transfer(memory)
            self._slots = SlotRing(memory, [], STATEFUL_SLOTS, exact=not self._transfer.streamed)
            # The stream lives as long as the adapter (its feeds come and go), and goes with it.
            weakref.finalize(self, self._transfer.close).atexit = False
        inputs = {a.name: a for a in session.get_inputs()}
        outputs = {a.name: a for a in session.get_outputs()}
        self._state = dict(state)
        for out_name, in_name in self._state.items():
            if out_name not in outputs:
                raise ValueError(f"state output {out_name!r} is not an output of the session ({list(outputs)})")
            if in_name not in inputs:
                raise ValueError(f"state input {in_name!r} (for output {out_name!r}) is not an input of the "
                                 f"session ({list(inputs)})")
        if len(set(self._state.values())) != len(self._state):
            raise ValueError("two state outputs replace the same state input")
        extra = [n for n in (initial_state or {}) if n not in inputs]
        if extra:
            raise ValueError(f"initial_state names {extra} that are not inputs of the session")
        self._state_inputs = list(dict.fromkeys(list(self._state.values()) + list(initial_state or {})))
        self._specs = {s.name: s for s in input_specs(session)}
        self._data_inputs = [a for n, a in inputs.items() if n not in self._state_inputs]
        if not self._data_inputs:
            raise ValueError("every input of the session is state: there is nothing to feed")
        self._plain_outputs = [n for n in outputs if n not in self._state]
        self._cur: Dict[str, Any] = {}   # state input -> OrtValue bound as input next step
        self._next: Dict[str, Any] = {}  # state output -> OrtValue the next step writes
        self._keep: Dict[str, np.ndarray] = {}  # host arrays behind zero-copy OrtValues
        self._lock = threading.Lock()
        self._binding = None
        self.steps = 0
        if initial_state is not None:
            self.load_state(initial_state)

    # -- the session protocol feeder uses --
    def get_inputs(self) -> List[Any]:
        """The data inputs (what fetchers supply), in the session's order."""
        return list(self._data_inputs)

    def get_outputs(self) -> List[Any]:
        """Outputs that are not state."""
        return [a for a in self.session.get_outputs() if a.name in self._plain_outputs]

    @property
    def state_inputs(self) -> List[str]:
        """Names of the state inputs (replaced after each step, or held constant), in order."""
        return list(self._state_inputs)

    @property
    def host_allocator(self) -> Optional[Callable[[Tuple[int, ...], Any], np.ndarray]]:
        """Staging memory for a feed's rebatcher (pinned on a GPU); None on the CPU."""
        return self._slots.memory.host_array if self._slots is not None else None

    @property
    def host_register(self) -> Optional[Callable[[int, int], Optional[Callable[[], None]]]]:
        """Registers a worker process's shared memory with the CUDA runtime (a feed of this adapter
        with worker processes maps it so); None on the CPU."""
        if self._transfer is not None and self._transfer.streamed:
            return self._transfer.memory.register
        return None

    def prepare_batch(self, batch: PreparedBatch) -> None:
        """Wrap the batch's arrays as OrtValues on ``device`` (called when the batch is made, by
        whichever thread makes it, ahead of the step that runs it): zero-copy on the CPU, else
        copied into a device slot that the step gives back.

        Args:
            batch: The batch being prepared; its ``ortvalues`` (and on a device its ``slot``)
                are set.
        """
        arrays = [np.ascontiguousarray(a) for a in batch.arrays]
        if self._slots is not None:
            assert self._transfer is not None
            slot = self._slots.acquire([a.nbytes for a in arrays])
            try:  # issued on the adapter's stream; the step waits for it just before it runs
                batch.ticket = self._transfer.copy(slot, [(a,) for a in arrays])
            except BaseException:
                slot.release()
                raise
            batch.slot = slot
            batch.meta = [(a.dtype, a.shape) for a in arrays]
        else:
            from_numpy = self._ort.OrtValue.ortvalue_from_numpy
            batch.ortvalues = [from_numpy(a, self.device, self.device_id) for a in arrays]

    def run_batch(self, batch: PreparedBatch, output_names: Optional[Sequence[str]], run_options: Any) -> List[Any]:
        """One training step on ``batch`` (what ``feed.run()`` calls).

        Args:
            batch: The prepared batch.
            output_names: Outputs to return (any non-state output, or a state output's new
                value); None: every output that is not state.
            run_options: An ``onnxruntime.RunOptions``, or None.

        Returns:
            The requested outputs, as numpy arrays.
        """
        names = list(output_names) if output_names is not None else list(self._plain_outputs)
        unknown = [n for n in names if n not in self._plain_outputs and n not in self._state]
        if unknown:
            raise ValueError(f"unknown outputs {unknown}; outputs: {self._plain_outputs + list(self._state)}")
        if batch.ortvalues is None and batch.slot is None:
            self.prepare_batch(batch)
        try:
            if batch.ticket is not None:
                batch.ticket.wait()  # its copy to the device
            return self._step(batch, names, run_options)
        finally:
            batch.release()  # the step has run: its device slot may take the next batch

    def _step(self, batch: PreparedBatch, names: List[str], run_options: Any) -> List[Any]:
        with self._lock:
            missing = [n for n in self._state_inputs if n not in self._cur]
            if missing:
                raise FeederError(f"state {missing} not set: pass initial_state or call load_state() first")
            if self._binding is None:
                self._binding = self.session.io_binding()
            b: Any = self._binding
            slot = batch.slot
            if slot is not None:  # in its device slot, bound by address with the batch's shapes
                assert batch.meta is not None
                for name, ptr, (dtype, shape) in zip(batch.names, slot.ptrs, batch.meta):
                    b.bind_input(name, self.device, self.device_id, dtype.type, list(shape), ptr)
            else:
                for name, ov in zip(batch.names, batch.ortvalues or ()):
                    b.bind_ortvalue_input(name, ov)
            for name in self._state_inputs:
                b.bind_ortvalue_input(name, self._cur[name])
            b.clear_binding_outputs()
            plain = [n for n in names if n in self._plain_outputs]
            for name in plain:
                b.bind_output(name, self.device, self.device_id)
            for out_name in self._state:
                b.bind_ortvalue_output(out_name, self._next[out_name])
            self.session.run_with_iobinding(b, run_options)
            got = dict(zip(plain, (ov.numpy() for ov in b.get_outputs()[:len(plain)])))
            for out_name, in_name in self._state.items():
                if out_name in names:  # numpy() is a view of a buffer the step after next overwrites
                    got[out_name] = np.array(self._next[out_name].numpy(), copy=True)
                # the swap: this step's outputs are the next step's inputs, and the old inputs'
                # buffers are written by the next step
                self._cur[in_name], self._next[out_name] = self._next[out_name], self._cur[in_name]
            b.clear_binding_inputs()
            self.steps += 1
            return [got[n] for n in names]

    # -- state --
    def state(self) -> Dict[str, np.ndarray]:
        """A copy of the current state as numpy arrays, by state input name."""
        with self._lock:
            return {name: np.array(self._cur[name].numpy(), copy=True) for name in self._state_inputs
                    if name in self._cur}

    def load_state(self, values: Mapping[str, np.ndarray]) -> None:
        """Set the state (every state input) from arrays.

        Args:
            values: ``{state input: numpy array}`` for every state input, e.g.
                ``dict(np.load("ckpt.npz"))`` of what :meth:`state` gave.

        Raises:
            ValueError: A state input is missing from ``values``.
        """
        missing = [n for n in self._state_inputs if n not in values]
        if missing:
            raise ValueError(f"load_state: missing state inputs {missing}")
        arrays = {}
        for name in self._state_inputs:
            spec = self._specs.get(name)
            a = np.asarray(values[name])
            if spec is not None and spec.dtype is not None and a.dtype != spec.dtype:
                if not np.can_cast(a.dtype, spec.dtype, casting="same_kind"):
                    raise ValueError(f"load_state: {name!r} has dtype {a.dtype}, the session wants {spec.dtype}")
                a = a.astype(spec.dtype)
            if spec is not None and spec.shape is not None:
                if a.ndim != len(spec.shape) or any(w is not None and w != h for w, h in zip(spec.shape, a.shape)):
                    raise ValueError(f"load_state: {name!r} has shape {a.shape}, the session wants {spec.shape}")
            arrays[name] = np.array(a, copy=True, order="C")  # private: the caller's array may change
        from_numpy = self._ort.OrtValue.ortvalue_from_numpy
        with self._lock:
            self._keep = {}
            self._cur, self._next = {}, {}
            for name, a in arrays.items():
                self._cur[name] = from_numpy(a, self.device, self.device_id)
                self._keep["in:" + name] = a
            for out_name, in_name in self._state.items():
                buf = np.empty_like(arrays[in_name])
                self._next[out_name] = from_numpy(buf, self.device, self.device_id)
                self._keep["out:" + out_name] = buf


class OrtTrainingModule:
    """onnxruntime-training's ``Module`` and ``Optimizer`` as a session feeder can feed.

    ``feed.run()`` performs one training step: the module's forward and backward on the batch,
    ``optimizer.step()``, and ``module.lazy_reset_grad()``; it returns ``[loss]`` (as numpy).
    ``get_inputs()`` gives the module's input names (types and shapes are learned from the first
    chunk, or read from ``train_model_path`` when given). Note: onnxruntime-training 1.19 holds
    the GIL during its train step, so fetcher threads run at a fraction of their speed meanwhile.

    Args:
        module: An ``onnxruntime.training.api.Module``.
        optimizer: Its ``onnxruntime.training.api.Optimizer``.
        train_model_path: The training model's ONNX file, to validate chunks against its input
            types and shapes; None: they are learned from the first chunk.
    """

    def __init__(self, module: Any, optimizer: Any, *, train_model_path: Optional[str] = None):
        self.module, self.optimizer = module, optimizer
        names = list(module.input_names())
        args = {n: _Arg(n) for n in names}
        if train_model_path is not None:
            args.update(_onnx_file_inputs(train_model_path, names))
        self._inputs = [args[n] for n in names]
        self._lock = threading.Lock()
        self.steps = 0

    def get_inputs(self) -> List[Any]:
        """The module's inputs as NodeArg-like descriptions (``name``, ``type``, ``shape``)."""
        return list(self._inputs)

    def get_outputs(self) -> List[Any]:
        """The module's outputs as NodeArg-like descriptions (names only)."""
        return [_Arg(n) for n in self.module.output_names()]

    def run_batch(self, batch: PreparedBatch, output_names: Optional[Sequence[str]], run_options: Any) -> List[Any]:
        """One training step on ``batch``: forward and backward, ``optimizer.step()``, gradients reset.

        Args:
            batch: The prepared batch.
            output_names: Outputs to return; None: all of them.
            run_options: Not used (onnxruntime-training's ``Module`` takes none).

        Returns:
            The requested outputs, as numpy arrays.
        """
        by_name = batch.as_dict()
        args = [np.ascontiguousarray(by_name[a.name]) for a in self._inputs]
        with self._lock:
            self.module.train()
            out = self.module(*args)
            self.optimizer.step()
            self.module.lazy_reset_grad()
            self.steps += 1
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        if output_names is None:
            return [np.asarray(o) for o in outs]
        names = list(self.module.output_names())
        return [np.asarray(outs[names.index(n)]) for n in output_names]


def _onnx_file_inputs(path: str, names: Sequence[str]) -> Dict[str, _Arg]:
    """Input types and shapes of the training model file, as NodeArg-like descriptions."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    out = {}
    for vi in model.graph.input:
        if vi.name in names:
            t = vi.type.tensor_type
            elem = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
            ort_type = _NUMPY_TO_ORT.get(np.dtype(elem))
            shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
            out[vi.name] = _Arg(vi.name, ort_type, shape)
    return out


# ---- batch inference (feeder.predict) -----------------------------------------------------------
def load_session(path: str, providers: Any = None) -> Any:
    """An InferenceSession with one intra-op thread: ``feeder.predict`` scales with replicas (one
    consumer thread each), not with ONNX Runtime's spinning thread pool. ``providers``: as
    :func:`feeder.device.providers_for` takes them (None: the CUDA provider where installed, else
    the CPU; see :func:`feeder.device.default_providers`)."""
    ort = import_onnxruntime()
    chosen = providers_for(providers)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(path, opts, providers=chosen if chosen is not None else default_providers())


def model_signature(session: Any) -> Dict[str, Any]:
    """Element type and shape of each of a session's inputs and outputs, by name (JSON-able)."""
    def args(items: Sequence[Any]) -> Dict[str, List[Any]]:
        return {a.name: [getattr(a, "type", None),
                         None if getattr(a, "shape", None) is None else [d if isinstance(d, (int, str)) else None
                                                                          for d in a.shape]] for a in items}
    return {"inputs": args(session.get_inputs()), "outputs": args(session.get_outputs())}


def session_model_bytes(session: Any) -> Optional[bytes]:
    """The serialized model of an InferenceSession made from bytes, when it kept them."""
    data = getattr(session, "_model_bytes", None)
    return data if isinstance(data, bytes) else None


def session_model_path(session: Any) -> Optional[str]:
    """The file an InferenceSession was made from, when it says."""
    path = getattr(session, "_model_path", None)
    return path if isinstance(path, str) and path else None


class PredictSession:
    """An InferenceSession as ``feeder.predict``'s replicas run it (feeder's custom-session protocol).

    ``feed_names`` are the inputs the source feeds, in order: the model's inputs, then the kept
    columns that are not model inputs. :meth:`get_inputs` declares the model's inputs as the model
    does (so chunks are validated against them), except that a fixed batch dimension is declared
    free, and the kept columns as unconstrained (any dtype and rank: ids, paths). When a batch is
    made (by whichever thread makes it, ahead of the consumer) :meth:`prepare_batch` wraps the
    model's inputs as OrtValues (padding a short last batch up to a fixed batch dimension); in the
    consumer thread :meth:`run_batch` binds them and the
    outputs, runs, and returns the written outputs, then the kept columns, then the row keys.

    Outputs are bound to buffers owned by the calling thread and reused run after run (re-made
    only when the row count changes), so what :meth:`run_batch` returns is valid until the same
    thread's next call: the caller copies it out before then. Each thread has its own IOBinding
    on the one shared session.
    """

    def __init__(self, session: Any, feed_names: Sequence[str], model_inputs: Sequence[str],
                 outputs: Sequence[str], kept: Sequence[str], ordered: bool = False):
        self._ort = import_onnxruntime()
        # ordered: each batch's place in the feed's sequence, stamped when it is prepared (batches
        # are prepared one at a time, in order) and returned last by run_batch, so that a writer
        # can put the batches of several consumer threads back in order.
        self.ordered = ordered
        self._seq_of: Dict[int, int] = {}
        self._next_seq = 0
        self.session = session
        self.feed_names = list(feed_names)
        self.model_inputs = list(model_inputs)
        self.outputs = list(outputs)
        self._model_pos = [self.feed_names.index(n) for n in self.model_inputs]
        self._kept_pos = [self.feed_names.index(n) for n in kept]
        args = {a.name: a for a in session.get_inputs()}
        specs = {s.name: s for s in input_specs(session)}
        fixed: Dict[str, int] = {}
        for n in self.model_inputs:
            dims = specs[n].shape
            if dims and dims[0] is not None:
                fixed[n] = dims[0]
        sizes = sorted(set(fixed.values()))
        if len(sizes) > 1:
            raise ValueError(f"the model's inputs fix different batch sizes {fixed}; feeder.predict feeds one")
        self.fixed_batch: Optional[int] = sizes[0] if sizes else None
        self._inputs: List[Any] = []
        for name in self.feed_names:
            arg = args.get(name)
            if arg is None:
                self._inputs.append(_Arg(name))  # a kept column: whatever the source gives
                continue
            shape: Optional[List[Any]] = None if arg.shape is None else list(arg.shape)
            if shape and self.fixed_batch is not None:
                shape[0] = None  # short batches are padded in prepare_batch, never dropped
            self._inputs.append(_Arg(name, arg.type, shape))
        outs = {o.name: o for o in session.get_outputs()}
        self._dtypes: List[Optional[np.dtype]] = []
        self._row_shapes: List[Optional[Tuple[int, ...]]] = []
        for name in self.outputs:
            o = outs[name]
            dtype = _ORT_TYPES.get(o.type)
            self._dtypes.append(np.dtype(dtype) if dtype is not None else None)
            out_dims: List[Any] = list(getattr(o, "shape", None) or [])
            known = len(out_dims) >= 1 and all(isinstance(d, int) and d >= 0 for d in out_dims[1:])
            self._row_shapes.append(tuple(int(d) for d in out_dims[1:]) if known else None)
        # IOBinding needs numeric tensors in and out; a string input or output runs with session.run.
        self._bind = (callable(getattr(session, "io_binding", None))
                      and not any(specs[n].is_string for n in self.model_inputs)
                      and all(d is not None for d in self._dtypes))
        self._local = threading.local()
        # Whether the outputs were seen to have one row per input row at two row counts (the
        # first batch's, see _check_rows). With a fixed batch dimension the count cannot vary:
        # the signature and the per-batch row check are all there is.
        self._rows_checked = self.fixed_batch is not None
        self._check_lock = threading.Lock()
        # On a GPU provider the inputs are copied to the device when the batch is made (ahead of the
        # consumer, by whichever thread makes it), not by ONNX Runtime inside the run.
        self._placement = session_placement(session)

    # -- the session protocol feeder uses --
    def get_inputs(self) -> List[Any]:
        return list(self._inputs)

    def get_outputs(self) -> List[Any]:
        return [o for o in self.session.get_outputs() if o.name in self.outputs]

    def _model_arrays(self, batch: PreparedBatch) -> List[np.ndarray]:
        arrays = [batch.arrays[i] for i in self._model_pos]
        b = self.fixed_batch
        if b is not None and batch.rows < b:  # repeat the last row: in-distribution, discarded after the run
            arrays = [np.concatenate([a, np.repeat(a[-1:], b - batch.rows, axis=0)]) for a in arrays]
        return arrays

    def prepare_batch(self, batch: PreparedBatch) -> None:
        """When the batch is made: the model inputs as OrtValues (zero-copy for contiguous arrays;
        on a GPU session, copied to the device now rather than inside the run)."""
        if self.ordered:  # (under the feed's lock, in the order of the batches)
            self._seq_of[id(batch)] = self._next_seq
            self._next_seq += 1
        if self._bind:
            from_numpy = self._ort.OrtValue.ortvalue_from_numpy
            arrays = [np.ascontiguousarray(a) for a in self._model_arrays(batch)]
            if self._placement.kind == "cuda":
                batch.ortvalues = [from_numpy(a, "cuda", self._placement.index) for a in arrays]
            else:
                batch.ortvalues = [from_numpy(a) for a in arrays]

    def run_batch(self, batch: PreparedBatch, output_names: Optional[Sequence[str]], run_options: Any) -> List[Any]:
        """In a consumer thread: run the model on ``batch``; returns ``outputs + kept + [row keys]``
        (the outputs are views of this thread's reused buffers), and when ``ordered`` the batch's
        place in the sequence last."""
        n = batch.rows
        if not self._rows_checked:
            self._check_rows(batch)
        rows = self.fixed_batch if self.fixed_batch is not None and n < self.fixed_batch else n
        if self._bind:
            got = self._run_bound(batch, rows, run_options)
        else:
            feeds = dict(zip(self.model_inputs, self._model_arrays(batch)))
            got = list(self.session.run(self.outputs, feeds, run_options))
        for name, g in zip(self.outputs, got):
            if getattr(g, "ndim", 0) < 1 or g.shape[0] != rows:
                raise ValueError(f"model output {name!r} has shape {getattr(g, 'shape', None)} for a batch of {rows} "
                                 f"rows: feeder.predict writes outputs with one row per input row (choose them "
                                 f"with outputs=)")
        if rows != n:
            got = [g[:n] for g in got]
        out: List[Any] = got + [batch.arrays[i] for i in self._kept_pos] + [batch.keys]
        if self.ordered:
            out.append(self._seq_of.pop(id(batch)))
        return out

    def _check_rows(self, batch: PreparedBatch) -> None:
        """Once, on the first batch, before any output is returned (so before anything is written):
        ValueError naming an output that does not have one row per input row. The model runs on
        the batch's rows at two row counts (n and n - 1; 1 and 2 for a batch of one row), so that
        an output whose length merely equals the batch size (a mean over the batch of a [n, n]
        input, say) cannot pass."""
        with self._check_lock:
            if self._rows_checked:
                return
            arrays = [batch.arrays[i] for i in self._model_pos]
            n = batch.rows
            for k in ((n, n - 1) if n > 1 else (1, 2)):
                feeds = {name: (a[:k] if k <= len(a) else np.concatenate([a, np.repeat(a[-1:], k - len(a), axis=0)]))
                         for name, a in zip(self.model_inputs, arrays)}
                got = self.session.run(self.outputs, feeds)
                for name, g in zip(self.outputs, got):
                    shape = getattr(g, "shape", None)
                    if not shape or shape[0] != k:
                        raise ValueError(f"model output {name!r} is not one value per row: {k} input rows gave it "
                                         f"shape {shape} (a reduction over the batch?); feeder.predict writes per-row "
                                         f"outputs (choose them with outputs=)")
            self._rows_checked = True

    def _run_bound(self, batch: PreparedBatch, rows: int, run_options: Any) -> List[np.ndarray]:
        local = self._local
        binding = getattr(local, "binding", None)
        if binding is None:
            binding = local.binding = self.session.io_binding()
            local.rows = -1
            local.buffers = None
        if batch.ortvalues is None:
            self.prepare_batch(batch)
        for name, ov in zip(self.model_inputs, batch.ortvalues or ()):
            binding.bind_ortvalue_input(name, ov)
        try:
            if local.rows != rows or local.buffers is None:
                local.buffers = self._bind_outputs(binding, rows)
                local.rows = rows
            if local.buffers is None:  # an output's row shape is not known yet: ONNX Runtime allocates
                self.session.run_with_iobinding(binding, run_options)
                got: List[np.ndarray] = binding.copy_outputs_to_cpu()
                self._row_shapes = [tuple(int(d) for d in g.shape[1:]) if getattr(g, "ndim", 0) >= 1 else None
                                    for g in got]
                binding.clear_binding_outputs()
                local.rows = -1  # bind buffers of the learned shapes from the next batch on
                return got
            self.session.run_with_iobinding(binding, run_options)
            return [buf for buf, _ in local.buffers]
        finally:
            binding.clear_binding_inputs()  # the batch's buffers are held by nobody but the feed

    def _bind_outputs(self, binding: Any, rows: int) -> Optional[List[Tuple[np.ndarray, Any]]]:
        """Bind every output to a fresh buffer of this thread, or to ORT's allocator (None) while
        some output's row shape is unknown."""
        binding.clear_binding_outputs()
        if any(s is None for s in self._row_shapes):
            for name in self.outputs:
                binding.bind_output(name)
            return None
        from_numpy = self._ort.OrtValue.ortvalue_from_numpy
        buffers = []
        for name, dtype, shape in zip(self.outputs, self._dtypes, self._row_shapes):
            assert shape is not None and dtype is not None
            buf = np.empty((rows,) + shape, dtype)
            ov = from_numpy(buf)
            binding.bind_ortvalue_output(name, ov)
            buffers.append((buf, ov))
        return buffers
