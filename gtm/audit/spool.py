"""The local write-ahead spool of audit rows.

Every flushed batch is appended here (and fsynced) before it is sent to the database, and the
file is emptied only after the database has committed it. A database outage, a crash or a
shutdown with the database away therefore loses no counted decision: the next drain replays the
file, skipping rows the database already holds (by ``node_seq``). The spool also remembers the
chain's end (sequence, hash, answers counted), so a node continues its chain without asking the
database.

The spool is evidence on its way to the database, so it is guarded like it:

* files are created mode 0600;
* each line carries a MAC (HMAC-SHA256 under a key derived from the chain's signing key,
  :mod:`gtm.audit.keys`): a line edited on disk, even with its hashes recomputed, fails the MAC
  and is refused at replay; it is moved, with the reason and its line number, to
  ``audit-<node>.rejected`` and counted (``gtm_audit_spool_rejected_total``), never replayed and
  never silently dropped;
* the spool names the audit store it belongs to (``store-id``): rows spooled for one database
  are never replayed into another (:meth:`Spool.bind`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import orjson
import structlog

from gtm import metrics
from gtm.audit.keys import KEY_NAME, ChainKey, load_or_create
from gtm.audit.record import GENESIS
from gtm.errors import ConfigError, Problem

log = structlog.get_logger(__name__)


class ChainHead(NamedTuple):
    seq: int
    hash: str
    answers: int  # answers counted by the chain's rows up to seq


class Rejected(NamedTuple):
    line: int
    reason: str


def _replace_private(path: Path, fill: Callable[[BinaryIO], object]) -> None:
    """Replace ``path`` atomically with what ``fill`` writes, mode 0600 from the first byte."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        fill(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_private(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically, mode 0600 from the first byte."""
    _replace_private(path, lambda f: f.write(data))


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written (a write may take part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _cut_private(path: Path, offset: int) -> int:
    """Replace ``path`` with its bytes from ``offset`` on, atomically, mode 0600 from the first
    byte; copied a chunk at a time (a spool behind a slow database holds tens of megabytes).
    Returns the bytes kept."""
    with path.open("rb") as src:
        src.seek(offset)
        _replace_private(path, lambda f: shutil.copyfileobj(src, f, _COPY_CHUNK))
    return path.stat().st_size


_COPY_CHUNK = 1 << 18  # 256 KiB: the copy is transient heap (memray: 2 MiB at 1 MiB chunks)


class Spool:
    def __init__(self, directory: Path, node: str, key: ChainKey | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node)
        self.directory = directory
        self.path = directory / f"audit-{safe}.jsonl"
        self.state_path = directory / f"audit-{safe}.chain.json"
        self.rejected_path = directory / f"audit-{safe}.rejected"
        self.running_path = directory / f"audit-{safe}.running"
        self.store_path = directory / "store-id"
        self.key = key if key is not None else load_or_create(directory / KEY_NAME)
        self._mac_key = self.key.mac_key
        self.rejected: list[Rejected] = []  # refused at the last read, for reports and tests
        # Offsets handed out (appends' ends, reads' ends) are logical: bytes ever written to
        # the file. ``_base`` is the logical offset of the file's first byte, so an end handed
        # out before a discard still names the same row after it.
        self._base = 0
        # Bytes at the file's start whose rows the database has (discarded), not yet cut off:
        # a writer draining a long spool a part at a time cuts the file once at least half of
        # it is done with, not after every part (each cut rewrites what follows).
        self._skip = 0
        # The newest tally-journal generation whose window is sealed in this spool
        # (gtm.audit.journal): saved with the chain's end, so a journal file left behind by a
        # crash between the two steps of a seal is known to be in the rows already.
        self.journal_sealed = self._state_int("journal")
        # Set at start when the journal was replayed: the newest moment from which counts were
        # recovered, which :meth:`last_written_at` reports instead of the last flush.
        self.recovered_through: float | None = None
        for path in (self.path, self.state_path):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(path, 0o600)  # spools written before they were private

    # -- the store it belongs to -----------------------------------------------------------------

    def bind(self, store_id: str) -> None:
        """Bind this spool to audit store ``store_id``: the first time, remember it; after
        that, refuse (:class:`ConfigError`) a different store rather than continue one store's
        chain in another or replay one store's rows into another."""
        try:
            bound = self.store_path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            _write_private(self.store_path, store_id.encode())
            return
        if bound != store_id:
            raise ConfigError(
                [
                    Problem(
                        str(self.store_path),
                        "",
                        f"this spool belongs to audit store {bound}, the database is store "
                        f"{store_id}: point GTM_SPOOL_DIR at this store's spool (or a new, "
                        "empty directory for a new store), or GTM_DATABASE_URL at its database",
                    )
                ]
            )

    def bound_store(self) -> str | None:
        try:
            return self.store_path.read_text(encoding="utf-8").strip() or None
        except FileNotFoundError:
            return None

    # -- rows --------------------------------------------------------------------------------------

    def _mac(self, body: bytes) -> bytes:
        return hmac.digest(self._mac_key, body, hashlib.sha256).hex().encode()

    def append(self, rows: list[dict[str, Any]], answers: int = 0) -> None:
        if rows:
            lines = [orjson.dumps(r) + b"\n" for r in rows]
            self.append_lines(lines, rows[-1]["node_seq"], rows[-1]["row_hash"], answers)

    def append_lines(
        self,
        lines: Iterable[bytes],
        last_seq: int,
        last_hash: str,
        answers: int = 0,
        *,
        journal: int | None = None,
    ) -> int:
        """Append rows already rendered as JSON lines (each ending in a newline) with their
        MACs and fsync, then remember the chain's end (and ``journal``, the tally-journal
        generation these rows seal, if any); returns the spool's size after the
        append (where these rows end: :meth:`discard_through`). A write torn by a crash leaves
        a partial last line: the append starts a new line after it, so the torn line never
        swallows the first row written after it."""
        rest = iter(lines)
        first = next(rest, None)
        if first is None:
            return self._base + self.size()
        mac = self._mac
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            if start > 0 and os.pread(fd, 1, start - 1) != b"\n":
                write_all(fd, b"\n")
            try:
                # Lines are rendered as they are written (gtm.audit.writer): a window's are not
                # all held at once. Written a chunk at a time by os.write, no buffer of ours.
                chunk: list[bytes] = []
                size = 0
                for line in itertools.chain((first,), rest):
                    entry = b"%s\t%s\n" % (line[:-1], mac(line[:-1]))
                    chunk.append(entry)
                    size += len(entry)
                    if size >= _COPY_CHUNK:
                        write_all(fd, b"".join(chunk))
                        chunk, size = [], 0
                write_all(fd, b"".join(chunk))
                os.fsync(fd)
            except BaseException:
                # A failure part way (a full disk, a line that would not render) leaves no rows
                # past the chain's saved end: a later append would chain after them otherwise.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)
                raise
            end = self._base + os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
        if journal is not None:
            self.journal_sealed = max(self.journal_sealed, journal)
        self._save_state(ChainHead(last_seq, last_hash, answers))
        return end

    def pending(self) -> list[dict[str, Any]]:
        return self.pending_through()[0]

    def pending_through(self, max_rows: int | None = None) -> tuple[list[dict[str, Any]], int]:
        """Rows waiting for the database, in order, and the logical offset where they end: all
        of them, or the first ``max_rows`` (a writer that fell behind drains the spool a part at
        a time, so reading it back costs bounded memory). A line whose MAC does not verify
        (edited on disk, or torn by a crash: never acknowledged as flushed) is refused, kept
        aside with the reason in ``audit-<node>.rejected`` and counted; rows after it still
        count, and if rows were lost with it, the chain shows the gap (``gtm audit verify``)."""
        try:
            f = self.path.open("rb")
        except FileNotFoundError:
            return [], self._base
        rows: list[dict[str, Any]] = []
        kept: list[bytes] = []
        lines: list[bytes] = []
        self.rejected = []
        consumed = 0
        unread = b""  # the line read past the last row taken, when max_rows cut the read
        with f:
            f.seek(self._skip)
            for raw in f:
                if max_rows is not None and len(rows) >= max_rows:
                    unread = raw
                    break
                consumed += len(raw)
                line = raw.rstrip(b"\n")
                lines.append(line)
                if not line:
                    continue
                body, _, mac = line.rpartition(b"\t")
                reason = None
                if not body:
                    reason = "no MAC (torn write, or written by something else)"
                elif not hmac.compare_digest(mac, self._mac(body)):
                    reason = "MAC does not verify: the line was altered after it was written"
                else:
                    try:
                        rows.append(orjson.loads(body))
                        kept.append(line + b"\n")
                    except orjson.JSONDecodeError:
                        reason = "MAC verifies but the row does not parse"
                if reason is not None:
                    self.rejected.append(Rejected(len(lines), reason))
            rest = unread + f.read() if self.rejected else b""
        if self.rejected:
            self._keep_rejected(lines)
            # Set aside once: the spool keeps only the lines that verify, so a retry while the
            # database is away does not refuse (and count) the same line again.
            compact = b"".join(kept)
            _write_private(self.path, compact + rest)
            # The refused bytes count as discarded, like the skipped ones before them: later
            # offsets keep their meaning.
            self._base += self._skip + consumed - len(compact)
            self._skip = 0
            return rows, self._base + len(compact)
        return rows, self._base + self._skip + consumed

    def _keep_rejected(self, lines: list[bytes]) -> None:
        fd = os.open(self.rejected_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as f:
            for r in self.rejected:
                entry = {
                    "line": r.line,
                    "reason": r.reason,
                    "text": lines[r.line - 1].decode("utf-8", "replace"),
                }
                f.write(orjson.dumps(entry) + b"\n")
                log.error("audit.spool_line_refused", spool=str(self.path), line=r.line,
                          reason=r.reason)  # fmt: skip
            f.flush()
            os.fsync(f.fileno())
        metrics.AUDIT_SPOOL_REJECTED.inc(len(self.rejected))

    def clear(self) -> None:
        self._base += self.size()
        self._skip = 0
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.flush()
            os.fsync(f.fileno())

    def discard_through(self, end: int) -> None:
        """Forget the rows up to the logical offset ``end`` (an append's or a read's end: rows
        the database committed), keeping whatever was appended after them. Flushes seal and
        spool while an earlier flush's rows are still being inserted, so the spool may hold
        more than the drain that calls this took."""
        cut = end - self._base
        if cut <= self._skip:
            return  # an earlier discard took these already
        size = self.size()
        if cut >= size:
            self.clear()
            return
        self._skip = cut
        if 2 * cut < size:
            # Skipped by reads until more than half the file is: then cut off. (In memory
            # only: after a crash the replay reads them again and the database's sequence
            # numbers skip them.)
            return
        self._skip = 0
        _cut_private(self.path, cut)
        self._base += cut

    def line_count(self) -> int:
        """Rows the spool holds (lines past the part already discarded), counted without
        parsing them."""
        try:
            f = self.path.open("rb")
        except FileNotFoundError:
            return 0
        count = 0
        with f:
            f.seek(self._skip)
            while chunk := f.read(1 << 20):
                count += chunk.count(b"\n")
        return count

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    # -- the chain's end ---------------------------------------------------------------------------

    def chain_head(self) -> ChainHead | None:
        """The end of the chain this node wrote here (sequence, hash, answers), if it ever did."""
        try:
            state = json.loads(self.state_path.read_text(encoding="utf-8"))
            return ChainHead(
                int(state["node_seq"]), str(state["row_hash"]), int(state.get("answers", 0))
            )
        except (FileNotFoundError, KeyError, ValueError):
            return None

    def last_written_at(self) -> float | None:
        """When the chain's end was last saved (its last flush), if ever; after a start that
        replayed the tally journal, the newest moment it recovered counts through."""
        if self.recovered_through is not None:
            return self.recovered_through
        try:
            return self.state_path.stat().st_mtime
        except FileNotFoundError:
            return None

    def _state_int(self, key: str) -> int:
        try:
            return int(json.loads(self.state_path.read_text(encoding="utf-8")).get(key, 0))
        except (FileNotFoundError, ValueError, AttributeError, TypeError):
            return 0

    def _save_state(self, head: ChainHead) -> None:
        body = {"node_seq": head.seq, "row_hash": head.hash, "answers": head.answers}
        if self.journal_sealed:
            body["journal"] = self.journal_sealed
        _write_private(self.state_path, json.dumps(body).encode())


__all__ = ["GENESIS", "ChainHead", "Rejected", "Spool"]
