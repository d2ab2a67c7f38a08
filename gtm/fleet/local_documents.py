"""The signed version a node accepted, kept on its own disk, and the review of published rows.

DESIGN.md rule 6: the database is untrusted storage. Someone who can write every table can
delete or edit the newest signed document rows; a node that restarted and trusted only the
database would then forget the activation and answer from an older version, or from its own
topology and policy files (on a fleet, two policies at once). So each node keeps, beside its
spool, a copy of the signed version it last accepted: content, approval record (manifest) and
signature, with its sequence and the hash of its record. The copy is written atomically (temp
file, fsync, rename, fsync of the directory) and verified again when read back, like any row
(signature and content digest: the file is not secret, and not trusted either).

On a restart the node answers from that copy until the database offers a valid signed version
at or above its sequence; it never falls back to its files while a signed version exists. A
database whose newest valid version is below the copy (rolled back, rows deleted or edited) or
that holds another record at the same sequence (a fork) is refused loudly by the runtime, which
keeps serving its copy.

:func:`review` sorts published rows into valid and refused, never raising: a row whose
``policies`` is not a mapping, whose topology is not text, whose record is garbage is refused
with its reason, and the other rows are used.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import orjson
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.fleet import shared_state
from gtm.fleet.shared_state import Published
from gtm.fleet.signed_documents import Manifest, Untrusted, check_content, manifest_hash, verify

FORMAT = 1
STATE_NAME = "documents-accepted.json"
# Rows a full review reads, highest claimed sequence first (as the state sync's first read).
REVIEW_LIMIT = 100


@dataclass(frozen=True, slots=True)
class Accepted:
    """A signed version that verified: its content, its approval record and signature."""

    topology: str
    policies: Mapping[str, str]
    manifest_text: str
    signature: str
    manifest: Manifest

    @property
    def sequence(self) -> int:
        return self.manifest.sequence

    @property
    def manifest_hash(self) -> str:
        return manifest_hash(self.manifest_text)

    @classmethod
    def verified(
        cls,
        topology: object,
        policies: object,
        manifest_text: object,
        signature: object,
        keys: Mapping[str, Ed25519PublicKey],
        min_approvals: int,
    ) -> Accepted:
        """The version when it verifies (signature, content digest, four-eyes);
        :class:`Untrusted` otherwise. Any sequence: the caller compares it with what it holds."""
        manifest = verify(topology, policies, manifest_text, signature, keys, None, min_approvals)
        topology_text, policy_texts = check_content(topology, policies)
        assert isinstance(manifest_text, str)  # verify checked both
        assert isinstance(signature, str)
        return cls(topology_text, policy_texts, manifest_text, signature, manifest)

    def record(self) -> bytes:
        """The file's bytes."""
        return orjson.dumps(
            {
                "format": FORMAT,
                "sequence": self.sequence,
                "manifest_hash": self.manifest_hash,
                "topology": self.topology,
                "policies": dict(self.policies),
                "manifest": self.manifest_text,
                "signature": self.signature,
            },
            option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2,
        )


def read_accepted(
    path: Path, keys: Mapping[str, Ed25519PublicKey], min_approvals: int
) -> Accepted | None:
    """The copy at ``path``, verified again; None when there is none; :class:`Untrusted` (with
    a ``local_*`` reason, or the verification's) when there is one that must not be used."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Untrusted("local_unreadable", f"{path}: {exc}") from None
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise Untrusted("local_corrupt", f"{path}: not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise Untrusted("local_corrupt", f"{path}: not a format-{FORMAT} accepted version")
    accepted = Accepted.verified(
        data.get("topology"),
        data.get("policies"),
        data.get("manifest"),
        data.get("signature"),
        keys,
        min_approvals,
    )
    if data.get("sequence") != accepted.sequence or data.get("manifest_hash") != (
        accepted.manifest_hash
    ):
        raise Untrusted(
            "local_mismatch",
            f"{path}: sequence/hash {data.get('sequence')!r}/{data.get('manifest_hash')!r} "
            f"are not the signed record's {accepted.sequence}/{accepted.manifest_hash}",
        )
    return accepted


def write_accepted(path: Path, accepted: Accepted) -> None:
    """Replace the copy at ``path`` atomically: a crash leaves the old copy or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as out:
            out.write(accepted.record())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a power cut
        dirfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)


@dataclass(frozen=True, slots=True)
class Review:
    """Published rows sorted: the ones that verify (highest sequence first) and the others."""

    valid: list[tuple[Accepted, Published]]
    refused: list[tuple[Published, Untrusted]]

    @property
    def newest(self) -> Accepted | None:
        return self.valid[0][0] if self.valid else None


def review(
    rows: Iterable[Published], keys: Mapping[str, Ed25519PublicKey], min_approvals: int
) -> Review:
    """Every row verified on its own; a row that does not is refused with its reason, whatever
    it holds (this never raises for a row's content)."""
    valid: list[tuple[Accepted, Published]] = []
    refused: list[tuple[Published, Untrusted]] = []
    for published in rows:
        try:
            accepted = Accepted.verified(
                published.topology,
                published.policies,
                published.manifest,
                published.signature,
                keys,
                min_approvals,
            )
        except Untrusted as exc:
            refused.append((published, exc))
            continue
        except Exception as exc:  # a row must never stop the others being read
            refused.append((published, Untrusted("malformed", f"{type(exc).__name__}: {exc}")))
            continue
        valid.append((accepted, published))
    valid.sort(key=lambda pair: (pair[0].sequence, pair[1].id), reverse=True)
    return Review(valid, refused)


@dataclass(frozen=True, slots=True)
class InForce:
    """The signed version in force as a reader outside a node sees it (``gtm explain``)."""

    accepted: Accepted | None  # None: no signed version anywhere; the files are in force
    source: str  # "database #<id>", "local copy <path>", or "files"
    notes: tuple[str, ...]  # what the reader should know (refusals, a database behind, ...)


async def read_in_force(
    engine: AsyncEngine,
    keys: Mapping[str, Ed25519PublicKey],
    min_approvals: int,
    local: Path | None = None,
) -> InForce:
    """The newest valid signed version in the database, or this node's own copy at ``local``
    when that is newer (the database was rolled back); database errors propagate."""
    rows = await shared_state.read_published_after(engine, None, REVIEW_LIMIT)
    result = review(rows, keys, min_approvals)
    notes: list[str] = []
    if result.refused:
        reasons = sorted({exc.reason for _, exc in result.refused})
        notes.append(f"{len(result.refused)} published row(s) refused ({', '.join(reasons)})")
    if rows and not keys:
        notes.append("no document key configured (GTM_DOCUMENT_KEYS): nothing can be verified")
    copy: Accepted | None = None
    if local is not None:
        try:
            copy = read_accepted(local, keys, min_approvals)
        except Untrusted as exc:
            notes.append(f"this node's copy {local} refused: {exc}")
    newest = result.newest
    if copy is not None and (newest is None or copy.sequence > newest.sequence):
        notes.append(
            f"the database's newest valid version ({newest.sequence if newest else 'none'}) "
            f"is below this node's copy (sequence {copy.sequence}): refused"
        )
        return InForce(copy, f"local copy {local}", tuple(notes))
    if newest is not None:
        published = result.valid[0][1]
        return InForce(newest, f"database row #{published.id}", tuple(notes))
    return InForce(None, "files", tuple(notes))


__all__ = [
    "Accepted",
    "InForce",
    "Review",
    "read_accepted",
    "read_in_force",
    "review",
    "write_accepted",
]
