"""Sending ``fetch_fun`` and ``worker_init_fun`` to worker processes: cloudpickle, inside
multiprocessing's own sending.

Plain pickling sends a function by name, so a lambda, a closure, or a function defined in a
notebook, a REPL or ``python -c`` could not reach a worker process started by "forkserver" or
"spawn". Like Ray, Dask and joblib, feeder sends them with cloudpickle, which sends such
functions by value (and importable ones still by name). Their code keeps the name of the file it
was written in (cloudpickle would call it ``<dynamic-code>``), and a notebook cell's lines travel
with it into the child's ``linecache``, so that a traceback from a worker process shows the
user's file, line and source text (:func:`_code`).

Multiprocessing's own objects a function may hold (``Value``, ``Lock``, ``Queue``, connections)
can only be pickled while multiprocessing starts a process: their reducers ask the starting
process's ``Popen`` to pass their descriptors and semaphores to the child. So a
:class:`Sendable` is cloudpickled from its ``__reduce__``, which multiprocessing calls while it
pickles the process's arguments inside ``Process.start()``, and with a pickler whose dispatch
table also holds multiprocessing's reducers: those objects travel exactly as multiprocessing
sends them to a child. The child unpickles it (plain ``pickle``) when :meth:`Sendable.get` is
called, inside the worker loop, so that a failure to rebuild it there is reported like any
other failure of the worker.

:func:`check_sendable` makes the same pickling once at registration, in a stand-in spawning
context that passes no descriptor, so that what cannot be sent at all (a thread lock, a
session, an open file, or a multiprocessing object of the "fork" context) is a ``TypeError``
there, naming what failed, and not a dead process later.
"""
from __future__ import annotations

import io
import linecache
import os
import pickle
import sys
import types
from collections import ChainMap
from multiprocessing import context as mp_context
from multiprocessing.context import BaseContext
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, List, Optional

import numpy as np

from ..sources.mapped import file_region


def dumps(obj: Any, buffer_callback: Optional[Callable[[Any], Any]] = None) -> bytes:
    """``obj`` cloudpickled, with multiprocessing's reducers for its own objects (call it inside a
    spawning context, see the module docstring)."""
    import cloudpickle  # not at import: `import feeder` need not pay for it

    class Pickler(cloudpickle.Pickler):  # type: ignore[misc]
        # The C pickler reads its dispatch table when it is made: a class attribute, not an
        # instance one. Open text files first (cloudpickle would send a copy of what one holds,
        # read whole), then cloudpickle's reducers (functions, classes, methods by value where
        # needed), then multiprocessing's (Connection, socket, shared-memory Arena...), then copyreg's.
        dispatch_table = ChainMap({io.TextIOWrapper: _text_file, types.CodeType: _code},
                                  cloudpickle.Pickler.dispatch_table,
                                  ForkingPickler._extra_reducers)  # type: ignore[attr-defined]

        def reducer_override(self, obj: Any) -> Any:
            # A memory-mapped array (or a view of one) that the function holds travels as its file
            # and offsets, as an ArraySource's does, never as the bytes it maps (a 10 GB file would
            # be read whole and copied into every worker process).
            # Only plain arrays and memmaps: a subclass (a masked array, a recarray) pickles as it
            # always did, with what it adds (a mask) kept.
            if type(obj) is np.ndarray or type(obj) is np.memmap:
                region = file_region(obj, keep_mode=True)
                if region is not None:
                    return region.open, (type(obj) is np.memmap,)
                if _owned_in_child(obj):
                    try:
                        buf = pickle.PickleBuffer(obj)  # type: ignore[arg-type]  # (numpy's stubs: not a Buffer)
                    except (ValueError, BufferError, TypeError):  # a dtype numpy does not export: as before
                        return super().reducer_override(obj)
                    return _owned_array, (buf, obj.dtype, obj.shape, obj.flags.writeable)
            return super().reducer_override(obj)

    buf = io.BytesIO()
    Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=buffer_callback).dump(obj)
    return buf.getvalue()


# numpy advises transparent huge pages for the arrays it allocates from this size on (Linux); an
# array rebuilt from a pickle lies in the pickle's bytes instead, on small pages.
OWNED_BYTES = 4 << 20
# ... up to this size: the rebuild is one more copy while the pickle is still held (a worker
# process's start-up peak grows by it). A bigger dataset belongs in a memory-mapped file, which
# travels as its file.
OWNED_MAX_BYTES = 256 << 20


def _owned_in_child(a: np.ndarray) -> bool:
    """Whether ``a`` is rebuilt in the worker process in memory numpy allocates itself.

    A big array the function reads (a dataset held in memory) arrived as a view of the bytes
    unpickling made: memory from the C allocator on 4 KiB pages, while the same array in the
    parent lies on huge pages that numpy asked for. Every read of it then missed the TLB more:
    with 3 MB chunks cut from a 50 MB array, two worker processes fed 6-8% fewer rows per second
    (benchmarks/compare.py, s-large) than with the array copied once into numpy's own memory."""
    return (type(a) is np.ndarray and OWNED_BYTES <= a.nbytes <= OWNED_MAX_BYTES and not a.dtype.hasobject
            and a.dtype.kind not in "mM" and a.flags.c_contiguous)  # (datetimes: no buffer protocol)


def _owned_array(buf: Any, dtype: np.dtype, shape: Any, writeable: bool) -> np.ndarray:
    """In the worker process: the array ``buf`` holds, copied into memory numpy allocated (see
    :func:`_owned_in_child`), with the writeable flag it had in the parent."""
    out = np.empty(shape, dtype)
    np.copyto(out.reshape(-1), np.frombuffer(buf, dtype=dtype, count=out.size))
    out.flags.writeable = writeable
    return out


def _code(code: types.CodeType) -> Any:
    """A code object sent by value, as cloudpickle sends it, but keeping where it was written.

    cloudpickle names every code object it sends ``<dynamic-code>``, so a traceback from a worker
    process showed ``File "<dynamic-code>", line 4`` instead of the user's file and line. This
    keeps ``co_filename``; and where the source is not a file (a notebook cell, which IPython
    registers with ``linecache``), it sends the cell's lines along, registered with the child's
    ``linecache``, so that the traceback shows the source text there too."""
    import cloudpickle

    rebuild, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    filename = code.co_filename
    lines = None
    if not os.path.isfile(filename):
        entry = linecache.cache.get(filename)
        if entry is not None and len(entry) == 4 and isinstance(entry[2], list):
            lines = entry[2]  # (one list per file, pickled once however many functions it holds)
    return _code_from, (rebuild, args, filename, lines)


def _code_from(rebuild: Any, args: Any, filename: str, lines: Optional[List[str]]) -> types.CodeType:
    """In the worker process: the code object, its file name restored, its source known to linecache."""
    code: types.CodeType = rebuild(*args)
    if lines is not None and filename not in linecache.cache:
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)  # mtime None: kept as is
    return code.replace(co_filename=filename) if code.co_filename != filename else code


def _text_file(f: Any) -> Any:
    if f is sys.stdout or f is sys.stderr:  # the child's own, as cloudpickle sends them
        return getattr, (sys, "stdout" if f is sys.stdout else "stderr")
    raise TypeError(f"cannot send an open file ({getattr(f, 'name', f)!r}, a {type(f).__name__}) to a worker "
                    f"process: open it there")


def _received(data: bytes) -> "Sendable":
    s = Sendable.__new__(Sendable)
    s._obj, s._data = None, data
    return s


class Sendable:
    """An object on its way to a worker process (see the module docstring). With the "fork"
    start method nothing is pickled: the child has the object itself."""

    def __init__(self, obj: Any):
        self._obj: Any = obj
        self._data: Optional[bytes] = None

    def __reduce__(self) -> Any:
        return _received, (dumps(self._obj),)

    def get(self) -> Any:
        """The object (in a child: rebuilt from what was sent, on the first call)."""
        if self._data is not None:
            self._obj, self._data = pickle.loads(self._data), None
        return self._obj


class _DryRunFd:
    def __init__(self, fd: int):
        self.fd = fd


class _DryRunPopen:
    """Stands in for the ``Popen`` of a process being started: multiprocessing's reducers ask it to
    pass descriptors to the child, which a dry run does not."""

    DupFd = _DryRunFd

    def duplicate_for_child(self, fd: int) -> int:
        return fd


def check_sendable(what: str, obj: Any, context: BaseContext) -> None:
    """TypeError naming ``what`` and what failed if ``obj`` cannot be sent to a worker process
    started by ``context``. Array buffers are not copied (protocol 5, out of band), and memory-mapped
    arrays of feeder's sources travel as their file, so a big source costs little to check."""
    method = context.get_start_method()
    if obj is None or method == "fork":
        return
    previous = mp_context.get_spawning_popen()
    mp_context.set_spawning_popen(_DryRunPopen())  # type: ignore[arg-type]  # thread-local: others unaffected
    try:
        dumps(obj, buffer_callback=lambda b: False)
    except Exception as e:
        if "fork context" in str(e):  # a multiprocessing Lock, Value, Queue... made with the "fork" context
            raise TypeError(
                f"{what} {obj!r:.200} holds a multiprocessing object made with the 'fork' context (as "
                f"multiprocessing.Lock(), Value() or Queue() are by default on Linux), which cannot be sent to "
                f"worker processes started with {method!r}: make it with multiprocessing.get_context({method!r}) "
                f"(the context of mp_context), or pass mp_context='fork'") from e
        raise TypeError(
            f"{what} {obj!r:.200} cannot be sent to worker processes started with {method!r} "
            f"({type(e).__name__}: {e}). It travels with everything it refers to (cloudpickle); what cannot "
            f"travel (a thread lock, an open file, a session) must be made in the worker process instead "
            f"(in worker_init_fun, or on the first call), or pass mp_context='fork'") from e
    finally:
        mp_context.set_spawning_popen(previous)
