"""``Runner``: runs one feed's batches through its session: IOBindings prepared ahead of the
consumer, outputs bound to reused buffer rings once their shapes are known, the device path
(``feeder.device``: slots, copies on a stream) and CUDA graphs per slot."""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import device as devices
from ..device import (
    CPU,
    DeviceMemory,
    Placement,
    SlotRing,
    Transfer,
    copy_value,
    cuda_graph_enabled,
)
from ..device.transfer import sources_of
from ..errors import FeederError
from ..rebatcher import BufferRing
from .batch import PreparedBatch
from .signature import _ORT_TYPES, import_onnxruntime, input_specs, output_names

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


def _sized(a: Any, size: int) -> bool:
    """Whether ``a`` has ``size`` rows (an array along axis 0, or a list)."""
    if isinstance(a, list):
        return len(a) == size
    return isinstance(a, np.ndarray) and a.ndim >= 1 and a.shape[0] == size


def _same(a: Any, b: Any) -> bool:
    """Whether two outputs hold the same values (floats to within rounding, NaN equal to NaN)."""
    if isinstance(a, list) or isinstance(b, list):
        return list(a) == list(b)
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if a.dtype.kind in "fc" and b.dtype.kind in "fc":
        return bool(np.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True))
    return bool(np.array_equal(a, b))


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

    def check_output_names(self, names: Sequence[str]) -> None:
        """ValueError for output names the session does not have (checked before a batch is
        taken: ONNX Runtime's own error would come after, with the batch's rows gone)."""
        if self._custom or not self._all_outputs:
            return
        unknown = [n for n in names if n not in self._all_outputs]
        if unknown:
            raise ValueError(f"output_names names {unknown}, which the session does not output; its outputs "
                             f"are {self._all_outputs}")

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

    def run_padded(self, batch: PreparedBatch, padded: Callable[[PreparedBatch, str], PreparedBatch],
                   output_names: Optional[Sequence[str]], run_options: Any, outputs: str = "host") -> List[Any]:
        """Run a short batch on a fixed batch dimension (feeder.feed): padded to it with its last
        row repeated, and once more with its first row repeated, so that an output with one row per
        batch row (its first ``batch.rows`` rows the same both times) is told from one that mixes
        rows (a mean over the batch): the first are cut back to the batch's rows, the second are a
        FeederError naming them (what they would give for the padded rows is no answer)."""
        if batch.binding is not None and batch.slot is None:  # prepared at its own size: not run
            self._bindings.append(batch.binding)
            batch.binding = None
        n = batch.rows
        names = list(self._all_outputs if output_names is None else output_names)
        last = padded(batch, "last")
        size = last.rows
        got = self.run(last, output_names, run_options, outputs)
        first = [self._host_copy(name, o) for name, o in zip(names, got)]
        second = [self._host_copy(name, o) for name, o in
                  zip(names, self.run(padded(batch, "first"), output_names, run_options, outputs))]
        out: List[Any] = []
        for name, o, a, b in zip(names, got, first, second):
            per_row = _sized(a, size) and _same(a[:n], b[:n])
            if not per_row and not _same(a, b):
                raise FeederError(
                    f"output {name!r} of the short last batch depends on more than each row (it changed with "
                    f"the rows the batch was padded with to the session's fixed batch dimension of {size}); "
                    f"register with last_batch='drop', or ask run() for the outputs with one row per batch row")
            if not per_row:
                out.append(o)
            elif outputs == "device" and not isinstance(a, list):
                out.append(self._owned_value(np.ascontiguousarray(a[:n])))
            else:
                out.append(a[:n])
        return out

    def _host_copy(self, name: str, o: Any) -> Any:
        """An output of a padded run as numpy (or a list, for a sequence output), copied: the next
        run may write into the buffers it was bound to."""
        if isinstance(o, np.ndarray):
            return o.copy()
        if isinstance(o, (list, tuple)):
            return list(o)
        try:
            return np.array(o.numpy())
        except Exception as e:  # (bfloat16 has no numpy type)
            raise FeederError(f"output {name!r} of the short last batch cannot be cut back to the batch's rows: "
                              f"its values have no numpy type ({e}); register with last_batch='drop'") from e

    def _owned_value(self, a: np.ndarray) -> Any:
        """An OrtValue that owns a copy of ``a`` (one made from the array would borrow its memory)."""
        ort = import_onnxruntime()
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(a.shape), a.dtype)
        value.update_inplace(a)
        return value

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
