"""The `feeder` command line's top level (issue 35, item 8): --version, argparse's "invalid
choice" for an unknown command, usage when none is given; the commands themselves are tested in
test_bench.py and test_predict_cli.py."""
from __future__ import annotations

import subprocess
import sys

import pytest

import feeder
from feeder.__main__ import main


def test_version_prints_the_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"feeder {feeder.__version__}"


def test_an_unknown_command_is_argparses_invalid_choice(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["nonsense"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nonsense'" in err and "'bench'" in err and "'predict'" in err, err


def test_no_command_prints_the_usage(capsys):
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: feeder") and "{bench,predict}" in err and "COMMAND" in err, err


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "bench" in out and "predict" in out and "--version" in out


def test_python_dash_m_feeder_version():
    out = subprocess.run([sys.executable, "-m", "feeder", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"feeder {feeder.__version__}", out.stderr
