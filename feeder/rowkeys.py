"""The row-key ledger's old import path: it lives in :mod:`feeder.sources.rowkeys` (row keys are the
resume protocol of the sources). Kept because the tests import ``feeder.rowkeys``; a constant
patched here would not reach the ledger: patch ``feeder.sources.rowkeys``."""
from __future__ import annotations

from .sources.rowkeys import (
    COMPACT_KEYS,
    SETTLE_RUN,
    KeyLedger,
    merge_ranges,
    one_run,
    public_names,
    source_state,
    split_keys,
    with_row_keys,
)

__all__ = ["COMPACT_KEYS", "SETTLE_RUN", "KeyLedger", "merge_ranges", "one_run", "public_names", "source_state",
           "split_keys", "with_row_keys"]
