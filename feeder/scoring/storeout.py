"""The output of ``feeder.predict`` in an object store (``s3://``, ``gs://``, an fsspec URI) or on
a filesystem passed as ``filesystem=``: parts committed by replacing a manifest.

An output prefix holds::

    part-00000-1a2b3c4d.parquet, ...   part files under unique names (index, then the writing
                                       call's run id): the committed ones are those the manifest lists
    _manifest.json                     the manifest: the committed parts, the source state that
                                       covers exactly their rows, and whether the output is complete
                                       (the same document as a local output's _feeder_predict.json)
    _SUCCESS                           present only while the output is complete
    _feeder_predict.lease              the call writing here (its run id, host and pid)

Object stores have no rename and no directories, but putting an object is atomic: it appears
complete or not at all, and replaces an object of the same name in one step. So the commit
protocol is Delta Lake's in miniature: a part is uploaded under a name no other call uses (an
upload killed half-way never appears; one completed but not yet listed is not committed), then
the manifest that lists it is put whole, replacing the last one. A crash at any instant leaves the
last manifest intact; the parts it does not list were never committed, are never given to a
reader (``PredictResult.files`` and the manifest list the committed parts), and are deleted by
:meth:`StoreOutput.recover` before the next call writes anything. Unique names also mean that a
call killed while uploading can never overwrite a committed part when its upload lands late.

``_SUCCESS`` follows the manifest that says complete and is deleted before a call writes anything
else, as on a local disk (:mod:`feeder.scoring.outputdir`).

Object stores have no locks. A call checks everything it can (the output, its manifest, the
model, the source's registration) before it puts its lease, so that a call refused changes
nothing; it puts the lease just before it writes anything, and reads it back before each manifest
it puts: a second call on the same output takes the lease over, and the first one stops at its
next commit (:class:`OutputTakenOver`) instead of interleaving its commits with the second's,
deleting the part it had just uploaded (never listed in a manifest, so that a reader of the prefix
after ``_SUCCESS`` reads exactly the manifest's rows). A lease left by a killed call never blocks
the next one, and a call deletes only its own lease when it ends, within :data:`CLOSE_S` seconds
(a store that stopped answering does not hold up the end of the call, a Ctrl-C included).

On a filesystem that is not an object store (a ``pyarrow.fs.LocalFileSystem`` or HDFS passed as
``filesystem=``) the manifest is written to a temporary name and moved over the old one.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from ..errors import FeederError
from ..storage import FileSystemStore, Retry, RetryCounts, is_transient, plain_error, retrying
from .outputdir import Listing, refuse_foreign

log = logging.getLogger("feeder")

MANIFEST_NAME = "_manifest.json"
SUCCESS_NAME = "_SUCCESS"
LEASE_NAME = "_feeder_predict.lease"
TORN_READS = 3  # reads of a manifest that does not parse before it counts as damaged
STORE_PART_RE = re.compile(r"part-(\d{5,})-([0-9a-f]{8})\.parquet\Z")
CLOSE_S = 5.0   # seconds a call waits, when it ends, for its lease to be deleted


class OutputTakenOver(FeederError):
    """Another ``feeder.predict`` call took this call's output over (it put its own lease): this
    call stopped at its commit. What it committed stays in the output, which the other call
    continues; running this call again would take the output back from it."""


class StoreOutput:
    """One output prefix in a store, opened for one predict call (same methods as
    :class:`~feeder.scoring.outputdir.OutputDir`)."""

    state_name = MANIFEST_NAME
    local = False

    def __init__(self, store: FileSystemStore, path: str, retry: Optional[Retry] = None):
        self.store = store
        self.prefix = path.rstrip("/") or path
        self.path = store.uri(self.prefix)  # what messages and PredictResult.files show
        self.run = secrets.token_hex(4)
        self.retry = retry or Retry()
        self._counts = RetryCounts()  # its first retry is logged at WARNING
        self._leased = False
        self._streams: Dict[int, Any] = {}  # part index -> its upload, open
        self._unlisted: Set[str] = set()    # parts this call uploaded that no manifest it put lists yet
        self._manifest_raw: Optional[bytes] = None  # the manifest as read_state last read it

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def join(self, name: str) -> str:
        return self.store.uri(self._key(name))

    def _io(self, fn: Any, what: str, name: Optional[str] = None) -> Any:
        """``fn()`` with the store's transient failures retried; access denied, a missing bucket
        or an endpoint that cannot be reached said in plain words (the store's error the cause)."""
        try:
            return retrying(fn, f"{what} ({self.path})", self.retry, counts=self._counts)
        except Exception as e:
            plain = plain_error(e, self.join(name) if name is not None else self.path)
            if plain is not None:
                raise plain from e
            raise

    # ---- opening --------------------------------------------------------------------------------
    def open(self) -> None:
        """Check the prefix, writing nothing: ValueError if it is an object (a file) or holds what
        we did not write; FileNotFoundError naming the bucket if it does not exist. The lease is
        put by :meth:`acquire`, once everything else is checked."""
        kind = self._io(lambda: self.store.kind(self.prefix), "looking at the output")
        if kind == "file":
            raise ValueError(f"output {self.path!r} exists and is an object (a file), not a prefix (a folder)")
        if kind == "none":
            bucket = self._io(lambda: self.store.missing_bucket(self.prefix), "looking at the output's bucket")
            if bucket is not None:
                raise FileNotFoundError(f"output {self.path!r}: the bucket {bucket!r} does not exist; create it "
                                        f"first (or check its name, the account and the endpoint)")
            self._io(lambda: self.store.make_dirs(self.prefix), "creating the output")
        self.refuse_foreign(self.scan())

    def acquire(self) -> None:
        """Put this call's lease (taking the output over from any call writing it): only once
        everything is checked, just before this call writes anything."""
        if self._leased:
            return
        lease = {"run": self.run, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        self._io(lambda: self.store.write_bytes(self._key(LEASE_NAME), json.dumps(lease).encode()), "putting the lease",
                 LEASE_NAME)
        self._leased = True

    def changed_since_read(self) -> bool:
        """Whether the manifest is not what :meth:`read_state` last read (another call committed
        since: the state read before the lease was put is stale)."""
        try:
            raw = self._io(lambda: self.store.read_bytes(self._key(MANIFEST_NAME)), "reading the manifest",
                           MANIFEST_NAME)
        except FileNotFoundError:
            raw = None
        return bool(raw != self._manifest_raw)

    def close(self, deadline_s: float = CLOSE_S) -> None:
        """Delete this call's lease if it still holds it (another call's is never deleted: it is
        read back and compared first), waiting at most ``deadline_s`` seconds: a store that does
        not answer leaves the lease behind, which never blocks the next call. Never raises; a
        Ctrl-C still interrupts the wait."""
        if not self._leased:
            return
        self._leased = False
        done = threading.Event()

        def release() -> None:
            try:
                if self._lease_holder() == self.run:
                    self.store.delete(self._key(LEASE_NAME))
            except Exception:
                log.debug("feeder.predict: deleting the lease of %s failed", self.path, exc_info=True)
            finally:
                done.set()

        # In a thread of its own, waited for in slices: a hung request neither holds up the end of
        # the call past the deadline nor keeps a second Ctrl-C from being handled.
        threading.Thread(target=release, name="feeder:predict:lease", daemon=True).start()
        deadline = time.monotonic() + deadline_s
        while not done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                log.warning("feeder.predict: the lease %s of %s was not deleted within %.0f s (the store does not "
                            "answer); it is left behind, and does not block the next call", LEASE_NAME, self.path,
                            deadline_s)
                return

    def _lease_holder(self) -> Optional[str]:
        try:
            raw = self._io(lambda: self.store.read_bytes(self._key(LEASE_NAME)), "reading the lease", LEASE_NAME)
        except FileNotFoundError:
            return None
        try:
            return str(json.loads(raw.decode()).get("run"))
        except (ValueError, AttributeError):
            return None

    def check_lease(self) -> None:
        """OutputTakenOver when another call took this output over (it put its own lease)."""
        holder = self._lease_holder()
        if holder != self.run:
            whose = (f"its lease {LEASE_NAME} now names the call {holder!r}, this call was {self.run!r}"
                     if holder is not None else
                     f"this call's lease {LEASE_NAME} ({self.run!r}) was replaced, and is gone: that call has ended")
            raise OutputTakenOver(f"another call took over the output {self.path!r} ({whose}); this call stopped so "
                                  f"that the two never interleave their commits. The rows it committed stay in the "
                                  f"output, which the other call continues (or has finished): do not start this call "
                                  f"again while the other runs (it would take the output back)")

    def refuse_foreign(self, found: Listing) -> None:
        """ValueError if the prefix holds anything we did not write (we never delete it)."""
        refuse_foreign(self.path, found, "objects", "prefix")

    # ---- reading ----------------------------------------------------------------------------------
    def scan(self) -> Listing:
        found = Listing()
        entries = self._io(lambda: self.store.listdir(self.prefix), "listing the output")
        parts = []
        for name, (is_file, size) in sorted(entries.items()):
            if is_file and STORE_PART_RE.match(name):
                parts.append(name)
                found.sizes[name] = size
            elif is_file and name == MANIFEST_NAME:
                found.state = True
            elif is_file and name == SUCCESS_NAME:
                found.success = True
            elif is_file and name.endswith(".tmp") and name[:-4] in (MANIFEST_NAME, LEASE_NAME, SUCCESS_NAME):
                found.temporary.append(name)  # a filesystem that is not an object store: written, then moved
            elif is_file and name == LEASE_NAME:
                continue
            else:
                found.foreign.append(name + ("" if is_file else "/"))
        found.parts = dict(enumerate(parts))  # unique names: several parts may share an index
        return found

    def read_state(self) -> Dict[str, Any]:
        """The committed manifest; ValueError if it is not one this version of feeder wrote."""
        try:
            state = self._io(self._read_manifest, "reading the manifest", MANIFEST_NAME)
        except (OSError, ValueError) as e:
            if isinstance(e, OSError) and (is_transient(e) or isinstance(e, PermissionError)):
                raise  # the store failed (or denied): the manifest is not damaged
            raise ValueError(f"output {self.path!r}: its manifest {MANIFEST_NAME} cannot be read ({e}); "
                             f"pass overwrite=True to start afresh") from e
        if not isinstance(state, dict):
            raise ValueError(f"output {self.path!r}: {MANIFEST_NAME} does not hold a feeder.predict manifest")
        return state

    def _read_manifest(self) -> Any:
        """The manifest, parsed. pyarrow reads an object with a HEAD (its size) and then a GET of
        that many bytes: a manifest replaced in between (a call still running elsewhere) reads
        short, and is read again (up to :data:`TORN_READS` times)."""
        for attempt in range(TORN_READS):
            raw = self.store.read_bytes(self._key(MANIFEST_NAME))
            try:
                state = json.loads(raw.decode("utf-8"))
                self._manifest_raw = raw
                return state
            except ValueError:
                if attempt == TORN_READS - 1:
                    raise
                time.sleep(0.05)
        return None  # pragma: no cover - the loop returns or raises

    def size(self, name: str) -> Optional[int]:
        return self._io(lambda: self.store.size(self._key(name)), f"looking at {name}", name)  # type: ignore

    def is_part(self, name: str) -> bool:
        return bool(STORE_PART_RE.match(name))

    def part_index(self, name: str) -> int:
        m = STORE_PART_RE.match(name)
        assert m is not None
        return int(m.group(1))

    # ---- writing ----------------------------------------------------------------------------------
    def write_state(self, state: Dict[str, Any], durable: bool = True) -> None:
        """Replace the manifest: one PUT of the whole document (atomic in an object store), after
        checking that this call still holds the lease. When another call took the output over,
        the parts this call uploaded that no manifest of its lists are deleted (a reader of the
        prefix never meets them beside the other call's ``_SUCCESS``) and OutputTakenOver is
        raised."""
        if self._leased:
            try:
                self.check_lease()
            except OutputTakenOver:
                self._delete_unlisted()
                raise
        data = json.dumps(state, separators=(",", ":")).encode("utf-8")
        self._io(lambda: self.store.write_bytes(self._key(MANIFEST_NAME), data), "putting the manifest", MANIFEST_NAME)
        self._unlisted -= {p["file"] for p in state.get("parts") or () if isinstance(p, dict)}

    def _delete_unlisted(self) -> None:
        """Delete the parts this call uploaded and never committed (never raises: the next call's
        recovery deletes what is left)."""
        for name in sorted(self._unlisted):
            try:
                self._io(functools.partial(self.store.delete, self._key(name)), f"deleting {name}", name)
                self._unlisted.discard(name)
            except Exception:
                log.warning("feeder.predict: %s: the uncommitted part %s could not be deleted", self.path, name,
                            exc_info=True)

    def part_name(self, index: int) -> str:
        return f"part-{index:05d}-{self.run}.parquet"

    def part_target(self, index: int) -> Tuple[Any, Any]:
        """(what a ParquetWriter writes part ``index`` to, no filesystem): an output stream to its
        final, unique name, since an upload appears only once complete."""
        stream = self._io(lambda: self.store.fs.open_output_stream(self._key(self.part_name(index))),
                          f"starting {self.part_name(index)}", self.part_name(index))
        self._streams[index] = stream
        return stream, None

    def publish_part(self, index: int, durable: bool = True) -> int:
        """Complete the part's upload (its writer closed): it appears whole; its size in bytes."""
        stream = self._streams.pop(index)
        size = int(stream.tell())
        self._unlisted.add(self.part_name(index))  # (once closed it may be there even if close() raises)
        stream.close()
        return size

    def discard_part(self, index: int) -> None:
        stream = self._streams.pop(index, None)
        if stream is not None:
            try:
                stream.close()  # an upload cannot be left half-way through pyarrow: complete it, then delete it
            except Exception:
                pass
        self.remove([self.part_name(index)])

    def write_marker(self, durable: bool = True) -> None:
        """Mark the output complete: an empty ``_SUCCESS``."""
        self._io(lambda: self.store.write_bytes(self._key(SUCCESS_NAME), b""), "putting _SUCCESS", SUCCESS_NAME)

    def remove_marker(self, durable: bool = True) -> None:
        self._io(lambda: self.store.delete(self._key(SUCCESS_NAME)), "deleting _SUCCESS", SUCCESS_NAME)

    def remove(self, names: List[str]) -> None:
        for name in names:
            self._io(functools.partial(self.store.delete, self._key(name)), f"deleting {name}", name)
            self._unlisted.discard(name)

    def recover(self, committed: Set[str]) -> List[str]:
        """Delete the parts the manifest does not commit (uploaded by a call killed before its
        commit); returns their names."""
        found = self.scan()
        stale = list(found.temporary) + [n for n in found.parts.values() if n not in committed]
        self.remove(stale)
        return stale
