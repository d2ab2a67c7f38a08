"""Reading the audit log back: the newest rows, an export over a time range, chain checks, and
the row behind a decision id."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from ipaddress import ip_network
from typing import Any

from sqlalchemy import ColumnElement, Text, cast, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gtm.audit.decision_id import mark_of, parse_id
from gtm.audit.record import ChainBreak, verify_chain
from gtm.audit.schema import decisions

# Plain str names: SQLAlchemy's are a str subclass, which orjson will not take as keys.
_COLUMNS = [str(c.name) for c in decisions.c if c.name != "id"]


def _as_dict(row: Any) -> dict[str, Any]:
    return {name: getattr(row, name) for name in _COLUMNS} | {"id": row.id}


def iso(us: int) -> str:
    return datetime.fromtimestamp(us / 1_000_000, tz=UTC).isoformat(timespec="milliseconds")


async def tail(engine: AsyncEngine, limit: int = 20, after_id: int = 0) -> list[dict[str, Any]]:
    """The newest ``limit`` rows (oldest first), or every row after ``after_id``."""
    query = select(decisions)
    if after_id:
        query = query.where(decisions.c.id > after_id).order_by(decisions.c.id)
    else:
        query = query.order_by(decisions.c.id.desc()).limit(limit)
    async with engine.connect() as conn:
        rows = [_as_dict(r) for r in (await conn.execute(query))]
    return sorted(rows, key=lambda r: r["id"])


async def export(
    engine: AsyncEngine,
    since_us: int | None = None,
    until_us: int | None = None,
    batch: int = 5000,
) -> AsyncIterator[dict[str, Any]]:
    """Every row in a time range, in id order, streamed in batches."""
    last_id = 0
    async with engine.connect() as conn:
        while True:
            query = select(decisions).where(decisions.c.id > last_id)
            if since_us is not None:
                query = query.where(decisions.c.last_at_us >= since_us)
            if until_us is not None:
                query = query.where(decisions.c.first_at_us < until_us)
            rows = (await conn.execute(query.order_by(decisions.c.id).limit(batch))).all()
            if not rows:
                return
            for row in rows:
                yield _as_dict(row)
            last_id = rows[-1].id


async def verify(engine: AsyncEngine) -> tuple[int, list[ChainBreak]]:
    """Check every node's chain; returns (rows checked, breaks)."""
    async with engine.connect() as conn:
        result = await conn.execute(
            select(decisions).order_by(decisions.c.node, decisions.c.node_seq)
        )
        rows = [_as_dict(r) for r in result]
    return len(rows), verify_chain(rows)


async def distinct(conn: AsyncConnection, column: ColumnElement[Any]) -> list[str]:
    """A column's distinct values, in order, by walking its index (one ``min(x) > last`` per
    value): the cost is per value, where ``SELECT DISTINCT`` reads every row (PostgreSQL has no
    skip scan). For the chains of the decisions table (``node``) and of the checkpoints."""
    out: list[str] = []
    while True:
        query = select(func.min(column))
        if out:
            query = query.where(column > out[-1])
        value = await conn.scalar(query)
        if value is None:
            return out
        out.append(str(value))


async def total_count(engine: AsyncEngine) -> int:
    """Answers accounted for in the store (the sum of row counts)."""
    async with engine.connect() as conn:
        value = await conn.scalar(select(func.coalesce(func.sum(decisions.c.count), 0)))
    return int(value or 0)


# A row's times span one flush window (about a second; longer when a flush overran, or when it
# counts proxied exchanges, which are counted at their decision's time when they end). Rows
# that began longer than this before an id's time are not searched.
_LONGEST_WINDOW_US = 600 * 1_000_000


async def find_decision(engine: AsyncEngine, decision_id: str) -> list[dict[str, Any]]:
    """The audit row(s) that counted the response carrying ``decision_id`` (empty until the
    node's writer has flushed it, about a second). Several rows when one client network got
    different answers for one name from one node within one flush window (a 307 and a 451 to
    two clients behind one NAT, say): each is a decision that node made for that network and
    name at that time, and the response's own is among them.

    Raises :class:`~gtm.audit.decision_id.DecisionIdError` for a malformed id."""
    wanted = parse_id(decision_id)
    lo = wanted.at_ms * 1000
    hi = lo + 999
    query = (
        select(decisions)
        .where(
            decisions.c.node == wanted.node,
            decisions.c.first_at_us <= hi,
            decisions.c.first_at_us >= lo - _LONGEST_WINDOW_US,
            decisions.c.last_at_us >= lo,
        )
        .order_by(decisions.c.node_seq)
    )
    async with engine.connect() as conn:
        rows = [_as_dict(r) for r in await conn.execute(query)]
    return [r for r in rows if mark_of(r["client_network"], r["name"]) == wanted.mark]


@dataclass(frozen=True, slots=True)
class RecordedInput:
    """The inputs of recorded decisions that decide alike, with how many answers they had."""

    channel: str
    name: str
    service: str
    client_network: str
    ecs_prefix: str | None
    residency_classes: tuple[str, ...]
    tenant: str | None
    answers: int
    example: str  # "node#node_seq" of one row that recorded them


async def decision_inputs(
    engine: AsyncEngine, since_us: int, until_us: int | None = None
) -> list[RecordedInput]:
    """The distinct decision inputs answered in a time range (rows of configured services),
    each weighted by its answers: what a replay of that traffic needs."""
    classes = cast(decisions.c.residency_classes, Text)  # JSON has no equality in PostgreSQL
    keys = (
        decisions.c.channel,
        decisions.c.name,
        decisions.c.service,
        decisions.c.client_network,
        decisions.c.ecs_prefix,
        classes,
        decisions.c.tenant,
    )
    query = (
        select(*keys, func.sum(decisions.c.count), func.min(decisions.c.id))
        .where(decisions.c.last_at_us >= since_us)
        .where(decisions.c.service.is_not(None), decisions.c.service != "")
        .group_by(*keys)
    )
    if until_us is not None:
        query = query.where(decisions.c.first_at_us < until_us)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
        first_ids = [r[8] for r in rows]
        examples: dict[int, str] = {}
        for start in range(0, len(first_ids), 5000):
            chunk = first_ids[start : start + 5000]
            found = await conn.execute(
                select(decisions.c.id, decisions.c.node, decisions.c.node_seq).where(
                    decisions.c.id.in_(chunk)
                )
            )
            examples.update({r.id: f"{r.node}#{r.node_seq}" for r in found})
    return [
        RecordedInput(
            r[0], r[1], r[2], r[3], r[4], tuple(json.loads(r[5])), r[6], int(r[7]), examples[r[8]]
        )
        for r in rows
    ]


@dataclass(frozen=True, slots=True)
class Filters:
    """What an audit search narrows to; every field optional, all of them ANDed."""

    since_us: int | None = None
    until_us: int | None = None
    service: str | None = None
    name: str | None = None
    client_network: str | None = None
    region: str | None = None
    outcome: str | None = None
    residency_class: str | None = None
    rule: str | None = None
    node: str | None = None


def enclosing_networks(text: str) -> list[str]:
    """The client networks a row may be recorded under for a client in ``text`` (an address or a
    network): the network itself and every wider one holding it. Rows record the client at the
    precision its decision depended on (a DNS answer for a whole GeoIP network records that
    network, gtm.geodns.precision), so a search for a /24 must find the /13 it lies in; as
    exact strings, the match stays an indexed IN. Text that is not an address is matched as
    it is."""
    try:
        network = ip_network(text.strip(), strict=False)
    except ValueError:
        return [text]
    return [str(network.supernet(new_prefix=p)) for p in range(network.prefixlen, -1, -1)]


def name_forms(text: str) -> list[str]:
    """The spellings a row may hold ``text`` under: DNS rows keep the query's absolute name
    (``chat.eu.gtm.example.``), HTTP rows the host (``chat.eu.gtm.example``); a search for
    either finds both, in the case typed and in lower case (DNS names are case-blind and
    rows are written as the resolver sent them, almost always lower)."""
    bare = text.strip().rstrip(".")
    if not bare:
        return [text]
    return sorted({bare, bare + ".", bare.lower(), bare.lower() + "."})


def _where(query: Any, f: Filters) -> Any:
    c = decisions.c
    if f.since_us is not None:
        query = query.where(c.last_at_us >= f.since_us)
    if f.until_us is not None:
        query = query.where(c.first_at_us < f.until_us)
    if f.client_network is not None:
        query = query.where(c.client_network.in_(enclosing_networks(f.client_network)))
    if f.name is not None:
        query = query.where(c.name.in_(name_forms(f.name)))
    for column, value in (
        (c.service, f.service),
        (c.region, f.region),
        (c.outcome, f.outcome),
        (c.node, f.node),
    ):
        if value is not None:
            query = query.where(column == value)
    # JSON arrays of names: matched on their text, the same on SQLite and PostgreSQL.
    if f.residency_class is not None:
        query = query.where(cast(c.residency_classes, Text).contains(json.dumps(f.residency_class)))
    if f.rule is not None:
        query = query.where(cast(c.matched_rules, Text).contains(json.dumps(f.rule)))
    return query


async def search(
    engine: AsyncEngine,
    filters: Filters,
    after_id: int = 0,
    limit: int = 100,
    *,
    newest_first: bool = False,
) -> tuple[list[dict[str, Any]], int | None]:
    """One page of matching rows in id order (oldest first, or newest first), and the cursor
    of the next page (None: last): the rows after ``after_id`` in that order (0: the start)."""
    query = _where(select(decisions), filters)
    if newest_first:
        if after_id:
            query = query.where(decisions.c.id < after_id)
        query = query.order_by(decisions.c.id.desc())
    else:
        query = query.where(decisions.c.id > after_id).order_by(decisions.c.id)
    query = query.limit(limit + 1)
    async with engine.connect() as conn:
        rows = [_as_dict(r) for r in await conn.execute(query)]
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, (rows[-1]["id"] if more and rows else None)


async def export_filtered(
    engine: AsyncEngine, filters: Filters, batch: int = 5000
) -> AsyncIterator[dict[str, Any]]:
    """Every matching row in id order, read in batches (memory stays bounded)."""
    after = 0
    while True:
        rows, _ = await search(engine, filters, after, batch)
        if not rows:
            return
        for row in rows:
            yield row
        after = rows[-1]["id"]
