"""docs/index.md lists every page (each docs/*.md and docs/serve/*.md; docs/bench/ holds results and is one
line), and every link in it and in the README resolves: to a file or folder of the repository, and for a link
into a markdown page with ``#anchor``, to one of that page's headings."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
INDEX = DOCS / "index.md"
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links(page: Path) -> list[str]:
    """The relative targets of ``page``'s markdown links (code blocks skipped; web addresses left out)."""
    text = re.sub(r"^(````|```).*?^\1\s*$", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for ``page``'s headings: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#+\s+(.*?)\s*$", page.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def _broken(page: Path) -> list[str]:
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no such heading)")
    return broken


def test_the_index_links_every_page():
    pages = {p.resolve() for p in [*DOCS.glob("*.md"), *(DOCS / "serve").glob("*.md")] if p != INDEX}
    linked = {(INDEX.parent / t.partition("#")[0]).resolve() for t in _links(INDEX)}
    missing = sorted(str(p.relative_to(DOCS.parent)) for p in pages - linked)
    assert not missing, f"docs/index.md does not list {missing}: add one line for each"


def test_every_link_in_the_index_resolves():
    assert not _broken(INDEX), _broken(INDEX)


def test_every_link_in_the_readme_resolves():
    assert not _broken(ROOT / "README.md"), _broken(ROOT / "README.md")
