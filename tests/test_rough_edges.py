"""The smaller rough edges a new user hit (issue 35, item 10): a model path passed as the session,
"1 fetcher threads", the example's documented --resume that trained nothing, the README's
headline count, max_buffered_batches said to count chunks."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

import feeder
from feeder.diagnosis import StageTimes, verdict

ROOT = pathlib.Path(__file__).resolve().parent.parent


def fetch(worker_id, batch_size):
    return [np.ones((4, 2), np.float32)]


@pytest.mark.parametrize("path", ["model.onnx", pathlib.Path("models") / "model.onnx"])
def test_a_model_path_as_the_session_says_how_to_load_it(coord, path):
    with pytest.raises(TypeError) as raised:
        feeder.init_data_input_workers(path, ["x"], fetch, 4, coordinator=coord)
    message = str(raised.value)
    assert "is a path" in message and f"onnxruntime.InferenceSession({os.fspath(path)!r}, providers=" in message
    assert not coord.feeds("train")


@pytest.mark.parametrize("mode, workers, words", [
    ("threads", 1, "1 fetcher thread:"), ("processes", 1, "1 fetcher process:"),
    ("threads", 2, "2 fetcher threads:"), ("processes", 3, "3 fetcher processes:")])
def test_the_figures_count_fetchers_in_words_that_agree(mode, workers, words):
    t = StageTimes(elapsed_s=2.0, batches=10, rows=640, consumer_wait_s=1.5, consumer_run_s=0.3, consumer_between_s=0.2,
                   workers=workers, mode=mode, fetch_s=1.0, fetch_blocked_s=0.0, fetch_wall_s=2.0 * workers,
                   fetch_cpu_s=0.5, fetch_cpu_wall_s=2.0 * workers, rows_fetched=640, queue_capacity=800)
    text = verdict(t)
    assert words in text, text
    assert "(320 rows/s)" in text  # the unit of the log lines too


def test_the_examples_documented_resume_trains_more_steps(tmp_path):
    pytest.importorskip("pyarrow")
    pytest.importorskip("tqdm")
    pytest.importorskip("onnx")
    example = ROOT / "examples" / "train_and_eval.py"
    data = tmp_path / "data"

    def run(*args):
        out = subprocess.run([sys.executable, str(example), "--data", str(data), "--checkpoint-every", "100", *args],
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    run("--steps", "40")
    # as getting-started.md and training.md give it: it printed "0 train steps" (--steps 400 was the default)
    resumed = run("--resume")
    assert "resumed from step 40" in resumed and "400 train steps" in resumed, resumed
    with np.load(data / "checkpoint.npz") as z:
        assert int(z["__step__"]) == 440
    done = run("--resume", "--steps", "100")
    assert "already" in done and "nothing to train" in done and "train steps" not in done, done
    docs = (ROOT / "docs" / "getting-started.md").read_text() + (ROOT / "docs" / "training.md").read_text()
    assert "python examples/train_and_eval.py --resume" in docs


def test_the_readme_headline_says_how_many_files_the_main_example_run_measured():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (row,) = [line for line in readme.splitlines() if line.startswith("| Magika's model")]
    files = json.loads((ROOT / "benchmarks" / "results" / "compare.json").read_text())["real_workload"]["files"]
    assert f"{int(files):,}-file sample" in row, row  # the figure's run scanned a sample ...
    assert "scans all of its files" in row, row  # ... and the example, run as the README says, all of them


def test_max_buffered_batches_is_said_to_count_chunks_wherever_it_is_documented():
    docstring = feeder.init_data_input_workers.__doc__
    entry = docstring[docstring.index("max_buffered_batches:"):docstring.index("init_fun:")]
    assert "in chunks" in entry and "not batches" in entry
    concepts = (ROOT / "docs" / "concepts.md").read_text(encoding="utf-8")
    assert re.search(r"`max_buffered_batches` sizes the queue; despite its\s+name it counts chunks", concepts)
