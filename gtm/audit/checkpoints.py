"""Signed checkpoints of the audit chains, kept in the database and in a sink outside it.

A checkpoint says: chain ``chain`` of store ``store`` had ``seq`` rows ending in hash ``head``,
which counted ``answers`` answers, at time ``at``; signed with the chain's Ed25519 key
(:mod:`gtm.audit.keys`). The hash chain links every row to the one before it, so a checkpoint
vouches for every row up to ``seq``: an edited, reordered, removed or re-hashed row, a
truncated tail or a deleted chain contradicts a checkpoint that someone holding the database
password cannot rewrite, because they hold neither the key nor the sink.

Kinds: ``open`` (a chain's first checkpoint, written when a node starts a chain: the sink's
chain files are the registry of chains, so a chain whose rows were all deleted is still
known), ``checkpoint`` (on a schedule and at shutdown), ``gap`` (a node that stopped
uncleanly says so when it starts again: answers counted after its last flush were lost),
``cut`` (retention removed the chain's rows through ``seq``: :mod:`gtm.audit.retention`).

The sink here is a directory (one append-only file per chain and key, and the public keys);
in production it is a write-once object store behind the same methods
(:mod:`gtm.audit.checkpoint_bucket`, chosen by ``GTM_AUDIT_CHECKPOINT_URL``: :func:`open_sink`).
Every line is checked when read; one that does not parse or verify is reported with its file and
line, never skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from gtm.audit.keys import ChainKey, key_id, load_public, public_pem

if TYPE_CHECKING:
    from gtm.settings import Settings

Kind = Literal["open", "checkpoint", "gap", "cut"]
EVENTS_CHAIN = "region_events"  # the fleet-wide event chain's id in checkpoints


@dataclass(frozen=True, slots=True)
class Checkpoint:
    kind: Kind
    chain: str
    seq: int
    head: str
    answers: int  # answers the chain's rows up to seq counted (events: 0)
    at: float
    store: str  # the audit store this chain belongs to (gtm.audit.store_id)
    key: str  # the signing key's id
    detail: str = ""

    def canonical(self) -> bytes:
        return orjson.dumps(asdict(self), option=orjson.OPT_SORT_KEYS)


@dataclass(frozen=True, slots=True)
class Signed:
    checkpoint: Checkpoint
    signature: str

    def line(self) -> bytes:
        body = {"checkpoint": asdict(self.checkpoint), "signature": self.signature}
        return orjson.dumps(body, option=orjson.OPT_SORT_KEYS) + b"\n"


def sign(checkpoint: Checkpoint, key: ChainKey) -> Signed:
    return Signed(checkpoint, key.sign(checkpoint.canonical()))


class BadCheckpoint(Exception):
    def __init__(self, location: str, problem: str) -> None:
        super().__init__(f"{location}: {problem}")
        self.location = location
        self.problem = problem


def parse(line: bytes, location: str) -> Signed:
    try:
        data = orjson.loads(line)
        checkpoint = Checkpoint(**data["checkpoint"])
        signature = data["signature"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise BadCheckpoint(location, f"not a checkpoint ({exc})") from None
    if not isinstance(signature, str):
        raise BadCheckpoint(location, "signature is not text")
    return Signed(checkpoint, signature)


def check(signed: Signed, keys: Mapping[str, Ed25519PublicKey], location: str) -> None:
    """Raise :class:`BadCheckpoint` unless a trusted key signed exactly this checkpoint."""
    key = keys.get(signed.checkpoint.key)
    if key is None:
        raise BadCheckpoint(location, f"signed with key {signed.checkpoint.key}, not trusted")
    try:
        key.verify(bytes.fromhex(signed.signature), signed.checkpoint.canonical())
    except (InvalidSignature, ValueError):
        raise BadCheckpoint(location, "signature does not verify: forged or altered") from None


class Sink(Protocol):
    """Where checkpoints go outside the database."""

    def publish_key(self, key: ChainKey) -> None: ...

    def append(self, signed: Signed) -> None: ...


class CheckpointSink(Sink, Protocol):
    """A sink that is also read back: what verification, retention and the evidence status
    take (:class:`DirectorySink`, :class:`gtm.audit.checkpoint_bucket.BucketSink`)."""

    @property
    def location(self) -> str:
        """Where it is, for people (a directory, an ``s3://`` URL)."""
        ...

    def keys(self) -> dict[str, Ed25519PublicKey]: ...

    def read(self) -> Iterator[tuple[str, bytes] | BadCheckpoint]:
        """Every checkpoint's bytes with its location, and a :class:`BadCheckpoint` for
        anything in the sink that must not be there."""
        ...


def open_sink(settings: Settings, where: str | Path | None = None) -> CheckpointSink:
    """The sink ``where`` names (a directory, or ``s3://BUCKET/PREFIX``), else the settings'
    (``GTM_AUDIT_CHECKPOINT_URL`` when set, else ``GTM_AUDIT_CHECKPOINT_DIR``)."""
    url = settings.audit_checkpoint_url if where is None else str(where)
    if url is not None and url.startswith("s3://"):
        from gtm.audit.checkpoint_bucket import BucketSink  # boto3 only where it is used

        return BucketSink.from_settings(settings, url)
    return DirectorySink(settings.checkpoint_dir if where is None else Path(where))


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


class DirectorySink:
    """``DIR/keys/<key id>.pub`` and ``DIR/chains/<chain>.<key id>.jsonl``, appended and
    fsynced. A key file once written is never replaced."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @property
    def location(self) -> str:
        return str(self.directory)

    def publish_key(self, key: ChainKey) -> None:
        keys = self.directory / "keys"
        keys.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(keys / f"{key.id}.pub", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        with os.fdopen(fd, "wb") as out:
            out.write(public_pem(key.public))
            out.flush()
            os.fsync(out.fileno())

    def append(self, signed: Signed) -> None:
        chains = self.directory / "chains"
        chains.mkdir(parents=True, exist_ok=True)
        cp = signed.checkpoint
        path = chains / f"{_safe(cp.chain)}.{cp.key}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        try:
            os.write(fd, signed.line())
            os.fsync(fd)
        finally:
            os.close(fd)

    def keys(self) -> dict[str, Ed25519PublicKey]:
        """The published public keys, by id (a file whose key does not match its name is not
        trusted)."""
        found: dict[str, Ed25519PublicKey] = {}
        for path in sorted((self.directory / "keys").glob("*.pub")):
            key = load_public(path.read_bytes())
            if key is not None and key_id(key) == path.stem:
                found[path.stem] = key
        return found

    def read(self) -> Iterator[tuple[str, bytes]]:
        """Every line of every chain file, with its location ("file:line")."""
        for path in sorted((self.directory / "chains").glob("*.jsonl")):
            with open(path, "rb") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        yield f"{path}:{n}", line


__all__ = [
    "EVENTS_CHAIN",
    "BadCheckpoint",
    "Checkpoint",
    "CheckpointSink",
    "DirectorySink",
    "Signed",
    "Sink",
    "check",
    "open_sink",
    "parse",
    "sign",
]
