"""Text classification on text that ships with Python, fed with pad= and length_window=.

Each docstring of a few standard-library packages (asyncio, email, http, ...) is a row, labelled
by its package. A WordPiece tokenizer is trained here on the training docstrings (the
``tokenizers`` package; nothing is downloaded), a bag-of-tokens classifier is fitted by counting
(multinomial naive Bayes: one embedding row of log-likelihoods per token), and the ONNX model is
built with onnx.helper: a masked self-attention block over token embeddings, added to the bag's
logits through a residual branch scaled by zero (ReZero's initialisation: the predictions are the
bag's, the cost is an attention layer's, which grows with the square of the padded length).

The fetcher threads tokenize docstrings and hand over their token ids as a list of arrays, one
per row, of any length; feeder pads each batch to its longest row and fills the model's
``attention_mask``. The same rows are scored twice: padded in arrival order, then with
``length_window`` (batches of rows of similar length). It prints the accuracy, the share of
padded token positions and the rows/s of each.

Run:  python examples/text_classification.py [--rows N] [--batch-size 64] [--window 1024]
(install: pip install -e '.[examples]')
"""
from __future__ import annotations

import argparse
import ast
import os
import sysconfig
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import feeder

PACKAGES = ("asyncio", "email", "http", "importlib", "logging", "multiprocessing", "unittest", "xml")
VOCAB = 4000
MAX_TOKENS = 512
WIDTH = 32  # the attention block's width


def docstrings(packages: Sequence[str] = PACKAGES) -> Tuple[List[str], np.ndarray]:
    """Every docstring of three words or more in the packages' source (read with ast, nothing
    imported), and its package's number."""
    stdlib = sysconfig.get_paths()["stdlib"]
    texts, labels = [], []
    for label, package in enumerate(packages):
        for root, dirs, files in os.walk(os.path.join(stdlib, package)):
            dirs[:] = sorted(d for d in dirs if not d.startswith("test") and d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                try:
                    with open(os.path.join(root, name), encoding="utf-8") as f:
                        tree = ast.parse(f.read())
                except (SyntaxError, UnicodeDecodeError, OSError):
                    continue
                for node in ast.walk(tree):
                    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                        doc = ast.get_docstring(node)
                        if doc and len(doc.split()) >= 3:
                            texts.append(doc)
                            labels.append(label)
    return texts, np.array(labels, np.int64)


def train_tokenizer(texts: Sequence[str]) -> Any:
    """A WordPiece tokenizer trained on ``texts``; id 0 is [PAD], rows are cut at MAX_TOKENS."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=VOCAB, special_tokens=["[PAD]", "[UNK]"],
                                                             show_progress=False))
    tok.enable_truncation(MAX_TOKENS)
    return tok


def tokenize(tok: Any, texts: Sequence[str]) -> List[np.ndarray]:
    return [np.array(e.ids, np.int64) for e in tok.encode_batch(list(texts))]


def naive_bayes(rows: Sequence[np.ndarray], labels: np.ndarray, classes: int, vocab: int,
                alpha: float = 0.5) -> Tuple[np.ndarray, np.ndarray]:
    """Per token and class, log P(token | class) (vocab x classes), and log P(class), by counting."""
    counts = np.zeros((classes, vocab))
    for row, label in zip(rows, labels):
        np.add.at(counts[label], row, 1.0)
    counts[:, 0] = 0.0  # [PAD] says nothing
    loglik = np.log((counts + alpha) / (counts + alpha).sum(axis=1, keepdims=True))
    prior = np.log(np.bincount(labels, minlength=classes) / len(labels))
    return loglik.T.astype(np.float32), prior.astype(np.float32)


def build_model(loglik: np.ndarray, prior: np.ndarray, seed: int = 0) -> bytes:
    """input_ids, attention_mask int64 [N, L], row int64 [N] -> logits [N, C], label [N], row [N]."""
    vocab, classes = loglik.shape
    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)

    f = TensorProto.FLOAT
    inits = [numpy_helper.from_array(loglik, "loglik"), numpy_helper.from_array(prior, "prior"),
             weight("emb", vocab, WIDTH), weight("wq", WIDTH, WIDTH), weight("wk", WIDTH, WIDTH),
             weight("wv", WIDTH, WIDTH), weight("wo", WIDTH, classes),
             helper.make_tensor("rezero", f, [], [0.0]), helper.make_tensor("scale", f, [], [WIDTH ** -0.5]),
             helper.make_tensor("one", f, [], [1.0]), helper.make_tensor("neg", f, [], [-1e9]),
             helper.make_tensor("ax1", TensorProto.INT64, [1], [1]),
             helper.make_tensor("ax2", TensorProto.INT64, [1], [2])]
    n = helper.make_node
    nodes = [
        n("Cast", ["attention_mask"], ["m"], to=f),                      # [N, L]: 1 for tokens, 0 for padding
        n("Unsqueeze", ["m", "ax2"], ["m3"]),                            # [N, L, 1]
        # the bag: sum over real tokens of log P(token | class), plus log P(class)
        n("Gather", ["loglik", "input_ids"], ["ll"]),                    # [N, L, C]
        n("Mul", ["ll", "m3"], ["llm"]), n("ReduceSum", ["llm", "ax1"], ["bag"], keepdims=0),
        n("Add", ["bag", "prior"], ["bag_logits"]),
        # a masked self-attention block over token embeddings, mean-pooled over real tokens
        n("Gather", ["emb", "input_ids"], ["x"]),                        # [N, L, D]
        n("MatMul", ["x", "wq"], ["q"]), n("MatMul", ["x", "wk"], ["k"]), n("MatMul", ["x", "wv"], ["v"]),
        n("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), n("MatMul", ["q", "kt"], ["s0"]),
        n("Mul", ["s0", "scale"], ["s1"]),                               # [N, L, L]
        n("Sub", ["one", "m"], ["pad"]), n("Mul", ["pad", "neg"], ["bias0"]),
        n("Unsqueeze", ["bias0", "ax1"], ["bias"]),                      # [N, 1, L]: padding gets no attention
        n("Add", ["s1", "bias"], ["s"]), n("Softmax", ["s"], ["a"], axis=-1), n("MatMul", ["a", "v"], ["h"]),
        n("Mul", ["h", "m3"], ["hm"]), n("ReduceSum", ["hm", "ax1"], ["hsum"], keepdims=0),
        n("ReduceSum", ["m", "ax1"], ["count"], keepdims=1), n("Max", ["count", "one"], ["count1"]),
        n("Div", ["hsum", "count1"], ["pooled"]), n("MatMul", ["pooled", "wo"], ["branch"]),
        n("Mul", ["branch", "rezero"], ["residual"]),
        n("Add", ["bag_logits", "residual"], ["logits"]),
        n("ArgMax", ["logits"], ["label"], axis=1, keepdims=0),
        n("Identity", ["row"], ["row_out"]),  # each row's number, to match predictions to rows in any order
    ]
    graph = helper.make_graph(
        nodes, "docstring_classifier",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", "L"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["N", "L"]),
         helper.make_tensor_value_info("row", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("logits", f, ["N", classes]),
         helper.make_tensor_value_info("label", TensorProto.INT64, ["N"]),
         helper.make_tensor_value_info("row_out", TensorProto.INT64, ["N"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10  # onnxruntime accepts IR <= 13; onnx 1.23 would stamp 14
    onnx.checker.check_model(model)
    return model.SerializeToString()


class Docstrings:
    """The fetch function: the next ``chunk`` docstrings, tokenized, as a list of token-id arrays
    (one per row, each its own length) and their row numbers. Thread-safe; raises StopIteration
    at the end."""

    def __init__(self, tok: Any, texts: Sequence[str], chunk: int = 32):
        self.tok, self.texts, self.chunk = tok, list(texts), chunk
        self._next = 0
        self._lock = threading.Lock()

    def __call__(self, worker_id: int, batch_size: int) -> Dict[str, Any]:
        with self._lock:
            start = self._next
            if start >= len(self.texts):
                raise StopIteration
            self._next = start + self.chunk
        texts = self.texts[start:start + self.chunk]
        return {"input_ids": tokenize(self.tok, texts), "row": np.arange(start, start + len(texts))}


def score(session: Any, tok: Any, texts: Sequence[str], batch_size: int, window: Optional[int]) -> Dict[str, Any]:
    """Every text through the model once; predictions by row, padded share, rows/s."""
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(session, None, Docstrings(tok, texts), batch_size, num_worker_threads=2,
                                   coordinator=coord, input_source_name="docstrings",
                                   pad={"input_ids": 0}, pad_to_multiple_of=8, length_window=window)
    predicted = np.full(len(texts), -1, np.int64)
    start = time.perf_counter()
    with coord:
        feed = coord.feed("docstrings")
        while True:
            try:
                _, label, rows = feed.run()
            except StopIteration:
                break
            predicted[rows] = label
        seconds = time.perf_counter() - start
        m = feed.metrics()  # token positions of the batches made: padding, and tokens
        padded, real = int(m["padded_elements"]), int(m["row_elements"])
    assert (predicted >= 0).all(), "every row is scored exactly once"
    return {"predicted": predicted, "seconds": seconds, "rows_per_s": len(texts) / seconds,
            "padded": padded, "padded_share": padded / max(1, padded + real)}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=0, help="docstrings to use (0: all of them)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--window", type=int, default=1024, help="rows held to sort by length")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    texts, labels = docstrings()
    order = np.random.default_rng(args.seed).permutation(len(texts))
    if args.rows:
        order = order[:args.rows]
    texts, labels = [texts[i] for i in order], labels[order]
    test = np.arange(len(texts)) % 5 == 0  # one docstring in five is held out
    train_texts = [t for t, held in zip(texts, test) if not held]
    t0 = time.perf_counter()
    tok = train_tokenizer(train_texts)
    loglik, prior = naive_bayes(tokenize(tok, train_texts), labels[~test], len(PACKAGES), tok.get_vocab_size())
    print(f"{len(texts)} docstrings from {len(PACKAGES)} packages ({', '.join(PACKAGES)}); tokenizer and "
          f"classifier trained on {len(train_texts)} of them in {time.perf_counter() - t0:.1f} s")

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # leave a core to the fetcher threads
    session = ort.InferenceSession(build_model(loglik, prior, args.seed), opts, providers=["CPUExecutionProvider"])
    results = {}
    for name, window in (("padded", None), ("padded + length_window", args.window)):
        r = results[name] = score(session, tok, texts, args.batch_size, window)
        accuracy = float((r["predicted"][test] == labels[test]).mean())
        r["accuracy"] = accuracy
        print(f"{name + ':':24} held-out accuracy {accuracy:.2f} (majority class "
              f"{np.bincount(labels[test]).max() / test.sum():.2f}), padded tokens {r['padded_share']:.0%} of "
              f"positions, {r['rows_per_s']:,.0f} rows/s")
    plain, windowed = results["padded"], results["padded + length_window"]
    print(f"length_window={args.window}: {plain['padded'] / max(windowed['padded'], 1):.1f}x fewer padded "
          f"positions, {windowed['rows_per_s'] / plain['rows_per_s']:.1f}x the rows/s")
    return results


if __name__ == "__main__":
    main()
