"""The region events' chain, keyed by its writers: operator actions and state changes are
evidence too.

A decision row says which regions were eligible; the region events say why one was not (a
probe saw it down, an operator drained it, who and why). They form one fleet-wide chain: a row's
hash covers its content, the id of the key that wrote it and the previous row's hash, so an
edited, removed or reordered event breaks every later hash. Appends are serialised through a
one-row chain head (see :func:`gtm.fleet.shared_state.append_events`); events are few, so one
chain for the fleet costs nothing and reads in the order it was written.

Threat model: the database is untrusted storage. Whoever holds its password can read and write
every table (on PostgreSQL as superuser, triggers switched off), but holds no key file and
cannot rewrite the write-once checkpoint sink (:mod:`gtm.audit.checkpoints`). An unkeyed chain
is no defence against that: such a writer appends a row with the right ``prev_hash`` and
``row_hash``, or deletes the newest one, and moves the head to match. So:

* every row is signed (Ed25519, :func:`sign_event`) by the audit chain key
  (:mod:`gtm.audit.keys`) of the process that wrote it, over its ``row_hash`` (which covers
  every hashed field, its ``key_id`` and the previous row's hash); verification checks it with
  the public keys published in the sink, so a forged, rewritten-and-rehashed or re-signed row
  is reported at that row;
* a writer checkpoints only the head it wrote itself (:func:`written_head`, noted when the
  transaction that appended it commits), never the head the database shows: an event deleted
  (and the head moved back) before anyone else appended is contradicted by its own writer's
  next checkpoint, and one replaced by another row by the hash there.

The process's key is registered by its anchor (:class:`gtm.audit.anchor.Anchor` ``start``): the
anchor is what checkpoints the heads the key wrote. A process without one (a script, a test
with no anchor) still writes its events, unsigned, and logs it; verification reports every
unsigned row as a break, never as evidence.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Mapping
from typing import Any

import orjson
import structlog
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection

from gtm.audit.keys import ChainKey
from gtm.audit.record import GENESIS, ChainBreak

log = structlog.get_logger(__name__)

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
PublicKeys = Mapping[str, Ed25519PublicKey]  # key id -> a writer's published public key
# Domain separation: an event's signature can never be taken for a checkpoint's, or back.
_SIGNED = b"gtm region event\0"


def event_hash(prev_hash: str, row: dict[str, Any]) -> str:
    fields = {k: row[k] for k in HASHED}
    key = row.get("key_id")
    if key is not None:
        # Only keyed rows hash their key id: rows written before the chain was keyed (0011)
        # keep the hashes they were written with, and are reported as unsigned, not as edited.
        fields["key_id"] = key
    body = orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(prev_hash.encode() + body).hexdigest()


def sign_event(key: ChainKey, row_hash: str) -> str:
    return key.sign(_SIGNED + row_hash.encode())


def signature_problem(row: Mapping[str, Any], keys: Mapping[str, Ed25519PublicKey]) -> str | None:
    """Why ``row`` is not attributable to a writer whose key is in ``keys`` (None: it is). The
    row's hash is checked separately; this vouches that a key holder wrote that hash."""
    key_id, signature = row.get("key_id"), row.get("signature")
    if key_id is None or signature is None:
        return (
            "event is not signed by any writer's key: added outside GTM (or written before the "
            "chain was keyed, or by a process with no audit key)"
        )
    public = keys.get(key_id)
    if public is None:
        return f"event is signed with key {key_id}, which the checkpoint sink does not publish"
    try:
        public.verify(bytes.fromhex(signature), _SIGNED + str(row["row_hash"]).encode())
    except (InvalidSignature, ValueError):
        return "event signature does not verify: forged, or rewritten and re-hashed"
    return None


def chain_events(
    rows: list[dict[str, Any]], seq: int, prev_hash: str, key: ChainKey | None = None
) -> tuple[int, str]:
    """Number ``rows`` after ``seq``, chain them after ``prev_hash`` and sign each with ``key``
    (unsigned without one); returns the new head (last sequence number, last hash)."""
    for row in rows:
        seq += 1
        row["seq"], row["prev_hash"] = seq, prev_hash
        row["key_id"] = None if key is None else key.id
        prev_hash = row["row_hash"] = event_hash(prev_hash, row)
        row["signature"] = None if key is None else sign_event(key, prev_hash)
    return seq, prev_hash


def verify_events(
    rows: list[dict[str, Any]],
    head: tuple[int, str] | None,
    keys: Mapping[str, Ed25519PublicKey] | None = None,
) -> list[ChainBreak]:
    """Check chained rows in ``seq`` order against each other and the chain head the database
    shows (None when it has none); with ``keys``, each row's signature too. This is a check of
    the database against itself (the head is no more trusted than the rows):
    :mod:`gtm.audit.verify` checks it against the signed checkpoints outside it. Rows without
    a ``seq`` are not in the chain and are skipped here (verify names them)."""
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
        elif keys is not None and (problem := signature_problem(row, keys)) is not None:
            breaks.append(ChainBreak(CHAIN, seq, problem))
        prev_seq, prev_hash = seq, row["row_hash"]
    if head is not None and head != (prev_seq, prev_hash):
        # The newest events were removed: nothing after them can show it, the head does.
        breaks.append(
            ChainBreak(CHAIN, head[0], f"the chain ends at {prev_seq}; its head says {head[0]}")
        )
    return breaks


# -- this process's writer ---------------------------------------------------------------------
#
# Process-wide because events are appended from many places (the state sync, the admin API's
# actions, operator commands) that all run beside one anchor. A stack, not one slot: several
# runtimes in one process (tests, the demo) each push their key, and one stopping leaves the
# others' in place.

_lock = threading.Lock()
_keys: list[ChainKey] = []
_written: dict[str, tuple[int, str]] = {}  # key id -> the newest (seq, hash) it committed
# key id -> heads it committed that a later head of its own did not extend (the chain went back
# under it: someone removed its events and moved the head back). Each is signed too, so the
# removal is contradicted even when the writer appends again before its next checkpoint.
_displaced: dict[str, list[tuple[int, str]]] = {}


def use_key(key: ChainKey) -> None:
    """Sign this process's events with ``key`` (its anchor checkpoints what it writes)."""
    with _lock:
        _keys.append(key)


def drop_key(key: ChainKey) -> None:
    with _lock:
        for i in range(len(_keys) - 1, -1, -1):
            if _keys[i] is key:
                del _keys[i]
                break


def warn_unsigned(seq: int) -> None:
    log.warning("region_events.unsigned", seq=seq, reason="no audit key in this process")


def signing_key() -> ChainKey | None:
    with _lock:
        return _keys[-1] if _keys else None


def written_head(key_id: str) -> tuple[int, str] | None:
    """The newest event head committed by the key ``key_id`` in this process: the events head
    its anchor signs (never the one the database shows)."""
    with _lock:
        return _written.get(key_id)


def take_displaced(key_id: str) -> list[tuple[int, str]]:
    """Heads ``key_id`` committed whose place in the chain another row took since (see
    ``_displaced``), oldest first; each is returned once, to be signed."""
    with _lock:
        return _displaced.pop(key_id, [])


def went_back(key_id: str, head_seq: int) -> bool:
    """Whether the chain's head (as the database shows it, ``head_seq``) is behind the newest
    event ``key_id`` committed: its events were removed. Logged where it is seen; the
    writer's own checkpoint is what makes it evidence."""
    known = written_head(key_id)
    if known is None or head_seq >= known[0]:
        return False
    log.error(
        "region_events.head_went_back",
        head_seq=head_seq,
        written_seq=known[0],
        problem="events this process wrote are gone from the database",
    )
    return True


def _note_written(key_id: str, seq: int, digest: str) -> None:
    with _lock:
        known = _written.get(key_id)
        if known is not None and seq <= known[0]:
            _displaced.setdefault(key_id, []).append(known)
        _written[key_id] = (seq, digest)


def remember_on_commit(conn: AsyncConnection, key_id: str, seq: int, digest: str) -> None:
    """Note ``(seq, digest)`` as written by ``key_id`` when ``conn``'s transaction commits, and
    forget it when it rolls back: a head in a rolled-back transaction was never written, and
    checkpointing it would be a false break."""
    sync = conn.sync_connection
    if sync is None:  # it has just appended the rows: it is connected
        raise RuntimeError("remember_on_commit on a closed connection")
    settled = False
    loop = asyncio.get_running_loop()

    def committed(_: Connection) -> None:
        nonlocal settled
        if not settled:
            settled = True
            _note_written(key_id, seq, digest)
            loop.call_soon(forget)

    def rolled_back(_: Connection) -> None:
        nonlocal settled
        if not settled:
            settled = True
            loop.call_soon(forget)

    def forget() -> None:
        # Removed after the dispatch that fired (not during it: it is iterating the listeners);
        # a pooled connection must not gather two listeners per append for its whole life.
        for name, fn in (("commit", committed), ("rollback", rolled_back)):
            if event.contains(sync, name, fn):
                event.remove(sync, name, fn)

    event.listen(sync, "commit", committed)
    event.listen(sync, "rollback", rolled_back)


__all__ = [
    "CHAIN",
    "HASHED",
    "PublicKeys",
    "chain_events",
    "drop_key",
    "event_hash",
    "remember_on_commit",
    "sign_event",
    "signature_problem",
    "signing_key",
    "take_displaced",
    "use_key",
    "verify_events",
    "warn_unsigned",
    "went_back",
    "written_head",
]
