"""The README's links resolve: every relative link names a file of this repository (and a heading of it,
when it has an anchor); the docs' runnable snippets print what the docs say they print. The site's own
links are checked by `mkdocs build --strict` (`make docs`, part of `make test`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+\s+(.+?)\s*$", re.MULTILINE)
SNIPPET = re.compile(
    r"<!-- snippet: (?P<name>[\w-]+).*?-->\n```python\n(?P<code>.*?)```\n.*?```text\n(?P<out>.*?)```", re.S
)
"""A runnable snippet: a marker comment, a python block, then the text block of what it prints."""


def anchors(markdown_file: Path) -> set[str]:
    """The anchors mkdocs gives the file's headings (its toc extension's slugs)."""
    return {slugify(title, "-") for title in HEADING.findall(markdown_file.read_text())}


def test_every_relative_link_of_the_readme_resolves():
    links = [t for t in LINK.findall((REPO / "README.md").read_text()) if "://" not in t]
    assert links, "the README points into docs/"
    for target in links:
        path, _, anchor = target.partition("#")
        assert (REPO / path).is_file(), f"README links {target}: no such file"
        if anchor:
            assert anchor in anchors(REPO / path), f"README links {target}: no such heading"


def snippets(markdown_file: Path) -> list[tuple[str, str, str]]:
    """(name, code, expected stdout) of each marked snippet of the page."""
    return [(m["name"], m["code"], m["out"]) for m in SNIPPET.finditer(markdown_file.read_text())]


def test_the_quick_start_page_holds_its_snippet():
    assert [name for name, _, _ in snippets(REPO / "docs" / "quickstart.md")] == ["quickstart"]


@pytest.mark.slow  # an aot_eager compile of a tiny model, about 20 s on two cores
@pytest.mark.subprocess
@pytest.mark.parametrize("name, code, expected", snippets(REPO / "docs" / "quickstart.md"))
def test_a_docs_snippet_prints_what_the_docs_show(tmp_path, name, code, expected):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected, f"docs snippet {name!r}: update its output block\n{result.stdout}"
