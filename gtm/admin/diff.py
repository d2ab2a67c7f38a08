"""A readable diff between two versions of the documents: YAML-aware, file by file.

Both sides are loaded and dumped again with sorted keys before they are compared, so a change
of key order, quoting or comments does not show as a change, and what does show is the data.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

TOPOLOGY = "topology.yaml"


@dataclass(frozen=True, slots=True)
class FileDiff:
    file: str
    status: str  # "changed" | "added" | "removed"
    diff: str  # unified diff of the normalised YAML


def _normal(text: str | None) -> list[str]:
    if text is None:
        return []
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError:
        return text.splitlines(keepends=True)  # shown as written; validation says why
    return yaml.safe_dump(data, sort_keys=True, default_flow_style=False).splitlines(keepends=True)


def diff_documents(
    before: tuple[str, Mapping[str, str]] | None, after: tuple[str, Mapping[str, str]]
) -> list[FileDiff]:
    """What changes from ``before`` (topology, policies; None: nothing yet) to ``after``."""
    old_files: dict[str, str] = {}
    if before is not None:
        old_files = {TOPOLOGY: before[0], **{f"policies/{k}": v for k, v in before[1].items()}}
    new_files = {TOPOLOGY: after[0], **{f"policies/{k}": v for k, v in after[1].items()}}
    out: list[FileDiff] = []
    for name in sorted(old_files.keys() | new_files.keys()):
        old, new = old_files.get(name), new_files.get(name)
        lines = list(
            difflib.unified_diff(
                _normal(old),
                _normal(new),
                fromfile=f"active/{name}" if old is not None else "/dev/null",
                tofile=f"proposed/{name}" if new is not None else "/dev/null",
            )
        )
        if not lines:
            continue
        status = "added" if old is None else "removed" if new is None else "changed"
        out.append(FileDiff(name, status, "".join(lines)))
    return out


__all__ = ["FileDiff", "diff_documents"]
