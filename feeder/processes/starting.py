"""Starting worker processes: the multiprocessing context (:func:`get_context`), a registration's
options (:class:`ProcessOptions`), and a Ctrl-C while they start.

Starting a process (``ProcFetchers.start``, ``feeder.processes.parent``): ``fetch_fun`` and
``worker_init_fun`` travel with cloudpickle (``feeder.processes.sending``); each child gets the read
end of its own *lifeline* pipe, whose write end only this (main) process holds, so the kernel kills
the child when this process dies (see ``feeder.processes.child.arm_lifeline``); and a Ctrl-C while
they start gives one ``KeyboardInterrupt``, in the parent, once every process is started and known
(``_ctrl_c_held``), and no traceback from any child: with "spawn" and "fork" the starting thread
blocks SIGINT while a child is made (the child inherits the mask, ignores SIGINT, then unblocks it),
and with "spawn" and "forkserver" the child's name, which multiprocessing unpickles first of all,
before re-importing the main module, sets SIGINT to "ignore" as it is unpickled (``_ChildName``).
The forkserver itself is never started with SIGINT blocked: the user's other processes are its
children too.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import operator
import os
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any, Callable, Iterator, List, Optional

# Imported once in the forkserver, so each child starts in milliseconds (cloudpickle: for functions
# sent by value).
PRELOAD = ["feeder.processes.child", "cloudpickle"]


@dataclass(frozen=True)
class ProcessOptions:
    """How a registration runs its worker processes (validated by ``feeder.api``)."""

    context: BaseContext
    worker_init_fun: Optional[Callable[[int], Any]] = None
    seed: Optional[int] = None


def get_context(mp_context: Any) -> BaseContext:
    """The multiprocessing context for ``mp_context`` (None: "forkserver" where available, else "spawn")."""
    if isinstance(mp_context, BaseContext):
        return mp_context
    methods = multiprocessing.get_all_start_methods()
    if mp_context is None:
        mp_context = "forkserver" if "forkserver" in methods else "spawn"
    if not isinstance(mp_context, str):
        raise TypeError(f"mp_context must be a start method name or a multiprocessing context, "
                        f"got {type(mp_context).__name__}")
    if mp_context not in methods:
        raise ValueError(f"mp_context {mp_context!r} is not available here (start methods: {methods})")
    ctx = multiprocessing.get_context(mp_context)
    if mp_context == "forkserver":
        # Adds to the forkserver's preload list only; harmless for other users of it.
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _SigintIgnored:
    """Unpickled in a child: SIGINT ignored (see _ChildName)."""

    def __reduce__(self) -> Any:
        return signal.signal, (int(signal.SIGINT), signal.SIG_IGN)


class _SigintUnblocked:
    """Unpickled in a child: SIGINT unblocked (a Ctrl-C pending meanwhile is then discarded)."""

    def __reduce__(self) -> Any:
        return signal.pthread_sigmask, (signal.SIG_UNBLOCK, (int(signal.SIGINT),))


class _ChildName(str):
    """A worker process's name. "spawn" and "forkserver" children unpickle their name before
    anything else, before they re-import the main module (which may take long: imports): this one
    unpickles as the plain name after setting SIGINT to "ignore" and unblocking it, so a Ctrl-C
    meanwhile gives no traceback in every child. Only the standard library is needed for that
    (importing feeder, hence numpy, before the main module would change what it sets up)."""

    def __reduce__(self) -> Any:
        return operator.itemgetter(2), ((_SigintIgnored(), _SigintUnblocked(), str(self)),)


@contextlib.contextmanager
def _ctrl_c_held(block: bool) -> Iterator[None]:
    """A Ctrl-C held back for the duration, then delivered (none is lost): the processes are all
    started and known by then, so none is left half-started. From the main thread, SIGINT's
    handler records it meanwhile (blocking it here would not do: the kernel hands a process's
    SIGINT to any thread that does not block it, and Python raises it in the main thread). With
    ``block``, SIGINT is also blocked in this thread, so that a child forked meanwhile ("spawn",
    "fork") is born with it blocked (see the module docstring)."""
    got: List[Any] = []
    handler: Any = None
    if threading.current_thread() is threading.main_thread():
        try:
            handler = signal.signal(signal.SIGINT, lambda signum, frame: got.append((signum, frame)))
        except ValueError:  # not the main interpreter
            handler = None
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if block else None
    try:
        yield
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
            if got and callable(handler):
                handler(*got[0])  # Python's default raises KeyboardInterrupt here
            elif got and handler == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def phantom_main_file_hidden() -> Iterator[None]:
    """For the duration, a main module whose ``__file__`` names no file (a script read from stdin,
    ``python - < script.py``: ``"<stdin>"``) has none: multiprocessing would otherwise have each
    "spawn" or "forkserver" child run that path as the main script, and every child died at start
    ("No such file or directory: '/cwd/<stdin>'"). Without it the child imports no main script,
    as for ``python -c``; fetch_fun travels by value (cloudpickle) either way."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str) or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path
