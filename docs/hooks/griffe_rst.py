"""A griffe extension (loaded by mkdocstrings, see mkdocs.yml): feeder's reST-isms as Markdown.

feeder's docstrings are written for ``help()`` and editors, with Sphinx roles
(``:func:`predict```, ``:class:`~feeder.errors.Failure```) and ``::`` before literal blocks.
mkdocstrings renders docstrings as Markdown, where both would show as written. This turns a
role into a code span (``~`` keeps the last component, as Sphinx does) and a trailing ``::`` into
``:``; double backquotes are already code in Markdown.
"""
from __future__ import annotations

import re
from typing import Any

from griffe import Extension

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|exc|data|obj|const):`(~?)([^`]+)`")
LITERAL = re.compile(r"(?<=\S)::$", re.MULTILINE)


def markdown(text: str) -> str:
    """``text`` with roles as code spans and ``word::`` as ``word:``."""
    def role(match: "re.Match[str]") -> str:
        tilde, target = match.groups()
        return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"

    return LITERAL.sub(":", ROLE.sub(role, text))


class RstRoles(Extension):
    """Rewrite each docstring as it is loaded."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:  # noqa: D102 (griffe's hook)
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
