"""The local write-ahead spool of audit rows.

Every flushed batch is appended here (and fsynced) before it is sent to the database, and the
file is emptied only after the database has committed it. A database outage, a crash or a
shutdown with the database away therefore loses no counted decision: the next drain replays the
file, skipping rows the database already holds (by ``node_seq``). The spool also remembers the
last sequence number and hash, so a node continues its chain without asking the database.
"""

from __future__ import annotations

import contextlib
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
        if rows:
            lines = [orjson.dumps(r) + b"\n" for r in rows]
            self.append_lines(lines, rows[-1]["node_seq"], rows[-1]["row_hash"])

    def append_lines(self, lines: list[bytes], last_seq: int, last_hash: str) -> None:
        """Append rows already rendered as JSON lines (each ending in a newline) and fsync,
        then remember the chain's end (``last_seq``, ``last_hash``). A write torn by a crash
        leaves a partial last line: the append starts a new line after it, so the torn line
        never swallows the first row written after it."""
        if not lines:
            return
        with open(self.path, "a+b") as f:  # writes go to the end whatever was read
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        self._save_state(last_seq, last_hash)

    def pending(self) -> list[dict[str, Any]]:
        """Rows waiting for the database, in order. An unreadable line (a write torn by a
        crash) is skipped: it was never acknowledged as flushed. Rows after it still count;
        if rows were lost with it, the chain shows the gap (``gtm audit verify``)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        rows = []
        for line in data.splitlines():
            if line:
                with contextlib.suppress(orjson.JSONDecodeError):
                    rows.append(orjson.loads(line))
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
