"""`feeder predict`: a refusal is one line on stderr in the command line's terms and exit status 2;
a failure while running is exit status 1, Ctrl-C 130; every option a message suggests exists."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from feeder.scoring import cli as predictcli
from feeder.scoring.outputdir import STATE_NAME, SUCCESS_NAME

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("onnx")

from models import batch_mean_model, linear_model  # noqa: E402

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
OPTIONS = {o for a in predictcli.parser()._actions for o in a.option_strings}


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    return env


def write_data(path, n=400, dtype=np.float32):
    x = np.random.default_rng(0).standard_normal((n, 4)).astype(dtype)
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 4),
                             "id": pa.array(np.arange(n))}), str(path), row_group_size=100)
    return x


@pytest.fixture
def files(tmp_path):
    (tmp_path / "m.onnx").write_bytes(linear_model())
    (tmp_path / "data").mkdir()
    write_data(tmp_path / "data" / "in.parquet")
    return tmp_path


def check_refusal(status, err):
    """Exit status 2, one line, in the command line's terms, suggesting only options that exist."""
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("feeder predict: error: "), err
    for option in re.findall(r"(?<![\w-])--[a-z][a-z-]*", err):
        assert option in OPTIONS, (option, err)
    assert not re.search(r"\b[a-z_]+=(True|False|\d|\[|'|\")", err), err  # no Python keyword arguments
    assert "feeder.predict" not in err
    return lines[0]


def cli(capsys, *args):
    """`feeder predict ARGS` in this process: (exit status, stderr)."""
    status = predictcli.main([str(a) for a in args])
    return status, capsys.readouterr().err


def cli_process(*args, patch="", **kw):
    """`feeder predict ARGS` in a process of its own, after the Python code ``patch`` ran there."""
    code = f"import sys\n{patch}\nfrom feeder.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-c", code, "predict", *map(str, args)], capture_output=True, text=True,
                          env=_env(), timeout=120, **kw)


def test_refusals_are_one_line_in_the_command_lines_terms(files, capsys):
    t = files
    model, data, out = t / "m.onnx", t / "data", t / "out"
    assert cli(capsys, model, data, out, "--keep", "id")[0] == 0
    capsys.readouterr()
    cases = []

    def refused(*args, want):
        line = check_refusal(*cli(capsys, *args))
        assert re.search(want, line), (want, line)
        cases.append(line)

    # other data: the file named, and --overwrite
    write_data(data / "in.parquet", n=300)
    refused(model, data, out, "--keep", "id", want=r"source files: 1 file\(s\) changed .*'in\.parquet'.*--overwrite")
    # touched only: named, and how --identity content helps
    write_data(data / "in.parquet")
    refused(model, data, out, "--keep", "id",
            want=r"only its modification time moved \(touched or copied\? a checkpoint written with --identity "
                 r"content compares contents instead\)\): 'in\.parquet'")
    # another model, other options
    (t / "m5.onnx").write_bytes(linear_model(out_dim=5))
    refused(t / "m5.onnx", data, out, "--keep", "id", want=r"model outputs y: the output has")
    refused(model, data, out, "--keep", "id", "--outputs", "y", want=r"option outputs: the output has")
    # the model: not a model, missing, an output it lacks, a fixed batch, a batch reduction
    (t / "bad.onnx").write_text("not a model")
    refused(t / "bad.onnx", data, t / "o2", want=r"model '.*bad\.onnx' cannot be loaded by onnxruntime")
    refused(t / "none.onnx", data, t / "o2", want=r"no such ONNX model file")
    refused(model, data, t / "o2", "--outputs", "nope", want=r"outputs \['nope'\] are not outputs of the model")
    (t / "fixed.onnx").write_bytes(linear_model(batch=4))
    refused(t / "fixed.onnx", data, t / "o2", "--keep", "id", want=r"pass --batch-size 4")
    (t / "mean.onnx").write_bytes(batch_mean_model())
    refused(t / "mean.onnx", data, t / "o2", want=r"model output 'm' .* \(choose them with --outputs\)")
    (t / "mean_d.onnx").write_bytes(batch_mean_model(dim="D"))
    refused(t / "mean_d.onnx", data, t / "o2", "--batch-size", "4",
            want=r"model output 'm' is not one value per row.*--outputs")
    assert cli(capsys, t / "mean_d.onnx", data, t / "o2", "--batch-size", "4", "--outputs", "y")[0] == 0
    # the data: not Parquet, a column it lacks, float64 for a float32 model (--cast converts)
    (t / "text").mkdir()
    (t / "text" / "a.parquet").write_text("no")
    refused(model, t / "text", t / "o3", want=r"'.*a\.parquet' is not a readable Parquet file")
    refused(model, data, t / "o3", "--keep", "nope", want=r"column\(s\) \['nope'\] not in")
    (t / "f64").mkdir()
    write_data(t / "f64" / "in.parquet", dtype=np.float64)
    refused(model, t / "f64", t / "o4", "--keep", "id", want=r"--cast converts safe casts")
    assert cli(capsys, model, t / "f64", t / "o4", "--keep", "id", "--cast")[0] == 0  # and nothing blocks it
    # the output: inside the input, holding files not ours
    refused(model, data, data / "scores", want=r"output '.*scores' is inside the input folder")
    (t / "theirs").mkdir()
    (t / "theirs" / "notes.txt").write_text("x")
    refused(model, data, t / "theirs", "--overwrite", want=r"holds files that feeder predict did not write")
    assert len(cases) == 15
    # arguments argparse refuses (its own usage message, exit status 2)
    with pytest.raises(SystemExit) as info:
        predictcli.main([str(model), str(data), str(t / "o5"), "--batch-size", "0"])
    assert info.value.code == 2 and "--batch-size: must be >= 1, got 0" in capsys.readouterr().err


def test_identity_content_resumes_on_copied_data(files, capsys):
    t = files
    out = t / "out"
    assert cli(capsys, t / "m.onnx", t / "data", out, "--identity", "content", "--keep", "id")[0] == 0
    state = json.loads((out / STATE_NAME).read_text())
    assert state["source"]["definition"]["files"][0]["version"].startswith("sha256:")
    (t / "data" / "in.parquet").write_bytes((t / "data" / "in.parquet").read_bytes())  # copied: a new mtime
    status, err = cli(capsys, t / "m.onnx", t / "data", out, "--identity", "content", "--keep", "id")
    assert status == 0, err


ROOT_MAKES_EVERYTHING_WRITABLE = os.geteuid() == 0


def test_a_read_only_output_folder_and_a_full_disk_are_one_line_refusals_in_a_process(files):
    t = files
    model, data, out = t / "m.onnx", t / "data", t / "out"
    out.mkdir()
    if ROOT_MAKES_EVERYTHING_WRITABLE:  # root writes anywhere: the file system's answer, simulated
        patch = (f"import errno, os\nreal = os.open\nOUT = {str(out)!r}\n"
                 "def refusing(path, flags, *a, **kw):\n"
                 "    if str(path).startswith(OUT) and flags & os.O_CREAT:\n"
                 "        raise PermissionError(errno.EACCES, 'Permission denied', str(path))\n"
                 "    return real(path, flags, *a, **kw)\n"
                 "os.open = refusing\n")
    else:
        patch = ""
        out.chmod(0o555)
    try:
        done = cli_process(model, data, out, patch=patch)
    finally:
        out.chmod(0o755)
    line = check_refusal(done.returncode, done.stderr)
    assert "Permission denied" in line and str(out) in line and "Traceback" not in done.stderr
    # the disk fills up while parts are written (the writer thread), or at the first state
    enospc = ("import errno\nimport feeder.scoring.outputdir as od\n"
              "def full(*a, **kw):\n"
              "    raise OSError(errno.ENOSPC, 'No space left on device')\n")
    done = cli_process(model, data, out, "--rows-per-file", "100", patch=enospc + "od.fsync_file = full\n")
    line = check_refusal(done.returncode, done.stderr)
    assert "No space left on device" in line and "run the same command again to continue" in line, line
    assert not (out / SUCCESS_NAME).exists()
    done = cli_process(model, data, t / "out2", patch=enospc + "od.OutputDir.write_state = full\n")
    line = check_refusal(done.returncode, done.stderr)
    assert "No space left on device" in line, line
    # space again: the same command finishes the output
    done = cli_process(model, data, out, "--rows-per-file", "100")
    assert done.returncode == 0 and done.stdout.startswith("400 rows written"), done.stderr


def test_a_failure_while_running_is_exit_status_1_and_ctrl_c_130(files):
    t = files
    model, data, out = t / "m.onnx", t / "data", t / "out"
    failing = ("import errno, pyarrow.parquet as pq\nreal = pq.ParquetFile.read_row_group\ncalls = [0]\n"
               "def read(self, *a, **kw):\n"
               "    calls[0] += 1\n"
               "    if calls[0] == 3:\n"
               "        raise OSError(errno.EIO, 'Input/output error')\n"
               "    return real(self, *a, **kw)\n"
               "pq.ParquetFile.read_row_group = read\n")
    done = cli_process(model, data, out, "--threads", "1", "--replicas", "1", "--rows-per-file", "100",
                       patch=failing)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("feeder predict: failed: ") and "Input/output error" in last and "in.parquet" in last
    assert "run the same command again to continue" in last
    slow = ("import time, pyarrow.parquet as pq\nreal = pq.ParquetFile.read_row_group\n"
            "def read(self, *a, **kw):\n"
            "    time.sleep(0.5)\n"
            "    return real(self, *a, **kw)\n"
            "pq.ParquetFile.read_row_group = read\n")
    code = f"import sys\n{slow}\nfrom feeder.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"
    (t / "many").mkdir()
    for i in range(10):  # 40 row groups read one at a time at 0.5 s each: a run that outlasts the signal
        write_data(t / "many" / f"{i}.parquet")
    p = subprocess.Popen([sys.executable, "-c", code, "predict", str(model), str(t / "many"), str(t / "out2"),
                          "--threads", "1", "--replicas", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    deadline = time.monotonic() + 60
    while not (t / "out2" / STATE_NAME).exists() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, (p.returncode, err)
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "feeder predict: interrupted; run the same command again to continue"
