"""Asking a worker process for its stack, for a ``FeedTimeout``'s diagnosis, without ever harming it.

Two ways, per process. Its control thread answers a request on the channel with the main
thread's Python stack: the usual way. Where that does not come in time (C code holding the GIL:
no Python thread of the process can run), ``faulthandler`` writes the main thread's stack from a
C signal handler (SIGUSR1) into a file that the parent reads (``feeder.processes.child``).

Any number of consumers may time out at the same moment, and each asks. So, per process
(:class:`StackProbe`):

* one request is in flight at a time: a consumer that finds one in flight waits for its answer,
  which every waiting consumer shares (and a child that cannot answer never has its channel
  filled with requests);
* an answer carries the number of the request it answers: a consumer never mistakes an older
  answer for its own, nor misses its answer because another consumer asked again meanwhile
  (with one event per process, a second consumer cleared the event the first waited on, and
  the first then took the child for unresponsive);
* faulthandler is asked only when the request in flight went unanswered, and never again while
  its dump is being written or shortly after (that dump is shared);
* the dump covers the main thread only, and the signal goes to that thread alone (``tgkill``):
  the handler then reads only the frames of the thread it interrupted, which cannot change
  under it. Dumping every thread read the control thread's frames while it ran, answering
  another consumer's request, and the process died of SIGSEGV (4 consumers timing out together:
  1 to 3 runs in 40). Diagnosis must never harm what it diagnoses.
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from typing import Any, Callable, Optional, Tuple

DUMP_FRESH_S = 0.5    # a dump this recent is shared, not asked for again (seconds)
DUMP_STALE_S = 1.0    # a dump asked for this long ago that never stopped growing no longer blocks a new one
DUMP_PAUSE_S = 0.005  # a dump is complete once its file has not grown over this pause
CLOSE_WAIT_S = 1.0    # closing the dump file waits at most this long for a reader


def _tgkill() -> Optional[Any]:
    """The C library's ``tgkill(pid, tid, signal)`` (glibc 2.30 and later), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).tgkill
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_TGKILL = _tgkill()  # constant


def signal_thread(pid: int, tid: Optional[int], signum: int) -> bool:
    """Send ``signum`` to thread ``tid`` (a native thread id) of process ``pid``, or, where that is
    not possible, to the process (the child blocks SIGUSR1 in its control thread, so it still goes
    to another thread). False if it could not be sent (the process is gone)."""
    if _TGKILL is not None and tid is not None:
        return bool(_TGKILL(pid, tid, signum) == 0)
    try:
        os.kill(pid, signum)
        return True
    except OSError:
        return False


class StackProbe:
    """One worker process's stack requests and faulthandler dumps (see the module docstring).

    Thread-safe: consumers call :meth:`request`, :meth:`wait`, :meth:`start_dump` and
    :meth:`read_dump`; the process's receiver thread calls :meth:`attach`, :meth:`answer` and
    :meth:`close`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.sent = 0        # the number of the last request sent
        self.answered = 0    # the number of the last request answered
        self.asked_at = 0.0  # when the request in flight was sent (monotonic s)
        self.text: Optional[str] = None  # the last answer: the main thread's stack, innermost last
        self._dump = threading.Lock()    # the dump's state and file (held while reading it)
        self._fd: Optional[int] = None
        self._pid: Optional[int] = None
        self._tid: Optional[int] = None
        self._dump_start = 0     # where the last dump begins in the file
        self._dump_at = 0.0      # when it was asked for (0.0: never)
        self._dump_text: Optional[str] = None  # its text once complete (None while being written)

    def attach(self, pid: int, tid: Optional[int], fd: int) -> None:
        """The process said hello: its pid, its main thread's native id, its faulthandler file."""
        with self._dump:
            self._pid, self._tid, self._fd = pid, tid, fd

    # ---- the control thread's answers -------------------------------------------------------
    def request(self, send: Callable[[Tuple[Any, ...]], bool], now: float) -> int:
        """The number of the request whose answer to wait for: the one in flight, or a new one
        sent now with ``send`` (False if it could not be sent; then the last one)."""
        with self._cond:
            if self.sent > self.answered:
                return self.sent
            try:
                if send(("stack", self.sent + 1)):
                    self.sent += 1
                    self.asked_at = now
            except (OSError, ValueError):
                pass  # the channel is closed: the process is gone or going
            return self.sent

    def answer(self, text: str, seq: int) -> None:
        """The control thread's answer to request ``seq``."""
        with self._cond:
            self.text = text
            if seq > self.answered:
                self.answered = seq
            self._cond.notify_all()

    def wait(self, seq: int, until: float) -> bool:
        """Wait until request ``seq`` is answered or ``until`` (monotonic s); True if it is."""
        with self._cond:
            while self.answered < seq:
                left = until - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    # ---- faulthandler -------------------------------------------------------------------------
    def start_dump(self, now: float) -> bool:
        """Have faulthandler dump the main thread's stack, unless a dump is being written or was
        written less than DUMP_FRESH_S ago (it is shared); False if none can be had."""
        with self._dump:
            if self._fd is None or self._pid is None:
                return False
            if self._dump_at and (now - self._dump_at < (DUMP_FRESH_S if self._dump_text is not None
                                                         else DUMP_STALE_S)):
                return True
            try:
                start = os.fstat(self._fd).st_size
            except OSError:
                return False
            if not signal_thread(self._pid, self._tid, signal.SIGUSR1):
                return False
            self._dump_start, self._dump_at, self._dump_text = start, now, None
            return True

    def read_dump(self, deadline: float) -> str:
        """The last dump's text, once its file stops growing (by ``deadline``, monotonic s, at the
        latest: then what was written so far); '' if nothing came."""
        if not self._dump.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return ""  # another consumer reads it and keeps the lock past this one's deadline
        try:
            if self._dump_text is not None:
                return self._dump_text
            fd, start = self._fd, self._dump_start
            if fd is None:
                return ""
            size = start
            while True:
                new = os.fstat(fd).st_size
                now = time.monotonic()
                if new > start and new == size:
                    text = os.pread(fd, new - start, start).decode("utf-8", "replace")
                    self._dump_text = text  # complete: shared from now on
                    return text
                if now >= deadline:
                    return os.pread(fd, new - start, start).decode("utf-8", "replace") if new > start else ""
                size = new
                time.sleep(min(DUMP_PAUSE_S, max(0.0, deadline - now)))
        except OSError:
            return ""
        finally:
            self._dump.release()

    def close(self) -> None:
        """Close the dump file (the receiver, as it ends); waits for a reader, boundedly."""
        got = self._dump.acquire(timeout=CLOSE_WAIT_S)
        try:
            if self._fd is not None:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                self._fd = None
        finally:
            if got:
                self._dump.release()
