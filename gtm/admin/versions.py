"""Document versions: a topology and its policies, stored under the SHA-256 of their content.

A version is written once and never changes: its id is its content's digest
(:func:`gtm.fleet.signed_documents.content_digest`), and every read checks that the content
still hashes to it, so a row altered in the database is refused as tampered wherever it is
shown, diffed or activated. Which version is active is the proposals' business
(:mod:`gtm.admin.lifecycle`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from gtm.admin.diff import FileDiff, diff_documents
from gtm.admin.errors import Invalid, NotFound, Tampered
from gtm.audit.schema import document_versions
from gtm.control.log import ControlLog
from gtm.decision.bundle import parse_documents
from gtm.errors import ConfigError
from gtm.fleet.signed_documents import content_digest


@dataclass(frozen=True, slots=True)
class Version:
    id: str
    topology: str
    policies: Mapping[str, str]
    created_at: float
    created_by: str


def _us(t: float) -> int:
    return round(t * 1e6)


def validate(topology: str, policies: Mapping[str, str]) -> None:
    """:class:`Invalid` with every problem and its path, as ``gtm policy validate`` gives them."""
    try:
        parse_documents(topology, policies, "proposed documents")
    except ConfigError as exc:
        raise Invalid("the documents do not validate", exc.problems) from None


async def store(
    conn: AsyncConnection, topology: str, policies: Mapping[str, str], by: str, now: float
) -> str:
    version = content_digest(topology, policies)
    exists = (
        await conn.execute(select(document_versions.c.id).where(document_versions.c.id == version))
    ).first()
    if exists is None:
        try:
            async with conn.begin_nested():  # the same content proposed twice at once
                await conn.execute(
                    insert(document_versions),
                    {
                        "id": version,
                        "topology": topology,
                        "policies": dict(policies),
                        "created_at_us": _us(now),
                        "created_by": by,
                    },
                )
        except IntegrityError:
            pass
    await get_version(conn, version)  # what is stored under the id is that content
    return version


async def active_version(conn: AsyncConnection, control: ControlLog) -> str | None:
    """The version of the newest activation, as the verified control log says (no row of the
    proposals table, however it was written, changes it)."""
    in_force = (await control.state(conn)).in_force
    return None if in_force is None else in_force.version


async def get_version(conn: AsyncConnection, version: str) -> Version:
    row = (
        await conn.execute(select(document_versions).where(document_versions.c.id == version))
    ).first()
    if row is None:
        raise NotFound(f"no version {version}")
    if content_digest(row.topology, row.policies) != row.id:
        raise Tampered(
            f"version {version} was altered in the database: its content no longer hashes to its id"
        )
    return Version(row.id, row.topology, row.policies, row.created_at_us / 1e6, row.created_by)


async def proposal_diff(
    conn: AsyncConnection,
    proposal_id: int,
    control: ControlLog,
    files: tuple[str, Mapping[str, str]] | None = None,
) -> tuple[str | None, list[FileDiff]]:
    """A proposal's version against the active one, or against ``files`` (the nodes' own
    documents) while none is: (active version id, file diffs)."""
    state = await control.state(conn)
    proposal = state.proposals.get(proposal_id)
    if proposal is None:
        raise NotFound(f"no proposal {proposal_id}")
    active = state.in_force.version if state.in_force is not None else None
    before = files
    if active is not None:
        old = await get_version(conn, active)
        before = (old.topology, old.policies)
    new = await get_version(conn, proposal.version)
    return active, diff_documents(before, (new.topology, new.policies))


__all__ = ["Version", "active_version", "get_version", "proposal_diff", "store", "validate"]
