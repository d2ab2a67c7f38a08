"""The proposals that take a document version into force, with four-eyes approval.

A version (:mod:`gtm.admin.versions`) is a topology and its policies, content-addressed. A
proposal carries one version through::

    draft -> proposed -> approved -> active -> superseded
       \\________\\___________\\-> withdrawn

Its author writes and edits it (an edit takes it back to draft and drops every approval) and
submits it; a principal holding ``policy-approver`` who is *not* its author approves the version
they reviewed (naming another version is a conflict: someone changed it since); with the
configured number of approvals it is approved, and an approver activates it: the admin service
signs the approval record and publishes the version in the same transaction, with the next
activation sequence. Rollback is a new proposal of an earlier version, under the same rule.
Every step is an event in the hash-chained log (:mod:`gtm.admin.events`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from gtm.admin import events, versions
from gtm.admin import principals as identities
from gtm.admin.diff import FileDiff, diff_documents
from gtm.admin.errors import Conflict, NotFound, Refused, Tampered
from gtm.admin.permissions import Role
from gtm.admin.principals import Principal
from gtm.admin.seals import Sealer, approval_fields, proposal_fields
from gtm.admin.signer import Signer
from gtm.audit.schema import approvals, principals, proposals
from gtm.fleet import shared_state
from gtm.fleet.signed_documents import Manifest

DRAFT, PROPOSED, APPROVED, ACTIVE = "draft", "proposed", "approved", "active"
SUPERSEDED, WITHDRAWN = "superseded", "withdrawn"


@dataclass(frozen=True, slots=True)
class Approval:
    approver: str
    version: str
    at: float
    comment: str


@dataclass(frozen=True, slots=True)
class Proposal:
    id: int
    version: str
    state: str
    author: str
    author_id: str
    reason: str
    base_version: str | None
    required_approvals: int
    approvals: tuple[Approval, ...]
    created_at: float
    updated_at: float
    activated_at: float | None
    sequence: int | None
    activate_at: float | None = None  # scheduled activation


def _us(t: float) -> int:
    return round(t * 1e6)


def _s(us: int | None) -> float | None:
    return None if us is None else us / 1e6


async def get(conn: AsyncConnection, proposal_id: int, *, lock: bool = False) -> Proposal:
    query = (
        select(proposals, principals.c.name)
        .join(principals, principals.c.id == proposals.c.author_id)
        .where(proposals.c.id == proposal_id)
    )
    if lock:
        query = query.with_for_update(of=proposals)
    row = (await conn.execute(query)).first()
    if row is None:
        raise NotFound(f"no proposal {proposal_id}")
    given = (
        await conn.execute(
            select(approvals, principals.c.name)
            .join(principals, principals.c.id == approvals.c.principal_id)
            .where(approvals.c.proposal_id == proposal_id)
            .order_by(approvals.c.at_us)
        )
    ).all()
    return _proposal(
        row, tuple(Approval(a.name, a.version_id, a.at_us / 1e6, a.comment) for a in given)
    )


def _proposal(row: Any, given: tuple[Approval, ...]) -> Proposal:
    return Proposal(
        row.id,
        row.version_id,
        row.state,
        row.name,
        row.author_id,
        row.reason,
        row.base_version_id,
        row.required_approvals,
        given,
        row.created_at_us / 1e6,
        row.updated_at_us / 1e6,
        _s(row.activated_at_us),
        row.sequence,
        _s(row.activate_at_us),
    )


async def list_all(conn: AsyncConnection, state: str | None = None) -> list[Proposal]:
    query = select(proposals.c.id).order_by(proposals.c.id.desc()).limit(200)
    if state is not None:
        query = query.where(proposals.c.state == state)
    ids = (await conn.execute(query)).scalars().all()
    return [await get(conn, i) for i in ids]


async def create(
    conn: AsyncConnection,
    author: Principal,
    topology: str,
    policies: Mapping[str, str],
    reason: str,
    *,
    required_approvals: int,
    now: float,
    node: str,
    sealer: Sealer,
) -> Proposal:
    versions.validate(topology, policies)
    version = await versions.store(conn, topology, policies, author.name, now)
    result = await conn.execute(
        insert(proposals).returning(proposals.c.id),
        {
            "version_id": version,
            "state": DRAFT,
            "author_id": author.id,
            "reason": reason,
            "base_version_id": await versions.active_version(conn),
            "required_approvals": required_approvals,
            "created_at_us": _us(now),
            "updated_at_us": _us(now),
        },
    )
    proposal_id = int(result.scalar_one())
    await conn.execute(
        update(proposals)
        .where(proposals.c.id == proposal_id)
        .values(seal=sealer.seal("proposal", proposal_fields(proposal_id, author.id)))
    )
    await events.record(
        conn,
        "proposal",
        f"#{proposal_id} drafted: version {version[:12]}",
        actor=author.name,
        now=now,
        node=node,
        reason=reason,
    )
    return await get(conn, proposal_id)


async def _check_author(conn: AsyncConnection, proposal: Proposal, sealer: Sealer) -> None:
    """The proposal's author is the one the admin service recorded: a row whose author was
    rewritten in the database (to make an approver "someone else") is refused."""
    seal = (
        await conn.execute(select(proposals.c.seal).where(proposals.c.id == proposal.id))
    ).scalar_one_or_none()
    if not sealer.verifies("proposal", proposal_fields(proposal.id, proposal.author_id), seal):
        raise Tampered(f"proposal #{proposal.id}'s record was altered in the database")


def _own(proposal: Proposal, principal: Principal, what: str) -> None:
    if proposal.author_id != principal.id:
        raise Refused(f"only the author of proposal #{proposal.id} may {what} it")


async def update_content(
    conn: AsyncConnection,
    proposal_id: int,
    principal: Principal,
    topology: str,
    policies: Mapping[str, str],
    *,
    now: float,
    node: str,
) -> Proposal:
    proposal = await get(conn, proposal_id, lock=True)
    _own(proposal, principal, "edit")
    if proposal.state not in (DRAFT, PROPOSED):
        raise Conflict(f"proposal #{proposal_id} is {proposal.state}; only drafts are edited")
    versions.validate(topology, policies)
    version = await versions.store(conn, topology, policies, principal.name, now)
    # A changed version voids every approval given to the previous one.
    await conn.execute(delete(approvals).where(approvals.c.proposal_id == proposal_id))
    await conn.execute(
        update(proposals)
        .where(proposals.c.id == proposal_id)
        .values(version_id=version, state=DRAFT, updated_at_us=_us(now))
    )
    await events.record(
        conn,
        "proposal",
        f"#{proposal_id} edited: version {version[:12]}, approvals cleared",
        actor=principal.name,
        now=now,
        node=node,
    )
    return await get(conn, proposal_id)


async def _author_step(
    conn: AsyncConnection,
    proposal_id: int,
    principal: Principal,
    what: str,
    allowed: tuple[str, ...],
    to: str,
    *,
    now: float,
    node: str,
) -> Proposal:
    """A step only the proposal's author may take, from one of the ``allowed`` states."""
    proposal = await get(conn, proposal_id, lock=True)
    _own(proposal, principal, what)
    if proposal.state not in allowed:
        raise Conflict(f"proposal #{proposal_id} is {proposal.state}, not {' or '.join(allowed)}")
    await _set_state(conn, proposal_id, to, now)
    await events.record(
        conn, "proposal", f"#{proposal_id} {to}", actor=principal.name, now=now, node=node
    )
    return await get(conn, proposal_id)


async def submit(
    conn: AsyncConnection, proposal_id: int, principal: Principal, *, now: float, node: str
) -> Proposal:
    return await _author_step(
        conn, proposal_id, principal, "submit", (DRAFT,), PROPOSED, now=now, node=node
    )


async def withdraw(
    conn: AsyncConnection, proposal_id: int, principal: Principal, *, now: float, node: str
) -> Proposal:
    return await _author_step(
        conn, proposal_id, principal, "withdraw", (DRAFT, PROPOSED, APPROVED), WITHDRAWN,
        now=now, node=node,
    )  # fmt: skip


async def approve(
    conn: AsyncConnection,
    proposal_id: int,
    principal: Principal,
    version: str,
    comment: str,
    *,
    now: float,
    node: str,
    sealer: Sealer,
) -> Proposal:
    proposal = await get(conn, proposal_id, lock=True)
    await _check_author(conn, proposal, sealer)
    if proposal.author_id == principal.id:
        # Four-eyes: whatever roles the author holds, and with whichever of its tokens.
        await events.record(
            conn,
            "denied",
            f"#{proposal_id}: its author may not approve it",
            actor=principal.name,
            now=now,
            node=node,
        )
        raise Refused(f"the author of proposal #{proposal_id} may not approve it")
    if proposal.state != PROPOSED:
        raise Conflict(f"proposal #{proposal_id} is {proposal.state}, not proposed")
    if version != proposal.version:
        raise Conflict(
            f"proposal #{proposal_id} is now version {proposal.version}, not the {version} "
            "reviewed: read it again"
        )
    if any(a.approver == principal.name for a in proposal.approvals):
        raise Conflict(f"{principal.name} already approved proposal #{proposal_id}")
    at_us = _us(now)
    await conn.execute(
        insert(approvals),
        {
            "proposal_id": proposal_id,
            "principal_id": principal.id,
            "version_id": version,
            "at_us": at_us,
            "comment": comment,
            "seal": sealer.seal(
                "approval", approval_fields(proposal_id, principal.id, version, at_us)
            ),
        },
    )
    # Counted after the insert, in the transaction: two approvals at once both see both.
    given = int(
        (
            await conn.execute(
                select(func.count()).where(
                    approvals.c.proposal_id == proposal_id, approvals.c.version_id == version
                )
            )
        ).scalar_one()
    )
    if given >= proposal.required_approvals:
        await _set_state(conn, proposal_id, APPROVED, now)
    await events.record(
        conn,
        "approval",
        f"#{proposal_id} approved ({given} of {proposal.required_approvals}), "
        f"version {version[:12]}",
        actor=principal.name,
        now=now,
        node=node,
        reason=comment or None,
    )
    return await get(conn, proposal_id)


async def activate(
    conn: AsyncConnection,
    proposal_id: int,
    principal: Principal,
    signer: Signer,
    *,
    now: float,
    node: str,
    sealer: Sealer,
    min_approvals: int = 1,
) -> Proposal:
    """Sign the approval record and publish the version, superseding the active one.
    ``min_approvals``: the service's configured number, which a row cannot lower."""
    proposal = await get(conn, proposal_id, lock=True)
    required = max(proposal.required_approvals, min_approvals)
    if proposal.state != APPROVED:
        raise Conflict(f"proposal #{proposal_id} is {proposal.state}, not approved")
    await _check_author(conn, proposal, sealer)
    # The record is checked again here, not trusted from the state column or the approvals
    # table: only approvals the admin service sealed, of this version, by a sealed principal
    # who holds policy-approver now, is not disabled and is not the author, count.
    valid = await _valid_approvals(conn, proposal, sealer)
    if len(valid) < required:
        await events.record(
            conn,
            "denied",
            f"#{proposal_id}: activation refused, {len(valid)} valid approval(s) of {required}",
            actor=principal.name,
            now=now,
            node=node,
        )
        raise Conflict(f"proposal #{proposal_id} has {len(valid)} valid approval(s) of {required}")
    version = await versions.get_version(conn, proposal.version)
    # Claim it first, conditionally: the first write serialises concurrent activations (a row
    # lock on PostgreSQL, the write lock on SQLite, where the reads above take no lock), and
    # the one that finds it no longer approved stops here. Exactly once, whoever asks.
    claimed = await conn.execute(
        update(proposals)
        .where(proposals.c.id == proposal_id, proposals.c.state == APPROVED)
        .values(state=ACTIVE, activated_at_us=_us(now), updated_at_us=_us(now))
    )
    if claimed.rowcount != 1:
        raise Conflict(f"proposal #{proposal_id} was activated meanwhile")
    await conn.execute(
        update(proposals)
        .where(proposals.c.state == ACTIVE, proposals.c.id != proposal_id)
        .values(state=SUPERSEDED, updated_at_us=_us(now))
    )
    sequence = 1 + int(
        (await conn.execute(select(func.coalesce(func.max(proposals.c.sequence), 0)))).scalar_one()
    )
    await conn.execute(
        update(proposals).where(proposals.c.id == proposal_id).values(sequence=sequence)
    )
    manifest, signature = signer.sign(
        Manifest(
            version=proposal.version,
            sequence=sequence,
            proposal=proposal_id,
            author=proposal.author,
            approvers=tuple(a.approver for a in valid),
            required=required,
            activated_at=now,
            actor=principal.name,
            reason=proposal.reason,
            key=signer.key_id,
        )
    )
    await shared_state.publish(
        conn,
        version.topology,
        version.policies,
        proposal.version,
        principal.name,
        proposal.reason,
        now,
        manifest=manifest,
        signature=signature,
    )
    await events.record(
        conn,
        "activation",
        f"#{proposal_id} active: version {proposal.version[:12]}, sequence {sequence}, "
        f"approved by {', '.join(a.approver for a in valid)}",
        actor=principal.name,
        now=now,
        node=node,
        reason=proposal.reason,
    )
    return await get(conn, proposal_id)


async def schedule(
    conn: AsyncConnection,
    proposal_id: int,
    principal: Principal,
    at: float,
    *,
    now: float,
    node: str,
) -> Proposal:
    """Activate an approved proposal at ``at`` (any admin node with the signing key does it,
    once): the checks of :func:`activate` run then, not now."""
    proposal = await get(conn, proposal_id, lock=True)
    if proposal.state != APPROVED:
        raise Conflict(f"proposal #{proposal_id} is {proposal.state}, not approved")
    await conn.execute(
        update(proposals)
        .where(proposals.c.id == proposal_id)
        .values(activate_at_us=_us(at), activate_by=principal.id, updated_at_us=_us(now))
    )
    await events.record(
        conn,
        "schedule",
        f"#{proposal_id} to be activated at {at:.0f}",
        actor=principal.name,
        now=now,
        node=node,
    )
    return await get(conn, proposal_id)


async def due(conn: AsyncConnection, now: float) -> list[tuple[int, str]]:
    """Approved proposals whose scheduled time has come: (id, the scheduler's principal id)."""
    rows = await conn.execute(
        select(proposals.c.id, proposals.c.activate_by).where(
            proposals.c.state == APPROVED, proposals.c.activate_at_us <= _us(now)
        )
    )
    return [(r.id, r.activate_by) for r in rows if r.activate_by]


async def _valid_approvals(
    conn: AsyncConnection, proposal: Proposal, sealer: Sealer
) -> list[Approval]:
    rows = (
        await conn.execute(select(approvals).where(approvals.c.proposal_id == proposal.id))
    ).all()
    valid = []
    for row in rows:
        fields = approval_fields(row.proposal_id, row.principal_id, row.version_id, row.at_us)
        if not sealer.verifies("approval", fields, row.seal) or row.version_id != proposal.version:
            continue
        approver = await identities.by_id(conn, row.principal_id, sealer)
        if (
            approver is None
            or approver.disabled
            or approver.id == proposal.author_id
            or Role.POLICY_APPROVER not in approver.roles
        ):
            continue
        valid.append(Approval(approver.name, row.version_id, row.at_us / 1e6, row.comment))
    return valid


async def diff(
    conn: AsyncConnection,
    proposal_id: int,
    files: tuple[str, Mapping[str, str]] | None = None,
) -> tuple[str | None, list[FileDiff]]:
    """The proposal's version against the active one, or against ``files`` (the nodes' own
    documents) while none is: (active version id, file diffs)."""
    proposal = await get(conn, proposal_id)
    active = await versions.active_version(conn)
    before = files
    if active is not None:
        old = await versions.get_version(conn, active)
        before = (old.topology, old.policies)
    new = await versions.get_version(conn, proposal.version)
    return active, diff_documents(before, (new.topology, new.policies))


async def _set_state(conn: AsyncConnection, proposal_id: int, state: str, now: float) -> None:
    await conn.execute(
        update(proposals)
        .where(proposals.c.id == proposal_id)
        .values(state=state, updated_at_us=_us(now))
    )


__all__ = [
    "Approval",
    "Proposal",
    "activate",
    "approve",
    "create",
    "diff",
    "due",
    "get",
    "list_all",
    "schedule",
    "submit",
    "update_content",
    "withdraw",
]
