"""``python -m feeder bench|predict ...`` and the ``feeder`` console script."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

COMMANDS = {"bench": "measure a fetch function and a model; print the best configuration",
            "predict": "run an ONNX model over a Parquet table into a Parquet dataset, exactly once"}


def parser() -> argparse.ArgumentParser:
    """The top level: ``--version``, ``--help`` and the command; each command parses its own
    arguments (``feeder bench --help``, ``feeder predict --help``)."""
    from . import __version__

    p = argparse.ArgumentParser(
        prog="feeder", usage="feeder [-h] [--version] {" + ",".join(COMMANDS) + "} ...",
        description="feeder's command line: keep ONNX Runtime busy, measure, score tables.",
        epilog="commands:\n" + "".join(f"  {k:<8} {v}\n" for k, v in COMMANDS.items())
        + "\nRun 'feeder COMMAND --help' for a command's arguments.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"feeder {__version__}")
    p.add_argument("command", choices=list(COMMANDS), metavar="COMMAND",
                   help="one of: " + ", ".join(COMMANDS))
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args: List[str] = list(sys.argv[1:] if argv is None else argv)
    # An unknown command is argparse's "invalid choice" (exit 2); none at all, its usage (exit 2);
    # --version and --help exit 0 from here.
    parsed = parser().parse_args(args[:1])  # the command alone: what follows is the command's own
    rest = args[1:]
    if parsed.command == "predict":
        from .scoring import cli as predictcli

        return _exit(predictcli.main(rest))
    from . import bench

    return bench.main(rest)


def _exit(status: int) -> int:
    """``status``, or, when a failed or interrupted command leaves feeder threads stuck in calls
    to a store that stopped answering, the end of the process now with it (its output flushed):
    otherwise the interpreter's exit would wait for those calls (pyarrow's S3 client finishes its
    requests when it shuts down)."""
    import threading

    if status != 0 and any(t.is_alive() and t.name.startswith("feeder:") for t in threading.enumerate()):
        import logging
        import os

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
