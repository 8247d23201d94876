"""``PreparedBatch``: a batch as the runtime takes it (its arrays, their OrtValues, its IOBinding,
its device slot), made by the feed, prepared by the :class:`~feeder.runtime.runner.Runner`."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np


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
                 "output_where", "shape_key", "slot", "unfed", "ticket", "pieces", "meta", "pad_varies")

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
        self.pad_varies: Optional[Dict[str, List[int]]] = None  # feeder.padding's rounding history after it

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
