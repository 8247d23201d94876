"""feeder bench: measure a fetch function and a model, and say which configuration is fastest.

Usage::

    feeder bench MODULE:FETCH_FUN [--model PATH] [--batch-size N] [--seconds S] [--provider cpu|cuda|cuda:N] [--json]
    python -m feeder bench examples/quickstart.py:fetch --seconds 2

``MODULE`` is a module name importable from the current directory (``mypkg.data``) or a
path to a ``.py`` file. ``FETCH_FUN`` is called as ``fetch_fun(worker_id, batch_size)`` like
in any registration; it should go on returning chunks for the whole run (each configuration
calls it afresh; one that raises StopIteration ends that configuration early).

Each configuration runs for about ``S`` seconds, timed from its first batch (thread start-up
and warm-up excluded):

- ``fetch alone``: the fetch function called in a loop in one thread;
- ``feeder, N threads`` (N = 1 .. min(4, CPU count)) and, where this feeder has worker
  processes, ``feeder, N processes``: batches taken with ``next_batch()``, no model;
- ``model alone``: an ONNX Runtime session (``intra_op_num_threads=1``) run on batches
  already in memory;
- ``feeder + model, N threads|processes``: ``feed.run()`` end to end.

Input names come from the model when there is one, else from the chunk (dict keys, or
``input0, input1, ...`` for a list). The table has one line per configuration, then the best
configuration: the fastest ``feeder + model`` line when a model was measured, else the fastest
``feeder`` line. ``vs best`` is each line's rate over that best line's, for the lines it can be
compared with (those of its kind); the others show ``-`` (the ``fetch alone`` and ``model
alone`` lines are bounds, and the last line says how close the best comes to its bound).
``--json`` prints the same as JSON. Progress goes to stderr as each configuration is measured
(``--quiet``: none).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import inspect
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

FetchFun = Callable[[int, int], Any]
MAX_WORKERS = 4


@dataclass
class Result:
    """One configuration's measurement; ``error`` is set instead of a rate when it failed."""

    name: str
    kind: str                      # "fetch", "feeder", "model" or "end_to_end"
    workers: int = 0               # fetcher threads or processes (0 when not a feeder line)
    processes: bool = False
    rows: int = 0
    seconds: float = 0.0
    error: Optional[str] = None
    notes: List[str] = field(default_factory=list)

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 and self.error is None else 0.0


# ---- loading the fetch function ----------------------------------------------------------------
PRIVATE_PREFIX = "_feeder_bench_"  # module name of a file whose own name another module has


def load_fetch(spec: str) -> FetchFun:
    """``MODULE:FUN`` -> the function. MODULE is a dotted module name (imported with the current
    directory on ``sys.path``) or a path to a ``.py`` file, imported under its file name with its
    folder on ``sys.path`` so that worker processes can import it too. A file whose name another
    module has (``json.py``) is run under a private module name, which worker processes cannot
    import: what it defines is then handed on as a :class:`FileFetch`, which they can."""
    module_part, sep, fun_part = spec.rpartition(":")
    if not sep or not module_part or not fun_part:
        raise ValueError(f"expected MODULE:FETCH_FUN, got {spec!r}")
    private = False
    if module_part.endswith(".py") or os.sep in module_part or os.path.isfile(module_part):
        path = os.path.abspath(module_part)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no such file: {module_part}")
        folder, name = os.path.split(path)
        name = os.path.splitext(name)[0]
        loaded = sys.modules.get(name)
        if loaded is not None and _file_of(loaded) == path:
            module = loaded
        elif loaded is None and not _taken(name, path):
            if folder not in sys.path:
                sys.path.insert(0, folder)
            module = importlib.import_module(name)
        else:  # another module has that name: load the file under a private one, shadowing nothing
            module = _load_file(path, PRIVATE_PREFIX + name)
            private = True
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_part)
    fun = _attribute(module, fun_part)
    if not callable(fun):
        raise TypeError(f"{spec} is not callable (got {type(fun).__name__})")
    # Defined in the privately named module (a function, or an instance of a class of it): a
    # worker process could not unpickle it, so it travels as the file and the attribute's name.
    if private and module.__name__ in (getattr(fun, "__module__", None), type(fun).__module__):
        return FileFetch(path, module.__name__, fun_part, fun)
    result: FetchFun = fun
    return result


class FileFetch:
    """A fetch function defined in a ``.py`` file that runs under a private module name (see
    :func:`load_fetch`). Called, it calls that function. Pickled (for worker processes), it is
    the file's path and the attribute's name, and the worker process runs the file (under the
    same private name) at its first call: module-level code runs there again, and an object's
    state is what that code makes, as with a module imported by name."""

    def __init__(self, path: str, module_name: str, attr: str, fun: Optional[FetchFun] = None):
        self.path, self.module_name, self.attr = path, module_name, attr
        self._fun = fun

    def __call__(self, worker_id: int, batch_size: int) -> Any:
        fun = self._fun
        if fun is None:
            fun = self._fun = _attribute(_load_file(self.path, self.module_name), self.attr)
        return fun(worker_id, batch_size)

    def __getstate__(self) -> Dict[str, Any]:
        return {"path": self.path, "module_name": self.module_name, "attr": self.attr}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.path, self.module_name, self.attr = state["path"], state["module_name"], state["attr"]
        self._fun = None

    def __repr__(self) -> str:
        return f"FileFetch({self.path}:{self.attr})"


def _file_of(module: Any) -> str:
    return os.path.abspath(getattr(module, "__file__", "") or "")


def _taken(name: str, path: str) -> bool:
    """Whether importing ``name`` would find another module than the file at ``path`` (a
    standard or installed one), or cannot name a module at all."""
    if not name.isidentifier():
        return True
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return found is not None and os.path.abspath(found.origin or "") != path


def _load_file(path: str, module_name: str) -> Any:
    """Run the file at ``path`` as module ``module_name`` (once per process). Its folder goes at
    the end of ``sys.path``, for the file's own imports of its neighbours, shadowing nothing."""
    module = sys.modules.get(module_name)
    if module is not None and _file_of(module) == path:
        return module
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.append(folder)
    file_spec = importlib.util.spec_from_file_location(module_name, path)
    if file_spec is None or file_spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[module_name] = module
    try:
        file_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def _attribute(module: Any, dotted: str) -> Any:
    obj = module
    for attr in dotted.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise AttributeError(f"module {module.__name__!r} has no {dotted!r}") from None
    return obj


# ---- chunks --------------------------------------------------------------------------------------
def chunk_arrays(chunk: Any, names: Optional[Sequence[str]] = None) -> Optional[Dict[str, np.ndarray]]:
    """A chunk as {name: array}: dicts as they are, lists named ``names`` (default ``input0..``)."""
    if chunk is None:
        return None
    if isinstance(chunk, dict):
        return {str(k): np.asarray(v) for k, v in chunk.items()}
    arrays = list(chunk)
    names = list(names) if names is not None else [f"input{i}" for i in range(len(arrays))]
    if len(names) != len(arrays):
        raise ValueError(f"chunk has {len(arrays)} arrays, expected {len(names)} ({names})")
    return {n: np.asarray(a) for n, a in zip(names, arrays)}


def chunk_rows(chunk: Any) -> int:
    """Rows of a chunk along axis 0 (0 for None or an empty chunk)."""
    if chunk is None:
        return 0
    first = next(iter(chunk.values()), None) if isinstance(chunk, dict) else (chunk[0] if len(chunk) else None)
    return 0 if first is None or np.ndim(first) == 0 else int(np.shape(first)[0])


def input_names_from_chunk(chunk: Any) -> List[str]:
    if isinstance(chunk, dict):
        return [str(k) for k in chunk]
    return [f"input{i}" for i in range(len(chunk))]


def make_batches(chunks: Sequence[Dict[str, np.ndarray]], batch_size: int, limit: int = 4) -> List[Dict[str, Any]]:
    """Up to ``limit`` batches of ``batch_size`` rows cut from ``chunks`` (a shorter one if that is all)."""
    if not chunks:
        return []
    whole = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
    n = len(next(iter(whole.values())))
    starts = range(0, max(1, n - batch_size + 1), batch_size)
    return [{k: np.ascontiguousarray(v[s:s + batch_size]) for k, v in whole.items()} for s in list(starts)[:limit]]


# ---- measurements ------------------------------------------------------------------------------
def measure_fetch(fetch: FetchFun, batch_size: int, seconds: float, keep_rows: int = 0
                  ) -> Tuple[Result, List[Any]]:
    """Call ``fetch(0, batch_size)`` in this thread for ``seconds`` (after a first call).
    Returns the result and the first chunks, up to ``keep_rows`` rows (for the model)."""
    res = Result("fetch alone, 1 thread", "fetch", workers=1)
    kept: List[Any] = []
    kept_rows = 0
    start: Optional[float] = None
    try:
        first = fetch(0, batch_size)  # warm-up, not timed
        if first is not None:
            kept.append(first)
            kept_rows += chunk_rows(first)
        start = time.perf_counter()
        deadline = start + seconds
        while time.perf_counter() < deadline:
            chunk = fetch(0, batch_size)
            n = chunk_rows(chunk)
            res.rows += n
            if n and kept_rows < keep_rows:
                kept.append(chunk)
                kept_rows += n
    except StopIteration:
        res.notes.append("the fetch function raised StopIteration")
    except Exception as e:
        res.error = _describe(e)
    res.seconds = time.perf_counter() - start if start is not None else 0.0
    return res, kept


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def supports_processes() -> bool:
    """Whether the installed feeder has worker processes (``num_worker_processes``)."""
    import feeder

    return "num_worker_processes" in inspect.signature(feeder.init_data_input_workers).parameters


def config_name(workers: int, processes: bool, model: bool) -> str:
    """``"feeder, 2 threads"``, ``"feeder + model, 1 process"``: a feeder line's name."""
    unit = ("process" if processes else "thread") + ("" if workers == 1 else ("es" if processes else "s"))
    return f"{'feeder + model' if model else 'feeder'}, {workers} {unit}"


def measure_feeder(fetch: FetchFun, input_names: Sequence[str], batch_size: int, seconds: float, workers: int, *,
                   processes: bool = False, session: Any = None, timeout: float = 60.0) -> Result:
    """Run one feed for ``seconds`` after its first batch: ``next_batch()`` without a session,
    ``run()`` with one. Rows are counted from the feed's own metrics."""
    import feeder

    label = config_name(workers, processes, session is not None)
    res = Result(label, "end_to_end" if session is not None else "feeder", workers=workers, processes=processes)
    coord = feeder.GlobalCoordinator()
    counts: Dict[str, Any] = {"num_worker_processes": workers} if processes else {"num_worker_threads": workers}
    start: Optional[float] = None
    rows0 = 0.0
    try:
        feeder.init_data_input_workers(session, list(input_names), fetch, batch_size, input_source_name="bench",
                                       timeout=timeout, log_interval=3600.0, coordinator=coord, **counts)
        coord.start()
        feed = coord.feed("bench")
        take = feed.run if session is not None else feed.next_batch
        try:
            take()  # warm-up: threads started, first chunks fetched; not timed
            rows0 = feed.metrics()["rows"]
            start = time.perf_counter()
            deadline = start + seconds
            while time.perf_counter() < deadline:
                take()
        except StopIteration:
            res.notes.append("the source ended")
        if start is not None:
            res.seconds = time.perf_counter() - start
            res.rows = int(feed.metrics()["rows"] - rows0)
    except Exception as e:
        res.error = _describe(e)
    finally:
        if not coord.stop():
            res.notes.append("a fetcher did not stop in time")
    return res


def measure_model(session: Any, batches: Sequence[Dict[str, Any]], seconds: float) -> Result:
    """``session.run`` on ``batches`` (already in memory), cycled for ``seconds`` after one warm-up run."""
    res = Result("model alone, 1 intra-op thread", "model")
    if not batches:
        res.error = "no batch to run (the fetch function returned no rows)"
        return res
    try:
        session.run(None, batches[0])
        start = time.perf_counter()
        deadline = start + seconds
        i = 0
        while time.perf_counter() < deadline:
            b = batches[i % len(batches)]
            session.run(None, b)
            res.rows += chunk_rows(b)
            i += 1
        res.seconds = time.perf_counter() - start
    except Exception as e:
        res.error = _describe(e)
    return res


def make_session(model: str, provider: Optional[str] = None) -> Any:
    """The model's session, one intra-op thread, on ``provider`` ("cpu", "cuda", "cuda:N"; None:
    the GPU where onnxruntime-gpu is installed, else the CPU)."""
    import onnxruntime as ort

    from .device import default_providers, providers_for

    providers = providers_for(provider)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # leave the other cores to the fetchers (see docs/concepts.md)
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model, opts, providers=providers if providers is not None else default_providers())


def worker_counts(cpus: Optional[int] = None) -> List[int]:
    k = min(MAX_WORKERS, cpus if cpus else (os.cpu_count() or MAX_WORKERS))
    return list(range(1, max(1, k) + 1))


def run_bench(fetch: FetchFun, *, model: Optional[str] = None, batch_size: int = 64, seconds: float = 3.0,
              workers: Optional[Sequence[int]] = None, processes: Optional[bool] = None,
              progress: Optional[Callable[[str], None]] = None, provider: Optional[str] = None,
              session: Any = None) -> List[Result]:
    """Every configuration in turn (see the module docstring); returns one Result per line.
    ``provider``: where the model runs ("cpu", "cuda", "cuda:N"; None: the GPU where installed).
    ``progress(line)`` is called before each configuration (``"[3/11] feeder, 2 threads ..."``)
    and after it (its rate, or its error). ``session``: ``model``'s, already made (else made here)."""
    counts = list(workers) if workers is not None else worker_counts()
    processes = supports_processes() if processes is None else processes
    say = progress or (lambda msg: None)
    if session is None and model:
        session = make_session(model, provider)
    model_names = [i.name for i in session.get_inputs()] if session is not None else None
    configs = [(n, False) for n in counts] + ([(n, True) for n in counts] if processes else [])
    total = 1 + len(configs) + ((1 + len(configs)) if session is not None else 0)
    results: List[Result] = []

    def measured(label: str, measure: Callable[[], Result]) -> Result:
        say(f"[{len(results) + 1}/{total}] {label}, about {seconds:g} s ...")
        res = measure()
        results.append(res)
        say(f"[{len(results)}/{total}] {res.name}: "
            + (f"error: {res.error}" if res.error is not None else f"{res.rows_per_s:,.0f} rows/s"))
        return res

    kept: List[Any] = []

    def fetch_alone() -> Result:
        res, got = measure_fetch(fetch, batch_size, seconds, keep_rows=4 * batch_size)
        kept.extend(got)
        if not got:
            res.error = res.error or "the fetch function returned no chunk"
        return res

    measured("fetch alone", fetch_alone)
    if not kept:
        return results
    names = model_names or input_names_from_chunk(kept[0])
    for n, procs in configs:
        measured(config_name(n, procs, False),
                 functools.partial(measure_feeder, fetch, names, batch_size, seconds, n, processes=procs))
    if session is not None:
        def model_alone() -> Result:
            try:
                chunks = [chunk_arrays(c, names) for c in kept]
                batches = make_batches([c for c in chunks if c], batch_size)
                batches = [{k: b[k] for k in names} for b in batches]
            except Exception as e:
                return Result("model alone, 1 intra-op thread", "model", error=_describe(e))
            return measure_model(session, batches, seconds)

        measured("model alone", model_alone)
        for n, procs in configs:
            measured(config_name(n, procs, True),
                     functools.partial(measure_feeder, fetch, names, batch_size, seconds, n, processes=procs,
                                       session=session))
    return results


def best(results: Sequence[Result]) -> Optional[Result]:
    """The configuration to use: the fastest end-to-end line when a model was measured, else the
    fastest feeder line (None if none succeeded)."""
    for kind in ("end_to_end", "feeder"):
        ok = [r for r in results if r.kind == kind and r.error is None and r.rows > 0]
        if ok:
            return max(ok, key=lambda r: r.rows_per_s)
        if any(r.kind == kind for r in results):
            return None  # the model was measured and failed everywhere: no feeder-only line stands in for it
    return None


# ---- output --------------------------------------------------------------------------------------
HEADER = f"{'configuration':<36} {'rows/s':>14} {'vs best':>8}"
# What bounds each kind of line: the fetch function alone bounds the feeder lines, the model alone
# the feeder + model lines.
BOUND_OF = {"feeder": "fetch", "end_to_end": "model"}
BOUND_NAME = {"fetch": "the fetch function alone", "model": "the model alone"}
BOUND_NOTE = {"fetch": "the fetch function alone, a bound for the feeder lines",
              "model": "the model alone on batches in memory, a bound for the feeder + model lines"}


def vs_best(r: Result, b: Optional[Result]) -> Optional[float]:
    """``r``'s rate over the best line's (the one ``best`` chose), for a line of the best's kind;
    None for the others, whose rate is not a configuration's to compare (a bound, or feeding
    without the model when the model was measured)."""
    if b is None or r.error is not None or r.kind != b.kind or b.rows_per_s <= 0:
        return None
    return r.rows_per_s / b.rows_per_s


def format_table(results: Sequence[Result]) -> str:
    """One line per configuration: name (36 wide), rows/s (integer with commas), the ratio to the
    best line (``0.50x``, :func:`vs_best`; ``-`` where it does not apply) or the error; then
    ``best: <name> (<rows/s> rows/s[, <ratio>x <bound>])``: the best line is the one at 1.00x."""
    b = best(results)
    lines = [HEADER]
    for r in results:
        if r.error is not None:
            lines.append(f"{r.name:<36} {'-':>14} {'-':>8}  error: {r.error}")
            continue
        ratio = vs_best(r, b)
        notes = list(r.notes) + ([BOUND_NOTE[r.kind]] if r.kind in BOUND_NOTE else [])
        note = f"  ({'; '.join(notes)})" if notes else ""
        shown = f"{ratio:>7.2f}x" if ratio is not None else f"{'-':>8}"
        lines.append(f"{r.name:<36} {r.rows_per_s:>14,.0f} {shown}{note}")
    if b is None:
        lines.append("best: none (the model failed in every configuration: see the errors above)"
                     if any(r.kind == "end_to_end" for r in results) else "best: none (every configuration failed)")
        return "\n".join(lines)
    verdict = f"best: {b.name} ({b.rows_per_s:,.0f} rows/s"
    bound = next((r for r in results if r.kind == BOUND_OF[b.kind] and r.error is None and r.rows_per_s > 0), None)
    if bound is not None:
        verdict += f", {b.rows_per_s / bound.rows_per_s:.2f}x {BOUND_NAME[bound.kind]}"
    lines.append(verdict + ")")
    return "\n".join(lines)


def to_json(results: Sequence[Result]) -> str:
    b = best(results)
    rows = [dict(asdict(r), rows_per_s=r.rows_per_s, vs_best=vs_best(r, b)) for r in results]
    return json.dumps({"results": rows, "best": b.name if b else None}, indent=2)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="feeder bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("fetch", metavar="MODULE:FETCH_FUN", help="module name or .py file, and the fetch function")
    parser.add_argument("--model", default=None, help="an ONNX model to run end to end")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per batch (default 64)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per configuration (default 3)")
    parser.add_argument("--workers", type=int, default=None,
                        help=f"measure 1..N fetchers (default: CPU count, at most {MAX_WORKERS})")
    parser.add_argument("--provider", default=None, metavar="cpu|cuda|cuda:N",
                        help="where the model runs (default: the GPU where onnxruntime-gpu is installed, else the CPU)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    if not args.seconds > 0:
        parser.error("--seconds must be > 0")
    if args.workers is not None and args.workers < 1:
        parser.error("--workers must be >= 1")
    try:
        fetch = load_fetch(args.fetch)
    except Exception as e:
        parser.error(f"cannot load {args.fetch}: {type(e).__name__}: {e}")
    if args.provider is not None:
        from .device import providers_for

        try:
            providers_for(args.provider)
        except (ValueError, TypeError) as e:
            parser.error(f"--provider {args.provider}: {e}")
    session = None
    if args.model is not None:
        if not os.path.isfile(args.model):
            parser.error(f"--model {args.model}: no such file")
        try:
            session = make_session(args.model, args.provider)
        except Exception as e:  # not an ONNX model, or one onnxruntime cannot load
            parser.error(f"--model {args.model}: onnxruntime cannot load it: {type(e).__name__}: {e}")
    counts = worker_counts(args.workers) if args.workers else None
    # Progress on stderr (a run takes seconds per configuration, a minute in all): whether stderr is a
    # terminal or a log file, stdout keeps only the table or the JSON.
    results = run_bench(fetch, model=args.model, batch_size=args.batch_size, seconds=args.seconds, workers=counts,
                        progress=None if args.quiet else (lambda line: print(f"feeder bench {line}", file=sys.stderr,
                                                                             flush=True)),
                        provider=args.provider, session=session)
    print(to_json(results) if args.json else format_table(results))
    if not supports_processes():
        print("(worker processes: not available in this feeder version)", file=sys.stderr)
    return 0 if best(results) is not None else 1
