"""A CPU-heavy pure-Python fetch function for benchmarks/compare.py's worker-process scenario.

Per-row token counting over short texts: each row is a text of a few words; its character
trigrams are counted in a dict (pure Python, holding the GIL) and hashed into 1024 buckets,
giving 1024 float32 features per row. About 1 ms per 32 rows on this project's machine.
Module-level and picklable, so worker processes can run it.
"""
from __future__ import annotations

import random
import zlib
from typing import List

import numpy as np

WORDS = ("data feeder batch tensor model queue thread process shared memory ring slot worker session "
         "input output python numpy onnx runtime token count text short long fast slow").split()


class TokenFetch:
    def __init__(self, rows: int = 32, width: int = 1024, words: int = 12, texts: int = 4096, seed: int = 0):
        rng = random.Random(seed)
        self.rows, self.width = rows, width
        self.texts: List[str] = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(texts)]
        self.buckets = {}  # trigram -> bucket, filled as trigrams are met (per process)
        self.rows_per_fetch = rows

    def __call__(self, worker_id: int, batch_size: int):
        out = np.zeros((self.rows, self.width), np.float32)
        texts, buckets, width = self.texts, self.buckets, self.width
        start = random.randrange(len(texts) - self.rows)
        for r in range(self.rows):
            t = texts[start + r]
            counts = {}
            for i in range(len(t) - 2):
                g = t[i:i + 3]
                counts[g] = counts.get(g, 0) + 1
            row = out[r]
            for g, n in counts.items():
                b = buckets.get(g)
                if b is None:
                    b = buckets[g] = zlib.crc32(g.encode()) % width
                row[b] += n
        return [out]
