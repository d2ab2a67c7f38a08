"""``gtm audit verify``: every chain checked against its links and its signed checkpoints.

Threat model: the database is untrusted storage. Whoever holds its password can read, write and
delete every row of every table (on PostgreSQL as superuser, with the append-only triggers
switched off), give the store a new id, and rewrite the heads it keeps; they hold no key file
and cannot rewrite the write-once checkpoint sink. What a verifier trusts is therefore only the
sink (:mod:`gtm.audit.checkpoints`): its signed checkpoints and the writers' public keys. The
database is what is being checked, never a source of trust, and an empty answer from it is not
an empty store: checkpoints with no rows behind them are breaks.

The sink first, as a whole:

* a checkpoint of a store other than the database's (the old id of a store that was erased and
  given a new one) is a break naming it, and so is a database whose store id no checkpoint
  knows while the sink holds others', or one with no store id at all;

then the rows, streamed chain by chain in pages (memory stays flat however large the store),
and for every chain:

* each row must follow the one before it (``seq`` + 1, ``prev_hash``) and hash to its
  ``row_hash``: an edited, removed or reordered row breaks here;
* at every checkpointed sequence the row's hash must be the checkpoint's head, and the answers
  counted through it the checkpoint's: a chain rewritten and re-hashed end to end is
  consistent with itself but not with a checkpoint;
* the chain must reach its newest checkpoint: a truncated tail, or a chain whose rows were all
  deleted (the sink's chain files are the registry), is a break;
* a chain with rows but no checkpoint at all is a break too (rows nobody signed for: added
  outside GTM, or a node whose sink is missing);
* a chain whose oldest rows retention removed (:mod:`gtm.audit.retention`) starts after its
  newest signed ``cut``: its next row must follow the cut's sequence and hash;
* each region event must be signed by its writer's key, published in the sink
  (:mod:`gtm.audit.event_chain`): a forged event, or one rewritten and re-hashed, is reported at
  that row; an event row outside the chain (no ``seq``) is reported by its id. Writers
  checkpoint only heads they wrote, so an event removed (and the head moved back) is
  contradicted by its writer's checkpoint.

A verification can start from checkpoints (``start``: one per chain, trusted because its
signature verifies): rows up to each are not read again, the row at the checkpoint must still be
there with the checkpoint's hash (a tail cut back behind the last pass is a break at once), and
the first row after it must follow that hash. That is how the scheduled verification
(:mod:`gtm.audit.watch`) goes on from where its last pass ended, and ``gtm audit verify --since``
checks a recent window of a large store.

A tail the checkpoints vouch for but the database does not hold yet is *spooled*, not a break,
when a node reporting within the liveness bound says its spool still holds it
(:mod:`gtm.audit.spool_reports`): rows sealed during an outage are late, not gone.

Rows after a chain's newest checkpoint are reported as not yet anchored (a running node
checkpoints every few seconds and at shutdown), and ``gap`` checkpoints (unclean stops) are
listed. A checkpoint line that does not parse or whose signature does not verify is a break
with its location; it is never used nor skipped silently.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.anchor import read_store_id
from gtm.audit.chain_check import ChainCheck, ChainResult
from gtm.audit.checkpoints import (
    EVENTS_CHAIN,
    BadCheckpoint,
    Checkpoint,
    CheckpointSink,
    Signed,
    check,
    parse,
)
from gtm.audit.event_chain import PublicKeys, event_hash, signature_problem
from gtm.audit.query import distinct
from gtm.audit.record import ChainBreak, row_hash
from gtm.audit.schema import audit_store, control_log, decisions, region_events
from gtm.audit.spool_reports import SpoolReport, read_spool_reports

_PAGE = 5000
_NAMED = 20  # rows outside the event chain named one by one (the count is always whole)
UNBOUND = "unbound"  # the store a node names before it could read the database's id (anchor)
# The control log's chain in the sink (gtm.control.anchor.CHAIN): not a decision chain. Its
# entries' signatures need the admin keys (gtm.control.anchor.verify_control_log); here each of
# its checkpoints must still find the entry it vouches for.
CONTROL_CHAIN = "control_log"


@dataclass
class Verification:
    store: str | None
    chains: dict[str, ChainResult] = field(default_factory=dict)
    breaks: list[ChainBreak] = field(default_factory=list)
    gaps: list[Checkpoint] = field(default_factory=list)
    cuts: list[Checkpoint] = field(default_factory=list)  # retention, newest per chain
    checkpoints: int = 0  # trusted checkpoints read
    newest_at: float | None = None  # the time of the newest trusted checkpoint read

    @property
    def rows(self) -> int:
        return sum(c.rows for c in self.chains.values() if c.chain != EVENTS_CHAIN)

    @property
    def spooled(self) -> dict[str, ChainResult]:
        """The chains whose tail is still in a live node's spool: incomplete, not broken."""
        return {c.chain: c for c in self.chains.values() if c.spooled}

    @property
    def unanchored(self) -> dict[str, int]:
        return {
            c.chain: c.last_seq - c.anchored_seq
            for c in self.chains.values()
            if c.last_seq > c.anchored_seq
        }


def read_checkpoints(
    sink: CheckpointSink, store: str | None
) -> tuple[list[tuple[Signed, str]], list[BadCheckpoint]]:
    """The sink's checkpoints of ``store`` whose signatures verify with its published keys,
    each with its location; and every line that does not (and whatever else the sink says
    must not be there)."""
    keys = sink.keys()
    good: list[tuple[Signed, str]] = []
    bad: list[BadCheckpoint] = []
    for item in sink.read():
        if isinstance(item, BadCheckpoint):
            bad.append(item)
            continue
        location, line = item
        try:
            signed = parse(line, location)
            check(signed, keys, location)
        except BadCheckpoint as exc:
            bad.append(exc)
            continue
        if store is None or signed.checkpoint.store == store:
            good.append((signed, location))
    return good, bad


def foreign_checkpoints(
    checkpoints: Iterable[tuple[Signed, str]], store: str | None
) -> tuple[list[tuple[Signed, str]], list[tuple[Signed, str]]]:
    """Trusted checkpoints split into the database's store's and other stores'. Checkpoints
    a node signed before it could learn the store id (``unbound``) are in neither: they vouch
    for no store."""
    own: list[tuple[Signed, str]] = []
    other: list[tuple[Signed, str]] = []
    for signed, location in checkpoints:
        named = signed.checkpoint.store
        if store is not None and named == store:
            own.append((signed, location))
        elif named != UNBOUND:
            other.append((signed, location))
    return own, other


def store_breaks(
    store: str | None, own: int, foreign: Iterable[tuple[Signed, str]]
) -> list[ChainBreak]:
    """Checkpoints in the sink whose store is not the database's are rows that should be
    there and are not: each (store, chain) is named at its newest checkpoint."""
    newest: dict[tuple[str, str], tuple[Checkpoint, str]] = {}
    for signed, location in foreign:
        cp = signed.checkpoint
        known = newest.get((cp.store, cp.chain))
        if known is None or cp.seq >= known[0].seq:
            newest[(cp.store, cp.chain)] = (cp, location)
    if not newest:
        return []
    stores = sorted({s for s, _ in newest})
    breaks: list[ChainBreak] = []
    if store is None:
        breaks.append(
            ChainBreak(
                "store",
                0,
                f"the database has no audit store id, and the checkpoint sink vouches for "
                f"store(s) {', '.join(stores)}: an erased store",
            )
        )
    elif own == 0:
        breaks.append(
            ChainBreak(
                "store",
                0,
                f"the database's store id {store} is unknown to the checkpoint sink, which "
                f"vouches for store(s) {', '.join(stores)}: an erased store given a new id",
            )
        )
    for (other, chain), (cp, location) in sorted(newest.items()):
        breaks.append(
            ChainBreak(
                chain,
                cp.seq,
                f"the checkpoint at {location} vouches for rows up to {cp.seq} of store "
                f"{other}, which is not this database's ({store or 'no id'}): checkpoints "
                "with no rows behind them",
            )
        )
    return breaks


async def _pages(
    engine: AsyncEngine, table: Any, seq_col: Any, where: Any, after: int = -1
) -> AsyncIterator[dict[str, Any]]:
    """The chain's rows after ``after`` in sequence order, a window of sequence numbers at a
    time. Not ``seq > last ORDER BY seq LIMIT n``: on a day partition the statistics have not
    caught up with yet, PostgreSQL sorts every remaining row for each such page (a million
    rows took five minutes). A window of sequences bounds each query whatever the plan, as a
    chain's sequence has no holes; a hole (a break) costs one lookup of the next row."""
    last = after
    while True:
        query = (
            select(table).where(where, seq_col > last, seq_col <= last + _PAGE).order_by(seq_col)
        )
        async with engine.connect() as conn:
            rows = [dict(r._mapping) for r in await conn.execute(query)]
            if not rows:
                following = select(seq_col).where(where, seq_col > last).order_by(seq_col)
                after_hole = await conn.scalar(following.limit(1))
                if after_hole is None:
                    return
                last = int(after_hole) - 1
                continue
        for row in rows:
            yield row
        last = rows[-1][seq_col.name]


async def _row_at(
    engine: AsyncEngine, table: Any, seq_col: Any, where: Any, seq: int
) -> dict[str, Any] | None:
    async with engine.connect() as conn:
        row = (await conn.execute(select(table).where(where, seq_col == seq))).first()
    return None if row is None else dict(row._mapping)


async def verify_store(
    engine: AsyncEngine,
    checkpoints: Iterable[tuple[Signed, str]],
    bad: Iterable[BadCheckpoint],
    store: str | None,
    start: Mapping[str, Checkpoint] | None = None,
    *,
    keys: PublicKeys | None = None,
    foreign: Iterable[tuple[Signed, str]] = (),
    spools: Mapping[str, SpoolReport] | None = None,
) -> Verification:
    """Every chain of the store checked against ``checkpoints`` (the store's own); each chain
    named in ``start`` from that checkpoint on. ``keys`` (the sink's published keys) check
    each event's signature; ``foreign`` are the sink's checkpoints of other stores, each a
    break (see :func:`store_breaks`); ``spools`` (by node) are live nodes' reports of rows
    still in their spools, read before the rows (a node drains only forwards)."""
    start = start or {}
    spools = spools or {}
    out = Verification(store)
    for b in bad:
        out.breaks.append(ChainBreak("checkpoint", 0, f"{b.location}: {b.problem}"))
    checkpoints = list(checkpoints)
    out.breaks.extend(store_breaks(store, len(checkpoints), foreign))
    anchors: dict[str, list[tuple[Checkpoint, str]]] = defaultdict(list)
    for signed, location in checkpoints:
        cp = signed.checkpoint
        out.checkpoints += 1
        out.newest_at = cp.at if out.newest_at is None else max(out.newest_at, cp.at)
        if cp.kind == "gap":
            out.gaps.append(cp)
        anchors[cp.chain].append((cp, location))
    async with engine.connect() as conn:
        nodes = await distinct(conn, decisions.c.node)
    chains = sorted(set(nodes) | (set(anchors) - {EVENTS_CHAIN, CONTROL_CHAIN}))
    for chain in chains:
        checker = ChainCheck(
            chain,
            anchors.get(chain, []),
            row_hash,
            "node_seq",
            True,
            start.get(chain),
            spool=spools.get(chain),
        )
        if checker.resumes is not None:
            checker.check_resumed(
                await _row_at(
                    engine, decisions, decisions.c.node_seq, decisions.c.node == chain,
                    checker.resumes.seq,
                )
            )  # fmt: skip
        async for row in _pages(
            engine, decisions, decisions.c.node_seq, decisions.c.node == chain, checker.after
        ):
            checker.feed(row)
        checker.finish()
        if checker.cut is not None:
            out.cuts.append(checker.cut)
        out.chains[chain] = checker.result
        out.breaks.extend(checker.breaks)
    events = ChainCheck(
        EVENTS_CHAIN,
        anchors.get(EVENTS_CHAIN, []),
        event_hash,
        "seq",
        False,
        start.get(EVENTS_CHAIN),
        None if keys is None else (lambda row: signature_problem(row, keys)),
    )
    if events.resumes is not None:
        events.check_resumed(
            await _row_at(
                engine,
                region_events,
                region_events.c.seq,
                region_events.c.seq.isnot(None),
                events.resumes.seq,
            )
        )
    async for row in _pages(
        engine, region_events, region_events.c.seq, region_events.c.seq.isnot(None), events.after
    ):
        events.feed(row)
    if events.result.rows or anchors.get(EVENTS_CHAIN):
        events.finish()
        out.chains[EVENTS_CHAIN] = events.result
        out.breaks.extend(events.breaks)
    out.breaks.extend(await _unchained_events(engine))
    out.breaks.extend(await _control_log_anchors(engine, anchors.get(CONTROL_CHAIN, [])))
    return out


async def _control_log_anchors(
    engine: AsyncEngine, anchors: list[tuple[Checkpoint, str]]
) -> list[ChainBreak]:
    """Each checkpoint of the control log's head against the entry it names: a log wiped or
    cut back behind it, or forked there, is a break (the newest such checkpoint per seq)."""
    if not anchors:
        return []
    async with engine.connect() as conn:
        held = {
            int(seq): str(digest)
            for seq, digest in await conn.execute(
                select(control_log.c.seq, control_log.c.entry_hash)
            )
        }
    breaks: list[ChainBreak] = []
    for cp, location in sorted(
        {cp.seq: (cp, loc) for cp, loc in anchors}.values(), key=lambda x: x[0].seq
    ):
        digest = held.get(cp.seq)
        if digest is None:
            breaks.append(
                ChainBreak(
                    CONTROL_CHAIN,
                    cp.seq,
                    f"the checkpoint at {location} vouches for this entry; the log has it no "
                    "more (cut back or wiped)",
                )
            )
        elif digest != cp.head:
            breaks.append(
                ChainBreak(
                    CONTROL_CHAIN,
                    cp.seq,
                    f"not the entry the checkpoint at {location} vouches for (a fork)",
                )
            )
    return breaks


async def _unchained_events(engine: AsyncEngine) -> list[ChainBreak]:
    """Event rows outside the chain (no ``seq``): the event log shows them, nothing vouches for
    them. Named by row id, the first few; the rest counted."""
    outside = region_events.c.seq.is_(None)
    async with engine.connect() as conn:
        count = int(await conn.scalar(select(func.count()).where(outside)) or 0)
        if not count:
            return []
        ids = list(
            await conn.scalars(
                select(region_events.c.id).where(outside).order_by(region_events.c.id).limit(_NAMED)
            )
        )
    breaks = [
        ChainBreak(
            EVENTS_CHAIN,
            0,
            f"event row id {i} is outside the chain (no seq): added outside GTM, or older "
            "than the chain",
        )
        for i in ids
    ]
    if count > len(ids):
        breaks.append(
            ChainBreak(EVENTS_CHAIN, 0, f"{count - len(ids)} more event row(s) outside the chain")
        )
    return breaks


def starts_at(checkpoints: Iterable[tuple[Signed, str]], since: float) -> dict[str, Checkpoint]:
    """For each chain, its newest checkpoint written at or before ``since``: where
    ``gtm audit verify --since`` starts."""
    out: dict[str, Checkpoint] = {}
    for signed, _ in checkpoints:
        cp = signed.checkpoint
        if cp.at <= since and (cp.chain not in out or cp.seq > out[cp.chain].seq):
            out[cp.chain] = cp
    return out


async def verify(
    engine: AsyncEngine,
    sink: CheckpointSink,
    *,
    start: Mapping[str, Checkpoint] | None = None,
    since: float | None = None,
    spools_since: float | None = None,
) -> Verification:
    """The store of ``engine`` verified against the checkpoints in ``sink`` (what
    ``gtm audit verify`` runs): the store's id, its trusted checkpoints, every chain; from
    ``start`` (per chain), or from the newest checkpoint at or before ``since``. With
    ``spools_since``, the spool reports of nodes that reported since then count a missing tail
    they still hold as spooled rather than broken."""
    store = await read_store_id(engine)
    # Every checkpoint in the sink, whichever store it names: one of another store is a break.
    trusted, bad = await asyncio.to_thread(read_checkpoints, sink, None)
    keys = await asyncio.to_thread(sink.keys)
    good, foreign = foreign_checkpoints(trusted, store)
    if since is not None:
        start = {**starts_at(good, since), **(start or {})}
    # Read after the checkpoints and before the rows: what a node drained since is in the rows.
    spools = None if spools_since is None else await read_spool_reports(engine, spools_since)
    out = await verify_store(
        engine, good, bad, store, start, keys=keys, foreign=foreign, spools=spools
    )
    async with engine.connect() as conn:
        ids = (await conn.execute(select(audit_store.c.id))).scalars().all()
    if len(ids) > 1:
        # One store per database: which one a reader takes would be the database's choice.
        out.breaks.append(
            ChainBreak("store", 0, f"the database names {len(ids)} audit stores: {sorted(ids)}")
        )
    return out


__all__ = [
    "ChainResult",
    "Verification",
    "foreign_checkpoints",
    "read_checkpoints",
    "starts_at",
    "store_breaks",
    "verify",
    "verify_store",
]
