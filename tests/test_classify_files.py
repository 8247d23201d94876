"""examples/classify_files.py gives exactly the labels of magika.Magika().identify_paths.

Needs the magika package (its bundled model and config; nothing is downloaded) and onnx.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest

magika = pytest.importorskip("magika")
pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "classify_files.py"


def load_example():
    # Importable by its name (examples/ on sys.path), so that worker processes can unpickle its fetch object.
    if str(EXAMPLE.parent) not in sys.path:
        sys.path.insert(0, str(EXAMPLE.parent))
    return importlib.import_module("classify_files")


cf = load_example()

PYTHON = '''"""A small module."""
import os
import sys


def walk(root):
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            yield os.path.join(dirpath, name)


class Counter:
    def __init__(self):
        self.n = 0

    def add(self, k=1):
        self.n += k
        return self.n


if __name__ == "__main__":
    print(sum(1 for _ in walk(sys.argv[1])))
'''

JSON = '''{
  "name": "feeder",
  "version": "0.1.0",
  "dependencies": {"numpy": ">=1.23", "onnxruntime": ">=1.16"},
  "keywords": ["onnx", "threads", "batching"],
  "authors": [{"name": "A. Person", "email": "a@example.com"}],
  "private": true,
  "count": 42
}
'''

HTML = '''<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>Test page</title>
  <link rel="stylesheet" href="style.css">
</head>
<body>
  <h1>Hello</h1>
  <p>This is a <a href="https://example.com">link</a> in a paragraph.</p>
  <ul><li>one</li><li>two</li></ul>
  <script src="app.js"></script>
</body>
</html>
'''

C = '''#include <stdio.h>
#include <stdlib.h>

static int add(int a, int b) {
    return a + b;
}

int main(int argc, char **argv) {
    int total = 0;
    for (int i = 1; i < argc; i++) {
        total = add(total, atoi(argv[i]));
    }
    printf("%d\\n", total);
    return EXIT_SUCCESS;
}
'''

TEXT = '''The quick brown fox jumps over the lazy dog. It was a bright cold day in April,
and the clocks were striking thirteen. Call me Ishmael. Some years ago, never mind how
long precisely, having little or no money in my purse, and nothing particular to interest
me on shore, I thought I would sail about a little and see the watery part of the world.
'''

MARKDOWN = '''# feeder

A threaded producer/consumer feeder for **ONNX Runtime**.

## Install

```bash
pip install onnx-feeder
```

## Usage

- register a fetch function
- start the coordinator
- call `feed.run()`

See [the docs](https://example.com/docs) for more.
'''


@pytest.fixture
def folder(tmp_path):
    files = {
        "module.py": PYTHON, "data.json": JSON, "page.html": HTML, "prog.c": C, "notes.txt": TEXT,
        "README.md": MARKDOWN,
        "big.py": PYTHON * 40,                      # > block_size: beginning and end read separately
        "padded.py": "\n\t " * 300 + PYTHON + " \t\n\r" * 900,  # whitespace stripped at both ends
        "mostly_blank.txt": "\n" * 5000 + "x = 1\n",  # < 8 bytes left after lstrip: no model
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "tiny.txt").write_bytes(b"hi\n")
    (tmp_path / "tiny.bin").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "random.bin").write_bytes(np.random.default_rng(0).integers(0, 256, 9000, dtype=np.uint8).tobytes())
    (tmp_path / "subdir").mkdir()
    paths = [str(tmp_path / n) for n in sorted(os.listdir(tmp_path))]
    paths.append(str(tmp_path / "does-not-exist"))
    if hasattr(os, "symlink"):
        os.symlink(tmp_path / "prog.c", tmp_path / "link.c")
        os.symlink(tmp_path / "gone", tmp_path / "broken-link")
        paths += [str(tmp_path / "link.c"), str(tmp_path / "broken-link")]
    return paths


def magika_labels(paths):
    results = magika.Magika().identify_paths(paths)
    return [str(r.output.label) if r.ok else str(r.status) for r in results]


def test_labels_equal_magika_identify_paths(folder):
    expected = magika_labels(folder)
    assert cf.classify(folder, workers=2, batch_size=4) == expected
    # the typed files really are recognised (not just "txt" on both sides)
    by_name = dict(zip((os.path.basename(p) for p in folder), expected))
    assert by_name["module.py"] == "python" and by_name["prog.c"] == "c" and by_name["data.json"] == "json"
    assert by_name["empty"] == "empty" and by_name["tiny.txt"] == "txt" and by_name["subdir"] == "directory"


@pytest.mark.parametrize("workers,batch_size,replicas", [(1, 1, 1), (3, 3, 2), (2, 64, 1)])
def test_labels_do_not_depend_on_threads_or_batching(folder, workers, batch_size, replicas):
    paths = folder * 3  # more rows than one batch, duplicates included
    assert cf.classify(paths, workers=workers, batch_size=batch_size, replicas=replicas) == magika_labels(paths)


def test_features_equal_magikas(folder):
    m = magika.Magika()
    extract = getattr(m, "_get_result_or_features_from_path", None)
    if extract is None:
        pytest.skip("magika's private feature extraction moved")
    cfg = cf.MagikaConfig()
    for path in folder:
        result, features = extract(Path(path))
        row = np.full(cfg.width, cfg.padding_token, dtype=np.int32)
        label = cf.features_or_label(path, cfg, row)
        if features is None:
            assert label == (str(result.output.label) if result.ok else str(result.status)), path
        else:
            assert label is None, path
            assert row.tolist() == list(features.beg) + list(features.end), path


def test_the_session_is_magikas_model_as_shipped():
    # The file indices ride along as a kept array (keep=["row_index"]), not through the model: the
    # example once added a pass-through input and output to Magika's model for them.
    import onnxruntime as ort

    plain = ort.InferenceSession(cf.model_path(), providers=["CPUExecutionProvider"])
    ours = cf.make_session()
    assert [i.name for i in ours.get_inputs()] == [i.name for i in plain.get_inputs()] == ["bytes"]
    assert [o.name for o in ours.get_outputs()] == [o.name for o in plain.get_outputs()]
    x = np.random.default_rng(1).integers(0, 257, (5, 2048)).astype(np.int32)
    np.testing.assert_array_equal(ours.run(None, {"bytes": x})[0], plain.run(None, {"bytes": x})[0])


def test_each_batch_carries_its_file_indices_as_a_kept_array(folder):
    import feeder

    cfg = cf.MagikaConfig()
    job = cf._Job(folder * 2, cfg, files_per_chunk=3)
    coord = feeder.GlobalCoordinator()
    feeder.init_data_input_workers(cf.make_session(), [cf.BYTES_INPUT], job.fetch, 4, keep=[cf.INDEX_INPUT],
                                   coordinator=coord, num_worker_threads=2)
    try:
        with coord:
            feed = coord.feed("train")
            for (scores,), batch in feed.runs([cf.SCORES_OUTPUT], with_batch=True):
                assert set(batch) == {cf.BYTES_INPUT, cf.INDEX_INPUT} and len(batch[cf.INDEX_INPUT]) == len(scores)
                for i, row in zip(batch[cf.INDEX_INPUT].tolist(), batch[cf.BYTES_INPUT]):
                    expected = np.full(cfg.width, cfg.padding_token, dtype=np.int32)
                    assert cf.features_or_label(job.paths[i], cfg, expected) is None
                    np.testing.assert_array_equal(row, expected)  # the index is this row's file
    finally:
        coord.stop()


def test_empty_list():
    assert cf.classify([]) == []


def test_progress_bar_is_quiet_when_stderr_is_not_a_terminal(capsys):
    pytest.importorskip("tqdm")
    progress = cf.Progress()
    for done in (0, 5, 10):
        progress(done, 10)
    assert progress.bar is not None and progress.bar.disable
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("processes,batch_size,replicas", [(2, 4, 1), (1, 3, 2)])
def test_labels_with_worker_processes_equal_magikas(folder, processes, batch_size, replicas):
    paths = folder * 3
    assert cf.classify(paths, batch_size=batch_size, replicas=replicas, processes=processes) == magika_labels(paths)


def test_labels_with_feeder_predict_equal_magikas_and_a_second_call_computes_nothing(folder, tmp_path):
    pytest.importorskip("pyarrow")
    paths = folder * 2
    labels, result = cf.classify_with_predict(paths, tmp_path / "scores", batch_size=4, replicas=2, progress=False)
    assert labels == magika_labels(paths)
    assert (result.rows, result.rows_computed) == (len(paths), len(paths))
    again, second = cf.classify_with_predict(paths, tmp_path / "scores", batch_size=8, progress=False)
    assert again == labels and (second.rows, second.rows_computed) == (len(paths), 0)
    assert cf.classify_with_predict([], tmp_path / "none", progress=False)[0] == []
