"""Ready-made sources: picklable fetch functions that shard, shuffle, repeat and resume exactly.

``from feeder.sources import ArraySource, ParquetSource, RayDataSource`` works without the
optional extras: each source module is imported on first use, and a source whose extra is
missing raises ImportError naming what to install when it is created. How feeder tells a
source which worker calls it (the binding protocol) is described in :mod:`feeder.sources.base`,
which also lists the package's modules in the order they import each other.
"""
from __future__ import annotations

import importlib
from typing import Any

from .base import ROW_KEY, SKIP, SourceBinding
from .sharded import ShardedSource
from .sharding import merge_states

_LAZY = {"ArraySource": ".arrays", "ParquetSource": ".parquet", "RayDataSource": ".ray",
         "TransformedSource": ".transform"}

__all__ = ["ArraySource", "ParquetSource", "RayDataSource", "ROW_KEY", "SKIP", "ShardedSource", "SourceBinding",
           "TransformedSource", "merge_states"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
