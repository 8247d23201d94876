"""``python -m feeder bench|predict ...`` and the ``feeder`` console script."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

COMMANDS = {"bench": "measure a fetch function and a model; print the best configuration",
            "predict": "run an ONNX model over a Parquet table into a Parquet dataset, exactly once"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        usage = "usage: feeder COMMAND ...\n\ncommands:\n" + "".join(f"  {k:<8} {v}\n" for k, v in COMMANDS.items())
        print(usage, file=sys.stdout if args and args[0] in ("-h", "--help") else sys.stderr, end="")
        return 0 if args and args[0] in ("-h", "--help") else 2
    if args[0] == "predict":
        from .scoring import cli as predictcli

        return _exit(predictcli.main(args[1:]))
    from . import bench

    return bench.main(args[1:])


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
