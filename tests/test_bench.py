"""feeder bench: loading MODULE:FETCH_FUN, the measurements, and the command's parseable output."""
from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from models import linear_model

from feeder import bench

FETCH_MODULE = textwrap.dedent("""
    import numpy as np

    def fetch(worker_id, batch_size):
        return {"x": np.ones((7, 4), np.float32)}

    def fetch_list(worker_id, batch_size):
        return [np.ones((5, 4), np.float32), np.arange(5)]
""")
LINE = re.compile(r"^(?P<name>.+?)\s{2,}(?P<rate>[\d,]+)\s+(?:(?P<ratio>\d+\.\d\d)x|-)(?:\s+\((?P<note>.*)\))?$")


def parse_table(text: str):
    """{configuration: (rows/s, ratio or None where the line shows "-")} and the best line's
    configuration name; checks that the "vs best" column and the verdict agree: the lines at
    1.00x are the best line (and lines that tie with it), and none shows 0.00x."""
    lines = text.strip().splitlines()
    assert lines[0].split() == ["configuration", "rows/s", "vs", "best"]
    rows = {}
    for line in lines[1:-1]:
        m = LINE.match(line)
        assert m, f"unparseable line: {line!r}"
        rows[m["name"].strip()] = (float(m["rate"].replace(",", "")), float(m["ratio"]) if m["ratio"] else None)
    best = re.fullmatch(r"best: (.+?) \(([\d,]+) rows/s(?:, \d+\.\d\dx the (?:fetch function|model) alone)?\)",
                        lines[-1])
    assert best, lines[-1]
    assert rows[best[1]][1] == 1.0, text  # the verdict's line is the one at 1.00x
    assert all(r[1] is None or r[1] > 0 for r in rows.values()), text  # never 0.00x
    return rows, best[1]


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    (tmp_path / "bench_fetch_mod.py").write_text(FETCH_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("bench_fetch_mod", None)


def test_load_fetch_by_module_name_and_by_file(module_dir):
    by_name = bench.load_fetch("bench_fetch_mod:fetch")
    assert by_name(0, 4)["x"].shape == (7, 4)
    by_file = bench.load_fetch(str(module_dir / "bench_fetch_mod.py") + ":fetch_list")
    assert [a.shape for a in by_file(0, 4)] == [(5, 4), (5,)]
    with pytest.raises(ValueError, match="MODULE:FETCH_FUN"):
        bench.load_fetch("no_colon")
    with pytest.raises(AttributeError, match="nope"):
        bench.load_fetch("bench_fetch_mod:nope")


def test_input_names_come_from_the_chunk():
    assert bench.input_names_from_chunk({"a": 1, "b": 2}) == ["a", "b"]
    assert bench.input_names_from_chunk([np.zeros(2), np.zeros(2)]) == ["input0", "input1"]
    assert bench.chunk_rows([np.zeros((5, 2))]) == 5 and bench.chunk_rows(None) == 0
    batches = bench.make_batches([{"x": np.arange(10)}, {"x": np.arange(10, 25)}], 8)
    assert [b["x"].tolist() for b in batches] == [list(range(8)), list(range(8, 16)), list(range(16, 24))]


def test_run_bench_without_model_measures_fetch_and_threads(module_dir):
    fetch = bench.load_fetch("bench_fetch_mod:fetch_list")
    results = bench.run_bench(fetch, batch_size=8, seconds=0.1, workers=[1, 2], processes=False)
    assert [r.name for r in results] == ["fetch alone, 1 thread", "feeder, 1 thread", "feeder, 2 threads"]
    assert all(r.error is None and r.rows > 0 for r in results), [(r.name, r.error) for r in results]
    assert bench.best(results).name.startswith("feeder, ")
    rows, best = parse_table(bench.format_table(results))
    assert set(rows) == {r.name for r in results} and best in rows
    assert max(ratio for _, ratio in rows.values() if ratio is not None) == 1.0
    assert rows["fetch alone, 1 thread"][1] is None  # a bound, not a configuration to compare


def test_a_failing_configuration_is_reported_not_raised():
    def fetch(worker_id, batch_size):
        return [np.ones((4, 2), np.float64)]

    results = bench.run_bench(fetch, batch_size=4, seconds=0.05, workers=[1], processes=False)
    assert all(r.error is None for r in results)
    bad = bench.measure_feeder(fetch, ["a", "b"], 4, 0.05, 1)  # two names for a one-array chunk
    assert bad.error is not None and "InputValidationError" in bad.error
    assert "error:" in bench.format_table([results[0], bad])


@pytest.mark.slow  # the command end to end: six timed configurations
def test_feeder_bench_command_with_a_model(module_dir):
    (module_dir / "tiny.onnx").write_bytes(linear_model(in_dim=4, out_dim=3))
    cmd = [sys.executable, "-m", "feeder", "bench", "bench_fetch_mod:fetch", "--model", "tiny.onnx",
           "--seconds", "0.3", "--batch-size", "16", "--workers", "2"]
    out = subprocess.run(cmd, cwd=module_dir, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    rows, best = parse_table(out.stdout)
    expected = {"fetch alone, 1 thread", "feeder, 1 thread", "feeder, 2 threads", "model alone, 1 intra-op thread",
                "feeder + model, 1 thread", "feeder + model, 2 threads"}
    assert expected <= set(rows), out.stdout
    assert best.startswith("feeder + model, ")
    assert all(rate > 0 for rate, _ in rows.values())
    assert max(ratio for _, ratio in rows.values() if ratio is not None) == 1.0
    # every feeder + model line is compared with the best one; the model alone is its bound
    assert all(ratio is not None for name, (_, ratio) in rows.items() if name.startswith("feeder + model"))
    assert rows["model alone, 1 intra-op thread"][1] is None and rows["feeder, 1 thread"][1] is None
    assert out.stdout.strip().splitlines()[-1].endswith("x the model alone)"), out.stdout
    # progress while it runs, on stderr, one line before and after each configuration
    progress = [line for line in out.stderr.splitlines() if line.startswith("feeder bench [")]
    assert len(progress) == 2 * len(rows), out.stderr
    assert progress[0].startswith(f"feeder bench [1/{len(rows)}] fetch alone"), out.stderr


def test_feeder_bench_json_and_usage(module_dir):
    out = subprocess.run([sys.executable, "-m", "feeder", "bench", "bench_fetch_mod:fetch", "--seconds", "0.1",
                          "--workers", "1", "--json"], cwd=module_dir, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    # the best line is the fastest feeder line (which of threads and processes wins a 0.1 s race of
    # this trivial fetch is the machine's business, not the contract's)
    feeder_lines = [r for r in data["results"] if r["kind"] == "feeder"]
    assert {r["name"] for r in feeder_lines} == {"feeder, 1 thread", "feeder, 1 process"}
    assert data["best"] == max(feeder_lines, key=lambda r: r["rows_per_s"])["name"]
    assert {r["kind"] for r in data["results"]} == {"fetch", "feeder"}
    by_name = {r["name"]: r for r in data["results"]}
    assert by_name[data["best"]]["vs_best"] == 1.0 and by_name["fetch alone, 1 thread"]["vs_best"] is None
    quiet = subprocess.run([sys.executable, "-m", "feeder", "bench", "bench_fetch_mod:fetch", "--seconds", "0.1",
                            "--workers", "1", "--quiet"], cwd=module_dir, capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0 and "feeder bench [" not in quiet.stderr, quiet.stderr
    usage = subprocess.run([sys.executable, "-m", "feeder"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "bench" in usage.stderr


FLOAT64_MODULE = textwrap.dedent("""
    import numpy as np
    def fetch(worker_id, batch_size):
        return {"x": np.ones((7, 4), np.float64)}
""")


def test_a_model_that_fails_everywhere_or_cannot_load_is_an_error_not_a_verdict(module_dir):
    # It printed "best: feeder, 1 thread" (a line without the model) and exited 0 when the model
    # failed in every configuration, and a raw onnxruntime traceback for a model it could not load.
    (module_dir / "bench_f64_mod.py").write_text(FLOAT64_MODULE)
    (module_dir / "tiny.onnx").write_bytes(linear_model(in_dim=4, out_dim=3))  # float32 x: float64 chunks fail
    out = subprocess.run([sys.executable, "-m", "feeder", "bench", "bench_f64_mod:fetch", "--model", "tiny.onnx",
                          "--seconds", "0.2", "--workers", "1", "--quiet"], cwd=module_dir, capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == ("best: none (the model failed in every configuration: see the "
                                                   "errors above)"), out.stdout
    (module_dir / "junk.onnx").write_bytes(b"not a model")
    for model, says in (("missing.onnx", "no such file"), ("junk.onnx", "onnxruntime cannot load it")):
        out = subprocess.run([sys.executable, "-m", "feeder", "bench", "bench_fetch_mod:fetch", "--model", model],
                             cwd=module_dir, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and f"--model {model}: {says}" in out.stderr and "Traceback" not in out.stderr, \
            out.stderr


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def test_the_examples_fetch_functions_load_by_file_path():
    pytest.importorskip("onnx")
    quick = bench.load_fetch(os.path.join(EXAMPLES, "quickstart.py") + ":fetch")
    assert quick(0, 64)[0].dtype == np.float32
    pytest.importorskip("magika")
    classify = bench.load_fetch(os.path.join(EXAMPLES, "classify_files.py") + ":fetch")
    chunk = classify(0, 16)
    assert list(chunk) == ["bytes"] and chunk["bytes"].dtype == np.int32 and chunk["bytes"].shape[1] == 2048


def test_a_file_named_like_another_module_runs_in_worker_processes_too(tmp_path, monkeypatch):
    """`feeder bench json.py:fetch`: the file ran under a private module name that worker
    processes cannot import, so every process line failed. It travels as path and name now."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "json.py").write_text(FETCH_MODULE)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_fetch adds the file's folder
    try:
        fetch = bench.load_fetch(str(data / "json.py") + ":fetch")
        assert sys.modules["json"].__file__ != str(data / "json.py")  # the standard json is left alone
        assert pickle.loads(pickle.dumps(fetch))(0, 4)["x"].shape == (7, 4)
    finally:
        sys.modules.pop(bench.PRIVATE_PREFIX + "json", None)
    cmd = [sys.executable, "-m", "feeder", "bench", str(data / "json.py") + ":fetch", "--seconds", "0.2",
           "--workers", "1", "--json"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    results = {r["name"]: r for r in json.loads(out.stdout)["results"]}
    assert "feeder, 1 process" in results, results
    assert all(r["error"] is None and r["rows"] > 0 for r in results.values()), results
