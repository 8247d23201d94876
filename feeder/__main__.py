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

        return predictcli.main(args[1:])
    from . import bench

    return bench.main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
