"""``feeder predict``: the command line of :func:`feeder.predict`.

Usage::

    feeder predict MODEL DATA OUTPUT [--batch-size N] [--outputs a,b] [--keep id] [--processes N]
                   [--threads N] [--replicas N] [--rows-per-file N] [--cast] [--columns X=f0,f1]
                   [--squeeze] [--order] [--identity content] [--shard env|RANK/WORLD]
                   [--provider cpu|cuda|cuda:N] [--s3-endpoint URL] [--overwrite] [--no-progress]

DATA is a Parquet file or folder, read with a ``ParquetSource`` whose columns are the model's
inputs plus the kept ones (columns named like them, unless ``--columns`` maps an input to a
column or stacks scalar columns into it: ``X=f0,f1,f2`` or ``X=f*``). DATA and OUTPUT are local
paths or URIs (``s3://bucket/prefix``, ``gs://...``, ``file://...``, fsspec URIs);
``--s3-endpoint URL`` sends ``s3://`` ones to an S3-compatible server (MinIO, a local test
server), as ``AWS_ENDPOINT_URL`` does; credentials come from the environment. Prints one line:
rows written, rows computed, seconds, rows/s. Exit status 0 on success; 2 for a refusal (bad
arguments, a model or data file that cannot be read, an output that is refused or cannot be
written, a full disk, access denied, a missing bucket), one line on stderr in the command line's
terms; 1 for a failure while running or a store that failed transiently (time-outs, throttling,
5xx answers, after feeder's retries) and for a call stopped because another took its output
over (the output stays resumable); 130 on Ctrl-C (the output stays resumable): a second Ctrl-C
ends the process at once, without waiting for the cleanup.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union


def _split(values: Optional[Sequence[str]]) -> List[str]:
    """``--keep a,b --keep c`` -> [a, b, c]."""
    return [n.strip() for v in values or () for n in v.split(",") if n.strip()]


def _count(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value
    parse.__name__ = f"int >= {least}"
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="feeder predict",
                                description="Run an ONNX model over a Parquet table into a Parquet dataset, every row "
                                            "exactly once; run it again after a crash to continue. The output is "
                                            "complete when it holds _SUCCESS.")
    p.add_argument("model", help="ONNX model file")
    p.add_argument("data", help="Parquet file or folder, a local path or a URI (s3://bucket/prefix, gs://..., "
                                "file://...); columns named like the model's inputs and the kept ones")
    p.add_argument("output", help="output folder, a local path or a URI (part-*.parquet files, the state or, in an "
                                  "object store, _manifest.json, and _SUCCESS once complete); not inside DATA")
    p.add_argument("--batch-size", type=_count(1), default=256, help="rows per model run (default 256)")
    p.add_argument("--outputs", action="append", help="model outputs to write, comma-separated (default: all)")
    p.add_argument("--keep", action="append", help="input columns to write beside the outputs, comma-separated")
    p.add_argument("--processes", type=_count(0), default=0, help="worker processes per replica reading the data "
                                                                  "(default 0: threads)")
    p.add_argument("--threads", type=_count(1), default=2, help="fetcher threads per replica (default 2)")
    p.add_argument("--replicas", type=_count(1), default=None, help="threads running the model (default: one per "
                                                                    "core)")
    p.add_argument("--rows-per-file", type=_count(1), default=262_144, help="rows per part file (default 262144)")
    p.add_argument("--cast", action="store_true", help="convert columns to the model's input types where that is "
                                                       "safe (float64 to float32, int64 to int32 when the values fit)")
    p.add_argument("--columns", action="append", metavar="INPUT=COLUMNS",
                   help="feed a model input from other columns: INPUT=name (one column of another name), or "
                        "INPUT=a,b,c or INPUT=f* (scalar columns stacked into one [N, k] input, a pattern in the "
                        "file's column order); repeat it for several inputs")
    p.add_argument("--squeeze", action="store_true", help="write an output of shape [N, 1] as a plain column")
    p.add_argument("--order", action="store_true", help="write the rows in the order of the input files (the "
                                                        "replicas still run side by side)")
    p.add_argument("--identity", choices=("metadata", "content"), default="metadata",
                   help="how an input file is known again when a run continues: metadata (default: size, "
                        "modification time and footer) or content (a SHA-256 of its bytes, read whole: for data "
                        "copied between machines)")
    p.add_argument("--provider", default=None, metavar="cpu|cuda|cuda:N",
                   help="where the model runs (default: the GPU where onnxruntime-gpu is installed, else the CPU)")
    p.add_argument("--shard", default=None, metavar="env|RANK/WORLD",
                   help="read this rank's part of the data only: 'env' (RANK and WORLD_SIZE from the environment, "
                        "as torchrun sets them) or RANK/WORLD; each rank writes OUTPUT with {rank} and {world} filled "
                        "in, or OUTPUT/rank-RRRRR-of-WWWWW")
    p.add_argument("--s3-endpoint", metavar="URL", default=None,
                   help="the S3-compatible server of s3:// DATA and OUTPUT, such as http://127.0.0.1:9000 (default: "
                        "AWS_ENDPOINT_URL, else AWS itself); credentials from the environment (AWS_ACCESS_KEY_ID, "
                        "AWS_SECRET_ACCESS_KEY, AWS_PROFILE)")
    p.add_argument("--overwrite", action="store_true", help="start afresh on an output of another model or data")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: one when stderr is a "
                                                             "terminal)")
    return p


def _names(match: "re.Match[str]") -> str:
    """``['a', 'b']`` -> ``a,b``."""
    return ",".join(re.findall(r"'([^']*)'", match.group(1)))


# How feeder.predict's messages name its keyword arguments -> the options of this command.
_CLI_TERMS: List[Tuple[str, Union[str, Callable[["re.Match[str]"], str]]]] = [
    (r"\boverwrite=True", "--overwrite"),
    (r"\bbatch_size=(\d+)", r"--batch-size \1"),
    (r"\bbatch_size\b", "--batch-size"),
    (r"\brows_per_file\b", "--rows-per-file"),
    (r"\bnum_worker_processes\b", "--processes"),
    (r"\bnum_worker_threads\b", "--threads"),
    (r"\breplicas=(\d+)", r"--replicas \1"),
    (r"\bcast=True", "--cast"),
    (r"\bordered=True", "--order"),
    (r"\bsqueeze=True", "--squeeze"),
    (r"\bidentity=['\"](\w+)['\"]", r"--identity \1"),
    (r",? or pass filesystem=", ""),  # a Python caller's way out; the command line has --s3-endpoint for S3
    (r"\b(?:keep|outputs)=(\[[^\]]*\])", lambda m: f"--{m.group(0).split('=')[0]} {_names(m)}"),
    (r"\b(keep|outputs)=", r"--\1"),
    (r"\bfeeder\.predict(?![/\w])", "feeder predict"),
]


def cli_terms(message: str) -> str:
    """A message of :func:`feeder.predict` in this command's terms (``--overwrite``, not
    ``overwrite=True``), on one line."""
    text = " ".join(message.split())
    for pattern, repl in _CLI_TERMS:
        text = re.sub(pattern, repl, text)
    return text


def parse_columns(values: Optional[Sequence[str]]) -> Dict[str, Union[str, List[str]]]:
    """``--columns X=f0,f1 --columns id=key`` -> ``{"X": ["f0", "f1"], "id": "key"}``: one name
    without a pattern is one column, several names (or a pattern) a stacked input."""
    out: Dict[str, Union[str, List[str]]] = {}
    for value in values or ():
        name, sep, cols = value.partition("=")
        names = [c.strip() for c in cols.split(",") if c.strip()]
        if not sep or not name.strip() or not names:
            raise ValueError(f"--columns takes INPUT=COLUMN[,COLUMN...] (or INPUT=PATTERN), got {value!r}")
        name = name.strip()
        if name in out:
            raise ValueError(f"--columns names input {name!r} twice")
        single = len(names) == 1 and not any(c in names[0] for c in "*?[")
        out[name] = names[0] if single else names
    return out


def _transient(e: BaseException) -> bool:
    """Whether ``e`` or what caused it is a store's transient failure (left after the retries)."""
    from feeder.storage import is_transient

    seen = 0
    cause: Optional[BaseException] = e
    while cause is not None and seen < 8:
        if is_transient(cause):
            return True
        cause, seen = cause.__cause__, seen + 1
    return False


def _exit_status(e: BaseException) -> Optional[int]:
    """2 for a refusal, 1 for a failure while running (a store's transient failure included, and
    a call whose output another took over), None for a bug (its traceback is shown)."""
    from feeder.errors import FeederError, FetchError
    from feeder.scoring.storeout import OutputTakenOver

    if isinstance(e, OutputTakenOver) or _transient(e):
        return 1
    if isinstance(e, (ValueError, TypeError, OSError, ImportError)):
        return 2
    if isinstance(e, FeederError):
        # Writing the output failed for a reason the user must fix (a full disk, a folder made
        # read-only): a refusal, like the same error at the start.
        return 2 if isinstance(e.__cause__, OSError) and not isinstance(e, FetchError) else 1
    return None


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    text = str(e)
    cause = e.__cause__
    if cause is not None and str(cause) and str(cause) not in text and not getattr(e, "feeder_plain", False):
        text += f" ({type(cause).__name__}: {cause})"
    return text


def _message(e: BaseException, status: int) -> str:
    """The one line on stderr: ``feeder predict: error|failed|stopped: ...`` in the command's
    terms, saying once that it is feeder predict, and what to do next."""
    from feeder.errors import FeederError
    from feeder.scoring.storeout import OutputTakenOver

    text = cli_terms(_describe(e))
    text = re.sub(r"(^|(?<=: ))feeder predict: ", "", text)  # said once, at the start of the line
    if isinstance(e, OutputTakenOver):
        return f"feeder predict: stopped: {text}"
    if _transient(e):
        return (f"feeder predict: failed: {text}; the store failed transiently (time-outs, throttling or 5xx answers, "
                f"after feeder's retries): the output keeps what was committed: run the same command again to "
                f"continue once the store answers")
    # Stopped while running (not refused at the start): what was committed stays.
    running = isinstance(e, FeederError) and not isinstance(e, ValueError)
    again = "; the output keeps what was committed: run the same command again to continue" if running else ""
    return f"feeder predict: {'error' if status == 2 else 'failed'}: {text}{again}"


class _Interrupts:
    """Ctrl-C: the first raises KeyboardInterrupt (the call cleans up: its part dropped, its lease
    deleted, within a few seconds); a second one while that runs ends the process at once."""

    def __init__(self) -> None:
        self.pressed = False
        self.previous: Any = None

    def __enter__(self) -> "_Interrupts":
        try:
            self.previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: Python's own handling
            self.previous = None
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.pressed:
            os.write(2, b"feeder predict: interrupted again; exiting without waiting for the cleanup "
                        b"(the output keeps what was committed)\n")
            os._exit(130)
        self.pressed = True
        raise KeyboardInterrupt

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _shard(text: Optional[str]) -> Any:
    """``--shard``: None, "env", or "RANK/WORLD" as (rank, world); ValueError in the CLI's words."""
    if text is None or text == "env":
        return text
    rank, _, world = text.partition("/")
    try:
        return int(rank), int(world)
    except ValueError:
        raise ValueError(f"--shard must be 'env' or RANK/WORLD (e.g. 3/8), got {text!r}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    with _Interrupts():
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    import feeder
    from feeder.sources import ParquetSource

    outputs = _split(args.outputs) or None
    keep = _split(args.keep)
    try:
        data_fs = output_fs = None
        if args.s3_endpoint is not None:
            from feeder.storage import s3_store, split_uri

            s3 = s3_store(args.s3_endpoint)
            data_fs = s3 if split_uri(args.data)[0] == "s3" else None
            output_fs = s3 if split_uri(args.output)[0] == "s3" else None
        model: Any = args.model
        providers: Any = args.provider
        columns = parse_columns(args.columns)
        if columns:
            # The source maps every input it feeds: the model's (known once it is loaded, here, once)
            # and the kept ones, named like their columns unless --columns says otherwise.
            from feeder.scoring.plan import _open_model

            model, _ = _open_model(args.model, providers)
            providers = None  # the session runs where it was made
            unknown = [n for n in columns if n not in [i.name for i in model.get_inputs()] + keep]
            if unknown:
                raise ValueError(f"--columns names {unknown}, which are neither inputs of the model "
                                 f"({[i.name for i in model.get_inputs()]}) nor kept")
            columns = {**{n: n for n in [i.name for i in model.get_inputs()] + keep}, **columns}
        source = ParquetSource(args.data, columns=columns or None, identity=args.identity, filesystem=data_fs,
                               shard=_shard(args.shard))
        result = feeder.predict(model, source, args.output, batch_size=args.batch_size, outputs=outputs,
                                keep=keep, replicas=args.replicas, num_worker_threads=args.threads,
                                num_worker_processes=args.processes, rows_per_file=args.rows_per_file,
                                cast=args.cast, ordered=args.order, squeeze=args.squeeze, overwrite=args.overwrite,
                                filesystem=output_fs, progress=False if args.no_progress else None,
                                providers=providers)
    except KeyboardInterrupt:
        print("feeder predict: interrupted; run the same command again to continue", file=sys.stderr)
        return 130
    except Exception as e:
        status = _exit_status(e)
        if status is None:
            raise
        print(_message(e, status), file=sys.stderr)
        return status
    print(f"{result.rows} rows written, {result.rows_computed} computed, {result.seconds:.2f} s, "
          f"{result.rows_per_s:.0f} rows/s")
    return 0
