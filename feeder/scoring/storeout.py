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

Object stores have no locks. A call puts its lease when it starts, and reads it back before each
manifest it puts: a second call on the same output takes the lease over, and the first one stops
at its next commit (a FeederError) instead of interleaving its commits with the second's. A lease
left by a killed call never blocks the next one.

On a filesystem that is not an object store (a ``pyarrow.fs.LocalFileSystem`` or HDFS passed as
``filesystem=``) the manifest is written to a temporary name and moved over the old one.
"""
from __future__ import annotations

import functools
import json
import os
import re
import secrets
import socket
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from ..errors import FeederError
from ..storage import FileSystemStore, Retry, retrying
from .outputdir import Listing, refuse_foreign

MANIFEST_NAME = "_manifest.json"
SUCCESS_NAME = "_SUCCESS"
LEASE_NAME = "_feeder_predict.lease"
TORN_READS = 3  # reads of a manifest that does not parse before it counts as damaged
STORE_PART_RE = re.compile(r"part-(\d{5,})-([0-9a-f]{8})\.parquet\Z")


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
        self._leased = False
        self._streams: Dict[int, Any] = {}  # part index -> its upload, open

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def join(self, name: str) -> str:
        return self.store.uri(self._key(name))

    def _io(self, fn: Any, what: str) -> Any:
        return retrying(fn, f"{what} ({self.path})", self.retry)

    # ---- opening --------------------------------------------------------------------------------
    def open(self) -> None:
        """Check the prefix (ValueError if it is a file or holds what we did not write) and put
        this call's lease."""
        kind = self._io(lambda: self.store.kind(self.prefix), "looking at the output")
        if kind == "file":
            raise ValueError(f"output {self.path!r} exists and is an object (a file), not a prefix (a folder)")
        if kind == "none":
            self._io(lambda: self.store.make_dirs(self.prefix), "creating the output")
        self.refuse_foreign(self.scan())
        lease = {"run": self.run, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        self._io(lambda: self.store.write_bytes(self._key(LEASE_NAME), json.dumps(lease).encode()), "putting the lease")
        self._leased = True

    def close(self) -> None:
        """Delete this call's lease if it still holds it (never raises)."""
        if not self._leased:
            return
        self._leased = False
        try:
            if self._lease_holder() == self.run:
                self.store.delete(self._key(LEASE_NAME))
        except Exception:
            pass

    def _lease_holder(self) -> Optional[str]:
        try:
            raw = self._io(lambda: self.store.read_bytes(self._key(LEASE_NAME)), "reading the lease")
        except FileNotFoundError:
            return None
        try:
            return str(json.loads(raw.decode()).get("run"))
        except (ValueError, AttributeError):
            return None

    def check_lease(self) -> None:
        """FeederError when another call took this output over (it put its own lease)."""
        holder = self._lease_holder()
        if holder != self.run:
            raise FeederError(f"feeder.predict: another call took over the output {self.path!r} (its lease "
                              f"{LEASE_NAME} is now {holder!r}, this call's is {self.run!r}); this call stops so "
                              f"that the two never interleave their commits")

    def refuse_foreign(self, found: Listing) -> None:
        """ValueError if the prefix holds anything we did not write (we never delete it)."""
        refuse_foreign(self.path, found, "objects", "prefix")

    # ---- reading ----------------------------------------------------------------------------------
    def scan(self) -> Listing:
        found = Listing()
        entries = self._io(lambda: self.store.listdir(self.prefix), "listing the output")
        parts = []
        for name, (is_file, _) in sorted(entries.items()):
            if is_file and STORE_PART_RE.match(name):
                parts.append(name)
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
            state = self._io(self._read_manifest, "reading the manifest")
        except (OSError, ValueError) as e:
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
                return json.loads(raw.decode("utf-8"))
            except ValueError:
                if attempt == TORN_READS - 1:
                    raise
                time.sleep(0.05)
        return None  # pragma: no cover - the loop returns or raises

    def size(self, name: str) -> Optional[int]:
        return self._io(lambda: self.store.size(self._key(name)), f"looking at {name}")  # type: ignore[no-any-return]

    def is_part(self, name: str) -> bool:
        return bool(STORE_PART_RE.match(name))

    def part_index(self, name: str) -> int:
        m = STORE_PART_RE.match(name)
        assert m is not None
        return int(m.group(1))

    # ---- writing ----------------------------------------------------------------------------------
    def write_state(self, state: Dict[str, Any], durable: bool = True) -> None:
        """Replace the manifest: one PUT of the whole document (atomic in an object store), after
        checking that this call still holds the lease."""
        if self._leased:
            self.check_lease()
        data = json.dumps(state, separators=(",", ":")).encode("utf-8")
        self._io(lambda: self.store.write_bytes(self._key(MANIFEST_NAME), data), "putting the manifest")

    def part_name(self, index: int) -> str:
        return f"part-{index:05d}-{self.run}.parquet"

    def part_target(self, index: int) -> Tuple[Any, Any]:
        """(what a ParquetWriter writes part ``index`` to, no filesystem): an output stream to its
        final, unique name, since an upload appears only once complete."""
        stream = self._io(lambda: self.store.fs.open_output_stream(self._key(self.part_name(index))),
                          f"starting {self.part_name(index)}")
        self._streams[index] = stream
        return stream, None

    def publish_part(self, index: int, durable: bool = True) -> int:
        """Complete the part's upload (its writer closed): it appears whole; its size in bytes."""
        stream = self._streams.pop(index)
        size = int(stream.tell())
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
        self._io(lambda: self.store.write_bytes(self._key(SUCCESS_NAME), b""), "putting _SUCCESS")

    def remove_marker(self, durable: bool = True) -> None:
        self._io(lambda: self.store.delete(self._key(SUCCESS_NAME)), "deleting _SUCCESS")

    def remove(self, names: List[str]) -> None:
        for name in names:
            self._io(functools.partial(self.store.delete, self._key(name)), f"deleting {name}")

    def recover(self, committed: Set[str]) -> List[str]:
        """Delete the parts the manifest does not commit (uploaded by a call killed before its
        commit); returns their names."""
        found = self.scan()
        stale = list(found.temporary) + [n for n in found.parts.values() if n not in committed]
        self.remove(stale)
        return stale
