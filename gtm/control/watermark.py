"""This reader's own copy of the verified control log, kept on its own disk.

The database can be rolled back by whoever holds its password; this file cannot (it is the
reader's own). Every entry the reader accepted is appended here, so after a restart it starts
from what it verified before, not from what the database says now: a log cut back, forked or
missing entries is refused by comparison with this copy, and the reader keeps acting on the
state folded from it (a drain it accepted stays in force). Entries are re-verified when read
back (signature and link); a line that does not verify ends the copy there, and is said.

One JSON object per line, appended and fsynced; a line cut short by a crash is dropped.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import orjson
import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from gtm.control.entry import BadEntry, Entry, check, from_row
from gtm.control.state import ControlState, fold

log = structlog.get_logger(__name__)


def read(path: Path, keys: Mapping[str, Ed25519PublicKey]) -> ControlState | None:
    """The state folded from the copy (None: there is none yet)."""
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return None
    state = ControlState()
    for n, line in enumerate(lines, 1):
        try:
            entry = from_row(orjson.loads(line))
            check(entry, keys, (state.seq, state.head))
        except (orjson.JSONDecodeError, BadEntry, AttributeError) as exc:
            if n < len(lines):  # not a last line cut short by a crash: say so
                log.error("control_log.replica_damaged", path=str(path), line=n, error=str(exc))
            break
        fold(state, entry)
    return state


def _last_seq(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            tail = f.read().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(tail):
        try:
            seq = orjson.loads(line).get("seq")
        except (orjson.JSONDecodeError, AttributeError):
            continue
        if isinstance(seq, int):
            return seq
    return 0


def append(path: Path, entries: Iterable[Entry]) -> None:
    """Append the entries the copy does not have yet (two readers in one process sharing a
    copy, or a refresh racing a commit, never write one twice)."""
    last = _last_seq(path)
    entries = [e for e in entries if e.seq > last]
    lines = b"".join(
        orjson.dumps(
            {
                "seq": e.seq,
                "prev_hash": e.prev_hash,
                "at_us": e.at_us,
                "kind": e.kind,
                "principal": e.principal,
                "body": e.body_text(),
                "key_id": e.key_id,
                "signature": e.signature,
            }
        )
        + b"\n"
        for e in entries
    )
    if not lines:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, lines)
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["append", "read"]
