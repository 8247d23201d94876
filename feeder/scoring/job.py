"""One call's work on one output (:class:`_Job`): its state read and checked against this call
(model, options, source definition, rank, parts), the output recovered, the replicas run, and
each committed part recorded in the state (format :data:`STATE_FORMAT`)."""
from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List, Optional, cast

import numpy as np

from ..api import init_data_input_workers
from ..coordinator import GlobalCoordinator
from ..errors import FeederError
from ..sources.rowkeys import KeyLedger, source_state
from ..sources.sharded import ShardedSource
from ..sources.state import definition_differences, jsonish, ranges_of
from .outputdir import Listing
from .partwriter import CommittedPart, Output, PartWriter
from .plan import SOURCE_NAME, _Plan, _wrapped
from .replicas import _Replicas

log = logging.getLogger("feeder")

STATE_FORMAT = "feeder.predict/1"


class _Job:
    """One call's work on one output directory: check and recover it, run, commit."""

    def __init__(self, out: Output, plan: _Plan, source: Any, fingerprint: Dict[str, Any],
                 options: Dict[str, Any], *, durable: bool):
        self.out = out
        self.plan = plan
        self.source = source
        self.fingerprint = fingerprint
        self.options = options
        self.durable = durable
        self.parts: List[Dict[str, Any]] = []
        self.rows = 0
        # Rows the source's filter dropped: done, never written. Their keys join the committed rows'
        # in _done (recorded at each commit from _filtered_keys, as the source's ledger got them),
        # loose until they touch committed rows, as in the source's own ledger (feeder.rowkeys): the
        # state stays a few ranges whatever the filter drops. ``filtered`` counts those in the state.
        self.filtered = 0
        self._filtered_keys: List[np.ndarray] = []
        self._filtered_lock = threading.Lock()
        self.resume: Optional[Dict[str, Any]] = None
        self._done = KeyLedger(SOURCE_NAME)
        self._fresh = True
        self._read = False  # prepare() read a state (checked again once the lease is put)
        self._found = Listing()
        self.overwrite = False

    def files(self) -> List[str]:
        return [self.out.join(p["file"]) for p in self.parts]

    # -- before anything runs --
    def prepare(self, overwrite: bool) -> bool:
        """Check the output directory and its state, writing nothing; True when it is already
        complete (:meth:`mark_finished` then writes its ``_SUCCESS`` if a crash left it out)."""
        self.overwrite = overwrite
        self.parts, self.rows, self.resume, self.filtered = [], 0, None, 0
        self._done, self._fresh, self._read = KeyLedger(SOURCE_NAME), True, False
        found = self.out.scan()
        self._found = found
        self.out.refuse_foreign(found)  # again, now under the lock
        if not found.state:
            if found.parts:
                raise ValueError(f"output {self.out.path!r} holds part files ({sorted(found.parts.values())[:3]}) but "
                                 f"no {self.out.state_name}, so feeder.predict did not write them (it writes its "
                                 f"state before the first part); use another directory")
            return False
        if overwrite:
            return False  # start afresh: run() replaces the state, then removes the old parts
        state = self.out.read_state()
        self._read = True
        self._check_rank(state)
        if state.get("parts") == [] and not state.get("rows"):
            # A state that commits no part (a run refused for bad data, or killed before its first
            # commit) holds nothing to lose: it never makes a call refuse "other data".
            try:
                self._check_state(state)
            except ValueError as e:
                log.info("feeder.predict: %s: its state commits no part and does not match this call (%s); "
                         "starting afresh", self.out.path, e)
                return False
        else:
            self._check_state(state)
        self.parts = list(state["parts"])
        self.rows = int(state["rows"])
        self.resume = state["source"]
        self.filtered = int(self.resume.get("rows_filtered", 0) or 0) if self.resume else 0
        self._done = KeyLedger(SOURCE_NAME, ranges_of(self.resume), self.filtered)
        self._fresh = False
        total = self._total()
        if total is not None and self.rows + self.filtered > total:
            raise ValueError(f"output {self.out.path!r} holds {self.rows} rows"
                             + (f" and {self.filtered} filtered" if self.filtered else "")
                             + f", more than this source's {total} (fewer epochs?); pass overwrite=True to start "
                             f"afresh (it removes that output)")
        # Complete only while the source has no more rows: a source given more epochs continues.
        return bool(state.get("complete")) and (total is None or self.rows + self.filtered == total)

    def mark_finished(self) -> None:
        """On a complete output: write its ``_SUCCESS`` if a crash left it out (after the final
        manifest), having deleted any part its state does not list; otherwise touch nothing."""
        if self._found.success:
            return
        self.out.acquire()
        self.out.recover({p["file"] for p in self.parts})
        self.out.write_marker(durable=self.durable)

    def _check_rank(self, state: Dict[str, Any]) -> None:
        """ValueError when the output was written by another rank (or world size) than this call's
        source: each rank writes, and resumes, an output of its own."""
        src = state.get("source")
        theirs = src.get("shard") if isinstance(src, dict) else None
        record = getattr(self.source, "feeder_shard_record", None)
        mine = record() if record is not None else None
        def who(r: Optional[Dict[str, Any]]) -> str:
            return "an unsharded source" if r is None else f"rank {r['ranks'][0]} of {r['world']}"
        if (theirs is None) != (mine is None) or (theirs is not None and mine is not None and (
                theirs.get("world"), theirs.get("ranks")) != (mine["world"], mine["ranks"])):
            raise ValueError(f"output {self.out.path!r} was written by {who(theirs)}, and this call reads "
                             f"{who(mine)}: each rank writes an output of its own (put {{rank}} in the output "
                             f"path, or let feeder.predict add rank-RRRRR-of-WWWWW to it)")

    def _check_state(self, state: Dict[str, Any]) -> None:
        where = f"output {self.out.path!r}"
        afresh = "pass overwrite=True to start afresh (it removes that output)"
        state_file = self.out.state_name
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"{where}: {state_file} has format {state.get('format')!r}, not {STATE_FORMAT!r} (another "
                             f"version of feeder?); {afresh}")
        if not state.get("resumable"):
            raise ValueError(f"{where} was written from a fetch function without row keys, so it cannot be continued "
                             f"or checked; {afresh}")
        if not self.plan.keyed:
            raise ValueError(f"{where} exists, and this source ({type(self.source).__name__}) has no row keys, so it "
                             f"cannot continue it; {afresh}")
        diffs = _model_differences(state.get("model") or {}, self.fingerprint)
        diffs += _differences("option", state.get("options") or {}, self.options)
        src = state.get("source")
        if not isinstance(src, dict) or src.get("format") is None:
            raise ValueError(f"{where}: {state_file} holds no source state; {afresh}")
        definition = getattr(self.source, "feeder_definition", None)
        mine = definition() if definition is not None else {}
        diffs += _differences("source", src.get("definition") or {}, mine)
        if diffs:
            raise ValueError(f"{where} was written from another source definition or model: " + "; ".join(diffs)
                             + f"; {afresh}")
        parts = state.get("parts")
        if not isinstance(parts, list) or not all(isinstance(p, dict) and {"file", "rows", "bytes"} <= set(p)
                                                  for p in parts):
            raise ValueError(f"{where}: {state_file} does not list its parts; {afresh}")
        for p in parts:
            if not isinstance(p["file"], str) or not self.out.is_part(p["file"]):
                raise ValueError(f"{where}: {state_file} lists {p['file']!r}, which is not a part file; {afresh}")
            # Sizes as the listing gave them (one request for every part, not a HEAD each).
            size = self._found.sizes.get(p["file"])
            if size != p["bytes"]:
                got = "missing" if size is None else f"{size} bytes, not {p['bytes']}"
                raise ValueError(f"{where} is damaged: its committed part {p['file']} is {got}; {afresh}")

    # -- the run --
    def run(self, replicas: int, batch_size: int, rows_per_file: int, counts: Dict[str, Any],
            progress: Optional[bool]) -> int:
        """Compute every row not yet committed; returns how many rows this call computed."""
        plan = self.plan
        coord = self._register(replicas, batch_size, counts)
        try:
            # Only now is anything written. In an object store, this call's lease first (another
            # call writing here stops at its next commit); if a call committed between the check of
            # the manifest and the lease, the manifest is read (and registered from) again.
            self.out.acquire()
            if self._read and self.out.changed_since_read():
                coord.stop()
                log.info("feeder.predict: %s: another call committed to the output while this one checked it; "
                         "its manifest is read again", self.out.path)
                if self.prepare(self.overwrite):
                    self.mark_finished()
                    return 0
                coord = self._register(replicas, batch_size, counts)
        except BaseException:
            coord.stop()
            raise
        try:
            # First the completion marker goes (durably), before any
            # part or state of this run: a folder with _SUCCESS is always a complete output. Then a
            # fresh state before the first part (a directory with parts and no state is never
            # ours), then whatever the state does not commit is deleted.
            self.out.remove_marker(durable=self.durable)
            if self._fresh:
                self.parts, self.rows, self._done = [], 0, KeyLedger(SOURCE_NAME)
                self.filtered = 0
                self.out.write_state(self._state(complete=False), durable=self.durable)
            removed = self.out.recover({p["file"] for p in self.parts})
            if removed:
                log.info("feeder.predict: %s: removed %d file(s) that no commit covers: %s", self.out.path,
                         len(removed), removed[:5])
            first = 1 + max((self.out.part_index(p["file"]) for p in self.parts), default=-1)
            writer = PartWriter(self.out, plan.columns, rows_per_file=rows_per_file, first_part=first,
                                on_commit=self._on_commit, keyed=plan.keyed, durable=self.durable)
        except BaseException:
            coord.stop()
            raise
        return _Replicas(coord, writer, plan, self._todo(), progress, replicas).run()

    def _register(self, replicas: int, batch_size: int, counts: Dict[str, Any]) -> GlobalCoordinator:
        """A coordinator with the source registered from the state read (not started)."""
        plan = self.plan
        coord = GlobalCoordinator()
        try:
            # Registration checks everything the source and feeder can. Ordered: one registration,
            # read in the source's order, whose batches the replica threads share (the writer puts
            # them back in order); otherwise one registration per replica.
            for _ in range(1 if plan.ordered else replicas):
                init_data_input_workers(plan.adapter, plan.feed_names, self.source, batch_size,
                                        input_source_name=SOURCE_NAME, coordinator=coord, resume_from=self.resume,
                                        ordered=plan.ordered, replica=True, **counts)
            ledger = coord.get_queue(SOURCE_NAME, 1).row_keys
            if ledger is not None:  # the keys of filtered rows, committed with the next part
                ledger.on_filtered = self._note_filtered
        except BaseException:
            coord.stop()
            raise
        return coord

    def _total(self) -> Optional[int]:
        """The rows of the whole source, when it can tell (rows x epochs; a rank's share of them)."""
        source = _wrapped(self.source)
        total = getattr(source, "feeder_total_rows", None)
        if isinstance(source, ShardedSource) and total is not None:
            return cast(Optional[int], total())
        return None

    def _todo(self) -> Optional[int]:
        """Rows still to compute or filter, when the source can tell."""
        total = self._total()
        return None if total is None else max(0, total - self.rows - self.filtered)

    def _note_filtered(self, keys: np.ndarray) -> None:
        """From the source's key ledger (any thread): keys of rows its filter dropped."""
        with self._filtered_lock:
            self._filtered_keys.append(np.array(keys, dtype=np.int64))

    def _take_filtered(self) -> np.ndarray:
        with self._filtered_lock:
            keys, self._filtered_keys = self._filtered_keys, []
        return np.concatenate(keys) if keys else np.zeros(0, np.int64)

    def _on_commit(self, part: Optional[CommittedPart], keys: Optional[np.ndarray], final: bool) -> None:
        """In the writer thread, once ``part`` is durable under its final name: record it in the state."""
        if part is not None:
            self.parts.append({"file": part.name, "rows": part.rows, "bytes": part.nbytes})
            self.rows += part.rows
        if self.plan.keyed and (part is not None or final):
            # The rows filtered so far are done too (they will never be written): committed with this part.
            done = self._done
            if keys is not None:
                done.record_keys(keys)
            done.record_filtered(self._take_filtered())
            if final:
                done.settle()
            ranges, self.filtered = done.snapshot()
            covered = int((ranges[:, 1] - ranges[:, 0]).sum())
            twice = done.duplicates
            if twice or covered != self.rows + self.filtered:  # a bug, never a user's error: refuse to commit it
                raise FeederError(f"feeder.predict: the committed parts hold {self.rows} rows and {self.filtered} were "
                                  f"filtered, but their row keys cover {covered} ({twice} twice); the output is left "
                                  f"at its last commit")
        if final:
            expected = self._todo()
            if expected is not None and expected != 0:
                raise FeederError(f"feeder.predict: the source ended with {self.rows} rows committed"
                                  + (f" and {self.filtered} filtered" if self.filtered else "")
                                  + f", {expected} short of its {self._total()} rows")
        if self.durable or final:
            self.out.write_state(self._state(complete=final), durable=self.durable)
        if final:
            # Nothing but the committed parts beside _SUCCESS (a part a stopped call uploaded late,
            # say): a reader of the folder or prefix reads exactly the state's rows.
            self.out.recover({p["file"] for p in self.parts})
            self.out.write_marker(durable=self.durable)  # after the state that says it is complete

    def _state(self, complete: bool) -> Dict[str, Any]:
        src = None
        if self.plan.keyed:
            src = source_state(SOURCE_NAME, self._done, self.source)
        state = {"format": STATE_FORMAT, "complete": complete, "resumable": self.plan.keyed,
                 "model": self.fingerprint, "options": self.options, "rows": self.rows, "parts": list(self.parts),
                 "source": src}
        if self.filtered:
            state["rows_filtered"] = self.filtered
        return state


def _differences(what: str, theirs: Dict[str, Any], mine: Dict[str, Any]) -> List[str]:
    """``what key: the output has X, this call Y`` for every entry that differs, one level into
    dicts (so that a message names the input, output or column that differs); files are named
    (added, removed, changed and how), hashes are said to differ, never shown (see
    :func:`~feeder.sources.state.definition_differences`)."""
    return definition_differences(theirs, mine, theirs_has="the output has", mine_has="this call", depth=1,
                                  prefix=f"{what} ")


def _model_differences(theirs: Dict[str, Any], mine: Dict[str, Any]) -> List[str]:
    """What differs between the model that wrote an output and this call's: its inputs' and
    outputs' types and shapes, its bytes, its external data files (by name). A hash one side does
    not know (a session that kept neither its bytes nor its path) is not compared."""
    out = _differences("model", {k: theirs.get(k) for k in ("inputs", "outputs")},
                       {k: mine.get(k) for k in ("inputs", "outputs")})
    a, b = theirs.get("sha256"), mine.get("sha256")
    if a is not None and b is not None and a != b:
        out.append("model sha256: the output was written by a model of other bytes (other weights or graph)")
    if a is not None and b is not None:
        ta, tb = jsonish(theirs.get("external_data") or {}), jsonish(mine.get("external_data") or {})
        for name in list(tb) + [n for n in ta if n not in tb]:
            if name not in ta:
                out.append(f"model external data file {name!r}: this call's model has it, the output's had not")
            elif name not in tb:
                out.append(f"model external data file {name!r}: the output's model had it, this call's has not")
            elif ta[name] != tb[name]:
                out.append(f"model external data file {name!r}: other contents than when the output was written "
                           f"(other weights: retrained?)")
    return out
