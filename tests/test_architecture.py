"""The shape of the package, held to what docs/architecture.md says of it (issue 36).

Read from the code's own imports with ``ast`` (imports inside functions counted, since a cycle
hidden in a function is still a cycle), so these checks need nothing imported.
"""
from __future__ import annotations

import ast
import os
import re
from typing import Dict, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "feeder")
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 150


def _modules() -> Dict[str, str]:
    """Module name -> path, for every .py file under feeder/."""
    mods = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                mods[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return mods


def import_graph(mods: Dict[str, str]) -> Dict[str, Set[str]]:
    """Module -> the feeder modules it imports, anywhere in its body."""
    graph: Dict[str, Set[str]] = {}
    for name, path in mods.items():
        package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        found: Set[str] = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from . import x` imports the module x; `from .m import name` imports m
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    found.add(t)
        graph[name] = found
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function():
    # The checks below are only worth what this finder is: a circle through an import inside a
    # function must count.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_counts_imports_inside_functions():
    mods = _modules()
    graph = import_graph(mods)
    # feeder.scoring.cli imports the package only inside main(): the walk must see it
    assert "feeder" in graph["feeder.scoring.cli"]
    assert "feeder.sources.rowkeys" in graph["feeder.rowkeys"]


def test_no_import_cycle_among_feeders_modules():
    assert cycles(import_graph(_modules())) == []


def test_no_module_over_800_lines():
    big = {name: n for name, path in _modules().items()
           if (n := sum(1 for _ in open(path))) > MAX_MODULE_LINES}
    assert big == {}, f"modules over {MAX_MODULE_LINES} lines: {big}"


# The lines of docs/architecture.md's "How the modules depend on each other", top to bottom: a
# module may import from its own line and the lines below it, never from one above. A name ending
# in "/" stands for a package and every module in it.
LAYERS = [
    ["feeder", "api", "checks", "scoring/", "bench", "__main__"],
    ["coordinator"],
    ["feed", "pump", "feedstats", "prometheus"],
    ["processes/", "fetchers", "coalescing", "workerstate"],
    ["runtime/", "sources/", "rowkeys"],
    ["chunkqueue", "validation", "padding"],
]
# The leaves: below everything, importing nothing of feeder's beyond their own package.
LEAVES = ["rebatcher", "ragged", "assembly", "readyqueue", "tuning", "diagnosis", "metrics", "pacing", "trace",
          "joins", "device/", "storage/", "errors"]


def _unit(module: str, mods: Dict[str, str]) -> str:
    """The name a layer lists ``module`` under: its top-level module, or its package with a '/'."""
    if module == "feeder":
        return "feeder"
    top = module.split(".")[1]
    return top + "/" if mods.get(f"feeder.{top}", "").endswith("__init__.py") else top


def test_imports_flow_down_the_lines_of_the_architecture_page():
    mods = _modules()
    rank = {u: i for i, line in enumerate(LAYERS) for u in line}
    rank.update({u: len(LAYERS) for u in LEAVES})
    units = {_unit(m, mods) for m in mods}
    assert units == set(rank), f"modules on no line: {sorted(units - set(rank))}; " \
                               f"lines naming no module: {sorted(set(rank) - units)}"
    upward, leaking = [], []
    for m, targets in import_graph(mods).items():
        for t in targets:
            um, ut = _unit(m, mods), _unit(t, mods)
            if rank[ut] < rank[um]:
                upward.append(f"{m} -> {t}")
            if um in LEAVES and ut != um:
                leaking.append(f"{m} -> {t}")
    assert upward == [], f"imports from a line above the importer's own: {upward}"
    assert leaking == [], f"leaves importing feeder's other modules: {leaking}"
    page = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    section = page[page.index("## How the modules depend on each other"):page.index("## Where to change what")]
    for u in [u for line in LAYERS for u in line] + LEAVES:
        shown = "feeder/__init__.py" if u == "feeder" else u
        assert f"`{shown}`" in section or (u == "rowkeys" and "`feeder/rowkeys.py`" in section), \
            f"docs/architecture.md's layers do not name {shown}"


def _commented(lines: List[str], node: ast.AST) -> bool:
    """A comment just above the function (or its decorators) says why it is one piece."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first >= 2 and lines[first - 2].lstrip().startswith("#")


def test_no_function_over_150_lines_without_a_comment_saying_why():
    long = []
    for name, path in _modules().items():
        text = open(path).read()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text, path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > MAX_FUNCTION_LINES and not _commented(lines, node):
                    long.append(f"{name}.{node.name} ({n} lines)")
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines with no comment saying why: {long}"


def test_architecture_page_names_every_module_and_no_missing_one():
    page = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    named = set()
    for name, path in _modules().items():
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        if rel.endswith("__init__.py"):
            continue
        folder, base = os.path.split(rel)
        # a module is named by its path, or by its file name in its folder's row
        if rel in page or re.search(rf"`{re.escape(base)}`", page):
            named.add(rel)
        else:
            raise AssertionError(f"docs/architecture.md does not name {rel} ({name})")
    # and every feeder/... path the page names exists
    for ref in set(re.findall(r"`(feeder/[\w/]+(?:\.py)?/?)`", page)):
        assert os.path.exists(os.path.join(ROOT, ref)), f"docs/architecture.md names {ref}, which does not exist"
    assert named
