"""The shapes a flush works in, and the decisions table's columns as the writer fills them.

A window's tallies merged by record (:class:`Window`), the rows one seal chained
(:class:`Batch`: compact until the database has them), and the parameters those rows become for
an INSERT or a COPY. Pure data and rendering: the writer (:mod:`gtm.audit.writer`) seals into
these, the drain (:mod:`gtm.audit.drain`) writes them out.
"""

from __future__ import annotations

import operator
import time
from array import array
from collections.abc import Iterator
from typing import Any

import orjson
from sqlalchemy import JSON

from gtm.audit.pacing import Slices
from gtm.audit.record import AuditRecord, RowForm, row_body, shared
from gtm.audit.schema import decisions
from gtm.audit.spool import Spool
from gtm.decision.memos import tables_mb

COLUMNS = [str(c.name) for c in decisions.c if c.name != "id"]
_JSON_COLUMNS = frozenset(str(c.name) for c in decisions.c if isinstance(c.type, JSON))
_PER_ROW = ("node", "node_seq", "first_at_us", "last_at_us", "count", "prev_hash", "row_hash")
_STATIC = tuple(c for c in COLUMNS if c not in _PER_ROW)
# A row's parameters are assembled as (per-row values) + (the record's static values); this
# picks them into the table's column order (None: already in order).
_ORDER = tuple(
    _PER_ROW.index(c) if c in _PER_ROW else len(_PER_ROW) + _STATIC.index(c) for c in COLUMNS
)
_PICK = None if tuple(range(len(_ORDER))) == _ORDER else operator.itemgetter(*_ORDER)


def insert_sql(paramstyle: str) -> str:
    # Straight to the driver's executemany: SQLAlchemy's per-row parameter processing cost
    # more than the insert itself at thousands of rows per flush.
    mark = "?" if paramstyle == "qmark" else "%s"
    return (
        f"INSERT INTO decisions ({', '.join(COLUMNS)}) VALUES ({', '.join([mark] * len(COLUMNS))})"
    )


# Text COPY. Binary COPY takes 15% more rows a second raw (bench/audit.py's baselines) but did
# nothing for the writer, whose own CPU is the bound (0.9x over four interleaved rounds, within
# their spread), so the simpler format stays.
COPY_SQL = f"COPY decisions ({', '.join(COLUMNS)}) FROM STDIN"


def _value(column: str, value: Any) -> Any:
    return orjson.dumps(value).decode() if column in _JSON_COLUMNS else value


def spooled_params(row: dict[str, Any]) -> tuple[Any, ...]:
    """Insert parameters of a row read back from the spool."""
    return tuple(_value(c, row[c]) for c in COLUMNS)


def static_params(row: dict[str, Any]) -> tuple[Any, ...]:
    """The parameters every row of one record shares (memoised in its :class:`RowForm`). The
    JSON ones (the candidates: most of them) are the same for every record of one answer, and
    kept once (:func:`gtm.audit.record.shared`)."""
    return tuple(shared(_value(c, row[c])) if c in _JSON_COLUMNS else row[c] for c in _STATIC)


class Batch:
    """The rows one flush sealed, compact until the database has them: per row its record's
    form, three integers and its hash; spool lines and parameters are built as they are
    written (a window's lines, held from its seal to its append, were the largest thing the
    writer kept: about 1.2 KB a row, thousands of rows a window under a flood)."""

    __slots__ = ("answers", "end", "first_seq", "forms", "hashes", "numbers")

    def __init__(self, first_seq: int, prev_hash: str, answers: int) -> None:
        self.first_seq = first_seq
        self.end = 0  # the spool's logical offset after this batch (Spool.discard_through)
        self.answers = answers  # the chain's answers through this batch's last row
        self.forms: list[RowForm] = []
        self.numbers = array("q")  # count, first_at_us, last_at_us of each row
        self.hashes = [prev_hash]  # row i chains hashes[i] -> hashes[i + 1]

    def __len__(self) -> int:
        return len(self.forms)

    def lines(self, node_json: bytes) -> Iterator[bytes]:
        """The spool line of each row: the row as JSON (its hashed body, as the seal rendered
        it, plus the chain columns), one newline-terminated line each."""
        numbers, hashes, seq = self.numbers, self.hashes, self.first_seq
        for i, form in enumerate(self.forms):
            n, first_us, last_us = numbers[3 * i], numbers[3 * i + 1], numbers[3 * i + 2]
            body = row_body(form, n, first_us, last_us, node_json, seq + i)
            yield b'%s,"prev_hash":"%s","row_hash":"%s"}\n' % (
                body[:-1],
                hashes[i].encode(),
                hashes[i + 1].encode(),
            )

    def params(self, node: str, start: int, stop: int) -> list[tuple[Any, ...]]:
        out = []
        numbers, hashes = self.numbers, self.hashes
        for i in range(start, stop):
            values = (
                node,
                self.first_seq + i,
                numbers[3 * i + 1],
                numbers[3 * i + 2],
                numbers[3 * i],
                hashes[i],
                hashes[i + 1],
                *self.forms[i].columns,
            )
            out.append(values if _PICK is None else _PICK(values))
        return out


# Sealed rows kept in memory for the drain while it inserts earlier ones; beyond, it reads
# them back from the spool, which has them all. A queued row holds its record's form, three
# numbers and a hash (about 1,500 bytes under a random-subnet flood, where forms are rarely
# shared: the drain task's batch measured 3.7 MiB for some 2,500 rows). Their bound is a share
# of the node's memory budget (gtm.geodns.budget counts QUEUE_SHARE among its tables'): a
# fixed 25,000 came to some 37 MiB, more than half of the default budget, whenever the
# database fell behind.
QUEUED_ROW_BYTES = 1500
QUEUE_SHARE = 0.06
_MIN_QUEUED_ROWS = 256


def queued_rows(budget_mb: float) -> int:
    """Sealed rows the writer keeps for the drain under a budget of ``budget_mb`` MiB."""
    rows = tables_mb(budget_mb) * (1 << 20) * QUEUE_SHARE / QUEUED_ROW_BYTES
    return max(_MIN_QUEUED_ROWS, int(rows))


class Window:
    """The tallies of one window merged by record, in order of first appearance: what the
    journal's ticks took so far, and then what the seal takes. The shape a seal needs (records,
    answer counts, first and last answer times), and few containers, so thousands of records do
    not become thousands of objects the garbage collector has to walk."""

    __slots__ = ("counts", "index", "records", "times")

    def __init__(self) -> None:
        self.index: dict[AuditRecord, int] = {}
        self.records: list[AuditRecord] = []
        self.counts = array("q")
        self.times = array("d")

    def __len__(self) -> int:
        return len(self.records)

    def add(self, record: AuditRecord, n: int, first: float, last: float) -> int:
        """Merge one tally; returns the record's index in the window."""
        i = self.index.get(record)
        if i is None:
            i = self.index[record] = len(self.records)
            self.records.append(record)
            self.counts.append(n)
            self.times.extend((first, last))
        else:
            self.counts[i] += n
            times = self.times
            if first < times[2 * i]:
                times[2 * i] = first
            if last > times[2 * i + 1]:
                times[2 * i + 1] = last
        return i

    async def gather(
        self, tallies: Iterator[tuple[AuditRecord, int, float, float]], slices: Slices
    ) -> None:
        """Merge ``tallies`` (identical decisions share a row), handing the loop back between
        slices."""
        add = self.add
        clock = time.perf_counter
        for record, n, first, last in tallies:
            add(record, n, first, last)
            if clock() > slices.deadline:
                await slices.next()

    async def take_in(
        self, tallies: Iterator[tuple[AuditRecord, int, float, float]], slices: Slices
    ) -> tuple[array[int], array[float]]:
        """Merge a journal tick's ``tallies``; returns, per decision answered since the last
        tick, its index in the window and answers, and its first and last answer: what the
        tick's journal line holds. Arrays, written out in one call each: this loop runs for
        every such decision ten times a second, so it is kept to the merge and four appends."""
        numbers = array("q")
        spans = array("d")
        index, counts, times = self.index, self.counts, self.times
        clock = time.perf_counter
        for record, n, first, last in tallies:
            if n > 0:
                i = index.get(record)
                if i is None:
                    i = self.add(record, n, first, last)
                else:
                    counts[i] += n
                    if first < times[2 * i]:
                        times[2 * i] = first
                    if last > times[2 * i + 1]:
                        times[2 * i + 1] = last
                numbers.append(i)
                numbers.append(n)
                spans.append(first)
                spans.append(last)
            if clock() > slices.deadline:
                await slices.next()
        return numbers, spans


def append_batch(spool: Spool, batch: Batch, node_json: bytes, journal: int) -> int:
    """Append a batch's lines to the spool (the rows as :meth:`Spool.append` would write
    them, rendered as they are written) and the journal generation they seal; where they end."""
    return spool.append_lines(
        batch.lines(node_json),
        batch.first_seq + len(batch) - 1,
        batch.hashes[-1],
        batch.answers,
        journal=journal,
    )
