"""``PredictSession``: the model as ``feeder.predict``'s replicas run it, an InferenceSession
behind feeder's custom-session protocol (``prepare_batch``, ``run_batch``): IOBinding per thread on
the shared session, outputs bound to each thread's reused buffers, the per-row check of the outputs."""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..device import session_placement
from ..runtime.batch import PreparedBatch
from ..runtime.signature import _ORT_TYPES, _Arg, import_onnxruntime, input_specs


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
            row_shapes: Dict[str, Any] = {}
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
                    # A row whose shape follows the batch's row count (x @ x.T, [N, N]) is no row of its
                    # own: its batches would not even stack into one column (and the last, short batch
                    # failed inside ONNX Runtime, on the output buffers bound for the others).
                    seen = row_shapes.setdefault(name, tuple(shape[1:]))
                    if seen != tuple(shape[1:]):
                        raise ValueError(f"model output {name!r} is not one value per row: its rows have shape "
                                         f"{seen} for one batch size and {tuple(shape[1:])} for another (they depend "
                                         f"on the batch); feeder.predict writes per-row outputs (choose them with "
                                         f"outputs=)")
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
