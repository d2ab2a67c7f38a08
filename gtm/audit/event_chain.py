"""The region events' hash chain: operator actions and state changes are evidence too.

A decision row says which regions were eligible; the region events say why one was not (a
probe saw it down, an operator drained it, who and why). They are chained like the decisions,
in one fleet-wide chain: a row's hash covers its content and the previous row's hash, so an
edited, removed or reordered event breaks every later hash. Appends are serialised through a
one-row chain head (see :func:`gtm.fleet.shared_state.append_events`); events are few, so one
chain for the fleet costs nothing and reads in the order it was written.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from gtm.audit.record import GENESIS, ChainBreak

HASHED = (
    "seq",
    "at_us",
    "node",
    "region",
    "kind",
    "state",
    "previous",
    "detail",
    "actor",
    "reason",
)
CHAIN = "region_events"  # the chain's name in ChainBreak reports


def event_hash(prev_hash: str, row: dict[str, Any]) -> str:
    body = orjson.dumps({k: row[k] for k in HASHED}, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(prev_hash.encode() + body).hexdigest()


def chain_events(rows: list[dict[str, Any]], seq: int, prev_hash: str) -> tuple[int, str]:
    """Number ``rows`` after ``seq`` and chain them after ``prev_hash``; returns the new
    head (last sequence number, last hash)."""
    for row in rows:
        seq += 1
        row["seq"], row["prev_hash"] = seq, prev_hash
        prev_hash = row["row_hash"] = event_hash(prev_hash, row)
    return seq, prev_hash


def verify_events(rows: list[dict[str, Any]], head: tuple[int, str] | None) -> list[ChainBreak]:
    """Check chained rows in ``seq`` order against each other and the chain head (the last
    sequence number and hash the store recorded; None when it has none). Rows written before
    the chain existed (no ``seq``) are not covered, and are skipped."""
    breaks: list[ChainBreak] = []
    prev_seq, prev_hash = 0, GENESIS
    for row in rows:
        seq = row["seq"]
        if seq is None:
            continue
        if seq != prev_seq + 1:
            breaks.append(ChainBreak(CHAIN, seq, f"sequence jumps from {prev_seq} to {seq}"))
        if row["prev_hash"] != prev_hash:
            breaks.append(ChainBreak(CHAIN, seq, "prev_hash does not match the previous event"))
        if event_hash(row["prev_hash"], row) != row["row_hash"]:
            breaks.append(ChainBreak(CHAIN, seq, "event content does not match its hash"))
        prev_seq, prev_hash = seq, row["row_hash"]
    if head is not None and head != (prev_seq, prev_hash):
        # The newest events were removed: nothing after them can show it, the head does.
        breaks.append(
            ChainBreak(CHAIN, head[0], f"the chain ends at {prev_seq}; its head says {head[0]}")
        )
    return breaks
