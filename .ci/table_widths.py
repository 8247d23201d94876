"""Fail when a table of the built site is wider than the page at a common screen width.

    python .ci/table_widths.py SITE_DIR [WIDTH]      # default 1280 px

Loads every page of the built site (``mkdocs build``) in headless Chromium at WIDTH pixels and
lists each table whose content is wider than the column it sits in (the reader would have to
scroll it sideways). Needs Debian's ``chromium``; .ci/run runs it where that is installed.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """<script>window.addEventListener('load', () => {
  const wide = [];
  document.querySelectorAll('.md-content table').forEach((t) => {
    const box = t.closest('.md-typeset__scrollwrap') || t.parentElement;
    if (t.scrollWidth > box.clientWidth + 1)
      wide.push(t.scrollWidth + ' px in ' + box.clientWidth + ': ' + (t.innerText || '').slice(0, 60).replace(/\\s+/g, ' '));
  });
  const out = document.createElement('pre');
  out.id = 'table-widths';
  out.textContent = JSON.stringify(wide);
  document.body.appendChild(out);
});</script>"""
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=3000", "--dump-dom"]


def wide_tables(page: Path, width: int) -> list:
    probe = page.with_name(f"_table_widths_{page.name}")
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
    profile = tempfile.mkdtemp()
    try:
        dom = subprocess.run(["chromium", *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},900",
                              probe.resolve().as_uri()], capture_output=True, text=True, timeout=120).stdout
    finally:
        probe.unlink()
        shutil.rmtree(profile, ignore_errors=True)
    found = re.search(r'<pre id="table-widths">(.*?)</pre>', dom, re.S)
    if found is None:
        raise RuntimeError(f"{page}: the page did not load in Chromium")
    import html
    import json

    return json.loads(html.unescape(found.group(1)))


def main(argv: list) -> int:
    site = Path(argv[0])
    width = int(argv[1]) if len(argv) > 1 else 1280
    bad = {}
    pages = sorted(p for p in site.rglob("*.html") if "assets" not in p.parts and p.name != "404.html")
    for page in pages:
        wide = wide_tables(page, width)
        if wide:
            bad[str(page.relative_to(site))] = wide
    for page, tables in bad.items():
        print(f"{page}: tables wider than the page at {width} px: {tables}", file=sys.stderr)
    print(f"{len(pages)} pages, {sum(map(len, bad.values()))} tables too wide at {width} px")
    return 1 if bad else 0


if __name__ == "__main__":
    if shutil.which("chromium") is None:
        print("chromium is not installed: table widths not checked", file=sys.stderr)
        sys.exit(0 if os.environ.get("TABLE_WIDTHS_REQUIRED") is None else 1)
    sys.exit(main(sys.argv[1:]))
