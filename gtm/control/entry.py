"""One control-log entry: what it says, who said it, and the signature that makes it count.

An entry is self-describing: ``kind`` (what happened), ``principal`` (the authenticated
principal's id, or ``bootstrap`` for the holder of the key file at the command line), ``body``
(the facts, a JSON object), its place (``seq``, ``prev_hash``) and time (``at_us``), the id of
the key that signed it and the signature over all of those (:meth:`Entry.signed_bytes`). Its hash
(``entry_hash``) covers the signed bytes and the signature; the next entry names it as
``prev_hash``. Changing any field, the order, or the set of entries breaks either a signature or
a link. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

GENESIS = "0" * 64
BOOTSTRAP = "bootstrap"  # the principal of entries written by the key file's holder (CLI)


class EntrySigner(Protocol):
    """What signs entries: the admin service's key (gtm.admin.signer.Signer)."""

    key_id: str

    def sign_bytes(self, body: bytes) -> str: ...


@dataclass(frozen=True, slots=True)
class Entry:
    seq: int
    prev_hash: str
    at_us: int
    kind: str
    principal: str
    body: Mapping[str, Any]
    key_id: str
    signature: str = ""

    def signed_bytes(self) -> bytes:
        return orjson.dumps(
            {
                "seq": self.seq,
                "prev": self.prev_hash,
                "at_us": self.at_us,
                "kind": self.kind,
                "principal": self.principal,
                "body": self.body,
                "key": self.key_id,
            },
            option=orjson.OPT_SORT_KEYS,
        )

    def body_text(self) -> str:
        return orjson.dumps(self.body, option=orjson.OPT_SORT_KEYS).decode()

    @property
    def entry_hash(self) -> str:
        return hashlib.sha256(self.signed_bytes() + self.signature.encode()).hexdigest()


def sign(
    signer: EntrySigner,
    *,
    seq: int,
    prev_hash: str,
    at_us: int,
    kind: str,
    principal: str,
    body: Mapping[str, Any],
) -> Entry:
    unsigned = Entry(seq, prev_hash, at_us, kind, principal, dict(body), signer.key_id)
    return Entry(
        seq,
        prev_hash,
        at_us,
        kind,
        principal,
        unsigned.body,
        signer.key_id,
        signer.sign_bytes(unsigned.signed_bytes()),
    )


class BadEntry(Exception):
    """An entry that must not be folded, and why (``seq`` says where)."""

    def __init__(self, seq: int, reason: str) -> None:
        super().__init__(f"control log entry {seq}: {reason}")
        self.seq = seq
        self.reason = reason


def from_row(row: Mapping[str, Any]) -> Entry:
    """An entry from a stored row; :class:`BadEntry` for one that does not even parse (a
    hostile row is refused with its reason, never an exception of another kind)."""
    seq = row.get("seq")
    where = seq if isinstance(seq, int) else -1
    try:
        body = orjson.loads(row["body"])
    except (orjson.JSONDecodeError, TypeError, KeyError):
        raise BadEntry(where, "its body is not JSON") from None
    if not isinstance(body, dict):
        raise BadEntry(where, "its body is not a JSON object")
    fields = ("prev_hash", "at_us", "kind", "principal", "key_id", "signature")
    values = {f: row.get(f) for f in fields}
    if not isinstance(seq, int) or not isinstance(values["at_us"], int):
        raise BadEntry(where, "its sequence or time is not an integer")
    if not all(isinstance(values[f], str) for f in fields if f != "at_us"):
        raise BadEntry(where, "a field is not text")
    return Entry(
        seq,
        str(values["prev_hash"]),
        int(values["at_us"]),
        str(values["kind"]),
        str(values["principal"]),
        body,
        str(values["key_id"]),
        str(values["signature"]),
    )


def check(
    entry: Entry,
    keys: Mapping[str, Ed25519PublicKey],
    after: tuple[int, str],
    stored_hash: str | None = None,
) -> None:
    """That ``entry`` follows ``after`` (sequence, hash), is signed by a trusted key and, when
    given, hashes to what the row stores; :class:`BadEntry` naming the first thing wrong."""
    seq, prev = after
    if entry.seq != seq + 1:
        raise BadEntry(entry.seq, f"follows {seq}: entries {seq + 1}..{entry.seq - 1} are missing")
    if entry.prev_hash != prev:
        raise BadEntry(entry.seq, "does not link to the entry before it (a fork or an edit)")
    key = keys.get(entry.key_id)
    if key is None:
        raise BadEntry(entry.seq, f"signed with key {entry.key_id!r}, not a trusted one")
    try:
        key.verify(bytes.fromhex(entry.signature), entry.signed_bytes())
    except (InvalidSignature, ValueError):
        raise BadEntry(entry.seq, "its signature does not verify (edited)") from None
    if stored_hash is not None and stored_hash != entry.entry_hash:
        raise BadEntry(entry.seq, "its stored hash is not its hash")


__all__ = ["BOOTSTRAP", "GENESIS", "BadEntry", "Entry", "EntrySigner", "check", "from_row", "sign"]
