"""Evidence status per chain: what the sink outside the database and the database's copy say.

For the console and ``GET /v1/audit/chains``: for every chain (each node's, each worker's, and
the fleet's event chain) its newest checkpoint and where it is held (the sink, the database's
``audit_checkpoints``, or both), its gaps (unclean stops) and retention cuts, and how far the
database's rows run past the newest checkpoint. It reads no decision row but each chain's newest,
so it answers in milliseconds on any store; checking the rows is :mod:`gtm.audit.verify`'s work
(the scheduled pass, :mod:`gtm.audit.watch`).

The sink is the trusted side. :class:`SinkIndex` reads it incrementally: each chain file from
where the previous read ended, every new line parsed and its signature checked once, and only
what a status needs is kept (per chain its newest checkpoint, its gaps and cuts, a count), so a
request costs the lines written since the last one and memory does not grow with the sink. A
line that does not parse or verify is listed with its file and line; a chain file that shrank or
vanished (the sink is append-only) is listed too, and the index is rebuilt from what is left.

A bucket sink (:mod:`gtm.audit.checkpoint_bucket`) is read the same way: each chain's folder
from the last object read there (its keys list in the order they were written).

A checkpoint in the database but not in the sink is shown as such: a node writes the sink first,
so such a row was written by someone else, or by a node whose sink is not this one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy import Row, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.anchor import read_store_id
from gtm.audit.checkpoints import (
    EVENTS_CHAIN,
    BadCheckpoint,
    Checkpoint,
    CheckpointSink,
    DirectorySink,
    Signed,
    check,
    parse,
)
from gtm.audit.query import distinct
from gtm.audit.schema import audit_checkpoints, decisions, event_chain

_MARKS = ("gap", "cut")  # the kinds a status lists in full
_MAX_PROBLEMS = 100  # sink lines listed one by one; beyond, counted
_CHUNK = 1 << 22  # bytes of a chain file read at once: a year's file is a gigabyte


@dataclass(frozen=True, slots=True)
class Held:
    """A checkpoint and where it is held."""

    checkpoint: Checkpoint
    signature: str
    in_sink: bool  # a sink line holds it and its signature verifies with a published key
    in_database: bool  # audit_checkpoints holds it
    location: str | None = None  # the sink's "file:line"


@dataclass
class _Seen:
    """One chain as the sink shows it."""

    count: int = 0
    newest: tuple[Signed, str] | None = None
    marks: list[tuple[Signed, str]] = field(default_factory=list)


def _later(a: Checkpoint, b: Checkpoint) -> bool:
    """Whether ``a`` is a later checkpoint of its chain than ``b`` (a chain's sequence only
    grows; an idle chain's heartbeats keep the sequence and move the time). Times compare in
    microseconds, as the database keeps them."""
    return (a.seq, round(a.at * 1e6)) > (b.seq, round(b.at * 1e6))


@runtime_checkable
class _ReadsNew(Protocol):
    def read_new(self, after: MutableMapping[str, str]) -> Iterator[tuple[str, bytes]]: ...


class SinkIndex:
    """The sink's checkpoints of every chain, read incrementally (see the module docstring).
    Blocking file I/O: call :meth:`refresh` in a thread; it is safe to call from several."""

    def __init__(self, sink: CheckpointSink) -> None:
        self.sink = sink
        self._lock = threading.Lock()
        self._reset()
        self.problems: list[BadCheckpoint] = []  # kept across rebuilds
        self.problem_count = 0

    def _reset(self) -> None:
        self._offsets: dict[Path, tuple[int, int]] = {}  # file -> (bytes read, lines read)
        self._after: dict[str, str] = {}  # a bucket's chain folder -> the last key read
        self._keys: dict[str, Ed25519PublicKey] = {}
        self.chains: dict[tuple[str, str], _Seen] = {}  # (store, chain) -> what the sink holds

    def _problem(self, problem: BadCheckpoint) -> None:
        self.problem_count += 1
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(problem)

    @property
    def keys(self) -> int:
        return len(self._keys)

    def refresh(self) -> None:
        with self._lock:
            if not isinstance(self.sink, DirectorySink):
                if isinstance(self.sink, _ReadsNew):
                    for location, line in self.sink.read_new(self._after):
                        self._line(line, location)
                return
            files = sorted((self.sink.directory / "chains").glob("*.jsonl"))
            gone = [p for p in self._offsets if p not in files]
            shrunk = [p for p in files if p in self._offsets and _size(p) < self._offsets[p][0]]
            if gone or shrunk:
                for path in gone:
                    self._problem(BadCheckpoint(str(path), "chain file vanished from the sink"))
                for path in shrunk:
                    self._problem(BadCheckpoint(str(path), "chain file shrank: lines removed"))
                self._reset()
            for path in files:
                self._read(path)

    def _read(self, path: Path) -> None:
        offset, lines = self._offsets.get(path, (0, 0))
        with open(path, "rb") as f:
            f.seek(offset)
            while data := f.read(_CHUNK):
                end = data.rfind(b"\n") + 1  # a line still being written is read next time
                if not end and len(data) < _CHUNK:
                    break
                if not end:  # no checkpoint is this long: skip the line, say where it was
                    lines += 1
                    self._problem(BadCheckpoint(f"{path}:{lines}", "line too long"))
                    while (more := f.read(_CHUNK)) and b"\n" not in more:
                        end += len(more)
                    end += len(data) + (more.index(b"\n") + 1 if more else 0)
                    offset += end
                    f.seek(offset)
                    continue
                for line in data[:end].splitlines():
                    lines += 1
                    if line.strip():
                        self._line(line, f"{path}:{lines}")
                offset += end
                f.seek(offset)
        self._offsets[path] = (offset, lines)

    def _line(self, line: bytes, location: str) -> None:
        try:
            signed = parse(line, location)
            if signed.checkpoint.key not in self._keys:
                self._keys = self.sink.keys()  # a key published since the last read
            check(signed, self._keys, location)
        except BadCheckpoint as exc:
            self._problem(exc)
            return
        cp = signed.checkpoint
        seen = self.chains.setdefault((cp.store, cp.chain), _Seen())
        seen.count += 1
        if seen.newest is None or _later(cp, seen.newest[0].checkpoint):
            seen.newest = (signed, location)
        if cp.kind in _MARKS:
            seen.marks.append((signed, location))

    def of_store(self, store: str | None) -> Iterator[tuple[str, _Seen]]:
        """Each chain's view, for ``store`` (every store's when None, as verify reads them)."""
        with self._lock:
            for (owner, chain), seen in sorted(self.chains.items()):
                if store is None or owner == store:
                    yield chain, seen


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


@dataclass
class ChainStatus:
    chain: str
    node: str | None  # the node whose chain it is (None: the fleet's event chain)
    kind: Literal["decisions", "events"]
    last_checkpoint: Held | None = None
    checkpoints_in_sink: int = 0
    database_seq: int | None = None  # the sequence of the chain's newest row in the database
    unanchored_rows: int = 0  # rows after the last checkpoint
    gaps: list[Held] = field(default_factory=list)
    cuts: list[Held] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class EvidenceStatus:
    store: str | None
    sink: str  # where the sink is (a directory, an s3:// URL)
    sink_checkpoints: int
    sink_keys: int
    problems: list[BadCheckpoint]  # the first of them
    problem_count: int
    chains: list[ChainStatus]


def node_of(chain: str) -> str | None:
    """The node a chain belongs to: a worker's chain is ``NODE/wN``."""
    return None if chain == EVENTS_CHAIN else chain.split("/", 1)[0]


def _held(row: Row[Any], in_sink: bool) -> Held:
    r = row._mapping
    cp = Checkpoint(
        r["kind"], r["chain"], int(r["seq"]), r["head"], int(r["answers"]), r["at_us"] / 1e6,
        r["store"], r["key_id"], r["detail"],
    )  # fmt: skip
    return Held(cp, r["signature"], in_sink=in_sink, in_database=True)


async def _database(
    engine: AsyncEngine, store: str | None
) -> tuple[dict[str, Held], dict[str, list[Held]], dict[str, int]]:
    """The database's side: each chain's newest checkpoint and its gaps and cuts (as copies in
    ``audit_checkpoints``, not yet matched with the sink), and each chain's newest row."""
    newest: dict[str, Held] = {}
    marks: dict[str, list[Held]] = {}
    heads: dict[str, int] = {}
    cps = audit_checkpoints.c
    async with engine.connect() as conn:
        for chain in await distinct(conn, cps.chain):
            query = select(audit_checkpoints).where(cps.chain == chain)
            if store is not None:
                query = query.where(cps.store == store)
            row = (await conn.execute(query.order_by(cps.id.desc()).limit(1))).first()
            if row is not None:
                newest[chain] = _held(row, in_sink=False)
        query = select(audit_checkpoints).where(cps.kind.in_(_MARKS)).order_by(cps.id)
        if store is not None:
            query = query.where(cps.store == store)
        for row in await conn.execute(query):
            held = _held(row, in_sink=False)
            marks.setdefault(held.checkpoint.chain, []).append(held)
        for node in await distinct(conn, decisions.c.node):
            seq = await conn.scalar(
                select(func.max(decisions.c.node_seq)).where(decisions.c.node == node)
            )
            heads[node] = int(seq or 0)
        events = await conn.scalar(select(event_chain.c.seq))
        if events:
            heads[EVENTS_CHAIN] = int(events)
    return newest, marks, heads


def _chain_status(
    chain: str,
    seen: _Seen | None,
    db_newest: Held | None,
    db_marks: list[Held],
    database_seq: int | None,
) -> ChainStatus:
    status = ChainStatus(chain, node_of(chain), "events" if chain == EVENTS_CHAIN else "decisions")
    status.database_seq = database_seq
    db_signatures = {m.signature for m in db_marks}
    if db_newest is not None:
        db_signatures.add(db_newest.signature)
    sink_signatures = set()
    if seen is not None:
        status.checkpoints_in_sink = seen.count
        for signed, location in seen.marks:
            sink_signatures.add(signed.signature)
            held = Held(signed.checkpoint, signed.signature, True,
                        signed.signature in db_signatures, location)  # fmt: skip
            (status.gaps if signed.checkpoint.kind == "gap" else status.cuts).append(held)
    for mark in db_marks:
        if mark.signature not in sink_signatures:
            (status.gaps if mark.checkpoint.kind == "gap" else status.cuts).append(mark)
            status.warnings.append(
                f"the database holds a {mark.checkpoint.kind} at #{mark.checkpoint.seq} that "
                "the sink does not: not written by a node of this sink"
            )
    for marks in (status.gaps, status.cuts):
        marks.sort(key=lambda h: (h.checkpoint.seq, h.checkpoint.at))
    sink_newest = None
    if seen is not None and seen.newest is not None:
        signed, location = seen.newest
        in_db = db_newest is not None and db_newest.signature == signed.signature
        sink_newest = Held(signed.checkpoint, signed.signature, True, in_db, location)
    last = sink_newest
    if db_newest is not None and (
        sink_newest is None
        or (
            db_newest.signature != sink_newest.signature
            and _later(db_newest.checkpoint, sink_newest.checkpoint)
        )
    ):
        # Newer than anything the sink holds: the sink is read to its end, so it is not there.
        last = db_newest
        status.warnings.append(
            f"the database's newest checkpoint (#{db_newest.checkpoint.seq}) is not in the "
            "sink: it is not anchored outside the database"
        )
    status.last_checkpoint = last
    if last is None:
        if database_seq:
            status.warnings.append(
                f"{database_seq} row(s) and no checkpoint: nothing vouches for them"
            )
        return status
    if sink_newest is None:
        return status
    # What the rows are held to is the sink's newest checkpoint, whatever the database says.
    vouched, at = sink_newest.checkpoint.seq, sink_newest.checkpoint.at
    # Retention removes a prefix: a chain whose rows all went ends at its newest cut.
    cut = max((c.checkpoint.seq for c in status.cuts if c.in_sink), default=0)
    # A checkpoint also vouches for rows its node has sealed and not yet inserted (a second or
    # so; longer while the database is away and its spool holds them).
    not_yet = "or its node has not inserted them yet (its spool holds them)"
    if database_seq is None:
        if vouched > cut:
            status.warnings.append(
                f"no row of this chain is in the database; the sink's checkpoint of {at:.3f} "
                f"vouches for rows up to #{vouched}: they are gone, {not_yet}"
            )
    elif database_seq < vouched:
        status.warnings.append(
            f"the database ends at #{database_seq}; the sink's checkpoint of {at:.3f} vouches "
            f"for rows up to #{vouched}: the tail is gone, {not_yet}"
        )
    else:
        status.unanchored_rows = database_seq - vouched
    return status


async def evidence_status(engine: AsyncEngine, index: SinkIndex) -> EvidenceStatus:
    """Every chain's evidence, from the sink (refreshed first) and the database."""
    store = await read_store_id(engine)
    # The database first: a node writes each checkpoint to the sink before the database, so a
    # sink read after it holds every checkpoint the database showed (unless it is not a node's).
    db_newest, db_marks, heads = await _database(engine, store)
    await asyncio.to_thread(index.refresh)
    seen = dict(index.of_store(store))
    chains = sorted(set(seen) | set(db_newest) | set(db_marks) | set(heads))
    return EvidenceStatus(
        store=store,
        sink=index.sink.location,
        sink_checkpoints=sum(s.count for s in seen.values()),
        sink_keys=index.keys,
        problems=list(index.problems),
        problem_count=index.problem_count,
        chains=[
            _chain_status(c, seen.get(c), db_newest.get(c), db_marks.get(c, []), heads.get(c))
            for c in chains
        ],
    )


__all__ = ["ChainStatus", "EvidenceStatus", "Held", "SinkIndex", "evidence_status", "node_of"]
