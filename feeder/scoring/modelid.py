"""The identity of an ONNX model for ``feeder.predict``: what an output records of the model that
wrote it, so that an output is never continued with another one.

A model is its ``.onnx`` file (or the bytes a session was made from) and, for a model saved with
``onnx.save_model(..., save_as_external_data=True)`` (how big models and torch exports are
saved), the external data files its tensors point to: retraining such a model may rewrite only
those. :func:`model_identity` hashes both (SHA-256).

The external files are found by walking the protobuf wire format of the model (ModelProto ->
graphs, nodes, attributes, functions -> TensorProto.external_data's ``location``), stepping over
every tensor's bytes without reading them: a multi-gigabyte model whose weights are inline costs
a hash of its file, never a second copy of it in memory (``onnx.load`` would parse it whole), and
the ``onnx`` package is not needed.
"""
from __future__ import annotations

import hashlib
import mmap
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..storage import sha256_file

# Which fields of which ONNX message hold messages that may hold tensors (field number -> kind),
# from onnx.proto (checked against onnx's own descriptors in tests/test_predict.py).
_CHILDREN: Dict[str, Dict[int, str]] = {
    "model": {7: "graph", 20: "training", 25: "function"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "function": {7: "node"},
    "training": {1: "graph", 2: "graph"},
    "sparse": {1: "tensor", 2: "tensor"},
}
_TENSOR_EXTERNAL_DATA = 13       # TensorProto.external_data: repeated StringStringEntryProto
_ENTRY_KEY, _ENTRY_VALUE = 1, 2  # StringStringEntryProto.key, .value
_MAX_DEPTH = 64                  # nested subgraphs (If, Loop, Scan) deeper than this are not a model


class NotAModel(ValueError):
    """The bytes are not an ONNX model's protobuf encoding."""


def _varint(buf: Any, pos: int, end: int) -> Tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= end or shift > 63:
            raise NotAModel("a truncated or overlong varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _fields(buf: Any, start: int, end: int) -> Iterator[Tuple[int, int, int, int]]:
    """(field number, wire type, value start, value end) of each field of one message; a varint's
    or fixed value's span is skipped over, a length-delimited one is given as its span."""
    pos = start
    while pos < end:
        tag, pos = _varint(buf, pos, end)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            _, after = _varint(buf, pos, end)
        elif wire == 1:
            after = pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos, end)
            after = pos + size
        elif wire == 5:
            after = pos + 4
        else:  # groups (3, 4) are not used by onnx.proto; anything else is not protobuf
            raise NotAModel(f"wire type {wire}")
        if after > end or number == 0:
            raise NotAModel("a field runs past its message")
        yield number, wire, pos, after
        pos = after


def external_data_locations(buf: Any) -> List[str]:
    """The ``location`` of every tensor of a serialized ModelProto whose data is external, in
    order of appearance, each once. NotAModel (a ValueError) if ``buf`` is not protobuf."""
    found: Dict[str, None] = {}
    stack: List[Tuple[str, int, int, int]] = [("model", 0, len(buf), 0)]
    while stack:
        kind, start, end, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise NotAModel("graphs nested deeper than any model's")
        if kind == "tensor":
            for number, wire, lo, hi in _fields(buf, start, end):
                if number == _TENSOR_EXTERNAL_DATA and wire == 2:
                    entry = {n: bytes(buf[a:b]) for n, w, a, b in _fields(buf, lo, hi) if w == 2}
                    if entry.get(_ENTRY_KEY) == b"location" and _ENTRY_VALUE in entry:
                        found.setdefault(entry[_ENTRY_VALUE].decode("utf-8", "replace"))
            continue
        children = _CHILDREN[kind]
        for number, wire, lo, hi in _fields(buf, start, end):
            child = children.get(number)
            if child is not None and wire == 2:
                stack.append((child, lo, hi, depth + 1))
    return list(found)


def _locations_in_file(path: str) -> List[str]:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise NotAModel("an empty file")
        # Mapped, not read: only the pages holding message headers are touched, never the tensors'.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                return external_data_locations(view)
            finally:
                view.release()


def model_identity(path: Optional[str] = None, data: Optional[bytes] = None) -> Dict[str, Any]:
    """``{"sha256": <hex of the model's bytes>}``, plus ``"external_data": {location: <hex>}`` for
    a model whose tensors are in external files (locations as the model names them, relative to
    its folder; for a model given as ``data``, to the working directory, as ONNX Runtime resolves
    them). Give the model's file ``path`` or its bytes ``data``.

    Raises ValueError naming an external data file that cannot be read (the model cannot be
    identified, so an output written with it could not be checked on a resume).
    """
    if data is not None:
        digest = hashlib.sha256(data).hexdigest()
        folder = os.getcwd()
        try:
            locations = external_data_locations(memoryview(data))
        except NotAModel:
            locations = []  # the session loaded it, whatever it is: identified by its bytes alone
    elif path is not None:
        digest = sha256_file(path)
        folder = os.path.dirname(os.path.abspath(path))
        try:
            locations = _locations_in_file(path)
        except NotAModel:
            locations = []
    else:
        raise TypeError("model_identity needs a path or bytes")
    identity: Dict[str, Any] = {"sha256": digest}
    if locations:
        external = {}
        for location in locations:
            where = os.path.normpath(os.path.join(folder, location))
            try:
                external[location] = sha256_file(where)
            except OSError as e:
                raise ValueError(f"the model's external data file {location!r} ({where}) cannot be read "
                                 f"({type(e).__name__}: {e.strerror or e}); feeder.predict records the model's weights "
                                 f"with its output") from e
        identity["external_data"] = external
    return identity
