"""Worker processes and the main script: the ``if __name__ == "__main__":`` guard.

A worker process started with "spawn" or "forkserver" first imports the main script again
(under the name ``__mp_main__``), so that what it defines exists there. Its top-level code runs
again in the worker: code that starts feeder must sit under ``if __name__ == "__main__":``, or
each worker would start feeder, and workers of its own, as it starts. multiprocessing refuses
that (a ``RuntimeError`` on the worker's stderr), and the worker died before it could say why:
"died while starting", the cause only in multiprocessing's traceback.

feeder says it itself, twice over:

* in the parent, at ``start()`` (:func:`unguarded_call`): ``start()`` was called, directly or
  not, from a top-level statement of the main script that no ``if`` about ``__name__`` guards.
  Then no process is started, and the ``FeederError`` names the script and the line;
* in the worker (:func:`refuse_in_bootstrap`), where the parent could not tell (the script
  cannot be read, a guard that lets the workers' import through): a ``start()`` of worker
  processes while a worker process of feeder imports the main script ends that process at once
  with exit code :data:`MAIN_REIMPORT_EXIT`, which its parent turns into a ``FetchError`` naming
  the worker and saying what to do (``feeder.processes.parent``). A feed of threads started
  there is let run (it harms nothing but the worker's time), with a warning.
"""
from __future__ import annotations

import ast
import logging
import multiprocessing
import os
import sys
from typing import Optional, Tuple

from ..errors import FeederError

log = logging.getLogger("feeder")

MAIN_REIMPORT_EXIT = 117  # a worker process's exit code: its import of the main script started feeder
ADVICE = ("put the code that starts feeder under `if __name__ == \"__main__\":` (worker processes started by "
          "\"spawn\" or \"forkserver\" import the main script again, and its top-level code runs again in each of "
          "them), or use worker threads (num_worker_threads) instead of num_worker_processes")
# What a guard's test names: `__name__ == "__main__"`, `__name__ != "__mp_main__"`,
# `multiprocessing.parent_process() is None`, `current_process().name == "MainProcess"`.
GUARD_NAMES = frozenset({"__name__", "__main__", "__mp_main__", "parent_process", "current_process"})
REIMPORTING = ("spawn", "forkserver")  # the start methods whose workers import the main script again


def reimported_main() -> Optional[str]:
    """The path of the main script that a "spawn" or "forkserver" worker imports again, or None
    (an interactive session, ``python -c``, a package's ``__main__``), as multiprocessing decides."""
    main = sys.modules.get("__main__")
    if main is None:
        return None
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None:  # python -m name
        return None if spec_name == "__main__" or spec_name.endswith(".__main__") else path
    if path is None or os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None
    return str(path)


def _is_guard(test: ast.expr) -> bool:
    for node in ast.walk(test):
        if isinstance(node, ast.Name) and node.id in GUARD_NAMES:
            return True
        if isinstance(node, ast.Attribute) and node.attr in GUARD_NAMES:
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in GUARD_NAMES:
            return True
    return False


def unguarded_call(method: str) -> Optional[Tuple[str, int]]:
    """``(script, line)`` when this call comes from a top-level statement of the main script that
    a worker started by ``method`` would run again (no ``if`` about ``__name__`` around it); None
    when it does not, or when that cannot be told (then :func:`refuse_in_bootstrap` does)."""
    if method not in REIMPORTING:
        return None
    path = reimported_main()
    if path is None:
        return None
    main_globals = sys.modules["__main__"].__dict__
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is main_globals and frame.f_code.co_name == "<module>"):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None or os.path.abspath(frame.f_code.co_filename) != os.path.abspath(path):
        return None  # not from the script's own top-level code (exec'd code, a debugger's)
    line = frame.f_lineno
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and node.lineno <= line <= (node.end_lineno or node.lineno) \
                and _is_guard(node.test):
            return None
    return path, line


def refuse_in_bootstrap(processes: bool) -> None:
    """Called by ``start()``: refuse worker processes started while this process is itself
    starting, from its import of the main script (multiprocessing would refuse them). In a
    worker process of feeder: log why and end the process with MAIN_REIMPORT_EXIT (its parent
    says the rest); in another library's: a FeederError. A feed of threads only is let start,
    with a warning in a worker process of feeder (it then runs that feed too)."""
    proc = multiprocessing.current_process()
    if not getattr(proc, "_inheriting", False):  # set by multiprocessing while a child prepares
        return
    ours = proc.name.startswith("feeder:")
    if not processes:
        if ours:
            log.warning("feeder worker process %s (pid %d): its import of the main script started a feed of threads, "
                        "which now runs in this process too: %s", proc.name, os.getpid(), ADVICE)
        return
    if ours:
        log.error("feeder worker process %s (pid %d): its import of the main script called start() for worker "
                  "processes; ending it: %s", proc.name, os.getpid(), ADVICE)
        logging.shutdown()
        os._exit(MAIN_REIMPORT_EXIT)
    raise FeederError(f"start() was called while process {proc.name!r} was starting, from its import of the "
                      f"main script: worker processes cannot start there; {ADVICE}")
