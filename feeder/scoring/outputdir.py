"""The output directory of ``feeder.predict``: its files, the commit protocol, and recovery.

An output directory holds::

    part-00000.parquet, ...       committed part files (each listed in the state)
    _feeder_predict.json          the state: the committed parts, and the source state that covers
                                  exactly their rows (see feeder.predict)
    _feeder_predict.lock          locked (flock) while a predict call writes here
    _SUCCESS                      present only while the output is complete (as Spark and Hadoop
                                  mark a finished job's output)
    .part-00007.parquet.tmp       a part being written
    _feeder_predict.json.tmp      a state being written

Names starting with "_" or "." are what Parquet readers (pyarrow.dataset, Spark) skip, so the
directory reads as a dataset of its parts.

The commit protocol (Hadoop's FileOutputCommitter and Delta Lake's log, in miniature): a part is
written under its temporary name, fsynced, renamed to its final name, and the directory fsynced;
then the state that lists it is written to a temporary file, fsynced and renamed over the old
state (``os.replace`` is atomic), and the directory fsynced again. A crash at any instant leaves
the last state intact; what it does not list (temporary files, a part renamed but not yet in the
state) was never committed and is deleted by :meth:`OutputDir.recover` before the next run.

The completion marker ``_SUCCESS`` is written (fsynced, and the directory fsynced) after the
state that says the output is complete, and deleted (durably) before a call writes anything else:
before the first state or part of a resumed, continued or overwriting run. So at any instant,
a folder holding ``_SUCCESS`` holds exactly the complete output its state lists; a reader checks
for it before reading. A ``_SUCCESS`` alone (copied, or left by hand) is ours to delete.

Only our own names are ever deleted: a directory holding anything else is refused (ValueError),
and a directory holding part files but no state was not written by ``feeder.predict`` (the state
is written before the first part), so it is refused too.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: no lock, the rest works
    fcntl = None  # type: ignore[assignment]

STATE_NAME = "_feeder_predict.json"
STATE_TMP = STATE_NAME + ".tmp"
LOCK_NAME = "_feeder_predict.lock"
SUCCESS_NAME = "_SUCCESS"
PART_RE = re.compile(r"part-(\d{5,})\.parquet\Z")
TMP_PART_RE = re.compile(r"\.part-(\d{5,})\.parquet\.tmp\Z")


def part_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def tmp_part_name(index: int) -> str:
    return f".{part_name(index)}.tmp"


def fsync_dir(path: str) -> None:
    """Make the directory's entries (a rename) durable; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """Flush a closed file's data to disk (fsync through a new descriptor syncs the whole file)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def refuse_foreign(path: str, found: "Listing", things: str, place: str) -> None:
    """ValueError if an output (a directory of ``files``, a prefix of ``objects``) holds anything
    feeder.predict did not write: it is never deleted, so the output is refused as it is."""
    if found.foreign:
        shown = found.foreign[:5] + (["..."] if len(found.foreign) > 5 else [])
        raise ValueError(f"output {path!r} holds {things} that feeder.predict did not write ({shown}); "
                         f"use an empty or new {place} (nothing was changed)")


@dataclass
class Listing:
    """What a scan of the output directory found, by kind (file names, not paths)."""

    parts: Dict[int, str] = field(default_factory=dict)   # part index -> name
    sizes: Dict[str, int] = field(default_factory=dict)   # part name -> its size in bytes, as listed
    temporary: List[str] = field(default_factory=list)    # our temporary files
    foreign: List[str] = field(default_factory=list)      # anything that is not ours
    state: bool = False
    success: bool = False                                 # the completion marker is there


class OutputDir:
    """One output directory, opened (created if needed) and locked for one predict call."""

    state_name = STATE_NAME
    local = True

    def __init__(self, path: "str | os.PathLike[str]"):
        self.path = os.path.abspath(os.fspath(path))
        self._lock_fd: Optional[int] = None

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    # ---- names (the same methods as feeder.scoring.storeout.StoreOutput) -------------------------
    def part_name(self, index: int) -> str:
        return part_name(index)

    def is_part(self, name: str) -> bool:
        return bool(PART_RE.match(name))

    def part_index(self, name: str) -> int:
        m = PART_RE.match(name)
        assert m is not None
        return int(m.group(1))

    def size(self, name: str) -> Optional[int]:
        path = self.join(name)
        return os.path.getsize(path) if os.path.isfile(path) else None

    def part_target(self, index: int) -> Tuple[str, Any]:
        """(where a ParquetWriter writes part ``index``: its temporary name, no filesystem)."""
        return self.join(tmp_part_name(index)), None

    def discard_part(self, index: int) -> None:
        self.remove([tmp_part_name(index)])

    # ---- opening and locking ------------------------------------------------------------------
    def open(self) -> None:
        """Create the directory if needed and take its lock; ValueError if it is not a directory
        or another predict call holds the lock."""
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ValueError(f"output {self.path!r} exists and is not a directory")
        os.makedirs(self.path, exist_ok=True)
        self.refuse_foreign(self.scan())  # before the lock file: a user's folder is left as it was
        if fcntl is None:  # pragma: no cover
            return
        fd = os.open(self.join(LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ValueError(f"output {self.path!r} is being written by another feeder.predict call (its lock "
                             f"{LOCK_NAME} is held); two calls on one output would interleave their parts") from None
        self._lock_fd = fd

    def acquire(self) -> None:
        """Nothing more: the lock taken by :meth:`open` keeps other calls out (a call refused at
        ``open`` changes nothing)."""

    def changed_since_read(self) -> bool:
        """False: under the lock, no other call commits."""
        return False

    def close(self) -> None:
        """Release the lock (the lock file stays: removing it would race with a new caller)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def refuse_foreign(self, found: "Listing") -> None:
        """ValueError if the directory holds anything we did not write (we never delete it)."""
        refuse_foreign(self.path, found, "files", "directory")

    # ---- reading ------------------------------------------------------------------------------
    def scan(self) -> Listing:
        found = Listing()
        for name in sorted(os.listdir(self.path)):
            m = PART_RE.match(name)
            if m and os.path.isfile(self.join(name)):
                found.parts[int(m.group(1))] = name
                found.sizes[name] = os.path.getsize(self.join(name))
            elif name == STATE_NAME and os.path.isfile(self.join(name)):
                found.state = True
            elif name == SUCCESS_NAME and os.path.isfile(self.join(name)):
                found.success = True
            elif (name == STATE_TMP or TMP_PART_RE.match(name)) and os.path.isfile(self.join(name)):
                found.temporary.append(name)
            elif name != LOCK_NAME:
                found.foreign.append(name)
        return found

    def read_state(self) -> Dict[str, Any]:
        """The committed state; ValueError if it is not one this version of feeder wrote."""
        path = self.join(STATE_NAME)
        try:
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"output {self.path!r}: its state {STATE_NAME} cannot be read ({e}); "
                             f"pass overwrite=True to start afresh") from e
        if not isinstance(state, dict):
            raise ValueError(f"output {self.path!r}: {STATE_NAME} does not hold a feeder.predict state")
        return state

    # ---- writing ------------------------------------------------------------------------------
    def write_state(self, state: Dict[str, Any], durable: bool = True) -> None:
        """Replace the state atomically: temporary file, fsync, rename, fsync the directory."""
        tmp = self.join(STATE_TMP)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(state, f, separators=(",", ":"))
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, self.join(STATE_NAME))
        if durable:
            fsync_dir(self.path)

    def publish_part(self, index: int, durable: bool = True) -> int:
        """Rename a written part from its temporary name to its final one; returns its size in
        bytes. ``durable``: fsync the file before and the directory after (the commit protocol)."""
        tmp, final = self.join(tmp_part_name(index)), self.join(part_name(index))
        if durable:
            fsync_file(tmp)
        os.replace(tmp, final)
        if durable:
            fsync_dir(self.path)
        return os.path.getsize(final)

    def write_marker(self, durable: bool = True) -> None:
        """Mark the output complete: an empty ``_SUCCESS``, fsynced, and the directory fsynced."""
        path = self.join(SUCCESS_NAME)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if durable:
            fsync_dir(self.path)

    def remove_marker(self, durable: bool = True) -> None:
        """Unmark the output (before anything else of a run is written); durable once it returns."""
        try:
            os.remove(self.join(SUCCESS_NAME))
        except FileNotFoundError:
            return
        if durable:
            fsync_dir(self.path)

    def remove(self, names: List[str]) -> None:
        for name in names:
            try:
                os.remove(self.join(name))
            except FileNotFoundError:
                pass

    def recover(self, committed: Set[str]) -> List[str]:
        """Delete our files that the state does not commit: temporary files, and parts renamed after
        the last state was written. Returns the names deleted."""
        found = self.scan()
        stale = list(found.temporary) + [n for n in found.parts.values() if n not in committed]
        self.remove(stale)
        if stale:
            fsync_dir(self.path)
        return stale
