"""What one audit row holds, and the hash chain that makes the log tamper-evident.

An :class:`AuditRecord` is the content of a decision as the audit keeps it: hashable, so the
writer counts identical decisions in one flush window into a single row. Each node chains its
rows: ``row_hash = sha256(prev_hash || canonical JSON of the row)``, so deleting, reordering or
editing a row breaks every later hash of that node.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Network, IPv6Network
from typing import Any, NamedTuple

import orjson

from gtm.decision.model import Decision
from gtm.decision.snapshot import Versions

GENESIS = "0" * 64

# Folded DNS rows (gtm.geodns.shapes) count a decision per client bucket while new client
# networks come faster than the writer seals them: an IPv4 /8 (at most 256 of them), an IPv6
# /20 (RIR allocations; the address space GeoIP places holds a few thousand).
FOLD_V4, FOLD_V6 = 8, 20


def is_folded(network: IPv4Network | IPv6Network) -> bool:
    """Whether a recorded client network is a fold bucket's (or wider)."""
    return network.prefixlen <= (FOLD_V4 if network.version == 4 else FOLD_V6)


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """Hashable; the hash is computed once, since the writer looks records up on every answer
    (a cached response hands the writer the same record object each time)."""

    channel: str
    query_type: str | None
    response: str | None
    client_network: str
    ecs_prefix: str | None
    country: str | None
    continent: str | None
    name: str
    service: str | None
    residency_classes: tuple[str, ...]
    tenant: str | None
    matched_rules: tuple[str, ...]
    snapshot_version: int
    topology_version: str
    policy_version: str
    geoip_build: str
    candidates: tuple[tuple[str, str, str, str], ...]  # (region, status, reason, detail)
    region: str | None
    answer: tuple[str, ...]
    outcome: str
    ttl: int
    _hash: int = field(init=False, repr=False, compare=False, default=0)
    # The record's share of its audit rows, rendered on first use (see :func:`row_form`): a busy
    # node writes a row per distinct decision and flush, and the same records recur every flush.
    _form: RowForm | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "_hash",
            hash(
                (
                    self.channel,
                    self.query_type,
                    self.response,
                    self.client_network,
                    self.ecs_prefix,
                    # Decisions alike but for the client's country share everything else: left
                    # out, a folded row's records (gtm.geodns.shapes) all collided.
                    self.country,
                    self.continent,
                    self.name,
                    self.snapshot_version,
                    self.region,
                    self.answer,
                    self.outcome,
                    self.candidates,
                    self.tenant,
                    self.residency_classes,
                )
            ),
        )

    def __hash__(self) -> int:
        return self._hash


def record_of(
    decision: Decision,
    *,
    channel: str,
    name: str,
    ecs: str | None = None,
    tenant: str | None = None,
    query_type: str | None = None,
    response: str | None = None,
    answer: tuple[str, ...] | None = None,
) -> AuditRecord:
    """The audit content of ``decision`` as answered on a channel.

    ``answer`` is what the client was actually given (the addresses of the type asked, or a
    redirect URL); by default every address of the decision.
    """
    v = decision.versions
    return AuditRecord(
        channel=channel,
        query_type=query_type,
        response=response,
        client_network=str(decision.client_network),
        ecs_prefix=ecs,
        country=decision.location.country,
        continent=decision.location.continent,
        name=name,
        service=decision.service,
        residency_classes=decision.residency_classes,
        tenant=tenant,
        matched_rules=decision.matched_rules,
        snapshot_version=v.snapshot,
        topology_version=v.topology,
        policy_version=v.policy,
        geoip_build=v.geoip,
        candidates=tuple(
            (c.region, c.status.value, c.reason.value, c.detail) for c in decision.candidates
        ),
        region=decision.region,
        answer=answer if answer is not None else decision.ipv4 + decision.ipv6,
        outcome=decision.outcome.value,
        ttl=decision.ttl,
    )


def row_of(
    record: AuditRecord,
    *,
    node: str,
    node_seq: int,
    first_at_us: int,
    last_at_us: int,
    count: int,
) -> dict[str, Any]:
    """A ``decisions`` row (without the chain columns) in its JSON-compatible form."""
    return {
        "node": node,
        "node_seq": node_seq,
        "first_at_us": first_at_us,
        "last_at_us": last_at_us,
        "count": count,
        "channel": record.channel,
        "query_type": record.query_type,
        "response": record.response,
        "client_network": record.client_network,
        "ecs_prefix": record.ecs_prefix,
        "country": record.country,
        "continent": record.continent,
        "name": record.name,
        "service": record.service,
        "residency_classes": list(record.residency_classes),
        "tenant": record.tenant,
        "matched_rules": list(record.matched_rules),
        "snapshot_version": record.snapshot_version,
        "topology_version": record.topology_version,
        "policy_version": record.policy_version,
        "geoip_build": record.geoip_build,
        "candidates": [
            {"region": r, "status": s, "reason": why, "detail": d}
            for r, s, why, d in record.candidates
        ],
        "region": record.region,
        "answer": list(record.answer),
        "outcome": record.outcome,
        "ttl": record.ttl,
    }


# Columns covered by the hash: everything but the database's own id and the chain columns.
HASHED_COLUMNS = (
    "node",
    "node_seq",
    "first_at_us",
    "last_at_us",
    "count",
    "channel",
    "query_type",
    "response",
    "client_network",
    "ecs_prefix",
    "country",
    "continent",
    "name",
    "service",
    "residency_classes",
    "tenant",
    "matched_rules",
    "snapshot_version",
    "topology_version",
    "policy_version",
    "geoip_build",
    "candidates",
    "region",
    "answer",
    "outcome",
    "ttl",
)


def row_hash(prev_hash: str, row: dict[str, Any]) -> str:
    # orjson with sorted keys is canonical (compact, UTF-8) and several times faster than the
    # json module; a busy node hashes thousands of rows a second.
    body = orjson.dumps({k: row[k] for k in HASHED_COLUMNS}, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(prev_hash.encode() + body).hexdigest()


# The hashed columns that differ from row to row of one record, in sorted (canonical) order.
PER_ROW_COLUMNS = ("count", "first_at_us", "last_at_us", "node", "node_seq")
assert tuple(c for c in sorted(HASHED_COLUMNS) if c in PER_ROW_COLUMNS) == PER_ROW_COLUMNS


class RowForm(NamedTuple):
    """What every row of one record shares, rendered once.

    ``segments`` is the canonical JSON that :func:`row_hash` hashes (sorted keys, compact), cut
    where the values of :data:`PER_ROW_COLUMNS` go, and once more before the client network: a
    row's body is the segments with those values between them (:func:`row_body`), byte for byte
    what ``orjson`` would produce for the whole row. ``columns`` holds whatever the caller
    derived from the row for its own use (the writer keeps its database parameters there).

    The segments before the client network (answer and candidates, most of a row) and after
    the node (outcome, versions, service) are the same for every record of one answer, however
    many client networks it was given to: they are kept once (:func:`shared`), not per record.
    """

    segments: tuple[bytes, bytes, bytes, bytes, bytes, bytes, bytes]
    columns: tuple[Any, ...]


# Equal values rendered for different records (segments, JSON columns), kept once. Bounded:
# past its limit the table starts afresh (what it handed out stays shared where it went).
_SHARED_LIMIT = 8192
_shared: dict[Any, Any] = {}


def shared(value: Any) -> Any:
    """``value``, or an equal one handed out before: a row form holds the same bytes or text
    as every other record's of the same answer instead of a copy of its own (row forms live
    as long as their records, thousands of them in a node's DNS caches)."""
    kept = _shared.get(value)
    if kept is None:
        if len(_shared) >= _SHARED_LIMIT:
            _shared.clear()
        kept = _shared[value] = value
    return kept


def row_form(record: AuditRecord, columns: Callable[[dict[str, Any]], tuple[Any, ...]]) -> RowForm:
    """The :class:`RowForm` of ``record``, memoised on it. ``columns`` must be the same function
    at every call (the writer's), as the memo does not record which one built it."""
    form = record._form
    if form is None:
        row = row_of(record, node="", node_seq=0, first_at_us=0, last_at_us=0, count=0)
        cuts: list[bytes] = []
        text = b"{"
        for i, key in enumerate(sorted(HASHED_COLUMNS)):
            if key == "client_network":
                cuts.append(text)
                text = b""
            text += (b"," if i else b"") + orjson.dumps(key) + b":"
            if key in PER_ROW_COLUMNS:
                cuts.append(text)
                text = b""
            else:
                text += orjson.dumps(row[key], option=orjson.OPT_SORT_KEYS)
        cuts.append(text + b"}")
        answer, client, s1, s2, s3, s4, s5 = cuts
        form = RowForm((shared(answer), client, s1, s2, s3, s4, shared(s5)), columns(row))
        object.__setattr__(record, "_form", form)
    return form


def row_body(
    form: RowForm, count: int, first_at_us: int, last_at_us: int, node_json: bytes, node_seq: int
) -> bytes:
    """The canonical JSON of one row (what :func:`row_hash` hashes after the previous hash);
    ``node_json`` is the node name as JSON (``orjson.dumps(node)``)."""
    answer, client, s1, s2, s3, s4, s5 = form.segments
    return b"%s%s%d%s%d%s%d%s%s%s%d%s" % (
        answer,
        client,
        count,
        s1,
        first_at_us,
        s2,
        last_at_us,
        s3,
        node_json,
        s4,
        node_seq,
        s5,
    )


def chain(rows: list[dict[str, Any]], prev_hash: str) -> str:
    """Fill ``prev_hash``/``row_hash`` of ``rows`` in order; return the last hash."""
    for row in rows:
        row["prev_hash"] = prev_hash
        prev_hash = row["row_hash"] = row_hash(prev_hash, row)
    return prev_hash


@dataclass(frozen=True, slots=True)
class ChainBreak:
    node: str
    node_seq: int
    problem: str


def verify_chain(rows: list[dict[str, Any]]) -> list[ChainBreak]:
    """Check rows of one or more nodes (each node's rows in ``node_seq`` order)."""
    breaks: list[ChainBreak] = []
    last: dict[str, tuple[int, str]] = {}
    for row in rows:
        node, seq = row["node"], row["node_seq"]
        prev_seq, prev_hash = last.get(node, (0, GENESIS))
        if seq != prev_seq + 1:
            breaks.append(ChainBreak(node, seq, f"sequence jumps from {prev_seq} to {seq}"))
        if row["prev_hash"] != prev_hash:
            breaks.append(ChainBreak(node, seq, "prev_hash does not match the previous row"))
        if row_hash(row["prev_hash"], row) != row["row_hash"]:
            breaks.append(ChainBreak(node, seq, "row content does not match its hash"))
        last[node] = (seq, row["row_hash"])
    return breaks


def zone_record(
    *,
    channel: str,
    name: str,
    client_network: str,
    ecs: str | None,
    query_type: str | None,
    response: str,
    outcome: str,
    answer: tuple[str, ...],
    versions: Versions,
) -> AuditRecord:
    """The audit content of an answer that needed no routing decision: the zone's own records,
    NXDOMAIN, NODATA, refusals and malformed queries (every answer is accounted for)."""
    return AuditRecord(
        channel=channel,
        query_type=query_type,
        response=response,
        client_network=client_network,
        ecs_prefix=ecs,
        country=None,
        continent=None,
        name=name,
        service=None,
        residency_classes=(),
        tenant=None,
        matched_rules=(),
        snapshot_version=versions.snapshot,
        topology_version=versions.topology,
        policy_version=versions.policy,
        geoip_build=versions.geoip,
        candidates=(),
        region=None,
        answer=answer,
        outcome=outcome,
        ttl=0,
    )
