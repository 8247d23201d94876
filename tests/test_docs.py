"""The documentation and the package, checked in the main suite.

* The docstring check (``docs/hooks/docstrings.py``): ``mkdocs build --strict`` fails when a
  public name has no docstring or a public parameter is not documented (the API reference is
  built from them); these tests run the same check without mkdocs, and check that it can fail.
* The repository as a user meets it: install hints name the distribution ``setup.cfg`` declares,
  and nothing points to a file outside the repository.
"""
from __future__ import annotations

import configparser
import importlib.util
import logging
import os
import re
import subprocess
from pathlib import Path
from typing import List

import pytest

import feeder
from feeder.sources import ArraySource

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "docs" / "hooks" / "docstrings.py"
# Not files of the repository: what git ignores (virtual environments, the built site, caches).
NOT_OURS = {".git", "site", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache",
            ".ruff_cache"}


def repo_files() -> List[Path]:
    """Every file of the working tree that git would commit (tracked or not yet added)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout
        return sorted(ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file())
    except (OSError, subprocess.SubprocessError):  # not a git checkout (an unpacked archive)
        files = []
        for folder, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in NOT_OURS and not d.startswith(".venv")
                       and not d.endswith(".egg-info")]
            files += [Path(folder) / n for n in names]
        return sorted(files)


def repo_text_files() -> List[Path]:
    """:func:`repo_files` that are text (UTF-8 without NUL bytes)."""
    texts = []
    for path in repo_files():
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        texts.append(path)
    return texts


@pytest.fixture(scope="module")
def hook():
    spec = importlib.util.spec_from_file_location("feeder_docs_hook", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_has_a_docstring(hook):
    assert hook.missing_docstrings() == []


def test_the_check_covers_both_public_lists_and_the_public_classes(hook):
    names = hook.public_names()
    assert {f"feeder.{n}" for n in feeder.__all__} | {f"feeder.sources.{n}" for n in feeder.sources.__all__} \
        == set(names)
    for name in ("feeder.init_data_input_workers", "feeder.GlobalCoordinator", "feeder.Feed", "feeder.ChunkQueue",
                 "feeder.StatefulSession", "feeder.OrtTrainingModule", "feeder.PrometheusLogger", "feeder.predict",
                 "feeder.PredictResult", "feeder.sources.ArraySource", "feeder.sources.ParquetSource",
                 "feeder.sources.RayDataSource"):
        assert name in names


def test_a_method_or_property_without_a_docstring_is_named(hook, monkeypatch):
    monkeypatch.setattr(feeder.Feed.next_batch, "__doc__", None)
    monkeypatch.setattr(feeder.GlobalCoordinator.sources.fget, "__doc__", "  ")  # blank counts as missing
    missing = hook.missing_docstrings()
    assert "feeder.Feed.next_batch" in missing
    assert "feeder.GlobalCoordinator.sources" in missing


def test_a_class_or_function_without_a_docstring_is_named(hook, monkeypatch):
    monkeypatch.setattr(feeder.FetchError, "__doc__", None)
    monkeypatch.setattr(feeder.init_data_input_workers, "__doc__", None)
    missing = hook.missing_docstrings()
    assert "feeder.FetchError" in missing and "feeder.init_data_input_workers" in missing


def test_an_override_needs_its_own_docstring(hook, monkeypatch):
    # ShardedSource.feeder_definition has one; an override in ArraySource without one is named.
    monkeypatch.setattr(ArraySource, "feeder_definition", lambda self: {}, raising=False)
    assert "feeder.sources.ArraySource.feeder_definition" in hook.missing_docstrings()


def test_an_attribute_docstring_is_read_where_the_attribute_is_assigned(hook, tmp_path, monkeypatch):
    pkg = tmp_path / "feeder_docs_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .impl import DOCUMENTED, UNDOCUMENTED\n")
    (pkg / "impl.py").write_text('DOCUMENTED = 1\n"""What it is."""\n\nUNDOCUMENTED = 2\nOTHER = 3\n"""Not its."""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert hook.attribute_docstring("feeder_docs_probe", "DOCUMENTED") == "What it is."
    assert hook.attribute_docstring("feeder_docs_probe", "UNDOCUMENTED") is None
    assert hook.attribute_docstring("feeder", "global_coordinator")
    assert hook.attribute_docstring("feeder.sources", "ROW_KEY")


def test_without_strict_the_hook_warns_per_name(hook, monkeypatch, caplog):
    monkeypatch.setattr(hook, "missing_docstrings", lambda: ["feeder.Nothing", "feeder.Feed.nothing"])
    config = {"strict": False}
    with caplog.at_level(logging.WARNING):
        assert hook.on_config(config) is config
    assert "feeder.Nothing" in caplog.text and "feeder.Feed.nothing" in caplog.text


def test_with_strict_the_hook_fails_the_build(hook, monkeypatch):
    exceptions = pytest.importorskip("mkdocs.exceptions")
    monkeypatch.setattr(hook, "missing_docstrings", lambda: ["feeder.Nothing"])
    with pytest.raises(exceptions.PluginError, match="feeder.Nothing"):
        hook.on_config({"strict": True})


# ---- the distribution's name (issue 26, item 11) --------------------------------------------
def distribution_name() -> str:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    return config["metadata"]["name"]


# A pip command that names the distribution "fe"+"eder" (on PyPI, someone else's): as a requirement,
# with or without extras. "onnx-feeder", a path or URL (".../x.git"), "-e ." and a comment do not count.
WRONG = "fe" + "eder"


def wrong_distribution_hints(text: str) -> List[str]:
    """The pip commands in ``text`` that name the distribution ``feeder``."""
    bad = []
    for line in text.splitlines():
        for match in re.finditer(r"pip3?\s+(?:install|uninstall|download|show|index\s+versions)\b[^\n`#]*", line):
            command = match.group(0)
            # a requirement "feeder" or "feeder[extra]": the name alone, not part of a longer one
            if re.search(rf"(?<![\w./@+-]){WRONG}(?:\[[^\]]*\])?(?![\w.-])", command) \
                    and not re.search(rf"(?<![\w./@+-]){WRONG}(?:\[[^\]]*\])?(?=/)", command):
                bad.append(command.strip())
    return bad


def test_the_distribution_is_not_named_like_the_unrelated_pypi_project():
    # "feeder" on PyPI is an unrelated project (0.4.3, 2014); the import name stays feeder.
    assert distribution_name() == "onnx-feeder"
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    assert "feeder = feeder.__main__:main" in config["options.entry_points"]["console_scripts"]


def test_no_install_hint_in_the_repository_names_the_wrong_distribution():
    bad = {}
    for path in repo_text_files():
        hints = wrong_distribution_hints(path.read_text(encoding="utf-8"))
        if hints:
            bad[str(path.relative_to(ROOT))] = hints
    assert not bad, f"pip commands naming the distribution {WRONG!r} (it is {distribution_name()!r}): {bad}"


def test_install_hints_with_an_extra_name_our_distribution_and_a_declared_extra():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    extras = set(config["options.extras_require"])
    seen = 0
    for path in repo_text_files():
        for name, extra in re.findall(r"pip3?\s+install\s+[^\n`]*?'([\w.-]*feeder)\[([\w,]+)\]'",
                                      path.read_text(encoding="utf-8")):
            seen += 1
            assert name == distribution_name(), (path, name)
            assert set(extra.split(",")) <= extras, (path, extra)
    assert seen >= 5  # the docs and the ImportError hints of feeder/


@pytest.mark.parametrize("text", [
    "pip install '" + WRONG + "[parquet]'", "pip install " + WRONG, "pip uninstall -q -y " + WRONG,
    "run `pip install " + WRONG + "[ray]` first", "pip install -U '" + WRONG + "'",
    "pip install '" + WRONG + "[parquet] @ git+https://example.org/x/y.git'",
])
def test_the_distribution_check_catches_the_wrong_name(text):
    assert wrong_distribution_hints(text)


@pytest.mark.parametrize("text", [
    "pip install 'onnx-feeder[parquet]'", "pip install -e '.[test]'", "pip uninstall -q -y onnx-feeder",
    "pip install --no-deps -e .", "pip install git+https://example.org/x/" + WRONG + ".git",
    "pip install prometheus_client  # for " + WRONG,
])
def test_the_distribution_check_lets_the_right_names_pass(text):
    assert not wrong_distribution_hints(text)
