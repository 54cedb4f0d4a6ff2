"""The README's links resolve: every relative link names a file of this repository (and a heading of it,
when it has an anchor). The site's own links are checked by `mkdocs build --strict` (`make docs`, part
of `make test`)."""

from __future__ import annotations

import re
from pathlib import Path

from markdown.extensions.toc import slugify

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+\s+(.+?)\s*$", re.MULTILINE)


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
