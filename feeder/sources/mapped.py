"""Memory-mapped arrays travel to worker processes as their file, never as their contents.

Pickling a ``np.memmap`` (or a view of one) pickles the bytes it maps: a source over a 10 GB
file would cost 10 GB in every worker process. :func:`file_region` tells where in which file
an array's elements lie, and :meth:`FileRegion.open` maps the same elements again in the
process that unpickles it, so each process reads only the pages it touches, from the page
cache every process shares.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Any, Literal, Optional, Tuple

import numpy as np


@dataclass(frozen=True)
class FileRegion:
    """Where an array's elements lie in a file: the byte offset of its first element, its dtype,
    shape and strides (bytes; negative ones too)."""

    filename: str
    offset: int
    dtype: Any
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    writable: bool = False  # mapped "r+" (writes reach the file, as in the process it came from)

    def contiguous(self) -> bool:
        """The elements lie one after the other in C order (an ``np.memmap`` can map them as they are)."""
        expected = np.dtype(self.dtype).itemsize
        for n, st in zip(reversed(self.shape), reversed(self.strides)):
            if n > 1 and st != expected:
                return False
            expected *= n
        return True

    def open(self, as_memmap: bool = False) -> np.ndarray:
        """The array, mapped from the file (only the span it covers): read-only unless ``writable``;
        with ``as_memmap``, an ``np.memmap`` where its elements are contiguous (``flush()`` works)."""
        dt = np.dtype(self.dtype)
        mode: Literal["r+", "r"] = "r+" if self.writable else "r"
        if as_memmap and self.contiguous():
            mapped: np.ndarray = np.memmap(self.filename, dtype=dt, mode=mode, offset=self.offset, shape=self.shape)
            return mapped
        low = sum((n - 1) * s for n, s in zip(self.shape, self.strides) if s < 0)
        high = sum((n - 1) * s for n, s in zip(self.shape, self.strides) if s > 0) + dt.itemsize
        span = np.memmap(self.filename, dtype=np.uint8, mode=mode, offset=self.offset + low, shape=(high - low,))
        out: np.ndarray = np.ndarray(self.shape, dtype=dt, buffer=span, offset=-low, strides=self.strides)
        return out


def file_region(a: np.ndarray, keep_mode: bool = False) -> Optional[FileRegion]:
    """The file region of ``a`` when its memory is a shared mapping of a file that still exists
    (a ``np.memmap``, ``np.load(..., mmap_mode="r")``, a view or slice of one, or an array whose
    ``.base`` chain leads to one); None otherwise, and for copy-on-write mappings (``mode="c"``),
    whose changes are not in the file. ``keep_mode``: a writable ``a`` of a writable mapping
    stays writable where it is opened again (else it is opened read-only)."""
    if a.size == 0 or a.dtype.hasobject:
        return None
    root: Any = a
    while isinstance(root, np.ndarray) and not (isinstance(root, np.memmap) and isinstance(root.base, mmap.mmap)):
        root = root.base
    if not isinstance(root, np.memmap) or root.mode == "c" or not root.filename:
        return None
    filename = os.fspath(root.filename)
    if not os.path.isfile(filename):
        return None
    # root's first byte is at root.offset of the file; a's data pointer is that far from root's.
    offset = int(root.offset) + (a.__array_interface__["data"][0] - root.__array_interface__["data"][0])
    writable = keep_mode and root.mode in ("r+", "w+") and a.flags.writeable
    return FileRegion(filename, offset, a.dtype, tuple(a.shape), tuple(a.strides), writable)
