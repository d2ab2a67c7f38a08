"""The tally journal: answers counted between seals, on disk within a journal interval.

The writer (:mod:`gtm.audit.writer`) seals the tallies of a window into chained rows once per
flush interval (about a second). Between seals every answer is an integer in memory, and a
``kill -9`` used to lose the whole open window: tens of thousands of answers at 50,000 a second.
The journal narrows that to one journal interval (``GTM_AUDIT_JOURNAL_INTERVAL_S``, 100 ms):
on that interval the writer's background task takes what was counted since its last tick and
appends it here, one line per tick; on start after an unclean stop, the lines are replayed into
the store as tallies (sealed, chained and counted like any others) and only what came after the
last line is lost (the gap checkpoint starts there).

Durability: lines are written with plain ``write()``, no fsync. A ``kill -9`` (or any crash of
the process) does not lose what ``write()`` handed to the kernel's page cache; losing power
does, and against that only the seal's fsync of the spool stands (a window of about a second,
as before). Fsyncing ten times a second per worker would cost far more than it buys.

Format. One file per window (``audit-<node>.journal-<generation>``, mode 0600, in the spool
directory); the generation goes up by one per seal. The first line is a header (node, store,
generation), each later line one tick or a part of one: the tick's time, the decisions new to
this file in full (defined once per file and then referred to by number), and per decision the
answers counted, first and last answer. A tick of many decisions is cut into lines of a few
hundred, all but the last marked continued (``"c"``); its answers count as recovered through
its time once its last line is read. Each line carries a MAC (HMAC-SHA256 under a key derived
from the chain's key, like spool lines) over the generation, its line number and its text, so
a line edited, moved to another line or file, or a file renamed, does not verify. The header
names the audit store: a journal of another store is refused whole (``store-id``, as the spool
is bound).

Sealing a window records its generation in the spool's chain state in the same step as the
rows (:meth:`gtm.audit.spool.Spool.append_lines`), then deletes the window's file: a file whose
generation is sealed already is stale (the process died between the two) and is deleted at
start, not replayed, so no answer is counted twice.

A line that does not verify, does not parse, or refers to a decision no verified line defined
is refused: kept aside with its file, line number and reason in ``audit-<node>.rejected`` (the
spool's), logged and counted (``gtm_audit_journal_rejected``), never replayed and never
silently dropped. A torn last line (the process died inside ``write()``) is refused the same
way. A file cut short after a verified line cannot be told from a crash that came there: the
answers cut off are inside the gap the restart signs, as are those of a file deleted whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import operator
import os
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import structlog
from prometheus_client import Counter

from gtm.audit.record import AuditRecord
from gtm.audit.spool import Spool, write_all

log = structlog.get_logger(__name__)

JOURNAL_REJECTED = Counter(
    "gtm_audit_journal_rejected",
    "Tally journal lines refused at replay (MAC, parse, another store, torn by the crash)",
)
JOURNAL_REPLAYED = Counter(
    "gtm_audit_journal_replayed_answers",
    "Answers recovered from the tally journal after an unclean stop (sealed into the store)",
)

# (record, answers, first answer, last answer), unix seconds: what the writer seals.
JournalTally = tuple[AuditRecord, int, float, float]

_HEADER = b"H"
_TICK = b"T"
_VERSION = 1
# Definitions, or answer pairs, per line of a tick (about 500 bytes a definition).
_PER_LINE = 256
# A decision is written as the JSON array of its record's fields, in this order (the header's
# version names the order): one C call, where rendering its row form costs twenty times as
# much, and a tick is on the clock (its answers are in memory only until it is written).
_FIELDS = tuple(f.name for f in dataclasses.fields(AuditRecord) if f.init)
_fields_of = operator.attrgetter(*_FIELDS)


@dataclass(frozen=True, slots=True)
class JournalProblem:
    path: str
    line: int
    reason: str


@dataclass(slots=True)
class Recovered:
    """What :meth:`Journal.recover` found: the answers to replay, merged per decision."""

    tallies: list[JournalTally] = field(default_factory=list)
    answers: int = 0
    through: float | None = None  # the newest replayed tick: answers counted before it are here
    generation: int = 0  # the highest generation seen (replayed, stale or refused)
    files: int = 0  # files replayed (a line or more used)
    problems: list[JournalProblem] = field(default_factory=list)


def encode_record(record: AuditRecord) -> bytes:
    """A record as the journal writes it (:func:`decode_record` reads it back)."""
    return orjson.dumps(_fields_of(record))


_INTS = frozenset({"snapshot_version", "ttl"})
_STRINGS = frozenset({"residency_classes", "matched_rules", "answer"})


def _well_typed(name: str, value: Any) -> bool:
    if name in _INTS:
        return type(value) is int
    if name in _STRINGS:
        return isinstance(value, list) and all(isinstance(x, str) for x in value)
    if name == "candidates":
        return isinstance(value, list) and all(
            isinstance(c, list) and len(c) == 4 and all(isinstance(x, str) for x in c)
            for c in value
        )
    return value is None or isinstance(value, str)


def decode_record(values: Any) -> AuditRecord:
    """The record :func:`encode_record` wrote; ValueError when it is not one."""
    if not isinstance(values, list) or len(values) != len(_FIELDS):
        raise ValueError("not a decision record")
    given = dict(zip(_FIELDS, values, strict=True))
    wrong = [name for name, value in given.items() if not _well_typed(name, value)]
    if wrong:
        raise ValueError(f"a field of the wrong type: {wrong[0]}")
    for name in _STRINGS:
        given[name] = tuple(given[name])
    given["candidates"] = tuple(tuple(c) for c in given["candidates"])
    return AuditRecord(**given)


class Journal:
    """One node's tally journal in its spool directory.

    :meth:`encode` runs on the event loop (it renders decisions new to the window's file);
    :meth:`write`, :meth:`drop_through` and :meth:`close` run in the writer's journal thread,
    one at a time and in order; :meth:`recover` runs at start, before any of them."""

    def __init__(self, spool: Spool, node: str) -> None:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node)
        self.spool = spool
        self.node = node
        self.directory = spool.directory
        self.prefix = f"audit-{safe}.journal-"
        self._pattern = re.compile(re.escape(self.prefix) + r"(\d+)")
        self._key = hashlib.sha256(b"gtm audit journal mac\0" + spool.key.mac_key).digest()
        # Loop side: the generation being encoded, and its decisions already defined in it.
        self._encoding = -1
        self._defined = 0  # decisions of the window (by index) defined in the file so far
        # Thread side: the open file and the next line number in it.
        self._fd: int | None = None
        self._fd_generation = -1
        self._line = 0

    def path(self, generation: int) -> Path:
        return self.directory / f"{self.prefix}{generation}"

    def generations(self) -> list[int]:
        """Generations with a file in the spool directory, oldest first."""
        found = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.directory):
                match = self._pattern.fullmatch(entry.name)
                if match is not None:
                    found.append(int(match.group(1)))
        return sorted(found)

    def _mac(self, generation: int, line: int, text: bytes) -> bytes:
        message = b"%d:%d:%s" % (generation, line, text)
        return hmac.digest(self._key, message, hashlib.sha256).hex().encode()

    # -- writing (the writer's background task, then its journal thread) ---------------------

    def encode(
        self,
        generation: int,
        at: float,
        records: list[AuditRecord],
        numbers: array[int],
        spans: array[float],
    ) -> Iterator[bytes]:
        """One tick's line bodies: the window's decisions not yet defined in its file (those
        with an index past the last tick's, from ``records``, the window's in order), and per
        decision answered in the tick its index and answers (``numbers``, in pairs) and its
        first and last answer in unix seconds (``spans``, in pairs; JSON keeps a float exact).

        A tick is cut into lines of at most :data:`_PER_LINE` definitions or answer pairs,
        definitions first (a line refers only to decisions defined on it or before it), every
        line but the last marked continued (``"c":1``): the first tick of a window defines
        every decision answered in it, thousands under a flood of distinct clients, and one
        line for all of them was several copies of megabytes at once (memray: the largest
        transient in a node's heap). Lines are produced one at a time, as the caller writes."""
        if generation != self._encoding:
            self._encoding, self._defined = generation, 0
        stamp = round(at * 1_000_000)
        pairs = len(numbers) // 2
        while self._defined < len(records):
            start = self._defined
            stop = min(len(records), start + _PER_LINE)
            defs = b",".join(
                b"[%d,%s]" % (i, encode_record(records[i])) for i in range(start, stop)
            )
            self._defined = stop
            last = stop == len(records) and pairs <= _PER_LINE
            yield b'{"at":%d,"d":[%s],"n":%s,"s":%s%s}' % (
                stamp,
                defs,
                orjson.dumps(numbers.tolist()) if last else b"[]",
                orjson.dumps(spans.tolist()) if last else b"[]",
                b"" if last else b',"c":1',
            )
            if last:
                return
        for start in range(0, max(pairs, 1), _PER_LINE):
            stop = min(pairs, start + _PER_LINE)
            yield b'{"at":%d,"d":[],"n":%s,"s":%s%s}' % (
                stamp,
                orjson.dumps(numbers[2 * start : 2 * stop].tolist()),
                orjson.dumps(spans[2 * start : 2 * stop].tolist()),
                b"" if stop == pairs else b',"c":1',
            )

    def write(self, generation: int, body: bytes, store: str | None) -> None:
        """Append one tick to ``generation``'s file (created with its header on first use).
        Plain ``write()``: in the page cache from here on, which a kill -9 does not undo."""
        if self._fd_generation != generation:
            self.close()
            path = self.path(generation)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
            self._fd, self._fd_generation, self._line = fd, generation, 0
            header = orjson.dumps(
                {"v": _VERSION, "node": self.node, "store": store, "generation": generation}
            )
            self._append(_HEADER + b"\t" + header)
        self._append(_TICK + b"\t" + body)

    def _append(self, text: bytes) -> None:
        assert self._fd is not None
        self._line += 1
        write_all(self._fd, b"%s\t%s\n" % (text, self._mac(self._fd_generation, self._line, text)))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._fd_generation, self._line = None, -1, 0

    def drop_through(self, generation: int) -> None:
        """The windows through ``generation`` are sealed (their rows fsynced in the spool):
        their files go."""
        if self._fd is not None and self._fd_generation <= generation:
            self.close()
        for g in self.generations():
            if g <= generation:
                with contextlib.suppress(FileNotFoundError):
                    self.path(g).unlink()

    # -- replay at start ---------------------------------------------------------------------

    def recover(self, sealed: int, store: str | None) -> Recovered:
        """Read the journal files a previous run left: those of windows sealed through
        ``sealed`` are stale and deleted; the rest are verified and their answers returned
        (merged per decision); every refused line is kept aside and reported. The files stay
        until :meth:`drop_through` after the replayed tallies are sealed."""
        out = Recovered(generation=sealed)
        merged: dict[AuditRecord, list[Any]] = {}
        for generation in self.generations():
            out.generation = max(out.generation, generation)
            path = self.path(generation)
            if generation <= sealed:
                log.info("audit.journal_stale", journal=str(path), sealed=sealed)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            try:
                data = path.read_bytes()
            except OSError as exc:
                out.problems.append(JournalProblem(str(path), 0, f"unreadable: {exc}"))
                continue
            used = self._replay_file(path, generation, data, store, merged, out)
            if used:
                out.files += 1
        for record, (n, first, last) in merged.items():
            out.tallies.append((record, n, first, last))
            out.answers += n
        if out.problems:
            self._keep_rejected(out.problems)
        return out

    def _replay_file(
        self,
        path: Path,
        generation: int,
        data: bytes,
        store: str | None,
        merged: dict[AuditRecord, list[Any]],
        out: Recovered,
    ) -> int:
        lines = data.split(b"\n")
        torn = lines.pop()  # after the last newline: empty unless a write was cut short
        problems = out.problems
        where = str(path)
        defined: dict[int, AuditRecord] = {}
        refused_defs = False
        used = 0
        header_ok = False
        for number, line in enumerate(lines, 1):
            text, _, mac = line.rpartition(b"\t")
            if not text or not hmac.compare_digest(mac, self._mac(generation, number, text)):
                problems.append(
                    JournalProblem(
                        where,
                        number,
                        "MAC does not verify: the line was altered, moved or written by "
                        "something else",
                    )
                )
                refused_defs = True
                if number == 1:
                    break
                continue
            kind, _, body = text.partition(b"\t")
            if number == 1:
                reason = self._check_header(kind, body, generation, store)
                if reason is not None:
                    problems.append(JournalProblem(where, 1, reason))
                    break
                header_ok = True
                continue
            try:
                tick = orjson.loads(body) if kind == _TICK else None
                if not isinstance(tick, dict):
                    raise ValueError("not a tick")
                at = float(tick["at"]) / 1_000_000
                new = {int(i): decode_record(values) for i, values in tick["d"]}
                numbers, spans = tick["n"], tick["s"]
                if len(numbers) != len(spans) or len(numbers) % 2:
                    raise ValueError("answers and times do not pair up")
                entries = [
                    (int(numbers[k]), int(numbers[k + 1]), float(spans[k]), float(spans[k + 1]))
                    for k in range(0, len(numbers), 2)
                ]
            except (ValueError, KeyError, TypeError) as exc:
                problems.append(
                    JournalProblem(where, number, f"MAC verifies but unreadable: {exc}")
                )
                refused_defs = True
                continue
            defined.update(new)
            missing = [i for i, *_ in entries if i not in defined]
            if missing:
                why = "defined on a refused line" if refused_defs else "never defined"
                problems.append(
                    JournalProblem(where, number, f"refers to decision #{missing[0]}, {why}")
                )
                continue
            for i, n, first, last in entries:
                if n <= 0:
                    continue
                entry = merged.get(defined[i])
                if entry is None:
                    merged[defined[i]] = [n, first, last]
                else:
                    entry[0] += n
                    entry[1] = min(entry[1], first)
                    entry[2] = max(entry[2], last)
            if not tick.get("c"):
                # The tick's last line: every answer counted before ``at`` is in the file. (A
                # crash between the lines of one tick keeps the answers of those written.)
                out.through = at if out.through is None else max(out.through, at)
            used += 1
        else:
            if torn:
                problems.append(
                    JournalProblem(
                        where,
                        len(lines) + 1,
                        "torn: the process stopped while writing this line (not used)",
                    )
                )
        if not header_ok and len(lines) > 1:
            problems.append(
                JournalProblem(
                    where, 2, f"lines 2-{len(lines)} not used: the file's header was refused"
                )
            )
        return used

    def _check_header(
        self, kind: bytes, body: bytes, generation: int, store: str | None
    ) -> str | None:
        try:
            header = orjson.loads(body) if kind == _HEADER else None
        except orjson.JSONDecodeError:
            header = None
        if not isinstance(header, dict):
            return "not a journal header"
        if header.get("node") != self.node or header.get("generation") != generation:
            return (
                f"header names node {header.get('node')!r} generation "
                f"{header.get('generation')!r}, this file is node {self.node!r} generation "
                f"{generation}: not replayed"
            )
        theirs = header.get("store")
        if theirs is not None and store is not None and theirs != store:
            return (
                f"this journal belongs to audit store {theirs}, this spool and its database "
                f"to store {store}: not replayed (its answers are not this store's)"
            )
        return None

    def _keep_rejected(self, problems: list[JournalProblem]) -> None:
        texts: dict[str, list[bytes]] = {}
        path = self.spool.rejected_path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as f:
            for p in problems:
                if p.path not in texts:
                    try:
                        texts[p.path] = Path(p.path).read_bytes().split(b"\n")
                    except OSError:
                        texts[p.path] = []
                lines = texts[p.path]
                text = lines[p.line - 1] if 0 < p.line <= len(lines) else b""
                entry = {
                    "file": Path(p.path).name,
                    "line": p.line,
                    "reason": p.reason,
                    "text": text.decode("utf-8", "replace"),
                }
                f.write(orjson.dumps(entry) + b"\n")
                log.error("audit.journal_line_refused", journal=p.path, line=p.line,
                          reason=p.reason)  # fmt: skip
            f.flush()
            os.fsync(f.fileno())
        JOURNAL_REJECTED.inc(len(problems))


__all__ = [
    "JOURNAL_REPLAYED",
    "Journal",
    "JournalProblem",
    "Recovered",
    "decode_record",
    "encode_record",
]
