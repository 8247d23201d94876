"""``source.map(fn)`` and ``source.filter(pred)``: the user's functions in the fetch path of a
ready-made source, with every promise of that source kept.

A :class:`TransformedSource` wraps one source (chains are flattened: ``src.map(f).filter(g)``
wraps ``src`` once, with two steps) and is itself a fetch function. A call reads a chunk from
the wrapped source, in the same fetcher thread or worker process, hands it to the steps as
``{column: array}`` and returns what the steps made, in the registration's input order. What
stays out of the user's sight:

* **Row keys.** A resumable source appends its row keys to every chunk
  (``feeder.sources.rowkeys``). The wrapper takes them off before the functions run and puts
  back those of the rows that remain: a ``map`` must return as many rows as it got (each output
  row is the row of the same position), a ``filter`` drops rows and their keys together.
* **Filtered rows.** The keys of the rows a ``filter`` drops go to the source's
  :class:`~feeder.sources.rowkeys.KeyLedger` as *filtered*: recorded as done (they will never be
  delivered), so that a checkpoint stays a few ranges per unit in flight and a resume never
  reads them again, and counted apart from the delivered rows. In threads they are handed over
  at once (``SourceBinding.on_filtered``); a worker process keeps them until it reports to the
  parent (``feeder_filtered_keys``: with a message every 50 ms and with its last ones, see
  ``feeder.processes.child``). A unit whose rows were all
  dropped returns :data:`~feeder.sources.base.SKIP`: an ordered source's round-robin counts it
  as that worker's turn, so that chunks keep the order of the units and an ordered resume gives
  exactly the batches an uninterrupted run would have given.
* **Figures.** ``feeder_counters(worker_ids)``: rows filtered and seconds spent in the functions
  (``transform_s``, apart from reading) per worker, added to ``feed.metrics()`` and shown by
  ``diagnose()``.
* **Definition.** A checkpoint records the steps (their kind, the function's name and a digest
  of its code: :mod:`feeder.sources.functionid`) besides the wrapped source's definition: a
  state written without them, or with other steps or functions of other code, is refused; a
  function moved within its file (a comment added above a lambda) is the same function.
* **Read-only columns.** The functions get read-only views of the columns (an ArraySource's
  chunk is a view of the user's arrays, which later epochs read again): a write into one is an
  ``InputValidationError`` naming the function, never a change to the data.

Columns are numpy arrays, or for an input whose rows differ in length (``pad=``) whatever form
such rows come in (a list of arrays, a ``Ragged``): a filter keeps their rows by row number, a map
may return them, counted by ``len()``; the validator judges them as any chunk.

Which columns the functions see: every column the wrapped source reads. ``ArraySource``: all its
arrays (given as a dict, so that they have names); ``ParquetSource``: the inputs its ``columns``
maps, or with ``columns=None`` every column of its files; ``RayDataSource``: likewise, every
column of the dataset with ``columns=None``. Names a ``map`` returns that the registration does
not feed are dropped; a name the registration feeds that the steps do not make is an
``InputValidationError`` at the first chunk, naming the input.
"""
from __future__ import annotations

import dataclasses
import operator
from time import perf_counter
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..errors import InputValidationError, exception_text
from .base import ROW_KEY, SKIP, FilteredSink, SourceBinding
from .functionid import function_digest
from .state import STEP_KEYS, definition_differences

MAP, FILTER = "map", "filter"
Step = Tuple[str, Callable[[Dict[str, np.ndarray]], Any]]
_BOOL = np.dtype(np.bool_)
# What a call needs, set at bind: (columns the steps see, outputs -> list, keyed, (is_map, fn) per step)
Plan = Tuple[List[str], Callable[[Dict[str, np.ndarray]], List[np.ndarray]], bool,
             Tuple[Tuple[bool, Callable[[Dict[str, np.ndarray]], Any]], ...]]


class _Take:
    """``cols -> [cols[name] for name in outputs]`` in one C call (KeyError for a missing name);
    picklable, as the bound source it belongs to travels to worker processes."""

    __slots__ = ("get", "one")

    def __init__(self, outputs: Sequence[str]):
        self.one = len(outputs) == 1
        self.get = operator.itemgetter(*outputs)

    def __call__(self, cols: Dict[str, np.ndarray]) -> List[np.ndarray]:
        got = self.get(cols)
        return [got] if self.one else list(got)

    def __getstate__(self) -> Tuple[bool, Any]:
        return self.one, self.get

    def __setstate__(self, state: Tuple[bool, Any]) -> None:
        self.one, self.get = state


def _read_only(a: Any) -> Any:
    """A numpy array as a read-only view of itself (the array itself when it is read-only already:
    Arrow's buffers); other forms of rows (a list of rows, a Ragged) as they are."""
    if isinstance(a, np.ndarray) and a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _rows_of(a: Any, mask: np.ndarray) -> Any:
    """The rows of column ``a`` that ``mask`` keeps: a numpy array by the mask (read-only, as
    the columns the steps get are), a list or tuple of rows (rows of different lengths) row by
    row, anything else (a Ragged) by row numbers."""
    if isinstance(a, np.ndarray):
        kept = a[mask]
        kept.flags.writeable = False
        return kept
    keep = np.flatnonzero(mask)
    if isinstance(a, (list, tuple)):
        return [a[i] for i in keep.tolist()]
    return a[keep]


def function_name(fn: Any, where: bool = True) -> str:
    """``module.qualname`` of a function, for messages (with ``where``, a lambda's file and line)
    and definitions (without: a function is recorded by what it is, see
    :mod:`feeder.sources.functionid`, never by where it sits)."""
    qual = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = f"{module}.{qual}" if module and module != "builtins" else qual
    code = getattr(fn, "__code__", None)
    if where and "<lambda>" in qual and code is not None:
        name += f" ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})"
    return name


# The entry point lives here, with the wrapper it returns: the sources inherit it and so import
# this module, which imports none of them (the package's imports flow one way, see base.py).
class Transformable:
    """``map`` and ``filter`` for the ready-made sources (see :mod:`feeder.sources.transform`)."""

    def map(self, fn: Callable[[Dict[str, np.ndarray]], Mapping[str, np.ndarray]]) -> "TransformedSource":
        """A new source whose rows are ``fn`` of this one's, computed where the fetch runs.

        ``fn`` gets a chunk as ``{column: array}`` (every column this source reads, the row
        keys left out) and returns ``{name: array}`` with the same number of rows along axis 0:
        those names are the source's inputs from then on. It runs in the fetcher thread or
        worker process that reads the chunk (it travels there with cloudpickle: lambdas work),
        on a chunk of any number of rows (a part of a unit after a resume): it must treat rows
        independently for a resume to be exact. Sharding, shuffling, ``state_dict`` and
        ``resume_from`` and ``feeder.predict``'s exactly-once are kept.

        Args:
            fn: ``fn({column: array}) -> {name: array}``, the same number of rows.

        Returns:
            A :class:`~feeder.sources.transform.TransformedSource`; chain ``map`` and ``filter``
            on it.

        Raises:
            TypeError: ``fn`` is not callable, or this source cannot name its columns.
        """
        return self._transformed("map", fn)

    def filter(self, pred: Callable[[Dict[str, np.ndarray]], Any]) -> "TransformedSource":
        """A new source without the rows for which ``pred`` is False: rows dropped on purpose.

        ``pred`` gets a chunk as ``{column: array}`` (as :meth:`map`'s ``fn`` does) and returns
        a bool mask of its rows (True: keep). Dropped rows are counted (``rows_filtered`` in
        ``feed.metrics()``, ``source_rows_filtered`` in the ledger) and recorded as done in the
        source's checkpoints, so that a resume does not read them again and a state stays
        small; they are never confused with lost rows.

        Args:
            pred: ``pred({column: array}) -> bool array`` of the chunk's length.

        Returns:
            A :class:`~feeder.sources.transform.TransformedSource`.

        Raises:
            TypeError: ``pred`` is not callable, or this source cannot name its columns.
        """
        return self._transformed("filter", pred)

    def _transformed(self, kind: str, fn: Any) -> "TransformedSource":
        return TransformedSource(self, ((kind, fn),))

    def _transform_columns(self) -> List[str]:
        """The names a transform's functions see: every column this source reads (at
        registration; a ValueError for a column it lacks)."""
        raise NotImplementedError

    def _offered_columns(self) -> Optional[Tuple[List[str], bool]]:
        """At registration, before the inputs are checked: (the columns this source has, whether it
        feeds every one of them), or None when it cannot tell yet (registration refuses a mask
        named like a column with it)."""
        return None


class TransformedSource(Transformable):
    """A source with ``map`` and ``filter`` steps (see the module docstring): made by
    ``source.map(fn)`` and ``source.filter(pred)``, registered like the source it wraps.

    Args:
        source: The wrapped ready-made source.
        steps: ``(kind, function)`` pairs, kind ``"map"`` or ``"filter"``, applied in order.

    Raises:
        TypeError: A source that is not one of ``feeder.sources`` (a plain fetch function), a
            function that is not callable, a step of another kind, or a source whose columns have
            no names (an ``ArraySource`` of a list of arrays).
    """

    def __init__(self, source: Any, steps: Sequence[Step]):
        if isinstance(source, TransformedSource):  # a chain is one wrapper, its steps in order
            steps = tuple(source.steps) + tuple(steps)
            source = source.wrapped
        if not isinstance(source, Transformable):
            # The steps see a chunk's columns by name and carry its row keys past the functions: what
            # only the ready-made sources say. A plain fetch function transforms its chunks itself.
            raise TypeError(f"TransformedSource wraps a source of feeder.sources (ArraySource, ParquetSource, "
                            f"RayDataSource, or a map or filter of one: source.map(fn), source.filter(pred)), got "
                            f"{type(source).__name__}; a fetch function of your own can apply fn to its chunks "
                            f"itself")
        for kind, fn in steps:
            if kind not in (MAP, FILTER):
                raise TypeError(f"a step is 'map' or 'filter', got {kind!r}")
            if not callable(fn):
                raise TypeError(f"{kind} needs a callable, got {type(fn).__name__}")
        check = getattr(source, "_check_transformable", None)
        if check is not None:
            check()
        self.source: Any = source
        self.steps: Tuple[Step, ...] = tuple(steps)
        self._maps = any(kind == MAP for kind, _ in self.steps)
        self.feeder_row_keys = bool(getattr(source, "feeder_row_keys", False))
        self.feeder_threads_only = bool(getattr(source, "feeder_threads_only", False))
        self._columns: Optional[List[str]] = None   # what the functions see (the wrapped source's inputs)
        self._outputs: Optional[List[str]] = None   # what the registration feeds, in order
        self._ordered = False
        self._plan: Optional[Plan] = None
        self._sink: Optional[FilteredSink] = None
        # Per worker id, written only by that worker's thread: [rows filtered, seconds in the
        # steps], and (in a worker process) the keys filtered since the process last reported.
        self._figures: Dict[int, List[float]] = {}
        self._pending: Dict[int, List[np.ndarray]] = {}
        self._codes: Optional[Dict[str, Optional[str]]] = None  # each step's code digest, once computed

    def _transformed(self, kind: str, fn: Any) -> "TransformedSource":
        return TransformedSource(self, ((kind, fn),))

    @property
    def wrapped(self) -> Any:
        """The source whose rows the steps transform."""
        return self.source

    def __getattr__(self, name: str) -> Any:
        # What feeder asks a source about itself and the wrapper does not answer (its shard, its
        # rows) is the wrapped source's to say. (Not during unpickling, before "source" is set.)
        if name.startswith("feeder_") and "source" in self.__dict__:
            return getattr(self.__dict__["source"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"{self.source!r}" + "".join(f".{kind}({function_name(fn)})" for kind, fn in self.steps)

    @property
    def epochs(self) -> Optional[int]:
        """The wrapped source's epochs (None: endless)."""
        return getattr(self.source, "epochs", 1)

    # ---- what a state must match -------------------------------------------------------------
    def _steps_definition(self) -> Dict[str, Any]:
        """What a state records of the steps: ``transforms``, each step's kind and function name;
        ``transforms_code``, a digest of each function's code (None for a callable that cannot
        be inspected), computed once."""
        codes = self._codes
        if codes is None:
            codes = self._codes = {f"step {i} ({kind} {function_name(fn, where=False)})": function_digest(fn)
                                   for i, (kind, fn) in enumerate(self.steps, 1)}
        return {"transforms": [[kind, function_name(fn, where=False)] for kind, fn in self.steps],
                "transforms_code": dict(codes)}

    def feeder_definition(self) -> Dict[str, Any]:
        """The wrapped source's definition, plus the steps (kind, function name and a digest of its
        code: see :mod:`feeder.sources.functionid`)."""
        definition = getattr(self.source, "feeder_definition", None)
        inner = definition() if definition is not None else {}
        return {**inner, **self._steps_definition()}

    def _inner_state(self, state: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
        """``state`` as the wrapped source sees it (its definition without the steps), after a
        ValueError naming the steps when they differ."""
        if state is None:
            return None
        if not isinstance(state, Mapping) or not isinstance(state.get("definition"), Mapping):
            return dict(state) if isinstance(state, Mapping) else state
        definition = dict(state["definition"])
        theirs = {key: definition.pop(key) for key in STEP_KEYS if key in definition}
        diffs = definition_differences(theirs, self._steps_definition(), depth=1)
        if diffs:
            raise ValueError("resume_from is the state of a different source definition; " + "; ".join(diffs))
        return {**state, "definition": definition}

    # ---- the binding protocol ----------------------------------------------------------------
    def feeder_input_names(self) -> Optional[List[str]]:
        """The inputs this source can feed when known before it runs (no ``map`` step: the
        wrapped source's columns), else None (what the functions return decides)."""
        if self._maps:
            return None
        return list(self.source._transform_columns())

    def _offered_columns(self) -> Optional[Tuple[List[str], bool]]:
        # Without a map, the wrapped source's columns, of which only the inputs are fed; with one,
        # what the map makes is known at the first chunk.
        if self._maps:
            return None
        inner = self.source._offered_columns()
        return None if inner is None else (inner[0], False)

    def feeder_validate(self, input_names: Sequence[str], resume: Optional[Mapping[str, Any]]) -> None:
        """At registration: the wrapped source checks its columns (every one it reads, see the
        module docstring) and ``resume``; without a ``map`` step, every input must be one of its
        columns.

        Args:
            input_names: The registration's inputs.
            resume: Its ``resume_from`` state, or None.
        """
        inputs = [n for n in input_names if n != ROW_KEY]
        inner_resume = self._inner_state(resume)
        columns = list(self.source._transform_columns())
        if not self._maps:
            missing = [n for n in inputs if n not in columns]
            if missing:
                raise ValueError(f"{type(self.source).__name__} has no column(s) {missing} for the input(s) of the "
                                 f"same name (its columns: {columns}); a filter passes columns on as they are")
        self.source.feeder_validate(tuple(columns), inner_resume)
        self._columns = columns
        self._outputs = inputs

    def feeder_bind(self, binding: SourceBinding) -> None:
        """At ``start()``: bind the wrapped source to the same workers, with its own columns as
        its inputs and the state as it sees it; keep where filtered rows go.

        Args:
            binding: What feeder tells the source (see :class:`~feeder.sources.SourceBinding`).
        """
        if self._columns is None:
            self.feeder_validate(binding.input_names, binding.resume)
        assert self._columns is not None
        self._outputs = [n for n in binding.input_names if n != ROW_KEY]
        self._ordered = binding.ordered
        self._sink = binding.on_filtered
        self._plan = (list(self._columns), _Take(self._outputs), self.feeder_row_keys,
                      tuple((kind == MAP, fn) for kind, fn in self.steps))
        self._figures, self._pending = {}, {}
        # Without a map, the wrapped source's columns reach the session as they are: what the
        # session declares for them (a stacked input's dtype with cast=True, an [N, 1] input fed by
        # a scalar column) is the wrapped source's to act on, as if no filter stood between. After a
        # map, the session takes what the map makes, not the columns.
        specs: Tuple[Any, ...] = ()
        if not self._maps and binding.specs:
            from ..validation import InputSpec

            declared = dict(zip(binding.input_names, binding.specs))
            specs = tuple(declared.get(c, InputSpec(c)) for c in self._columns)
        inner = dataclasses.replace(binding, input_names=tuple(self._columns), resume=self._inner_state(binding.resume),
                                    on_filtered=None, specs=specs, cast=binding.cast and not self._maps)
        self.source.feeder_bind(inner)

    def feeder_release(self) -> None:
        """At ``stop()``: release the wrapped source; forget where filtered rows went."""
        self._sink = None
        release = getattr(self.source, "feeder_release", None)
        if release is not None:
            release()

    def feeder_describe(self) -> str:
        """The wrapped source's phrase, and the steps."""
        describe = getattr(self.source, "feeder_describe", None)
        what = describe() if describe is not None else type(self.source).__name__
        return what + ", then " + ", ".join(f"{kind} {function_name(fn)}" for kind, fn in self.steps)

    def feeder_counters(self, worker_ids: Sequence[int]) -> Dict[str, float]:
        """Rows filtered and seconds spent in the steps (``transform_s``) by these workers, in
        this process, plus the wrapped source's own counters.

        Args:
            worker_ids: The workers whose figures to add up.
        """
        out: Dict[str, float] = {}
        inner = getattr(self.source, "feeder_counters", None)
        if inner is not None:
            out.update(inner(worker_ids))
        filtered = seconds = 0.0
        figures = self._figures
        for w in worker_ids:
            f = figures.get(w)
            if f is not None:
                filtered += f[0]
                seconds += f[1]
        out["rows_filtered"] = out.get("rows_filtered", 0.0) + filtered
        out["transform_s"] = out.get("transform_s", 0.0) + seconds
        return out

    def feeder_filtered_keys(self, worker_ids: Sequence[int]) -> Optional[np.ndarray]:
        """In a worker process: the keys of the rows these workers filtered since the last call
        (taken: each is reported once), or None.

        Args:
            worker_ids: The workers whose keys to take (call it from their thread).
        """
        taken: List[np.ndarray] = []
        for w in worker_ids:
            keys = self._pending.get(w)
            if keys:
                self._pending[w] = []
                taken += keys
        if not taken:
            return None
        return taken[0] if len(taken) == 1 else np.concatenate(taken)

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state["_sink"] = None  # the feeds' ledger stays in this process; a worker process reports instead
        state["_figures"], state["_pending"] = {}, {}
        return state

    # ---- fetching ------------------------------------------------------------------------------
    def __call__(self, worker_id: int, batch_size: int) -> Any:
        # The common case (a map that checks out, a filter that keeps every row) in few steps: a
        # unit of work pays about a microsecond for the wrapper (benchmarks/transform.py --calls).
        plan = self._plan
        if plan is None:
            raise RuntimeError("a TransformedSource was called before feeder bound it; pass it as the fetch_fun of "
                               "init_data_input_workers and start the coordinator")
        columns, take, keyed, steps = plan
        arrays = self.source(worker_id, batch_size)
        if arrays is SKIP:  # (an ordered source resuming its shuffle windows, feeder.sources.windowreplay)
            return SKIP
        # Read-only views: a step may not change the source's data (an ArraySource's chunk is a view
        # of the user's arrays), which later epochs read again; a write fails at once (see below).
        cols: Dict[str, np.ndarray] = {name: _read_only(a) for name, a in zip(columns, arrays)}
        keys = arrays[-1] if keyed else None
        n = len(keys) if keys is not None else (len(arrays[0]) if len(arrays) else 0)
        figures = self._figures.get(worker_id)
        if figures is None:
            figures = self._figures[worker_id] = [0.0, 0.0]
        t0 = perf_counter()
        fn: Any = None
        try:
            for is_map, fn in steps:
                if is_map:
                    out = fn(cols)
                    if out is not cols:
                        cols = self._mapped(fn, out, n)
                        continue
                    for a in cols.values():  # the dict it got, maybe changed in place: still n rows each?
                        if type(a) is not np.ndarray or not a.ndim or a.shape[0] != n:
                            cols = self._mapped(fn, out, n)
                            break
                    continue
                mask = fn(cols)
                if type(mask) is not np.ndarray or mask.dtype is not _BOOL or mask.shape != (n,):
                    mask = self._mask(fn, mask, n)
                kept = int(np.count_nonzero(mask))
                if kept == n:
                    continue
                self._filtered(worker_id, figures, n - kept, None if keys is None else keys[~mask])
                if kept == 0:
                    return SKIP
                cols = {name: _rows_of(a, mask) for name, a in cols.items()}
                if keys is not None:
                    keys = keys[mask]
                n = kept
        except ValueError as e:
            if fn is not None and not isinstance(e, InputValidationError) and "read-only" in exception_text(e):
                raise InputValidationError(
                    f"{function_name(fn)}, a step of {type(self.source).__name__}.{self._steps_text()}, wrote into a "
                    f"column it was given ({exception_text(e)}): the columns map and filter functions get are "
                    f"read-only, so that a function never changes the source's data (an ArraySource's arrays, "
                    f"which later epochs read again). Make a new array (d['x'] = d['x'] + 1) or write into a copy "
                    f"(x = d['x'].copy())") from e
            self._note(e, fn, worker_id)
            raise
        except Exception as e:
            self._note(e, fn, worker_id)
            raise
        finally:
            figures[1] += perf_counter() - t0
        try:
            chunk = take(cols)
        except KeyError:
            assert self._outputs is not None
            outputs = self._outputs
            missing = [name for name in outputs if name not in cols]
            raise InputValidationError(
                f"input {missing[0]!r}: the steps .{self._steps_text()} made no {missing[0]!r} "
                f"(they made {sorted(cols)}); the source's inputs are {outputs}") from None
        if keys is not None:
            chunk.append(keys)
        return chunk

    def _note(self, e: BaseException, fn: Any, worker_id: int) -> None:
        if fn is not None and not isinstance(e, InputValidationError) and hasattr(e, "add_note"):
            e.add_note(f"(raised in {function_name(fn)}, a step of {type(self.source).__name__}"
                       f".{self._steps_text()}, worker {worker_id})")

    def _steps_text(self) -> str:
        return ".".join(f"{kind}({function_name(fn)})" for kind, fn in self.steps)

    def _filtered(self, worker_id: int, figures: List[float], rows: int, keys: Optional[np.ndarray]) -> None:
        figures[0] += rows
        sink = self._sink
        if sink is not None:
            sink(rows, keys)
        elif keys is not None:
            self._pending.setdefault(worker_id, []).append(keys)

    @staticmethod
    def _mapped(fn: Any, out: Any, n: int) -> Dict[str, np.ndarray]:
        """``out`` of map function ``fn`` as ``{name: array}`` of ``n`` rows, or an
        InputValidationError naming the function (and the name at fault)."""
        if type(out) is not dict and not isinstance(out, Mapping):
            raise InputValidationError(f"map function {function_name(fn)} returned {type(out).__name__}; it must "
                                       f"return a dict of name -> numpy array")
        for name, a in out.items():
            if type(a) is np.ndarray and type(name) is str and a.ndim and a.shape[0] == n:
                continue  # the common case, checked in one line
            if not isinstance(name, str):
                raise InputValidationError(f"map function {function_name(fn)} returned the key {name!r}; names are str")
            if isinstance(a, np.ndarray):
                rows: Optional[int] = a.shape[0] if a.ndim else None
                what = f"{rows} rows (shape {a.shape})"
            elif isinstance(a, (str, bytes, Mapping)) or not hasattr(a, "__len__") or not hasattr(a, "__getitem__"):
                raise InputValidationError(f"input {name!r}: map function {function_name(fn)} returned "
                                           f"{type(a).__name__} for it; it must return numpy arrays (or rows of "
                                           f"different lengths for a padded input: a list of arrays, a Ragged)")
            else:  # rows of different lengths, for a padded input: the validator judges them
                rows = len(a)
                what = f"{rows} rows ({type(a).__name__})"
            if rows != n:
                got = "a scalar" if rows is None else what
                raise InputValidationError(f"input {name!r}: map function {function_name(fn)} returned {got} for a "
                                           f"chunk of {n} rows; a map returns one row per row it gets (drop rows "
                                           f"with filter)")
        return out if type(out) is dict else dict(out)

    @staticmethod
    def _mask(pred: Any, got: Any, n: int) -> np.ndarray:
        """What ``pred`` returned as a bool array of ``n`` (a list of bools is taken too); an
        InputValidationError naming the predicate for anything else."""
        mask = np.asarray(got)
        if mask.dtype != np.bool_ or mask.shape != (n,):
            raise InputValidationError(f"filter predicate {function_name(pred)} returned {mask.dtype} values of shape "
                                       f"{mask.shape} for a chunk of {n} rows; it must return a bool mask of shape "
                                       f"({n},) (True: keep the row)")
        return mask
