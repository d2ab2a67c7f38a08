"""The local write-ahead spool of audit rows.

Every flushed batch is appended here (and fsynced) before it is sent to the database, and the
file is emptied only after the database has committed it. A database outage, a crash or a
shutdown with the database away therefore loses no counted decision: the next drain replays the
file, skipping rows the database already holds (by ``node_seq``). The spool also remembers the
last sequence number and hash, so a node continues its chain without asking the database.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import orjson

from gtm.audit.record import GENESIS


class Spool:
    def __init__(self, directory: Path, node: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node)
        self.path = directory / f"audit-{safe}.jsonl"
        self.state_path = directory / f"audit-{safe}.chain.json"

    def append(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        data = b"".join(orjson.dumps(r) + b"\n" for r in rows)
        with open(self.path, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._save_state(rows[-1]["node_seq"], rows[-1]["row_hash"])

    def pending(self) -> list[dict[str, Any]]:
        """Rows waiting for the database, in order. A torn last line (crash mid-write) is
        dropped, and cut from the file: it was never acknowledged as flushed, and rows appended
        after it would otherwise run on from it into one unreadable line, lost to every later
        replay."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        rows = []
        good = 0  # bytes up to the end of the last readable line
        for line in data.split(b"\n"):
            if not line:
                good += 1
                continue
            try:
                rows.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                break
            good += len(line) + 1
        good = min(good, len(data))
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
                f.flush()
                os.fsync(f.fileno())
        return rows

    def clear(self) -> None:
        with open(self.path, "w", encoding="utf-8") as f:
            f.flush()
            os.fsync(f.fileno())

    def chain_state(self) -> tuple[int, str] | None:
        """(last node_seq, last row_hash) this node wrote, if it ever wrote here."""
        try:
            state = json.loads(self.state_path.read_text(encoding="utf-8"))
            return int(state["node_seq"]), str(state["row_hash"])
        except (FileNotFoundError, KeyError, ValueError):
            return None

    def _save_state(self, seq: int, digest: str) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"node_seq": seq, "row_hash": digest}), encoding="utf-8")
        os.replace(tmp, self.state_path)


__all__ = ["GENESIS", "Spool"]
