"""What a ``map`` or ``filter`` function is, for a checkpoint: a digest of its code, not of where it sits.

A state records each step of a transformed source (``feeder.sources.transform``) so that a state
is never resumed behind other functions. A function is identified by what it is: its bytecode, its
constants and the names it uses, its defaults, and the values its closure holds, recursively for
the functions and code objects among them. Not by where it sits: line numbers and file names are
left out, so that a comment added above a lambda, or a function moved within its file, leaves a
checkpoint resumable, while a changed body, constant, default or captured value refuses it.

What cannot be inspected counts by its type alone: a callable object that is not a function (its
class's name stands for it), and a value in a closure or a default that is neither a number, a
string, bytes, a numpy array, a container of those nor a function (a tokenizer, a model object).
Global variables a function reads are named (``co_names``) but their values are not recorded. An
array above 64 MiB counts by its dtype, shape and a sample of a million of its values.
Bytecode is that of the running Python: a state written by another minor version of Python is of
other functions.
"""
from __future__ import annotations

import functools
import hashlib
import types
from typing import Any, Optional, Set

import numpy as np

DIGEST_CHARS = 16  # hex characters kept of a function's SHA-256
FULL_ARRAY_BYTES = 64 << 20  # an array a function holds is hashed whole up to this size...
SAMPLE_VALUES = 1 << 20      # ... beyond it, this many of its values spread evenly (and its first and last)
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def function_digest(fn: Any) -> Optional[str]:
    """A hex digest of what ``fn`` is (see the module docstring), or None for a callable that is
    not a function, method or ``functools.partial`` of one (its name alone then identifies it)."""
    if not isinstance(fn, (types.FunctionType, types.MethodType, functools.partial)):
        return None
    h = hashlib.sha256()
    _value(h, fn, set())
    return h.hexdigest()[:DIGEST_CHARS]


def _put(h: Any, tag: str, data: bytes = b"") -> None:
    h.update(tag.encode() + len(data).to_bytes(8, "little") + data)


def _code(h: Any, code: types.CodeType, seen: Set[int]) -> None:
    # Everything that makes the code run as it does; co_filename, co_firstlineno, the line table
    # and the qualified name say where it sits, and are left out.
    _put(h, "code", code.co_code)
    _put(h, "shape", repr((code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags,
                           code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)).encode())
    table = getattr(code, "co_exceptiontable", None)
    if table is not None:
        _put(h, "except", table)
    _put(h, "consts", str(len(code.co_consts)).encode())
    for c in code.co_consts:
        _value(h, c, seen)


def _value(h: Any, v: Any, seen: Set[int]) -> None:
    """Feed ``h`` with a value a function holds (a constant, a default, a closure's cell)."""
    if isinstance(v, _SCALARS):
        _put(h, type(v).__name__, repr(v).encode())
        return
    if isinstance(v, np.generic):
        _put(h, "np." + v.dtype.str, v.tobytes())
        return
    if id(v) in seen:  # a function that refers to itself (through a closure): once is enough
        _put(h, "seen")
        return
    seen.add(id(v))
    if isinstance(v, types.CodeType):
        _code(h, v, seen)
    elif isinstance(v, types.FunctionType):
        _put(h, "function", v.__name__.encode())
        _code(h, v.__code__, seen)
        _value(h, v.__defaults__, seen)
        _value(h, sorted((v.__kwdefaults__ or {}).items()), seen)
        cells = v.__closure__ or ()
        _put(h, "closure", str(len(cells)).encode())
        for cell in cells:
            try:
                contents = cell.cell_contents
            except ValueError:  # a cell not yet filled
                _put(h, "empty cell")
                continue
            _value(h, contents, seen)
    elif isinstance(v, types.MethodType):
        _put(h, "method")
        _value(h, v.__func__, seen)
        _put(h, "self", _type_name(type(v.__self__)).encode())
    elif isinstance(v, functools.partial):
        _put(h, "partial")
        _value(h, v.func, seen)
        _value(h, v.args, seen)
        _value(h, sorted(v.keywords.items()), seen)
    elif isinstance(v, np.ndarray):
        _put(h, "ndarray", f"{v.dtype.str}{v.shape}".encode())
        if v.dtype.hasobject:
            _value(h, v.tolist(), seen)
        elif v.nbytes <= FULL_ARRAY_BYTES:
            _put(h, "data", hashlib.sha256(np.ascontiguousarray(v).tobytes()).digest())
        else:  # an embedding table, say: sampled, as ArraySource fingerprints big data
            picked = v.flat[np.unique(np.linspace(0, v.size - 1, SAMPLE_VALUES).astype(np.int64))]  # no copy of v
            _put(h, "sample", hashlib.sha256(np.ascontiguousarray(picked).tobytes()).digest())
    elif isinstance(v, (tuple, list)):
        _put(h, type(v).__name__, str(len(v)).encode())
        for x in v:
            _value(h, x, seen)
    elif isinstance(v, dict):
        _put(h, "dict", str(len(v)).encode())
        for k, x in v.items():
            _value(h, k, seen)
            _value(h, x, seen)
    elif isinstance(v, (set, frozenset)):
        _put(h, type(v).__name__, repr(sorted(repr(x) for x in v)).encode())
    elif isinstance(v, types.ModuleType):
        _put(h, "module", v.__name__.encode())
    elif isinstance(v, type):
        _put(h, "class", _type_name(v).encode())
    else:  # an object that cannot be inspected: its type stands for it
        _put(h, "object", _type_name(type(v)).encode())


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"
