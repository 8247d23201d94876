"""Padding and length windows (issue 29): padded positions, copies per byte, model-bound rows/s.

Rows of token ids whose lengths follow a long-tailed distribution (log-normal, median 48 tokens,
cut to 1-512), in chunks of 32 rows, batches of 64:

1. *padded positions*: the PadRebatcher alone, plain padding against ``length_window=1024``
   (and 256, 4096), and the bytes it copies per byte of the rows (1.00: each row written once);
2. *cost of padding*: microseconds per batch of the PadRebatcher against the one copy of the
   same rows that a plain rebatch would make (``np.concatenate`` of the rows, no padding), and
   against concatenate-then-pad (the two copies padding must not make);
3. *model-bound rows/s*: the example's model (examples/text_classification.py: a masked
   self-attention block of width 32 beside a bag of tokens, one intra-op thread) fed by two
   fetcher threads through ``feed.run()``, plain padding against ``length_window=1024``, the two
   contenders alternated ``--rounds`` times (the machine is shared: ratios per round).

Run:  python benchmarks/padding.py [--rows 16384] [--rounds 3] [--json benchmarks/results/padding.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import feeder  # noqa: E402
from feeder.padding import ByteRing, PadInput, PadRebatcher  # noqa: E402
from feeder.ragged import Ragged  # noqa: E402

BATCH, CHUNK, VOCAB, CLASSES = 64, 32, 4000, 8


def lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(48), 1.0, n)), 1, 512).astype(np.int64)


def chunks(lens: np.ndarray, seed: int = 1) -> List[List[Any]]:
    """Chunks of CHUNK rows: token ids as values + offsets (what a Parquet list column gives), row ids."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(0, len(lens), CHUNK):
        part = lens[i:i + CHUNK]
        values = rng.integers(2, VOCAB, int(part.sum()), dtype=np.int64)
        out.append([Ragged(values, np.concatenate([[0], np.cumsum(part)])), np.arange(i, i + len(part))])
    return out


def rebatch(data: List[List[Any]], window: Optional[int]) -> Dict[str, Any]:
    rb = PadRebatcher(BATCH, [0, 0], [PadInput(0, "input_ids", 0, (None,), "attention_mask", np.dtype(np.int64))],
                      window=window, ring=ByteRing(4))
    batches = 0
    t0 = time.perf_counter()
    for c in data:
        rb.add(c)
        while rb.pop() is not None:
            batches += 1
    rb.end_of_data()
    while rb.pop() is not None:
        batches += 1
    batches += rb.flush() is not None
    seconds = time.perf_counter() - t0
    source = sum(c[0].nbytes + c[1].nbytes for c in data)
    return {"window": window, "padded_positions": rb.padded_elements, "real_positions": rb.real_elements,
            "padded_share": rb.padded_elements / (rb.padded_elements + rb.real_elements),
            "copies_per_byte": rb.copied_bytes / source, "us_per_batch": seconds / batches * 1e6}


def copy_costs(data: List[List[Any]], repeat: int = 3) -> Dict[str, float]:
    """us per batch of 64 rows: one plain copy of the rows; concatenate-then-pad; the PadRebatcher."""
    rows = [[c[0].row(i) for i in range(len(c[1]))] for c in data]
    flat = [r for part in rows for r in part]
    groups = [flat[i:i + BATCH] for i in range(0, len(flat) - BATCH + 1, BATCH)]

    def best(fn: Any) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times) / len(groups) * 1e6

    def one_copy() -> None:
        for g in groups:
            np.concatenate(g)

    def concat_then_pad() -> None:
        for g in groups:
            values = np.concatenate(g)
            lens = np.array([len(r) for r in g])
            out = np.zeros((len(g), int(lens.max())), np.int64)
            mask = np.arange(out.shape[1]) < lens[:, None]
            out[mask] = values

    def padder() -> None:
        rb = PadRebatcher(BATCH, [0], [PadInput(0, "input_ids", 0, (None,), "attention_mask", np.dtype(np.int64))],
                          ring=ByteRing(4))
        for g in groups:
            rb.add([Ragged.from_rows(g)])
            rb.pop()

    def padder_ragged() -> None:
        rb = PadRebatcher(BATCH, [0, 0], [PadInput(0, "input_ids", 0, (None,), "attention_mask", np.dtype(np.int64))],
                          ring=ByteRing(4))
        for c in data:
            rb.add(c)
            while rb.pop() is not None:
                pass

    return {"one_copy_us": best(one_copy), "concat_then_pad_us": best(concat_then_pad),
            "pad_rows_list_us": best(padder), "pad_values_offsets_us": best(padder_ragged)}


class Tokens:
    """Fetch function: the next CHUNK rows of token ids, as a list of arrays (one per row)."""

    def __init__(self, data: List[List[Any]]):
        self.data = data
        self._next = 0
        self._lock = threading.Lock()

    def __call__(self, worker_id: int, batch_size: int) -> Dict[str, Any]:
        with self._lock:
            i = self._next
            if i >= len(self.data):
                raise StopIteration
            self._next += 1
        ragged, ids = self.data[i]
        return {"input_ids": list(ragged), "row": ids}


def model_bound(session: Any, data: List[List[Any]], window: Optional[int]) -> float:
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(session, None, Tokens(data), BATCH, num_worker_threads=2, coordinator=coord,
                                   pad={"input_ids": 0}, pad_to_multiple_of=8, length_window=window)
    rows = 0
    t0 = time.perf_counter()
    with coord:
        feed = coord.feed("train")
        while True:
            try:
                rows += len(feed.run()[2])
            except StopIteration:
                break
    return rows / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16384, help="rows of the synthetic corpus")
    parser.add_argument("--model-rows", type=int, default=4096, help="rows scored per model-bound run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results there")
    args = parser.parse_args()

    lens = lengths(args.rows)
    data = chunks(lens)
    result: Dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/padding.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, shared with other jobs",
        "python": platform.python_version(), "numpy": np.__version__,
        "lengths": {"distribution": "log-normal, median 48, sigma 1.0, cut to 1-512", "rows": args.rows,
                    "mean": float(lens.mean()), "p50": float(np.median(lens)), "p99": float(np.percentile(lens, 99)),
                    "max": int(lens.max())},
        "batch_size": BATCH, "chunk_rows": CHUNK,
    }
    plain = rebatch(data, None)
    windows = [rebatch(data, w) for w in (256, 1024, 4096)]
    result["padding"] = [plain] + windows
    for w in windows:
        w["fewer_padded_positions_x"] = plain["padded_positions"] / w["padded_positions"]
    for r in result["padding"]:
        print(f"window {str(r['window']):>5}: padded {r['padded_share']:6.1%} of positions "
              f"({r['padded_positions']:,}), {r.get('fewer_padded_positions_x', 1.0):5.1f}x fewer than plain, "
              f"{r['copies_per_byte']:.2f} copies per byte, {r['us_per_batch']:.0f} us per batch")
    result["copy_costs"] = copy_costs(data)
    print("us per batch of 64 rows:", {k: round(v, 1) for k, v in result["copy_costs"].items()})

    import onnxruntime as ort
    import text_classification as tc

    rng = np.random.default_rng(2)
    loglik = rng.standard_normal((VOCAB, CLASSES)).astype(np.float32)
    prior = np.zeros(CLASSES, np.float32)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(tc.build_model(loglik, prior), opts, providers=["CPUExecutionProvider"])
    model_data = chunks(lengths(args.model_rows, seed=3), seed=4)
    rounds = []
    for k in range(args.rounds):  # alternate the contenders: the machine's load moves
        order = [None, 1024] if k % 2 == 0 else [1024, None]
        got = {str(w): model_bound(session, model_data, w) for w in order}
        got["ratio"] = got["1024"] / got["None"]
        rounds.append(got)
        print(f"round {k + 1}: plain padding {got['None']:,.0f} rows/s, length_window=1024 {got['1024']:,.0f} "
              f"rows/s: {got['ratio']:.2f}x")
    result["model_bound"] = {"model": "examples/text_classification.py build_model (attention width 32, one "
                                      "intra-op thread), 2 fetcher threads, pad_to_multiple_of=8",
                             "rows": args.model_rows, "rounds": rounds,
                             "median_ratio": float(np.median([r["ratio"] for r in rounds]))}
    print(f"model-bound rows/s, length_window=1024 / plain: median {result['model_bound']['median_ratio']:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
