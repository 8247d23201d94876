"""The documentation's docstring check (``docs/hooks/docstrings.py``), run in the main suite.

``mkdocs build --strict`` fails when a public name has no docstring (the API reference is built
from them); these tests run the same check without mkdocs, and check that the check can fail.
"""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest

import feeder
from feeder.sources import ArraySource

HOOK = Path(__file__).resolve().parents[1] / "docs" / "hooks" / "docstrings.py"


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
