"""Copies of batches to the device, on a CUDA stream of the feed's own.

A :class:`Transfer` belongs to one feed (or one ``StatefulSession``). :meth:`Transfer.copy` issues
a batch's copies into a device slot (``feeder.device.memory.Slot``) with ``cudaMemcpyAsync`` on
the feed's non-blocking stream (one copy per input from staging memory, or one per piece straight
from where the rows lie: a worker process's registered shared memory), records an event after
them and returns a :class:`Ticket`. Issuing takes microseconds and returns before the copy is
done: the copy of batch n+1 overlaps the run of batch n. The consumer waits on the ticket (the
event, with the GIL released) just before it runs the batch.

Memory is reused only once its copy is done, whoever lets go of it first:

* the memory copied from (staging buffers, chunks in shared memory) is kept alive by the ticket,
  and the transfer keeps every ticket until its event has completed (:meth:`Transfer.reap`), so a
  staging buffer goes back to its ring, and a chunk's shared memory back to its worker process,
  only after the copy that read it;
* a slot is released by the run that read it, after the run returned (``feeder.runtime``); the
  next copy into it is issued on the same stream, after every copy before it.

Without a CUDA runtime (another provider whose runtime cannot be reached), copies go through
``OrtValue.update_inplace``, synchronous, into slots of the batch's exact size; the log says so
once.

``copy_s`` adds up how long the copies took on the device (timed with a pair of events per batch;
the stand-in times its memmoves), for ``stage_times()`` and ``diagnose()``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Deque, List, Sequence, Tuple

import numpy as np

from .memory import DeviceMemory, Slot, address

log = logging.getLogger("feeder")


class Ticket:
    """One batch's copy to the device: done once its event has completed.

    ``keep`` holds what the copy reads (staging buffers, chunk views) until then."""

    __slots__ = ("start", "end", "keep", "done", "nbytes", "issued", "_transfer", "__weakref__")

    def __init__(self, transfer: "Transfer", start: int, end: int, keep: Any, nbytes: int, issued: float):
        self._transfer = transfer
        self.start, self.end = start, end
        self.keep = keep
        self.nbytes = nbytes
        self.issued = issued
        self.done = start == 0 and end == 0  # (a synchronous copy is done when issued)

    def wait(self) -> None:
        """Wait until the copy is done (the GIL released meanwhile)."""
        if not self.done:
            self._transfer.wait(self)

    def __del__(self) -> None:  # its events go back to the pool once nobody can wait on them
        transfer = self._transfer
        if self.start and transfer is not None:
            transfer._give_back(self.start, self.end)


class Transfer:
    """Copies to one device on a stream of the feed's own (see the module docstring). Thread-safe:
    any thread may issue copies and wait on tickets.

    Args:
        memory: The device memory (its ``runtime``: the CUDA runtime, the stand-in, or None).

    ``trace`` (a ``feeder.trace.TraceHook``) and ``track``, when set, put each copy on a trace, as a
    "copy" span on that track, once its time is known.
    """

    def __init__(self, memory: DeviceMemory):
        self.memory = memory
        self.runtime = memory.runtime
        self.index = memory.placement.index
        self.trace: Any = None
        self.track = "stream"
        self._lock = threading.Lock()
        self._stream = 0
        self._inflight: Deque[Ticket] = deque()  # issued, not known to be done (in stream order)
        self._events: List[int] = []             # pool of free events
        self._returned: Deque[int] = deque()     # events of tickets gone, not yet back in the pool
        self._made: List[int] = []               # every event made (destroyed at close)
        self._closed = False
        self._last_end = 0.0  # where the last copy ended, as far as known (monotonic s)
        self.copy_s = 0.0     # seconds the device spent copying (timed)
        self.copied_bytes = 0
        self.copies = 0
        if self.runtime is None:
            log.info("feeder: no CUDA runtime is reachable in this process for %s; batches are copied to the device "
                     "with OrtValue.update_inplace (synchronous, in the thread that makes the batch)",
                     memory.placement)

    @property
    def streamed(self) -> bool:
        """Whether copies are asynchronous on a stream (else ``update_inplace``)."""
        return self.runtime is not None

    # -- issuing -------------------------------------------------------------------------------------
    def copy(self, slot: Slot, sources: Sequence[Sequence[np.ndarray]], keep: Any = None) -> Ticket:
        """Copy ``sources`` (per input: C-contiguous host arrays whose bytes, one after the other,
        are that input's batch) into ``slot``'s buffers; returns the ticket to wait on before a run
        reads the slot. ``keep``: more to keep alive until the copy is done."""
        nbytes = sum(a.nbytes for parts in sources for a in parts)
        if self.runtime is None:
            return self._update_inplace(slot, sources, nbytes)
        runtime = self.runtime
        runtime.set_device(self.index)  # (per thread: the stream and events are the device's)
        with self._lock:
            if self._closed:
                raise RuntimeError("the feed's device copies are closed (the feed stopped)")
            if not self._stream:
                self._stream = runtime.stream_create()
            stream = self._stream
            start, end = self._event(), self._event()
            now = time.monotonic()
            # Under the lock: one batch's copies and its events are one block on the stream, so the
            # stream's order is the tickets' order (reap relies on it).
            runtime.event_record(start, stream)
            for ptr, parts, cap in zip(slot.ptrs, sources, slot.caps):
                offset = 0
                for a in parts:
                    n = a.nbytes
                    if n:
                        if offset + n > cap:
                            raise ValueError(f"a batch input of {offset + n} bytes into a device slot of {cap}")
                        runtime.memcpy_async(ptr + offset, address(a), n, stream)
                    offset += n
            runtime.event_record(end, stream)
            # What the copy reads and the buffers it writes live until it is done, whoever lets go first.
            ticket = Ticket(self, start, end, (sources, slot.buffers, keep), nbytes, now)
            self._inflight.append(ticket)
            self.copied_bytes += nbytes
            self.copies += 1
        slot.ticket = ticket
        self.reap()
        return ticket

    def _event(self) -> int:  # (under the lock)
        returned = self._returned
        while returned:
            self._events.append(returned.popleft())
        if self._events:
            return self._events.pop()
        assert self.runtime is not None
        e = self.runtime.event_create(timing=True)
        self._made.append(e)
        return int(e)

    def _give_back(self, start: int, end: int) -> None:
        # From a ticket's __del__: any thread, at any moment (this one may hold the lock): no lock here.
        self._returned.append(start)
        self._returned.append(end)

    def _update_inplace(self, slot: Slot, sources: Sequence[Sequence[np.ndarray]], nbytes: int) -> Ticket:
        t0 = time.monotonic()
        for value, parts in zip(slot.buffers, sources):
            a = parts[0] if len(parts) == 1 else np.concatenate([p.reshape(-1).view(np.uint8) for p in parts])
            value.update_inplace(a.reshape(-1).view(np.uint8))
        t1 = time.monotonic()
        ticket = Ticket(self, 0, 0, None, nbytes, t0)
        with self._lock:
            self.copy_s += t1 - t0
            self.copied_bytes += nbytes
            self.copies += 1
        self._traced(ticket, t0, t1 - t0)
        slot.ticket = ticket
        return ticket

    # -- completion ---------------------------------------------------------------------------------
    def wait(self, ticket: Ticket) -> None:
        """Wait for ``ticket``'s copy (the GIL released: ctypes), then let go of what it kept."""
        assert self.runtime is not None
        self.runtime.set_device(self.index)
        self.runtime.event_synchronize(ticket.end)
        self._finish(ticket)
        self.reap()

    def reap(self) -> None:
        """Let go of what finished copies kept (their tickets in stream order; never waits)."""
        runtime = self.runtime
        while True:
            with self._lock:
                if not self._inflight:
                    return
                ticket = self._inflight[0]
            if not ticket.done and not runtime.event_query(ticket.end):
                return
            self._finish(ticket)

    def _finish(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.done and ticket.keep is None:
                self._drop(ticket)
                return
            ticket.done = True
            ticket.keep = None
            self._drop(ticket)
            seconds = 0.0
            try:
                seconds = self.runtime.event_elapsed_s(ticket.start, ticket.end) if self.runtime else 0.0
            except Exception:  # noqa: BLE001 - the figure is lost, not the copy
                seconds = 0.0
            start = max(ticket.issued, self._last_end)
            self._last_end = start + seconds
            self.copy_s += seconds
        self._traced(ticket, start, seconds)

    def _traced(self, ticket: Ticket, start: float, seconds: float) -> None:
        tracer = self.trace.tracer if self.trace is not None else None
        if tracer is not None:
            tracer.span("copy", start, start + seconds, track=self.track, bytes=ticket.nbytes)

    def _drop(self, ticket: Ticket) -> None:  # (under the lock)
        try:
            self._inflight.remove(ticket)
        except ValueError:
            pass

    def pending(self) -> int:
        """Copies issued and not known to be done."""
        return len(self._inflight)

    def synchronize(self) -> None:
        """Wait for every copy issued so far; let go of what they kept."""
        with self._lock:
            stream = self._stream
        if stream and self.runtime is not None:
            self.runtime.set_device(self.index)
            self.runtime.stream_synchronize(stream)
        self.reap()

    def close(self) -> None:
        """At stop: wait for the copies in flight (their memory must outlive them), then let go of
        the stream and the events."""
        try:
            self.synchronize()
        except Exception:  # noqa: BLE001
            log.warning("feeder: waiting for the device copies in flight failed", exc_info=True)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for t in self._inflight:
                t.done, t.keep = True, None
            self._inflight.clear()
            made, self._made, self._events = self._made, [], []
            stream, self._stream = self._stream, 0
        runtime = self.runtime
        if runtime is None:
            return
        try:
            runtime.set_device(self.index)
        except Exception:  # noqa: BLE001
            pass
        for e in made:
            try:
                runtime.event_destroy(e)
            except Exception:  # noqa: BLE001
                pass
        if stream:
            try:
                runtime.stream_destroy(stream)
            except Exception:  # noqa: BLE001
                pass


def sources_of(arrays: Sequence[np.ndarray]) -> List[Tuple[np.ndarray, ...]]:
    """Per input, the one (C-contiguous) array whose bytes are that input's batch."""
    return [(a if a.flags.c_contiguous else np.ascontiguousarray(a),) for a in arrays]
