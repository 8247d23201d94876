"""examples/text_classification.py runs small (issue 29, item 5): docstrings of the standard library,
a tokenizer trained here, pad= and length_window=; every row scored once, better than chance, and the
window pads fewer positions."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

pytest.importorskip("onnx")
pytest.importorskip("tokenizers")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "text_classification.py"


def test_the_example_runs_small(capsys):
    if str(EXAMPLE.parent) not in sys.path:
        sys.path.insert(0, str(EXAMPLE.parent))
    tc = importlib.import_module("text_classification")
    results = tc.main(["--rows", "400", "--batch-size", "16", "--window", "128"])
    out = capsys.readouterr().out
    assert "400 docstrings from 8 packages" in out and "fewer padded positions" in out
    plain, windowed = results["padded"], results["padded + length_window"]
    assert plain["accuracy"] == windowed["accuracy"] > 0.4  # 8 classes: chance is about 0.2
    assert (plain["predicted"] == windowed["predicted"]).all()  # the same rows, whatever their order
    assert windowed["padded"] * 2 < plain["padded"]
