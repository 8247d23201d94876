"""MkDocs hook: every public name of feeder has a docstring, or the documentation does not build.

The API reference is generated from docstrings (mkdocstrings), and a name without one would be
missing from it without a word. So before MkDocs builds anything, :func:`missing_docstrings`
lists the public names that have none:

* every name in ``feeder.__all__`` and ``feeder.sources.__all__``: classes and functions by their
  own ``__doc__``; other objects (``global_coordinator``, ``ROW_KEY``) by the string literal
  that follows their assignment in the module that defines them, which is where mkdocstrings
  reads an attribute's docstring from;
* every public method and property (a name without a leading underscore) of those classes and
  of their base classes inside feeder. A method that overrides one must say what it does
  itself: mkdocstrings shows an override's own docstring, not its base's.

And :func:`undocumented_parameters` lists the public parameters that no ``Args:`` section
(Google style; also ``Keyword Args:``, ``Attributes:`` for a dataclass's fields) documents: of
every public function, method and constructor above. Constructors of classes that feeder makes
itself (:data:`MADE_BY_FEEDER`) and the plumbing between feeder's own threads
(:data:`INTERNAL`, left out of the reference) are exempt; parameters whose name starts with an
underscore are not public.

With ``mkdocs build --strict`` (CI) the hook raises, naming each of them; without ``--strict`` it
logs one warning per name, so that ``mkdocs serve`` keeps serving while you write them.

``tests/test_docs.py`` runs :func:`missing_docstrings` in the main test suite; this file imports
mkdocs only inside the hook itself, so the tests do not need it.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import logging
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("feeder", "feeder.sources")


def _own_doc(obj: Any) -> Optional[str]:
    """The docstring written on ``obj`` itself (not inherited, not generated), or None."""
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__")
        if doc and getattr(obj, "__dataclass_fields__", None) is not None \
                and doc.startswith(f"{obj.__name__}("):
            return None  # the signature that @dataclass writes where a docstring is missing
    else:
        doc = getattr(obj, "__doc__", None)
    return doc if isinstance(doc, str) and doc.strip() else None


def _function_of(member: Any) -> Any:
    """The function behind a method, property, classmethod or staticmethod; None for data."""
    if isinstance(member, property):
        return member.fget
    if isinstance(member, (classmethod, staticmethod)):
        return member.__func__
    if inspect.isfunction(member):
        return member
    func = getattr(member, "func", None)  # functools.cached_property
    return func if inspect.isfunction(func) else None


def _module_file(module_name: str) -> Optional[Path]:
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def attribute_docstring(module_name: str, name: str, _depth: int = 0) -> Optional[str]:
    """The docstring of module attribute ``name``: the string literal right after its assignment,
    following ``from .x import name`` to the module that assigns it (as mkdocstrings does)."""
    path = _module_file(module_name)
    if path is None or _depth > 10:
        return None
    body = ast.parse(path.read_text(encoding="utf-8")).body
    is_package = path.name == "__init__.py"
    for i, node in enumerate(body):
        targets: List[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            following = body[i + 1] if i + 1 < len(body) else None
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) \
                    and isinstance(following.value.value, str) and following.value.value.strip():
                return following.value.value
            return None
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) != name:
                    continue
                if node.level:
                    parts = module_name.split(".")
                    base = parts if is_package else parts[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if node.module is None:  # from . import name: a submodule
                    return _own_doc(importlib.import_module(f"{target}.{alias.name}"))
                return attribute_docstring(target, alias.name, _depth + 1)
    return None


def public_names() -> Dict[str, Any]:
    """Every name the documentation must cover, as 'package.Name' -> object."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    names: Dict[str, Any] = {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            names[f"{package}.{name}"] = getattr(module, name)
    return names


def missing_docstrings() -> List[str]:
    """The public names, methods and properties of feeder without a docstring, sorted.

    Empty when the documentation is complete. Names are given as they are imported
    (``feeder.Feed.metrics``, ``feeder.sources.ArraySource.feeder_validate``).
    """
    names = public_names()
    public_path = {id(obj): path for path, obj in names.items() if inspect.isclass(obj)}
    missing = set()
    seen = set()
    for path, obj in names.items():
        package, _, name = path.rpartition(".")
        if inspect.isclass(obj) or inspect.isroutine(obj):
            if _own_doc(obj) is None:
                missing.add(path)
        elif attribute_docstring(package, name) is None:
            missing.add(path)
        if not inspect.isclass(obj):
            continue
        for klass in obj.__mro__:
            if not klass.__module__.startswith("feeder"):
                continue
            owner = public_path.get(id(klass), f"{klass.__module__}.{klass.__qualname__}")
            for member_name, member in vars(klass).items():
                if member_name.startswith("_") or (owner, member_name) in seen:
                    continue
                seen.add((owner, member_name))
                func = _function_of(member)
                if func is not None and _own_doc(func) is None:
                    missing.add(f"{owner}.{member_name}")
    return sorted(missing)


# ---- parameters ----------------------------------------------------------------------------
# Classes whose objects feeder makes and hands out: users never call their constructors.
MADE_BY_FEEDER = {"feeder.Feed", "feeder.ChunkQueue", "feeder.sources.SourceBinding"}
# Methods that are plumbing between feeder's threads (fetchers, enqueuer, consumers): public to
# feeder's modules, not to users; docs/reference/feeds.md leaves them out.
INTERNAL = {f"feeder.ChunkQueue.{name}" for name in (
    "configure", "register_workers", "put", "wait_available", "worker_ended", "fail", "get", "delivered",
    "dropped", "discarded", "add_holder", "add_flusher", "check_ledger")} | {"feeder.Feed.pump_put"}
SECTION = re.compile(r"^(?P<indent>\s*)(?:Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|"
                     r"Other Parameters|Attributes):\s*$")
ENTRY = re.compile(r"^\s*\**(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*(?:\([^)]*\))?\s*:(?:\s|$)")


def documented_parameters(doc: Optional[str]) -> List[str]:
    """The names documented in ``doc``'s parameter sections (``Args:`` and the like), in order."""
    if not doc:
        return []
    lines = inspect.cleandoc(doc).splitlines()
    names: List[str] = []
    i = 0
    while i < len(lines):
        section = SECTION.match(lines[i])
        i += 1
        if not section:
            continue
        base, entry_indent = len(section.group("indent")), None
        while i < len(lines):
            line = lines[i]
            if line.strip():
                indent = len(line) - len(line.lstrip())
                if indent <= base:
                    break  # the section ended
                if entry_indent is None:
                    entry_indent = indent
                entry = ENTRY.match(line) if indent == entry_indent else None
                if entry:
                    names.append(entry.group("name"))
            i += 1
    return names


def _parameters(func: Any) -> List[str]:
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return []
    return [p.name for p in signature.parameters.values()
            if p.name not in ("self", "cls") and not p.name.startswith("_")]


def undocumented_parameters() -> List[str]:
    """Public parameters that no docstring documents, as ``'feeder.predict(batch_size)'``, sorted.

    Empty when every public parameter is documented. A constructor's parameters may be
    documented in the class docstring or in ``__init__``'s (mkdocstrings shows them together).
    """
    names = public_names()
    public_path = {id(obj): path for path, obj in names.items() if inspect.isclass(obj)}
    missing = set()
    seen = set()
    for path, obj in names.items():
        checks: List[tuple] = []
        if inspect.isfunction(obj):
            checks.append((path, obj, obj.__doc__))
        elif inspect.isclass(obj):
            init = vars(obj).get("__init__")
            fields = getattr(obj, "__dataclass_fields__", None)
            # A dataclass's constructor takes its fields, documented as Attributes (below).
            if path not in MADE_BY_FEEDER and fields is None and init is not None and inspect.isfunction(init) \
                    and not issubclass(obj, BaseException):
                checks.append((path, init, f"{_own_doc(obj) or ''}\n\n{init.__doc__ or ''}"))
            for klass in obj.__mro__:
                if not klass.__module__.startswith("feeder"):
                    continue
                owner = public_path.get(id(klass), f"{klass.__module__}.{klass.__qualname__}")
                for member_name, member in vars(klass).items():
                    if member_name.startswith("_") or (owner, member_name) in seen or isinstance(member, property):
                        continue
                    seen.add((owner, member_name))
                    func = _function_of(member)
                    if func is not None and f"{owner}.{member_name}" not in INTERNAL:
                        checks.append((f"{owner}.{member_name}", func, func.__doc__))
            if fields is not None:
                documented = set(documented_parameters(_own_doc(obj)))
                missing.update(f"{path}.{name}" for name in fields if not name.startswith("_")
                               and name not in documented)
        for where, func, doc in checks:
            documented = set(documented_parameters(doc))
            missing.update(f"{where}({name})" for name in _parameters(func) if name not in documented)
    return sorted(missing)


# ---- the MkDocs hook ------------------------------------------------------------------------
log = logging.getLogger("mkdocs.hooks.docstrings")  # under "mkdocs": --strict counts its warnings


def on_config(config: Any) -> Any:
    """Check the docstrings before anything is built (MkDocs calls this once per build)."""
    missing = missing_docstrings()
    parameters = undocumented_parameters()
    if missing or parameters:
        if config.get("strict"):
            from mkdocs.exceptions import PluginError

            problems = []
            if missing:
                problems.append(f"{len(missing)} public name(s) of feeder without a docstring (the API "
                                f"reference would silently lack them): " + ", ".join(missing))
            if parameters:
                problems.append(f"{len(parameters)} public parameter(s) without an entry in their docstring's "
                                f"Args section: " + ", ".join(parameters))
            raise PluginError("; ".join(problems))
        for name in missing:
            log.warning("public name without a docstring: %s", name)
        for name in parameters:
            log.warning("public parameter without documentation: %s", name)
    return config
