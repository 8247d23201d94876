"""``feeder predict``: the command line of :func:`feeder.predict`.

Usage::

    feeder predict MODEL DATA OUTPUT [--batch-size N] [--outputs a,b] [--keep id] [--processes N]
                   [--threads N] [--replicas N] [--rows-per-file N] [--provider cpu|cuda|cuda:N]
                   [--overwrite] [--no-progress]

DATA is a Parquet file or folder, read with a ``ParquetSource`` whose columns are the model's
inputs plus the kept ones (columns named like them). Prints one line: rows written, rows computed,
seconds, rows/s. Exit status 0 on success, 2 for bad arguments or a refused output (the message
says why), 1 for a failure while running, 130 on Ctrl-C (the output stays resumable).
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence


def _split(values: Optional[Sequence[str]]) -> List[str]:
    """``--keep a,b --keep c`` -> [a, b, c]."""
    return [n.strip() for v in values or () for n in v.split(",") if n.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="feeder predict",
                                description="Run an ONNX model over a Parquet table into a Parquet dataset, every row "
                                            "exactly once; run it again after a crash to continue.")
    p.add_argument("model", help="ONNX model file")
    p.add_argument("data", help="Parquet file or folder (columns named like the model's inputs and the kept ones)")
    p.add_argument("output", help="output folder (part-*.parquet files and the state)")
    p.add_argument("--batch-size", type=int, default=256, help="rows per model run (default 256)")
    p.add_argument("--outputs", action="append", help="model outputs to write, comma-separated (default: all)")
    p.add_argument("--keep", action="append", help="input columns to write beside the outputs, comma-separated")
    p.add_argument("--processes", type=int, default=0, help="worker processes per replica reading the data "
                                                            "(default 0: threads)")
    p.add_argument("--threads", type=int, default=2, help="fetcher threads per replica (default 2)")
    p.add_argument("--replicas", type=int, default=None, help="threads running the model (default: one per core)")
    p.add_argument("--rows-per-file", type=int, default=262_144, help="rows per part file (default 262144)")
    p.add_argument("--provider", default=None, metavar="cpu|cuda|cuda:N",
                   help="where the model runs (default: the GPU where onnxruntime-gpu is installed, else the CPU)")
    p.add_argument("--overwrite", action="store_true", help="start afresh on an output of another model or data")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: one when stderr is a "
                                                             "terminal)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    import feeder
    from feeder.sources import ParquetSource

    outputs = _split(args.outputs) or None
    try:
        source = ParquetSource(args.data)
        result = feeder.predict(args.model, source, args.output, batch_size=args.batch_size, outputs=outputs,
                                keep=_split(args.keep), replicas=args.replicas, num_worker_threads=args.threads,
                                num_worker_processes=args.processes, rows_per_file=args.rows_per_file,
                                overwrite=args.overwrite, progress=False if args.no_progress else None,
                                providers=args.provider)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
        print(f"feeder predict: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("feeder predict: interrupted; run the same command again to continue", file=sys.stderr)
        return 130
    print(f"{result.rows} rows written, {result.rows_computed} computed, {result.seconds:.2f} s, "
          f"{result.rows_per_s:.0f} rows/s")
    return 0
