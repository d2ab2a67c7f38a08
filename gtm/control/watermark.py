"""The highest control-log entry a reader accepted, kept on its own disk.

The database can be rolled back by whoever holds its password; this file cannot (it is the
reader's own). A log whose entry at this sequence is missing or has another hash was cut back or
forked, and is refused. Written atomically (temporary file, fsync, rename): a crash leaves the
old mark or the new one, never half of one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import orjson


@dataclass(frozen=True, slots=True)
class Mark:
    seq: int
    hash: str


class BadMark(Exception):
    """The mark file exists but cannot be read: refuse, never start from nothing."""


def read(path: Path) -> Mark | None:
    try:
        data = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, orjson.JSONDecodeError) as exc:
        raise BadMark(f"{path}: {exc}") from None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("seq"), int)
        or not isinstance(data.get("hash"), str)
    ):
        raise BadMark(f"{path}: not a control-log mark")
    return Mark(data["seq"], data["hash"])


def write(path: Path, mark: Mark) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(orjson.dumps({"seq": mark.seq, "hash": mark.hash}))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


__all__ = ["BadMark", "Mark", "read", "write"]
