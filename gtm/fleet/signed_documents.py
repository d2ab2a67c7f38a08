"""Published documents a node may trust: content, approval record and Ed25519 signature.

DESIGN.md rule 6: a topology or policy change comes into force only when a second principal
approved it and the admin service signed it; a row written straight into the database is
refused by every node. The admin service (:mod:`gtm.admin`) holds the private key, in a file
outside the database; nodes hold only public keys (``GTM_DOCUMENT_KEYS``). What is signed is the
*manifest*, a canonical JSON approval record::

    {"version": <SHA-256 of the content>, "sequence": <activation serial>,
     "proposal": 7, "author": "alice", "approvers": ["bob"], "required": 1,
     "activated_at": 1764000000.0, "actor": "bob", "reason": "...", "key": <key id>}

and a node checks, before anything comes into force (:func:`verify`): the signature over the
manifest's exact bytes with a trusted key; that the content hashes to ``version`` (so the
topology and policies cannot be swapped under a valid manifest); four-eyes in the record itself
(``required`` distinct approvers, none of them the author); and that ``sequence`` is higher
than the one in force (an older, validly signed version re-inserted as the newest row is a
replay, not a rollback: a rollback is a new activation with a new sequence).

Every field of a row is untrusted input (DESIGN.md rule 6: an attacker may write any value to any
column): a ``policies`` that is not a mapping of names to text, a topology that is not text, a
manifest that is not an approval record are refused by :func:`verify` with a reason like any
other bad row, never an exception of another kind.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from gtm.errors import ConfigError, GTMError, Problem


class Untrusted(GTMError):
    """A published document that must not come into force, and why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  # a short code for metrics: unsigned, bad_signature, ...
        self.detail = detail


def content_digest(topology: str, policies: Mapping[str, str]) -> str:
    """The version id of a topology and its policies: SHA-256 over their canonical JSON."""
    body = orjson.dumps(
        {"topology": topology, "policies": dict(policies)}, option=orjson.OPT_SORT_KEYS
    )
    return hashlib.sha256(body).hexdigest()


def manifest_hash(manifest_text: str) -> str:
    """The id of one signed approval record: SHA-256 over its exact bytes. Two records of the
    same sequence with different hashes are a fork."""
    return hashlib.sha256(manifest_text.encode()).hexdigest()


def key_id(key: Ed25519PublicKey) -> str:
    """A public key's id: the first 16 hex digits of SHA-256 over its raw bytes."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Manifest:
    version: str
    sequence: int
    proposal: int
    author: str
    approvers: tuple[str, ...]
    required: int
    activated_at: float
    actor: str
    reason: str
    key: str

    def canonical(self) -> bytes:
        """The bytes that are signed and stored."""
        return orjson.dumps(
            {**asdict(self), "approvers": list(self.approvers)}, option=orjson.OPT_SORT_KEYS
        )

    @classmethod
    def parse(cls, text: str) -> Manifest:
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise TypeError(f"a JSON {type(data).__name__}, not an object")
            if not isinstance(data["approvers"], list):
                raise TypeError("approvers is not a list")
            manifest = cls(
                version=str(data["version"]),
                sequence=int(data["sequence"]),
                proposal=int(data["proposal"]),
                author=str(data["author"]),
                approvers=tuple(str(a) for a in data["approvers"]),
                required=int(data["required"]),
                activated_at=float(data["activated_at"]),
                actor=str(data["actor"]),
                reason=str(data["reason"]),
                key=str(data["key"]),
            )
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            raise Untrusted("bad_manifest", f"not an approval record: {exc!s:.200}") from None
        if not math.isfinite(manifest.activated_at):
            raise Untrusted("bad_manifest", "activated_at is not a finite time")
        return manifest


def check_content(topology: object, policies: object) -> tuple[str, dict[str, str]]:
    """``topology`` and ``policies`` when the one is text and the other a mapping of file names
    to text; :class:`Untrusted` (``malformed``) otherwise: what a row's columns must hold before
    anything else is looked at."""
    if not isinstance(topology, str):
        raise Untrusted("malformed", f"topology is a {type(topology).__name__}, not text")
    if not isinstance(policies, Mapping):
        raise Untrusted("malformed", f"policies is a {type(policies).__name__}, not a mapping")
    for name, text in policies.items():
        if not isinstance(name, str) or not isinstance(text, str):
            raise Untrusted("malformed", f"policies[{name!r:.80}] is not text named by text")
    return topology, {str(name): str(text) for name, text in policies.items()}


def verify(
    topology: object,
    policies: object,
    manifest_text: object,
    signature_hex: object,
    keys: Mapping[str, Ed25519PublicKey],
    in_force: int | None,
    min_approvals: int = 1,
) -> Manifest:
    """The manifest of a published row that may come into force; :class:`Untrusted` otherwise.

    ``keys``: the trusted public keys by id; ``in_force``: the sequence a new version must be
    above (the one in force, or what the node last had before it restarted; None: nothing yet);
    ``min_approvals``: the node's own configured minimum, whatever the record says.
    """
    if not manifest_text or not signature_hex:
        raise Untrusted("unsigned", "no approval record or signature")
    if not isinstance(manifest_text, str) or not isinstance(signature_hex, str):
        raise Untrusted("malformed", "the approval record or the signature is not text")
    topology_text, policy_texts = check_content(topology, policies)
    if not keys:
        raise Untrusted("no_keys", "this node has no document key to verify with")
    manifest = Manifest.parse(manifest_text)
    key = keys.get(manifest.key)
    if key is None:
        raise Untrusted("unknown_key", f"signed with key {manifest.key!r}, not a trusted one")
    try:
        key.verify(bytes.fromhex(signature_hex), manifest_text.encode())
    except (InvalidSignature, ValueError, UnicodeError):
        raise Untrusted("bad_signature", "the signature does not verify") from None
    try:
        digest = content_digest(topology_text, policy_texts)
    except (TypeError, ValueError) as exc:  # orjson: text that is not valid Unicode
        raise Untrusted("malformed", f"the content cannot be hashed: {exc!s:.200}") from None
    if digest != manifest.version:
        raise Untrusted("content_mismatch", f"content hashes to {digest}, not {manifest.version}")
    approvers = set(manifest.approvers)
    if len(approvers) != len(manifest.approvers) or manifest.author in approvers:
        raise Untrusted("four_eyes", "approvers must be distinct and none of them the author")
    required = max(1, manifest.required, min_approvals)
    if len(approvers) < required:
        raise Untrusted("four_eyes", f"{len(approvers)} approval(s) of {required}")
    if in_force is not None and manifest.sequence <= in_force:
        raise Untrusted("replayed", f"sequence {manifest.sequence} is not after {in_force}")
    return manifest


def load_public_keys(paths: tuple[Path, ...]) -> dict[str, Ed25519PublicKey]:
    """Trusted document keys from PEM files, by key id; :class:`ConfigError` with every bad
    file."""
    keys: dict[str, Ed25519PublicKey] = {}
    problems: list[Problem] = []
    for path in paths:
        try:
            key = serialization.load_pem_public_key(path.read_bytes())
        except (OSError, ValueError) as exc:
            problems.append(Problem(str(path), "", f"not a readable PEM public key: {exc}"))
            continue
        if not isinstance(key, Ed25519PublicKey):
            problems.append(Problem(str(path), "", "not an Ed25519 public key"))
            continue
        keys[key_id(key)] = key
    if problems:
        raise ConfigError(problems)
    return keys


__all__ = [
    "Manifest",
    "Untrusted",
    "check_content",
    "content_digest",
    "key_id",
    "load_public_keys",
    "manifest_hash",
    "verify",
]
