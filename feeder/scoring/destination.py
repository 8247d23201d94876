"""Where a call writes: its rank's output folder (:func:`rank_output`), local or in a store
(:func:`_output`), never inside the folder a ``ParquetSource`` reads (:func:`_refuse_output_in_input`)."""
from __future__ import annotations

import os
from typing import Any

from ..sources.sharded import ShardedSource
from .outputdir import STATE_NAME, OutputDir
from .partwriter import Output
from .plan import _wrapped
from .storeout import StoreOutput


def rank_output(output: Any, source: Any) -> Any:
    """The output folder of this call: ``output`` itself, or for a source sharded between ranks
    (``shard=``), the rank's own: ``output`` with ``{rank}`` and ``{world}`` filled in, or else
    (no ``{rank}`` in it) ``output`` with ``{world}`` filled in, then ``/rank-RRRRR-of-WWWWW``
    (so that ranks never write one folder, and the parent folder reads as one dataset of every
    rank's parts). Unsharded, ``{rank}`` and ``{world}`` are 0 and 1."""
    source = _wrapped(source)  # a map or filter of a sharded source is sharded the same way
    shard = getattr(source, "shard", None)
    if not isinstance(source, ShardedSource) or shard is None or shard[1] < 2:
        # unsharded: rank 0 of 1 (so that one script serves both), never a folder named "{rank}"
        if isinstance(output, (str, os.PathLike)) and ("{rank}" in os.fspath(output) or
                                                      "{world}" in os.fspath(output)):
            return os.fspath(output).replace("{rank}", "0").replace("{world}", "1")
        return output
    given = os.fspath(output)
    rank, world = shard
    path = given.replace("{rank}", str(rank)).replace("{world}", str(world))
    if "{rank}" in given:
        return path
    if "://" not in path and os.path.exists(os.path.join(path, STATE_NAME)):  # (a local output, that is)
        raise ValueError(f"output {path!r} is itself an output of feeder.predict, and this call's source is rank "
                         f"{rank} of {world}, whose output would go inside it: pass the folder that holds the ranks' "
                         f"outputs, or put {{rank}} in the output path")
    return path.rstrip("/") + f"/rank-{rank:05d}-of-{world:05d}"


def _output(output: Any, filesystem: Any) -> Output:
    """The output folder: a local directory (``OutputDir``: temporary names, fsync and rename), or a
    prefix in a store (``StoreOutput``: unique part names, committed by a manifest)."""
    from ..storage import resolve

    store, path = resolve(output, filesystem)
    if store.local:
        return OutputDir(path)
    return StoreOutput(store, path)  # type: ignore[arg-type]


def _refuse_output_in_input(source: Any, out: Output) -> None:
    """ValueError when the output folder is inside (or is) a folder a ``ParquetSource`` reads, or
    holds one of its files: the output's parts are Parquet files, so the next call's source would
    read them as input (and this output would hold files that are not ours). Objects are compared
    by their URIs."""
    from ..sources.parquet import ParquetSource

    source = _wrapped(source)
    if not isinstance(source, ParquetSource):
        return
    local = isinstance(out, OutputDir)
    outside = os.path.realpath(out.path) if local else out.path.rstrip("/")
    sep = os.sep if local else "/"
    for root in source.roots:
        if _is_uri(root) == local:
            continue
        real = os.path.realpath(root) if local else root.rstrip("/")
        if (not local or os.path.isdir(real)) and (outside == real or outside.startswith(real + sep)):
            raise ValueError(f"output {out.path!r} is inside the input folder {root!r}: the next call would "
                             f"read the output's part files as input; choose an output folder outside it")
    for path, _ in source.files:
        if _is_uri(path) == local:
            continue
        if (os.path.realpath(path) if local else path).startswith(outside + sep):
            raise ValueError(f"input file {path!r} is inside the output folder {out.path!r}; choose an output "
                             f"folder that holds no input")


def _is_uri(path: str) -> bool:
    from ..storage import split_uri

    return split_uri(path)[0] is not None
