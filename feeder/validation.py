"""Chunk normalisation and validation, run in the fetcher thread that produced the chunk.

A chunk (list/tuple in input order, or dict by input name) becomes a tuple of arrays in
input order, checked against each input's :class:`InputSpec` (from the session's input
signature, or learned from the first chunk when there is no session). Every failure is an
:class:`InputValidationError` naming source, worker, input, expected and received:
ONNX Runtime's own messages on the IOBinding path are cryptic, and
``OrtValue.update_inplace`` silently reinterprets a wrong dtype, so these checks are ours.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import InputValidationError
from .ragged import Ragged


@dataclass(frozen=True)
class InputSpec:
    """What one input accepts. ``dtype`` None: any; ``shape`` None: any rank; a None dim: any size.
    ``pad``: the pad value of an input named in ``pad=`` (None: not padded), whose rows may differ
    in shape (see ``feeder.ragged``); a fixed dim of such an input is the most a row may have."""

    name: str
    dtype: Optional[np.dtype] = None
    shape: Optional[Tuple[Optional[int], ...]] = None
    is_string: bool = False
    pad: Any = None
    kept: bool = False  # an array of keep=: carried with the batch, never bound (any values, None too)


def fixed_batch_inputs(specs: Sequence[InputSpec], axes: Sequence[int]) -> List[str]:
    """Names of the inputs whose batch axis has a fixed size in the session's signature."""
    return [s.name for s, ax in zip(specs, axes)
            if s.shape is not None and ax < len(s.shape) and s.shape[ax] is not None]


def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"array of dtype {x.dtype} and shape {x.shape}"
    return f"{type(x).__name__}"


def int_arg(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int, for an argument ``name`` that takes an int >= ``minimum``: TypeError
    for a bool or anything else that is not an int, ValueError below ``minimum``, each naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def can_cast(src: np.dtype, dst: np.dtype) -> bool:
    """The casts ``cast=True`` performs: within a kind or widening (float64->float32, int64->float32,
    bool->anything), never float->int, signed->unsigned or anything->bool."""
    return bool(np.can_cast(src, dst, casting="same_kind"))


class ChunkValidator:
    """Turns a raw chunk into a tuple of arrays for one source, or raises.

    One validator serves every registration (replica) of a source, because replicas rebatch
    each other's chunks: what the source accepts is decided once. Each replica's declared
    expectations (from its session) are merged in with :meth:`add_replica`; dimensions they
    leave free (and, without a session, the dtypes) are learned from the source's first valid
    chunk, so that all chunks of a source can be concatenated; with ``dont_rebatch`` nothing
    is learned because each chunk is its own batch.
    """

    def __init__(self, source: str, input_names: Sequence[str], batch_axes: Sequence[int],
                 specs: Sequence[InputSpec], *, cast: bool, dont_rebatch: bool, fixed_batch: Optional[bool] = None,
                 masks: Optional[Dict[str, str]] = None):
        self.source = source
        self.masks = dict(masks or {})  # mask name -> its padded input (pad=): made by padding, never fetched
        self.names = tuple(input_names)
        self._index = {n: i for i, n in enumerate(self.names)}
        self.axes = tuple(batch_axes)
        self.specs = list(specs)
        self._declared = list(specs)  # before learning: tells which expectations were learned
        self.cast = cast
        self.learn = not dont_rebatch
        # dont_rebatch with a fixed batch dim: rows are checked too
        self.fixed_batch = (dont_rebatch and bool(fixed_batch_inputs(specs, batch_axes))) if fixed_batch is None \
            else fixed_batch
        self._lock = threading.Lock()
        self._learned = False
        self._fast: Optional[List[Tuple[Any, ...]]] = None
        self._single: Optional[Tuple[Any, ...]] = None
        # Inputs whose rows may differ in shape (pad=): normalised to a Ragged, or a plain array.
        self.ragged = any(s.pad is not None for s in specs)
        self._pad_fits: Dict[Tuple[int, np.dtype], bool] = {}
        self._build_fast()

    def __getstate__(self) -> Dict[str, Any]:
        """Picklable (worker processes get a copy, with what the source has learned so far)."""
        with self._lock:
            state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        # Unpickled dtypes equal numpy's own dtype objects but are not them, and the fast path
        # compares by identity: without this, every chunk in a worker process took the full
        # checks (about 3 us a chunk, most of a tiny chunk's cost).
        if self._fast is not None:
            self._fast = [(np.dtype(d.str), ax, other, ndim) for d, ax, other, ndim in self._fast]
            if self._single is not None:
                self._single = (self._fast[0][0],) + tuple(self._single[1:])

    def _build_fast(self) -> None:
        """Precompute the per-input (dtype, axis, rank, other dims) of the fast path, once every
        expectation is fixed; the full checks (and their messages) run only when it misses."""
        if not self.learn or self.ragged:
            return
        fast = []
        for spec, ax in zip(self.specs, self.axes):
            if spec.is_string or spec.dtype is None or spec.shape is None or ax >= len(spec.shape):
                return
            other = spec.shape[:ax] + spec.shape[ax + 1:]
            if any(d is None for d in other):
                return
            fast.append((spec.dtype, ax, other, len(spec.shape)))
        self._fast = fast
        if len(fast) == 1 and fast[0][1] == 0:
            self._single = (fast[0][0], fast[0][2], fast[0][3])

    def add_replica(self, specs: Sequence[InputSpec], *, cast: bool) -> None:
        """Merge another registration's declared input specs into what the source accepts.

        Raises ValueError when they contradict what the source already accepts (declared by an
        earlier registration or learned from its chunks): a replica would otherwise rebatch
        chunks its own session cannot take."""
        if cast != self.cast:
            raise ValueError(f"source {self.source!r} is already fed with cast={self.cast}; a replica must use "
                             f"the same, got cast={cast}")
        with self._lock:
            declared = [_merge(self.source, old, new) for old, new in zip(self._declared, specs)]
            current = [_merge(self.source, old, new, _LEARNED if self._learned else "")
                       for old, new in zip(self.specs, specs)]
            self._declared, self.specs = declared, current
            if not self.learn:
                self.fixed_batch = bool(fixed_batch_inputs(declared, self.axes))
            self._fast = self._single = None
            self._build_fast()

    def check(self, chunk: Any, worker_id: int) -> Tuple[Tuple[np.ndarray, ...], int]:
        """Validate ``chunk``; returns (arrays in input order, row count) or raises."""
        single = self._single
        if single is not None and type(chunk) in (list, tuple) and len(chunk) == 1:
            a = chunk[0]  # the commonest case, one input batched on axis 0, checked inline
            if type(a) is np.ndarray and a.dtype is single[0] and a.ndim == single[2] and a.shape[1:] == single[1]:
                return (a,), a.shape[0]
        fast = self._fast
        if fast is not None and type(chunk) in (list, tuple) and len(chunk) == len(fast):
            rows = -1
            for a, (dtype, ax, other, ndim) in zip(chunk, fast):
                # dtype identity (not equality) keeps this cheap; an equal but distinct dtype
                # object just takes the full path below
                if type(a) is not np.ndarray or a.dtype is not dtype:
                    break
                shape = a.shape
                if len(shape) != ndim:
                    break
                if (shape[1:] if ax == 0 else shape[:ax] + shape[ax + 1:]) != other:
                    break
                if rows < 0:
                    rows = shape[ax]
                elif shape[ax] != rows:
                    break
            else:
                return tuple(chunk), rows
        arrays = self(chunk, worker_id)
        return arrays, int(arrays[0].shape[self.axes[0]]) if arrays else 0

    def _fail(self, worker_id: int, name: Optional[str], expected: str, got: str) -> InputValidationError:
        where = f"source {self.source!r}, worker {worker_id}"
        if name is not None:
            where += f", input {name!r}"
        return InputValidationError(f"{where}: expected {expected}, got {got}")

    def __call__(self, chunk: Any, worker_id: int) -> Tuple[np.ndarray, ...]:
        arrays = self._normalise(chunk, worker_id)
        rows = None
        out: List[Any] = []
        for i, a in enumerate(arrays):
            name, spec, axis = self.names[i], self.specs[i], self.axes[i]
            if spec.pad is not None:
                a = self._ragged_input(a, i, worker_id)
                n = len(a) if isinstance(a, Ragged) else a.shape[0]
                if rows is None:
                    rows = n
                elif n != rows:
                    raise self._fail(worker_id, name, f"{rows} rows like input {self.names[0]!r}", f"{n} rows")
                out.append(a)
                continue
            if not isinstance(a, np.ndarray):
                hint = ""
                if isinstance(a, Ragged) or (isinstance(a, (list, tuple)) and a and isinstance(a[0], np.ndarray)):
                    hint = " (rows of different shapes: name the input in pad= to pad them)"
                raise self._fail(worker_id, name, "a numpy array", _describe(a) + hint)
            a = self._check_dtype(a, spec, worker_id, self._declared[i].dtype is None, self._declared[i].is_string)
            if a.ndim <= axis:
                raise self._fail(worker_id, name, f"an array with batch axis {axis} (rank > {axis})",
                                 f"rank {a.ndim}, shape {a.shape}")
            if spec.shape is not None:
                origin = _LEARNED if self._declared[i].shape is None else ""
                if a.ndim != len(spec.shape):
                    raise self._fail(worker_id, name, f"rank {len(spec.shape)} (shape {_fmt(spec.shape)}){origin}",
                                     f"rank {a.ndim}, shape {a.shape}")
                for d, (want, have) in enumerate(zip(spec.shape, a.shape)):
                    if want is not None and want != have and (d != axis or self.fixed_batch):
                        declared = self._declared[i].shape
                        origin = _LEARNED if declared is None or declared[d] is None else ""
                        raise self._fail(worker_id, name, f"shape {_fmt(spec.shape)} (dim {d} = {want}){origin}",
                                         f"shape {a.shape}")
            n = a.shape[axis]
            if rows is None:
                rows = n
            elif n != rows:
                raise self._fail(worker_id, name,
                                 f"{rows} rows along axis {axis} like input {self.names[0]!r}",
                                 f"{n} rows (shape {a.shape})")
            out.append(a)
        if self.learn and rows and not self._learned and not self._learn(out):
            return self(tuple(out), worker_id)  # another worker learned first: check against it
        return tuple(out)

    def _ragged_input(self, a: Any, i: int, worker_id: int) -> Any:
        """A padded input's rows as a Ragged (or a plain array: rows of one shape), checked:
        numeric, the input's dtype (cast where allowed), the input's rank, no row longer than a
        size the session fixes, a pad value that the dtype holds."""
        spec, name = self.specs[i], self.names[i]
        if isinstance(a, np.ndarray) and a.dtype.kind == "O":
            if a.ndim != 1:
                raise self._fail(worker_id, name, "rows of different shapes as a 1-d object array of arrays",
                                 f"an object array of shape {a.shape}")
            a = list(a)
        if isinstance(a, (list, tuple)):
            try:
                a = Ragged.from_rows(a)
            except (ValueError, TypeError) as e:
                raise self._fail(worker_id, name, "a list of numeric arrays of one dtype and rank, one per row",
                                 str(e)) from None
        if not isinstance(a, (Ragged, np.ndarray)):
            raise self._fail(worker_id, name, "rows as a list of arrays, a feeder.Ragged or a numpy array",
                             _describe(a))
        rank = a.ndim
        if isinstance(a, np.ndarray) and rank < 2:
            raise self._fail(worker_id, name, "rows of rank >= 1 (a padded input has a batch axis and at least one "
                             "more)", f"rank {rank}, shape {a.shape}")
        empty = not len(a)
        if a.dtype.kind not in "biufc" and not empty:
            raise self._fail(worker_id, name, "numeric rows (a padded input cannot hold strings or objects)",
                             f"dtype {a.dtype}")
        want = spec.dtype
        if want is not None and a.dtype != want and not empty:
            learned = self._declared[i].dtype is None
            if not (self.cast and can_cast(a.dtype, want)):
                hint = "" if self.cast else " (cast=True converts safe casts)"
                raise self._fail(worker_id, name, f"dtype {want}{_LEARNED if learned else ''}",
                                 f"dtype {a.dtype}{hint}")
            # (rows that hold no value at all, [] or shape (n, 0), have no range to check)
            if a.sizes().sum() if isinstance(a, Ragged) else a.size:
                self._check_int_cast(worker_id, name, a.dtype, want,
                                     lambda: a.value_range() if isinstance(a, Ragged) else (a.min(), a.max()))
            a = a.astype(want)
        if spec.shape is not None and not empty:
            if rank != len(spec.shape):
                origin = _LEARNED if self._declared[i].shape is None else ""
                raise self._fail(worker_id, name, f"rows of rank {len(spec.shape) - 1} (a batch of shape "
                                 f"{_fmt(spec.shape)}){origin}", f"rows of rank {rank - 1}")
            longest = a.shapes.max(axis=0) if isinstance(a, Ragged) else a.shape[1:]
            for d, fixed in enumerate(spec.shape[1:]):
                if fixed is not None and int(longest[d]) > fixed:
                    raise self._fail(worker_id, name, f"rows of at most {fixed} along axis {d + 1} (the session's "
                                     f"shape {_fmt(spec.shape)}; shorter rows are padded to it)",
                                     f"a row of {int(longest[d])}")
        key = (i, a.dtype)
        fits = self._pad_fits.get(key)
        if fits is None and not empty:
            fits = self._pad_fits[key] = holds_value(a.dtype, spec.pad)
        if fits is False:
            raise self._fail(worker_id, name, f"a dtype that holds the pad value {spec.pad!r}", f"dtype {a.dtype}")
        return a

    def _normalise(self, chunk: Any, worker_id: int) -> Sequence[Any]:
        if isinstance(chunk, dict):
            unknown = [k for k in chunk if k not in self._index]
            missing = [n for n in self.names if n not in chunk]
            if unknown or missing:
                parts = []
                if missing:
                    parts.append(f"missing {missing}")
                if unknown:
                    parts.append(f"unknown {unknown}")
                masked = [k for k in unknown if k in self.masks]
                if masked:
                    parts.append(self._mask_hint(masked[0]))
                raise self._fail(worker_id, (missing or unknown)[0],
                                 f"a dict with keys {list(self.names)}", ", ".join(parts))
            return [chunk[n] for n in self.names]
        if isinstance(chunk, (list, tuple)):
            if len(chunk) != len(self.names):
                got = f"{len(chunk)} items"
                if self.masks and len(chunk) > len(self.names):
                    got += f" ({', '.join(self._mask_hint(m) for m in self.masks)})"
                raise self._fail(worker_id, None, f"{len(self.names)} arrays for inputs {list(self.names)}", got)
            return chunk
        if isinstance(chunk, np.ndarray) and len(self.names) == 1:
            raise self._fail(worker_id, self.names[0], "a list, tuple or dict of arrays",
                             f"a bare {_describe(chunk)} (wrap it: [array])")
        raise self._fail(worker_id, None, "a list, tuple or dict of numpy arrays, or None", _describe(chunk))

    def _mask_hint(self, mask: str) -> str:
        padded = self.masks[mask]
        return (f"{mask!r} is the name of the mask pad= makes for input {padded!r}, never fetched: if fetch_fun "
                f"returns data of that name, name the mask otherwise (mask_names={{{padded!r}: "
                f"{padded + '_pad_mask'!r}}})")

    def _refuse_none(self, a: np.ndarray, spec: InputSpec, worker_id: int) -> None:
        """A None in an object array is a null, said as such (not as a wrong dtype)."""
        if spec.kept:
            return
        flat = a.ravel()
        try:
            if None not in flat.tolist():  # (3x faster than the loop below; == fails on array elements)
                return
        except (ValueError, TypeError):
            pass
        at = next((i for i, x in enumerate(flat) if x is None), None)  # (identity, not ==)
        if at is not None:
            row = _row(at, a.shape, self.axes[self._index[spec.name]])
            nulls = sum(x is None for x in flat)
            expected = "strings" if spec.is_string else ("values" if spec.dtype is None else f"dtype {spec.dtype}")
            raise self._fail(worker_id, spec.name, f"{expected} without nulls",
                             f"a null (None) in row {row} of the chunk ({nulls} in all)")

    def _check_dtype(self, a: np.ndarray, spec: InputSpec, worker_id: int, learned: bool,
                     session_string: bool = False) -> np.ndarray:
        if spec.is_string:
            if a.dtype.kind not in "OUS":
                raise self._fail(worker_id, spec.name, "a string array (dtype object or str)", f"dtype {a.dtype}")
            if session_string:
                return self._as_text(a, spec, worker_id)  # (nulls too: one pass over the values)
            if a.dtype.kind == "O":
                self._refuse_none(a, spec, worker_id)
            return a
        if a.dtype.kind == "O":
            if self.learn and not self._learned and spec.dtype is None and _all_strings(a):
                return a  # a string input, learned from this first chunk (Ray Data hands strings so)
            self._refuse_none(a, spec, worker_id)
            raise self._fail(worker_id, spec.name, f"a numeric array{_want(spec.dtype)}",
                             f"dtype object (shape {a.shape}); object arrays are accepted only for string inputs")
        want = spec.dtype
        if want is None or a.dtype == want:
            return a
        if self.cast and can_cast(a.dtype, want):
            if a.size:
                self._check_int_cast(worker_id, spec.name, a.dtype, want, lambda: (a.min(), a.max()))
            if not (want.kind == "f" and a.size and _may_overflow(a.dtype, want)):
                return a.astype(want)
            # A safe cast never turns a finite value into an infinite one (float64 1e39 -> float32).
            with np.errstate(over="ignore"):  # overflow is checked and reported right here
                out = a.astype(want)
            overflow = np.isinf(out)
            if a.dtype.kind in "fc":
                overflow &= np.isfinite(a)
            if overflow.any():
                bad = a[overflow]
                raise self._fail(worker_id, spec.name, f"finite values that fit {want} "
                                 f"(at most {float(np.finfo(want).max):g} in magnitude)",
                                 f"{a.dtype} values as large as {bad.flat[np.argmax(np.abs(bad))]!r}")
            return out
        hint = "" if self.cast else " (cast=True converts safe casts)"
        raise self._fail(worker_id, spec.name, f"dtype {want}{_LEARNED if learned else ''}", f"dtype {a.dtype}{hint}")

    def _as_text(self, a: np.ndarray, spec: InputSpec, worker_id: int) -> np.ndarray:
        """A string array for a session's tensor(string) input as ONNX Runtime reads it right: str.
        ONNX Runtime reads a bytes array (dtype S) as text running from one value into the next,
        and a bytes object as its repr ("b'cat'"), and turns numbers in an object array into their
        text: bytes are decoded as UTF-8 (one copy, of string inputs only), anything else refused."""
        if a.dtype.kind == "U":
            return a
        name = spec.name
        axis = self.axes[self._index[name]]
        if a.dtype.kind == "S":
            try:
                return np.char.decode(a, "utf-8")
            except UnicodeDecodeError:
                flat = a.ravel().tolist()
                at = next(k for k, x in enumerate(flat) if not _utf8(x))
                got = f"bytes that are not UTF-8 in row {_row(at, a.shape, axis)}: {flat[at]!r:.60}"
                raise self._fail(worker_id, name, "text (bytes must be UTF-8: the session's input is a string)",
                                 got) from None
        flat = a.ravel().tolist()
        if all(type(x) is str for x in flat):
            return a
        if any(x is None for x in flat):
            self._refuse_none(a, spec, worker_id)  # (a null is said as such)
        out = []
        for k, x in enumerate(flat):
            what = None
            if isinstance(x, bytes):
                try:
                    x = x.decode("utf-8")
                except UnicodeDecodeError:
                    what = "bytes that are not UTF-8"
            elif not isinstance(x, str):
                what = f"{type(x).__name__} {x!r:.60}"
            if what is not None:
                raise self._fail(worker_id, name, "strings (str, or bytes of UTF-8 text: the session's input is a "
                                 "string)", f"{what} in row {_row(k, a.shape, axis)}")
            out.append(x)
        text = np.empty(len(out), dtype=object)
        text[:] = out
        return text.reshape(a.shape)

    def _check_int_cast(self, worker_id: int, name: str, have: np.dtype, want: np.dtype,
                        bounds: Callable[[], Tuple[Any, Any]]) -> None:
        """InputValidationError for integers that a safe cast to ``want`` would change: outside an
        integer type's range, or without an exact value in a float type (2**24 + 1 as a float32 is
        2**24: an id, a count or a timestamp silently changed). ``bounds()``: the smallest and the
        largest value, asked for only where a check is due."""
        if have.kind not in "iu":
            return
        if want.kind in "iu":
            info = np.iinfo(want)
            lo, hi = bounds()
            if lo < info.min or hi > info.max:
                raise self._fail(worker_id, name, f"values that fit {want}", f"{have} values in [{lo}, {hi}]")
            return
        if want.kind not in "fc" or not _inexact_ints(have, want):
            return
        lo, hi = bounds()
        exact = 2 ** (np.finfo(want).nmant + 1)
        if int(lo) < -exact or int(hi) > exact:
            worst = int(hi) if abs(int(hi)) >= abs(int(lo)) else int(lo)
            if abs(worst) > float(np.finfo(want).max):
                return  # beyond the type's range: refused as an overflow, the worse of the two
            raise self._fail(worker_id, name, f"integers {want} holds exactly (at most 2**{np.finfo(want).nmant + 1} "
                             f"= {exact} in magnitude)", f"{have} values as large as {worst}")

    def _learn(self, arrays: List[np.ndarray]) -> bool:
        """Fix the dtypes and non-batch dims the spec leaves free to those of this first chunk;
        False if another worker's chunk got there first."""
        with self._lock:
            if self._learned:
                return False
            # A str/bytes array makes a string input (any width; object arrays of str accepted too);
            # any other dtype is fixed to the first chunk's.
            strings = [s.pad is None and (s.is_string or a.dtype.kind in "US"
                                          or (a.dtype.kind == "O" and _all_strings(a)))
                       for s, a in zip(self.specs, arrays)]
            self.specs = [
                InputSpec(s.name,
                          None if is_str else (s.dtype if s.dtype is not None else a.dtype),
                          # a padded input's rows differ in shape: only its rank is learned
                          (s.shape if s.shape is not None else (None,) * a.ndim) if s.pad is not None else
                          tuple(None if d == ax else a.shape[d] for d in range(a.ndim)),
                          is_str, s.pad, s.kept)
                for s, a, ax, is_str in zip(self.specs, arrays, self.axes, strings)]
            self._learned = True
            self._build_fast()
            return True


_LEARNED = " like the source's first chunk"


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _row(flat_index: int, shape: Tuple[int, ...], axis: int = 0) -> int:
    """The row (along the batch ``axis``) of an element of an array of ``shape``, by its flat index."""
    return int(np.unravel_index(flat_index, shape)[axis]) if len(shape) > axis else 0


def _all_strings(a: np.ndarray) -> bool:
    """An object array holding only str (or bytes): what a string input may get without a session."""
    return a.size > 0 and all(isinstance(x, (str, bytes)) for x in a.flat)


def _spec_text(spec: InputSpec) -> str:
    kind = "strings" if spec.is_string else ("any dtype" if spec.dtype is None else f"dtype {spec.dtype}")
    return kind + ("" if spec.shape is None else f", shape {_fmt(spec.shape)}")


def _merge(source: str, old: InputSpec, new: InputSpec, origin: str = "") -> InputSpec:
    """The spec accepting what both accept; ValueError if nothing can satisfy both."""
    def conflict() -> ValueError:
        return ValueError(f"source {source!r}, input {old.name!r}: the source already takes {_spec_text(old)}{origin}, "
                          f"but this registration's session takes {_spec_text(new)}; replicas share one queue and "
                          f"rebatch each other's chunks, so they must accept the same chunks")

    if not _same_pad(old.pad, new.pad):
        raise ValueError(f"source {source!r}, input {old.name!r}: the source is already fed with pad value "
                         f"{old.pad!r} for it, this registration with {new.pad!r}; replicas share one queue and "
                         f"must pad the same inputs with the same value")
    if old.is_string or new.is_string:
        if (old.dtype is not None and not old.is_string) or (new.dtype is not None and not new.is_string):
            raise conflict()
        dtype, is_string = None, True
    else:
        if old.dtype is not None and new.dtype is not None and old.dtype != new.dtype:
            raise conflict()
        dtype, is_string = (old.dtype if old.dtype is not None else new.dtype), False
    if old.shape is None or new.shape is None:
        shape = old.shape if new.shape is None else new.shape
    else:
        if len(old.shape) != len(new.shape) or any(a is not None and b is not None and a != b
                                                   for a, b in zip(old.shape, new.shape)):
            raise conflict()
        shape = tuple(a if a is not None else b for a, b in zip(old.shape, new.shape))
    return InputSpec(old.name, dtype, shape, is_string, old.pad, old.kept)


def _same_pad(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(a == b) or bool(np.isnan(a) and np.isnan(b))


def holds_value(dtype: np.dtype, value: Any) -> bool:
    """Whether ``dtype`` holds ``value`` exactly (the pad value of an input of that dtype)."""
    try:
        with np.errstate(all="ignore"):
            v = np.array(value).astype(dtype)
    except (OverflowError, ValueError, TypeError):
        return False
    return bool(v == value) or bool(np.isnan(v) and np.isnan(value)) if dtype.kind in "fc" else bool(v == value)


def _inexact_ints(src: np.dtype, dst: np.dtype) -> bool:
    """Whether some integer of ``src`` has no exact value in the float type ``dst``."""
    return bool(int(np.iinfo(src).max) > 2 ** (np.finfo(dst).nmant + 1))


def _may_overflow(src: np.dtype, dst: np.dtype) -> bool:
    """Whether some finite value of ``src`` exceeds the float type ``dst``'s range."""
    top = float(np.finfo(dst).max)
    if src.kind in "fc":
        return float(np.finfo(src).max) > top
    if src.kind in "iu":
        return float(np.iinfo(src).max) > top
    return False


def _fmt(shape: Tuple[Optional[int], ...]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + (",)" if len(shape) == 1 else ")")


def _want(dtype: Optional[np.dtype]) -> str:
    return f" of dtype {dtype}" if dtype is not None else ""
