"""MkDocs hook and helpers: the code blocks of the documentation, runnable or marked as fragments.

The convention (see "Writing the documentation" in docs/getting-started.md): every fenced code
block names its language, and every Python block either runs as pasted, as a script in an empty
folder, or says on its first line that it is a fragment and why::

    ```python
    # fragment: session and fetch are yours; examples/quickstart.py is a whole program
    coord = feeder.init_data_input_workers(session, ["x"], fetch, 64)
    ```

``tests/test_docs.py`` runs every Python block of README.md and docs/ that is not a fragment,
each in a subprocess of its own; a block that fails is a failing test. This hook puts a visible
note above each fragment on the site, so that a reader knows before pasting it (on GitHub the
comment alone says it). It imports nothing of MkDocs, so the tests can use :func:`code_blocks`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, List, Optional

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")
FRAGMENT = re.compile(r"^#\s*fragment:\s*(?P<why>.*)$", re.IGNORECASE)
PYTHON = {"python", "py", "python3"}


@dataclass
class Block:
    """One fenced code block of a Markdown text."""

    lang: str        # the first word of the info string, lower case ("" when none)
    code: str        # the block's text, with the fence's indentation removed
    line: int        # 1-based line number of the opening fence
    indent: str      # the indentation of the fence (a block inside a list item)

    @property
    def is_python(self) -> bool:
        return self.lang in PYTHON

    @property
    def fragment(self) -> Optional[str]:
        """Why the block is a fragment (its first line says ``# fragment: why``), or None."""
        first = self.code.lstrip("\n").split("\n", 1)[0].strip()
        match = FRAGMENT.match(first)
        return match.group("why").strip() if match else None


def code_blocks(text: str) -> List[Block]:
    """The fenced code blocks of a Markdown text, in order."""
    blocks: List[Block] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, info = match.group("indent"), match.group("fence"), match.group("info").strip()
        body: List[str] = []
        j = i + 1
        while j < len(lines):
            closing = lines[j].strip()
            if closing.startswith(fence[0] * len(fence)) and not closing.strip(fence[0]):
                break
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        lang = info.split()[0].lstrip(".{").rstrip("}").lower() if info else ""
        blocks.append(Block(lang=lang, code="\n".join(body) + "\n", line=i + 1, indent=indent))
        i = j + 1
    return blocks


def note_fragments(markdown: str) -> str:
    """``markdown`` with a note above every Python block whose first line marks it a fragment."""
    lines = markdown.split("\n")
    insert = []
    for block in code_blocks(markdown):
        if block.is_python and block.fragment is not None:
            insert.append((block.line - 1, block.indent))
    for index, indent in reversed(insert):
        lines[index:index] = [f"{indent}*A fragment, not a whole program: it does not run as pasted.*"
                              "{ .fragment-note }", ""]
    return "\n".join(lines)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """MkDocs calls this with each page's Markdown before converting it."""
    return note_fragments(markdown)
