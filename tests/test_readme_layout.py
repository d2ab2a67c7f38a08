"""README's "Layout" tree matches the packages: every package and module it names exists, and
every package and module of both tiers is named (as ``name.py`` under its folder, or as a word
in its folder's line)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

TIERS = ("gtm", "regional_lb")
_DESCRIPTION_COLUMN = 20  # deeper lines continue the description of the line above


def _layout_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1]
    block = section.split("```\n", 2)[1]
    return block.splitlines()


def _read_tree() -> tuple[set[Path], dict[Path, set[str]]]:
    """The paths the tree names, and the words describing each folder."""
    named: set[Path] = set()
    words: dict[Path, set[str]] = {}
    stack: list[tuple[int, Path]] = []
    for line in _layout_block():
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= _DESCRIPTION_COLUMN:
            continue
        names, _, description = line.strip().partition("  ")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else Path()
        for token in names.split():
            if token.endswith("/"):
                folder = parent / token.rstrip("/")
                named.add(folder)
                words[folder] = set(re.findall(r"\w+", description))
                stack.append((indent, folder))
            else:
                named.add(parent / token)
    return named, words


def test_every_name_in_the_tree_exists() -> None:
    named, _ = _read_tree()
    missing = sorted(str(p) for p in named if not (ROOT / p).exists())
    assert not missing, f"README Layout names what does not exist: {missing}"


def test_every_package_and_module_is_in_the_tree() -> None:
    named, words = _read_tree()
    unnamed = []
    for tier in TIERS:
        for path in sorted((ROOT / tier).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if "__pycache__" in relative.parts:
                continue
            folder = relative.parent
            if folder not in named:
                unnamed.append(str(folder))
            elif (
                path.name not in ("__init__.py", "__main__.py")
                and relative not in named
                and path.stem not in words.get(folder, set())
            ):
                unnamed.append(str(relative))
    assert not unnamed, f"README Layout does not name: {sorted(set(unnamed))}"
