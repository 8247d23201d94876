"""A worker process's traceback, rebuilt on the exception the parent re-raises.

An exception pickled back from a worker process arrives without its traceback (pickle keeps
the type, the arguments and nothing of the frames), so the ``__cause__`` of the consumer's
``FetchError`` printed as a bare ``ValueError: ...``, the worker's traceback only as text in the
``FetchError``'s message. The child sends the frames of its traceback as ``(file name, line,
function)`` (:func:`frames_of`); :func:`attach` makes, for each, a real traceback entry in the
parent whose frame has that file name and function name and whose line is that line, the way
Jinja2 and tblib rebuild tracebacks: a one-line code object compiled under the frame's file name
is run and raises, and its frame is kept. So the cause prints like any local exception, with
the file, the line and (``linecache`` reads it in the parent, the same machine) the source text,
wherever a traceback is printed (``traceback``, ``logging``, the interpreter, pytest).

The code object puts a call at the line's indentation, spanning exactly the line's text, so that
no traceback printer underlines part of the line: what it points at is the whole line.
"""
from __future__ import annotations

import linecache
import sys
import traceback
import types
from typing import List, Optional, Sequence, Tuple

Frame = Tuple[str, int, str]  # file name, line number (1-based), function name
MAX_FRAMES = 64  # the innermost frames kept of a deeper traceback (a deep recursion says enough in 64)


def frames_of(e: BaseException) -> List[Frame]:
    """The frames of ``e``'s own traceback, outermost first (what :func:`attach` takes)."""
    summary = traceback.extract_tb(e.__traceback__)
    return [(f.filename, int(f.lineno or 0), f.name) for f in summary][-MAX_FRAMES:]


def _raise() -> None:
    raise _Marker


class _Marker(Exception):
    pass


def _entry(filename: str, lineno: int, name: str) -> Tuple[types.FrameType, int]:
    """A frame whose code has ``filename`` and ``name``, stopped at a call on line ``lineno`` that
    spans that line's text (as ``linecache`` has it here), and the offset of that call."""
    line = linecache.getline(filename, lineno) if lineno > 0 else ""
    text = line.strip()
    indent = len(line) - len(line.lstrip())
    call = "__r(" + " " * max(0, len(text.encode("utf-8")) - 5) + ")"  # (columns count bytes)
    if indent and lineno >= 2:  # an indented line: the call's column, inside parentheses opened on the line before
        source = "\n" * (lineno - 2) + "(\n" + line[:indent] + call + "\n)"
    else:
        source = "\n" * max(0, lineno - 1) + call
    code = compile(source, filename, "exec").replace(co_name=name)
    if sys.version_info >= (3, 11):  # the name a traceback prints from 3.11 on
        code = code.replace(co_qualname=name)
    scope = {"__r": _raise, "__name__": "feeder.processes.remotetb"}
    try:
        exec(code, scope)
    except _Marker as e:
        tb = e.__traceback__
        assert tb is not None and tb.tb_next is not None
        entry = tb.tb_next  # the frame of `code`, stopped at the call
        frame, lasti = entry.tb_frame, entry.tb_lasti
        del e, tb, entry
    finally:
        scope.clear()  # the frame keeps its (now empty) globals: nothing else of the parent's
    return frame, lasti


def attach(exc: BaseException, frames: Optional[Sequence[Frame]]) -> bool:
    """Give ``exc`` (an exception rebuilt in the parent, without a traceback) a traceback made of
    ``frames`` (outermost first). False if there were none or they could not be made (``exc`` is
    then left as it was)."""
    if not frames:
        return False
    tb: Optional[types.TracebackType] = None
    try:
        for filename, lineno, name in reversed(list(frames)):
            frame, lasti = _entry(str(filename), int(lineno), str(name))
            tb = types.TracebackType(tb, frame, lasti, int(lineno))
    except Exception:  # an odd file name or line: the text of the traceback is still in the message
        return False
    exc.__traceback__ = tb
    return True
