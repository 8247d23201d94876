"""Training session adapters, sessions feeder feeds with its custom-session protocol
(``prepare_batch``, ``run_batch``): ``StatefulSession`` (a train-step graph on a plain
InferenceSession, its state kept in OrtValues) and ``OrtTrainingModule`` (onnxruntime-training's
``Module`` and ``Optimizer``)."""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .. import device as devices
from ..device import DeviceMemory, Placement, SlotRing, Transfer, parse_device, resolve
from ..errors import FeederError
from .batch import PreparedBatch
from .signature import _ORT_TYPES, _Arg, import_onnxruntime, input_specs

STATEFUL_SLOTS = 6  # device slots of a StatefulSession (batches prepared ahead of its steps, all its feeds)

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
