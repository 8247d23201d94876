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
import json
import logging
import os
import re
import subprocess
import sys
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



# ---- every public parameter documented (issue 26, item 16) ----------------------------------
def test_every_public_parameter_is_documented(hook):
    assert hook.undocumented_parameters() == []


def test_the_parameter_check_covers_the_entry_points_and_the_feed(hook, monkeypatch):
    doc = feeder.predict.__doc__
    without = "\n".join(line for line in doc.splitlines() if not line.strip().startswith("batch_size:"))
    monkeypatch.setattr(feeder.predict, "__doc__", without)
    monkeypatch.setattr(feeder.init_data_input_workers, "__doc__", "Register.\n\nArgs:\n    session: the session.\n")
    monkeypatch.setattr(feeder.Feed.run, "__doc__", "Run the next batch.")
    missing = hook.undocumented_parameters()
    assert "feeder.predict(batch_size)" in missing and "feeder.predict(mp_context)" not in missing
    for name in ("input_source_name", "init_fun", "external_loggers", "dont_rebatch", "mp_context"):
        assert f"feeder.init_data_input_workers({name})" in missing
    assert "feeder.init_data_input_workers(session)" not in missing
    assert {"feeder.Feed.run(output_names)", "feeder.Feed.run(run_options)"} <= set(missing)


def test_a_constructor_and_a_dataclass_field_are_checked(hook, monkeypatch):
    monkeypatch.setattr(ArraySource, "__doc__", "Rows of arrays.")
    monkeypatch.setattr(feeder.PredictResult, "__doc__", "What predict did.\n\nAttributes:\n    rows: rows.\n")
    missing = hook.undocumented_parameters()
    assert "feeder.sources.ArraySource(block_rows)" in missing
    assert "feeder.PredictResult.files" in missing and "feeder.PredictResult.rows" not in missing
    # feeder makes feeds and queues itself: their constructors are not for users
    assert not any(m.startswith(("feeder.Feed(", "feeder.ChunkQueue(")) for m in missing)


def test_the_args_parser_reads_google_sections(hook):
    doc = """Summary.

    Args:
        first (int): One line.
        second: Two
            lines, with a colon: inside.
        *rest: Varargs.

    Keyword Args:
        third: Keyword.

    Returns:
        value: not a parameter.
    """
    assert hook.documented_parameters(doc) == ["first", "second", "rest", "third"]


def test_with_strict_a_parameter_without_documentation_fails_the_build(hook, monkeypatch):
    exceptions = pytest.importorskip("mkdocs.exceptions")
    monkeypatch.setattr(hook, "missing_docstrings", lambda: [])
    monkeypatch.setattr(hook, "undocumented_parameters", lambda: ["feeder.predict(batch_size)"])
    with pytest.raises(exceptions.PluginError, match=r"feeder\.predict\(batch_size\)"):
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


# ---- nothing points outside the repository (issue 26, item 12) ------------------------------
# The contract is docs/reference/contract.md. Spelt in pieces so that this file does not match.
OUTSIDE = [re.compile(p, re.IGNORECASE) for p in (r"\bAPI" + r"\.md\b", r"\.\./" + "shared", "shared" + r"\s+folder")]


def outside_references(text: str) -> List[str]:
    """What in ``text`` points to a file outside the repository."""
    return [m.group(0) for pattern in OUTSIDE for m in pattern.finditer(text)]


def test_nothing_in_the_repository_points_to_files_outside_it():
    bad = {}
    for path in repo_text_files():
        found = outside_references(path.read_text(encoding="utf-8"))
        if found:
            bad[str(path.relative_to(ROOT))] = found
    assert not bad, f"references to files outside the repository (the contract is docs/reference/contract.md): {bad}"


@pytest.mark.parametrize("text", ["see API" + ".md", "in the team's shared" + " folder", "../" + "shared/API" + ".md",
                                  "`api" + ".md`", "the Shared" + "\nFolder"])
def test_the_outside_reference_check_can_fail(text):
    assert outside_references(text)


def test_the_contract_page_is_in_the_docs_and_the_navigation():
    page = (ROOT / "docs" / "reference" / "contract.md").read_text(encoding="utf-8")
    for heading in ("## Registering a source", "## Chunks", "## The coordinator", "## The feed (one registration)",
                    "## Sessions", "## Worker processes", "## Sources", "## Checkpoint and resume",
                    "## Observability", "## Batch inference to files"):
        assert heading in page, heading
    assert "reference/contract.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "reference/contract.md" in (ROOT / "README.md").read_text(encoding="utf-8")


# ---- code blocks: runnable as pasted, or marked as fragments (issue 26, item 10) -------------
def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


CODEBLOCKS = _load("feeder_docs_codeblocks", ROOT / "docs" / "hooks" / "codeblocks.py")
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
BLOCK_TIMEOUT_S = 120  # each block's subprocess; they take 1-10 s on the 2-core CI machine
# Imports that come with an optional extra: a block that needs one is skipped where it is absent.
OPTIONAL = {"pyarrow": "parquet", "ray": "ray", "prometheus_client": "prometheus", "onnx": "examples",
            "tqdm": "examples", "magika": "examples", "torch": "bench", "moto": "test", "pandas": "test",
            "sklearn": "test", "skl2onnx": "test"}


def page_blocks():
    for page in PAGES:
        for block in CODEBLOCKS.code_blocks(page.read_text(encoding="utf-8")):
            yield page, block


def runnable_blocks():
    return [pytest.param(page, block, id=f"{page.relative_to(ROOT)}:{block.line}")
            for page, block in page_blocks() if block.is_python and block.fragment is None]


def test_every_code_block_names_its_language():
    # A block without a language could be Python that nobody runs; "text" is for output.
    bare = [f"{page.relative_to(ROOT)}:{block.line}" for page, block in page_blocks() if not block.lang]
    assert not bare, f"fenced code blocks without a language (python, bash, text, ...): {bare}"


def test_fragments_say_why():
    vague = [f"{page.relative_to(ROOT)}:{block.line}" for page, block in page_blocks()
             if block.is_python and block.fragment is not None and len(block.fragment) < 10]
    assert not vague, f"'# fragment:' needs a reason (what is missing, where a whole program is): {vague}"


def test_the_quick_starts_run_as_pasted():
    quick = [(page, block) for page, block in page_blocks()
             if page.name in ("README.md", "index.md", "getting-started.md") and block.is_python]
    assert len(quick) >= 3 and all(block.fragment is None for _, block in quick)


@pytest.mark.slow
@pytest.mark.parametrize("page, block", runnable_blocks())
def test_code_block_runs_as_pasted(page, block, tmp_path):
    import ast

    tree = ast.parse(block.code)  # a block that is not even Python fails here
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        for name in names:
            top = name.split(".")[0]
            if top in OPTIONAL and importlib.util.find_spec(top) is None:
                pytest.skip(f"needs {top} (the {OPTIONAL[top]!r} extra), which is not installed")
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=BLOCK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{page.relative_to(ROOT)}:{block.line} did not end within {BLOCK_TIMEOUT_S} s: {e.stderr}")
    assert out.returncode == 0, (
        f"{page.relative_to(ROOT)}:{block.line} does not run as pasted (mark it '# fragment: why' if it is "
        f"not meant to):\n{block.code}\n--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}")


def test_the_block_parser_finds_fences_in_lists_and_marks_fragments():
    text = ("intro\n\n```python\nprint(1)\n```\n\n- item\n\n    ```python\n    # fragment: x is yours, see y.py\n"
            "    f(x)\n    ```\n\n~~~text\nout\n~~~\n\n```\nbare\n```\n")
    blocks = CODEBLOCKS.code_blocks(text)
    assert [(b.lang, b.line, b.fragment) for b in blocks] == [
        ("python", 3, None), ("python", 9, "x is yours, see y.py"), ("text", 14, None), ("", 18, None)]
    assert blocks[1].code == "# fragment: x is yours, see y.py\nf(x)\n"
    noted = CODEBLOCKS.note_fragments(text)
    assert noted.count("A fragment, not a whole program") == 1
    assert "    *A fragment" in noted  # indented like its block, inside the list item


def test_the_readme_commands_are_the_ones_ci_runs():
    # The README's first block: the main job, then the tests; .ci/run runs the test command verbatim.
    readme = CODEBLOCKS.code_blocks((ROOT / "README.md").read_text(encoding="utf-8"))[0]
    commands = [line for line in readme.code.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2 and commands[0].endswith("python examples/classify_files.py")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert commands[1] in ci
    assert "pip install -q -e '.[examples]'" in commands[0] and "pip install -q -e '.[test]'" in commands[1]
    # The summary names failures and errors too, not only skips (issue 35: -rs hid 150 errors).
    report = re.search(r"python -m pytest .*-r(\w+)", commands[1])
    assert report and {"f", "E", "s"} <= set(report[1]), commands[1]
    # The plain run leaves the tests marked slow out (tests/conftest.py); CI runs them as a step of its own.
    assert any(re.fullmatch(r"python -m pytest -q -rfEs -m slow", line.strip()) for line in ci), "no slow step"
    getting_started = CODEBLOCKS.code_blocks((ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8"))[0]
    assert getting_started.code == readme.code  # the two commands, as the README gives them


# ---- every figure has its results file; the plots are drawn from them (items 15 and 17) ------
RESULTS_NAMED = re.compile(r"benchmarks/results/[\w.-]+\.json")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def doc_pages():
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def test_every_results_file_a_page_names_exists():
    named = {}
    for page in doc_pages():
        text = page.read_text(encoding="utf-8")
        for name in RESULTS_NAMED.findall(text):
            named.setdefault(name, str(page.relative_to(ROOT)))
        if page.parent.name == "benchmarks":  # benchmarks/README.md says results/NAME.json
            for name in re.findall(r"(?<![\w/])results/[\w.-]+\.json", text):
                named.setdefault("benchmarks/" + name, str(page.relative_to(ROOT)))
    assert len(named) >= 6
    missing = {name: page for name, page in named.items() if not (ROOT / name).is_file()}
    assert not missing, f"results files named by the docs but not committed: {missing}"
    for name in named:
        json.loads((ROOT / name).read_text(encoding="utf-8"))  # a results file is JSON


def test_every_dated_section_names_its_results_file():
    # A date in a section of README.md or docs/ is when something was measured: the section must
    # say where its figures are kept (the contract and benchmarks/README.md's history excepted).
    bad = []
    for page in [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")):
        sections = re.split(r"\n(?=#{1,3} )", page.read_text(encoding="utf-8"))
        for section in sections:
            if DATE.search(section) and not RESULTS_NAMED.search(section):
                bad.append(f"{page.relative_to(ROOT)}: {section.splitlines()[0]}")
    assert not bad, f"sections with a measurement date but no benchmarks/results/ file: {bad}"


def _plots():
    return _load("feeder_benchmark_plots", ROOT / "benchmarks" / "plots.py")


def test_the_committed_plots_are_what_the_script_draws_from_the_committed_results():
    pytest.importorskip("matplotlib")  # the docs extra; .ci/run also runs plots.py --check there
    assert _plots().stale() == [], "run python benchmarks/plots.py and commit docs/images/perf-*.svg"


def test_every_plot_is_shown_and_none_is_left_over():
    plots = _plots()
    committed = {p.name for p in (ROOT / "docs" / "images").glob("perf-*.svg")}
    assert committed == set(plots.PLOTS)
    pages = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs").glob("*.md"))
    for name in plots.PLOTS:
        assert f"images/{name}" in pages, name


# ---- the command line's help speaks plain text (issue 26, item 14) ---------------------------
@pytest.mark.parametrize("command", [[], ["bench"], ["predict"]])
def test_the_command_line_help_has_no_markup(command):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-m", "feeder", *command, "--help"], capture_output=True, text=True,
                         timeout=60, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout.lower()
    assert "``" not in out.stdout and not re.search(r":(func|class|meth):`", out.stdout), out.stdout
