"""Source states: what a checkpoint of a source holds, and how two source definitions differ.

A state (``coord.state_dict(name)``, format :data:`STATE_FORMAT`) records the source's definition
(``feeder_definition()``) and the key ranges delivered (``delivered``: ``[start, stop)`` pairs, see
:mod:`feeder.sources.rowkeys`), and for a padded feed that rounds (``pad_to_multiple_of``) the axes
rows had differed along by then (``pad_varies``, see :func:`pad_varies_of`). A resume checks the
definition first (:func:`check_state`): a state of another source is refused with a message naming
what differs.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

STATE_FORMAT = "feeder.source-state/1"


def ranges_of(state: Mapping[str, Any]) -> np.ndarray:
    """The delivered key ranges of a state as an int64 array of shape (k, 2): [start, stop)."""
    delivered = state.get("delivered", [])
    arr = np.asarray(delivered, dtype=np.int64).reshape(-1, 2)
    return arr


def pad_varies_of(state: Optional[Mapping[str, Any]]) -> Dict[str, List[int]]:
    """A state's ``pad_varies``: per padded input, the axes of its rows along which rows had
    differed by the checkpoint (``feeder.padding`` rounds those to ``pad_to_multiple_of``); empty if
    none. ValueError naming the field for anything else (a state edited by hand, or corrupted)."""
    raw = (state or {}).get("pad_varies") or {}
    ok = isinstance(raw, Mapping) and all(
        isinstance(k, str) and isinstance(v, (list, tuple))
        and all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in v)
        for k, v in raw.items())
    if not ok:
        raise ValueError(f"a source state's 'pad_varies' must map padded input names to lists of axes (ints >= 0), "
                         f"got {raw!r:.200}")
    return {k: sorted({int(a) for a in v}) for k, v in raw.items() if v}


def check_state(state: Any, definition: Mapping[str, Any]) -> None:
    """ValueError unless ``state`` is a source state for a source of this ``definition``; the
    message says what differs (see :func:`definition_differences`)."""
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"resume_from must be a state from coord.state_dict(name) (format {STATE_FORMAT!r}), "
                         f"got {type(state).__name__}"
                         + (f" of format {state.get('format')!r}" if isinstance(state, Mapping) else ""))
    diffs = definition_differences(state.get("definition") or {}, definition)
    if diffs:
        raise ValueError("resume_from is the state of a different source definition; " + "; ".join(diffs))


SHOWN_NAMES = 10  # file names listed per kind of change in a message; the count says how many more
_DIGEST = re.compile(r"[0-9a-f]{16,64}\Z")
# What a transformed source's definition records of its steps (feeder.sources.transform): each
# step's kind and function name, and a digest of each function's code.
STEP_KEYS = ("transforms", "transforms_code")
_WHERE = re.compile(r" \([^()]*:\d+\)\Z")  # " (train.py:9)": where an earlier feeder said a lambda sat


def _step_view(theirs: Mapping[str, Any], mine: Mapping[str, Any]) -> Tuple[Mapping[str, Any], Mapping[str, Any]]:
    """The two definitions as their steps are compared: a definition written by an earlier feeder
    named each lambda with its file and line and had no code digests (its steps are then compared
    by kind and name alone); when the steps themselves differ, their code is not reported too."""
    if STEP_KEYS[1] not in theirs and STEP_KEYS[1] not in mine:
        return theirs, mine
    if STEP_KEYS[1] not in theirs and STEP_KEYS[1] in mine and isinstance(theirs.get("transforms"), list):
        steps = [[s[0], _WHERE.sub("", s[1])] if isinstance(s, list) and len(s) == 2 and isinstance(s[1], str)
                 else s for s in theirs["transforms"]]
        theirs = {**theirs, "transforms": steps, STEP_KEYS[1]: mine[STEP_KEYS[1]]}
    if jsonish(theirs.get("transforms")) != jsonish(mine.get("transforms")):
        mine = {k: v for k, v in mine.items() if k != STEP_KEYS[1]}
        theirs = {k: v for k, v in theirs.items() if k != STEP_KEYS[1]}
    return theirs, mine


def definition_differences(theirs: Mapping[str, Any], mine: Mapping[str, Any], *, theirs_has: str = "the state has",
                           mine_has: str = "this source", depth: int = 0, prefix: str = "") -> List[str]:
    """One phrase per entry of two source definitions (or model fingerprints) that differs, as
    JSON sees them: ``key: the state has X, this source Y``. ``files`` (lists of per-file records
    ``{"name", "size", "version", ...}``) are compared by name: the files added, removed and
    changed, and how. A hash (a hex digest) is said to differ, never shown. ``depth`` > 0 goes
    that many levels into dicts, so that a message names the entry that differs (a model's input).
    A transformed source's steps are compared as :func:`_step_view` says."""
    theirs, mine = _step_view(theirs, mine)
    out: List[str] = []
    for key in list(mine) + [k for k in theirs if k not in mine]:
        a, b = jsonish(theirs.get(key)), jsonish(mine.get(key))
        if a == b:
            continue
        label = f"{prefix}{key}"
        if key == "files" and isinstance(a, list) and isinstance(b, list):
            out += [f"{label}: {d}" for d in file_differences(a, b, theirs_has=theirs_has, mine_has=mine_has,
                                                              versions=theirs.get("identity") == mine.get("identity"))]
        elif depth > 0 and isinstance(a, dict) and isinstance(b, dict):
            out += definition_differences(a, b, theirs_has=theirs_has, mine_has=mine_has, depth=depth - 1,
                                          prefix=f"{label} ")
        elif key not in mine:
            out.append(f"{label}: {theirs_has} {'a hash' if _is_digest(a) else _shown(a)}, {mine_has} has none")
        elif _is_digest(a) or _is_digest(b):
            out.append(f"{label}: {theirs_has} other contents than {mine_has} (their hashes differ)")
        else:
            out.append(f"{label}: {theirs_has} {_shown(a)}, {mine_has} {_shown(b)}")
    return out


def _is_digest(v: Any) -> bool:
    return isinstance(v, str) and bool(_DIGEST.match(v.rpartition(":")[2]))


def _shown(v: Any, limit: int = 300) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:SHOWN_NAMES])
    more = len(names) - SHOWN_NAMES
    return shown + (f" and {more} more" if more > 0 else "")


def file_differences(theirs: List[Any], mine: List[Any], *, theirs_has: str = "the state has",
                     mine_has: str = "this source", versions: bool = True) -> List[str]:
    """The files added, removed and changed between two lists of per-file records (dicts with a
    ``name``; ``size`` in bytes, ``version``, ``rows`` and ``footer`` where recorded), naming
    them. ``version`` is ``"<scheme>:<value>"``: ``mtime_ns`` (a local file's modification time),
    ``sha256`` (its contents) or a store's own (an ETag, a generation); ``versions=False``
    leaves versions out (the two sides record different kinds)."""
    def records(files: List[Any]) -> Dict[str, Dict[str, Any]]:
        out: Dict[str, Dict[str, Any]] = {}
        for f in files:
            if isinstance(f, dict) and isinstance(f.get("name"), str):
                out[f["name"]] = f
            elif isinstance(f, list) and f and isinstance(f[0], str):  # [name, rows]: an earlier feeder's
                out[f[0]] = {"name": f[0], "rows": f[1] if len(f) > 1 else None}
        return out

    a, b = records(theirs), records(mine)
    out = []
    removed = [n for n in a if n not in b]
    added = [n for n in b if n not in a]
    if removed:
        out.append(f"{len(removed)} file(s) removed ({theirs_has} them, {mine_has} does not): {_names(removed)}")
    if added:
        out.append(f"{len(added)} file(s) added ({mine_has} has them, {theirs_has} not): {_names(added)}")
    changed: Dict[str, List[str]] = {}
    for name, old in a.items():
        new = b.get(name)
        if new is None or old == new:
            continue
        how = []
        if "size" not in old or "version" not in old:
            how.append("no size or version recorded (a state of an earlier version of feeder)")
        else:
            if old.get("size") != new.get("size"):
                how.append(f"{old.get('size')} -> {new.get('size')} bytes")
            if old.get("rows") != new.get("rows"):
                how.append(f"{old.get('rows')} -> {new.get('rows')} rows")
            if old.get("footer") != new.get("footer"):
                how.append("other schema, row groups or column statistics in its footer")
            if versions and old.get("version") != new.get("version"):
                scheme = str(old.get("version")).partition(":")[0]
                if scheme == "mtime_ns":
                    how.append("modification time moved")
                elif scheme == "sha256":
                    how.append("other contents")
                else:
                    how.append(f"version {old.get('version')!r} -> {new.get('version')!r}")
        if how == ["modification time moved"]:
            how = ["only its modification time moved (touched or copied? a checkpoint written with "
                   "identity='content' compares contents instead)"]
        if how:
            changed.setdefault(", ".join(how), []).append(name)
    for what, names in changed.items():
        out.append(f"{len(names)} file(s) changed ({what}): {_names(names)}")
    if not out and [f.get("name") for f in a.values()] != [f.get("name") for f in b.values()]:
        out.append("the same files in another order")
    return out


def jsonish(v: Any) -> Any:
    """``v`` as JSON would give it back, to compare with a state read from JSON (tuples are lists
    after a round trip, dict keys strings)."""
    if isinstance(v, (list, tuple)):
        return [jsonish(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonish(x) for k, x in v.items()}
    return v
