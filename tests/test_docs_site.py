"""The documentation site holds together without building it: every page in docs/ is in the
mkdocs nav and every nav entry is a page; every relative link of the README and the pages names
a file that exists (and, inside docs/, a heading that exists); the README's two commands are
Makefile targets and CI runs the same test command. ``make docs`` builds the site with
``--strict`` when mkdocs is installed (the ``docs`` extra)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import ROOT

DOCS = ROOT / "docs"
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _nav_files(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, list):
        for item in node:
            yield from _nav_files(item)
    elif isinstance(node, dict):
        for value in node.values():
            yield from _nav_files(value)


def _nav() -> list[str]:
    return list(_nav_files(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]))


def _anchors(page: Path) -> set[str]:
    """The ids mkdocs' toc extension gives a page's headings (lowercase, words joined by -)."""
    text = _FENCE.sub("", page.read_text())
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\s-]", "", heading.lower()).strip()
        out.add(re.sub(r"[\s]+", "-", slug))
    return out


def _links(page: Path) -> list[str]:
    text = _FENCE.sub("", page.read_text())
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    nav = _nav()
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == pages, (
        f"not in the nav: {sorted(set(pages) - set(nav))}; "
        f"in the nav, no page: {sorted(set(nav) - set(pages))}"
    )


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for target in _links(page):
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
            elif page.parent == DOCS and path and DOCS not in file.parents:
                broken.append(f"{page.relative_to(ROOT)}: {target} (outside the site)")
    assert not broken, broken


def test_readme_commands_are_what_make_and_ci_run() -> None:
    readme = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test", "docs"):
        assert f"make {target}" in readme
        assert re.search(rf"^{target}:", makefile, re.M), f"no `{target}` target"
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), re.M)


def test_readme_is_a_front_page() -> None:
    """The README is what fits on a screen or two; the Layout tree is most of it."""
    readme = (ROOT / "README.md").read_text()
    before_layout = readme.split("\n## Layout\n", 1)[0]
    assert len(before_layout.splitlines()) <= 100
    for needed in ("GTM_ADMIN_URL", "GTM_ADMIN_TOKEN", "gtm token create", "var/demo-tokens"):
        assert needed in before_layout
