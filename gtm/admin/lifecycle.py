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
Every step is an entry of the signed control log (:mod:`gtm.control`), appended in the
transaction that makes it, and a proposal is what the fold of those entries says: the
``proposals`` and ``approvals`` tables are caches for people and reports, never read to decide.
Every step is also an event in the chained event log (:mod:`gtm.admin.events`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import orjson
from sqlalchemy import Text, cast, delete, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from gtm.admin import events, versions
from gtm.admin.errors import Conflict, NotFound, Refused
from gtm.admin.principals import Principal
from gtm.admin.signer import Signer
from gtm.audit.schema import approvals, documents, proposals
from gtm.control.log import ControlLog
from gtm.control.state import (
    ACTIVE,
    APPROVED,
    DRAFT,
    PROPOSED,
    SUPERSEDED,
    WITHDRAWN,
    ControlState,
    ProposalRec,
    Refusal,
)
from gtm.fleet import shared_state
from gtm.fleet.signed_documents import Manifest, Untrusted, content_digest, verify


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


def _view(state: ControlState, p: ProposalRec) -> Proposal:
    return Proposal(
        p.id,
        p.version,
        p.state,
        state.name_of(p.author_id),
        p.author_id,
        p.reason,
        p.base_version,
        p.required,
        tuple(
            Approval(state.name_of(a.approver_id), a.version, a.at_us / 1e6, a.comment)
            for a in p.approvals
        ),
        p.created_at_us / 1e6,
        p.updated_at_us / 1e6,
        _s(p.activated_at_us),
        p.sequence,
        _s(p.activate_at_us),
    )


def _rec(state: ControlState, proposal_id: int) -> ProposalRec:
    found = state.proposals.get(proposal_id)
    if found is None:
        raise NotFound(f"no proposal {proposal_id}")
    return found


async def get(conn: AsyncConnection, proposal_id: int, control: ControlLog) -> Proposal:
    state = await control.state(conn)
    return _view(state, _rec(state, proposal_id))


async def list_all(
    conn: AsyncConnection, control: ControlLog, state: str | None = None
) -> list[Proposal]:
    folded = await control.state(conn)
    chosen = sorted(folded.proposals.values(), key=lambda p: p.id, reverse=True)
    return [_view(folded, p) for p in chosen if state is None or p.state == state][:200]


async def _append(
    conn: AsyncConnection,
    control: ControlLog,
    kind: str,
    principal: Principal,
    body: Mapping[str, object],
    now: float,
) -> ControlState:
    """Append, turning the fold's refusal (a race lost, or a rule broken) into a conflict."""
    try:
        return await control.append(conn, kind, principal.id, body, now)
    except Refusal as exc:
        raise Conflict(str(exc)) from None


async def _cache(conn: AsyncConnection, state: ControlState, proposal_id: int) -> None:
    """Write the proposal's row and its approvals as the fold has them (a cache for reports
    and people reading the database; nothing decides from it)."""
    p = state.proposals[proposal_id]
    await conn.execute(delete(approvals).where(approvals.c.proposal_id == proposal_id))
    row = {
            "version_id": p.version,
            "state": p.state,
            "author_id": p.author_id,
            "reason": p.reason,
            "base_version_id": p.base_version,
            "required_approvals": p.required,
            "created_at_us": p.created_at_us,
            "updated_at_us": p.updated_at_us,
            "activate_at_us": p.activate_at_us,
            "activate_by": p.activate_by,
            "activated_at_us": p.activated_at_us,
            "sequence": p.sequence,
        }  # fmt: skip
    # Update, else insert: the admin's database role may not delete proposals.
    done = await conn.execute(update(proposals).where(proposals.c.id == p.id).values(**row))
    if not done.rowcount:
        await conn.execute(insert(proposals), {"id": p.id, **row})
    if p.approvals:
        await conn.execute(
            insert(approvals),
            [
                {
                    "proposal_id": p.id,
                    "principal_id": a.approver_id,
                    "version_id": a.version,
                    "at_us": a.at_us,
                    "comment": a.comment,
                }
                for a in p.approvals
            ],
        )


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
    control: ControlLog,
) -> Proposal:
    versions.validate(topology, policies)
    version = await versions.store(conn, topology, policies, author.name, now)
    before = await control.state(conn)
    proposal_id = before.next_proposal_id()
    base = before.in_force.version if before.in_force is not None else None
    state = await _append(
        conn,
        control,
        "proposal.create",
        author,
        {
            "id": proposal_id,
            "version": version,
            "reason": reason,
            "base": base,
            "required": required_approvals,
        },
        now,
    )
    await _cache(conn, state, proposal_id)
    await events.record(
        conn,
        "proposal",
        f"#{proposal_id} drafted: version {version[:12]}",
        actor=author.name,
        now=now,
        node=node,
        reason=reason,
    )
    return _view(state, state.proposals[proposal_id])


async def _refuse(
    conn: AsyncConnection, error: Refused, principal: Principal, now: float, node: str
) -> Refused:
    """A refusal is evidence too: a ``denied`` event in the caller's transaction. The caller
    commits it (``raise_after_commit``) so the event survives the error response."""
    await events.record(conn, "denied", error.message, actor=principal.name, now=now, node=node)
    error.recorded = True
    return error


def _own(proposal: ProposalRec, principal: Principal, what: str) -> Refused | None:
    if proposal.author_id != principal.id:
        return Refused(f"only the author of proposal #{proposal.id} may {what} it")
    return None


async def update_content(
    conn: AsyncConnection,
    proposal_id: int,
    principal: Principal,
    topology: str,
    policies: Mapping[str, str],
    *,
    now: float,
    node: str,
    control: ControlLog,
) -> Proposal:
    state = await control.state(conn)
    proposal = _rec(state, proposal_id)
    if (refused := _own(proposal, principal, "edit")) is not None:
        raise await _refuse(conn, refused, principal, now, node)
    if proposal.state not in (DRAFT, PROPOSED):
        raise Conflict(f"proposal #{proposal_id} is {proposal.state}; only drafts are edited")
    versions.validate(topology, policies)
    version = await versions.store(conn, topology, policies, principal.name, now)
    if version == proposal.version:
        raise Conflict(f"proposal #{proposal_id} is version {version[:12]} already: no change")
    # A changed version voids every approval given to the previous one (the fold does it).
    state = await _append(
        conn, control, "proposal.edit", principal, {"id": proposal_id, "version": version}, now
    )
    await _cache(conn, state, proposal_id)
    await events.record(
        conn,
        "proposal",
        f"#{proposal_id} edited: version {version[:12]}, approvals cleared",
        actor=principal.name,
        now=now,
        node=node,
    )
    return _view(state, state.proposals[proposal_id])


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
    control: ControlLog,
) -> Proposal:
    """A step only the proposal's author may take, from one of the ``allowed`` states."""
    proposal = _rec(await control.state(conn), proposal_id)
    if (refused := _own(proposal, principal, what)) is not None:
        raise await _refuse(conn, refused, principal, now, node)
    if proposal.state not in allowed:
        raise Conflict(f"proposal #{proposal_id} is {proposal.state}, not {' or '.join(allowed)}")
    state = await _append(conn, control, f"proposal.{what}", principal, {"id": proposal_id}, now)
    await _cache(conn, state, proposal_id)
    await events.record(
        conn, "proposal", f"#{proposal_id} {to}", actor=principal.name, now=now, node=node
    )
    return _view(state, state.proposals[proposal_id])


async def submit(
    conn: AsyncConnection,
    proposal_id: int,
    principal: Principal,
    *,
    now: float,
    node: str,
    control: ControlLog,
    files: tuple[str, Mapping[str, str]] | None = None,
) -> Proposal:
    """Draft to proposed; refused when the draft is what is in force (the active version, or
    with none the nodes' own ``files``): there would be nothing to approve."""
    state = await control.state(conn)
    proposal = _rec(state, proposal_id)
    in_force = state.in_force.version if state.in_force is not None else None
    in_force = in_force or (content_digest(*files) if files is not None else None)
    mine = proposal.author_id == principal.id and proposal.state == DRAFT
    if mine and in_force is not None and proposal.version == in_force:
        raise Conflict(
            f"proposal #{proposal_id} changes nothing: its documents are the ones in force "
            f"(version {in_force[:12]}); edit the draft before submitting it"
        )
    return await _author_step(
        conn, proposal_id, principal, "submit", (DRAFT,), PROPOSED,
        now=now, node=node, control=control,
    )  # fmt: skip


async def withdraw(
    conn: AsyncConnection,
    proposal_id: int,
    principal: Principal,
    *,
    now: float,
    node: str,
    control: ControlLog,
) -> Proposal:
    return await _author_step(
        conn, proposal_id, principal, "withdraw", (DRAFT, PROPOSED, APPROVED), WITHDRAWN,
        now=now, node=node, control=control,
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
    control: ControlLog,
) -> Proposal:
    proposal = _rec(await control.state(conn), proposal_id)
    if proposal.author_id == principal.id:
        # Four-eyes: whatever roles the author holds, and with whichever of its tokens.
        raise await _refuse(
            conn,
            Refused(f"the author of proposal #{proposal_id} may not approve it"),
            principal,
            now,
            node,
        )
    if proposal.state != PROPOSED:
        raise Conflict(f"proposal #{proposal_id} is {proposal.state}, not proposed")
    if version != proposal.version:
        raise Conflict(
            f"proposal #{proposal_id} is now version {proposal.version}, not the {version} "
            "reviewed: read it again"
        )
    if any(a.approver_id == principal.id for a in proposal.approvals):
        raise Conflict(f"{principal.name} already approved proposal #{proposal_id}")
    state = await _append(
        conn,
        control,
        "approval",
        principal,
        {"proposal": proposal_id, "version": version, "comment": comment},
        now,
    )
    await _cache(conn, state, proposal_id)
    after = state.proposals[proposal_id]
    given = len(state.valid_approvals(after))
    await events.record(
        conn,
        "approval",
        f"#{proposal_id} approved ({given} of {after.required}), version {version[:12]}",
        actor=principal.name,
        now=now,
        node=node,
        reason=comment or None,
    )
    return _view(state, after)


async def activate(
    conn: AsyncConnection,
    proposal_id: int,
    principal: Principal,
    signer: Signer,
    *,
    now: float,
    node: str,
    control: ControlLog,
    min_approvals: int = 1,
) -> Proposal:
    """Sign the approval record and publish the version, superseding the active one.
    ``min_approvals``: the service's configured number, which no entry can lower."""
    before = await control.state(conn)
    proposal = _rec(before, proposal_id)
    required = max(proposal.required, min_approvals)
    if proposal.state != APPROVED:
        raise Conflict(f"proposal #{proposal_id} is {proposal.state}, not approved")
    # Only approvals in the verified log, of this version, by principals who hold
    # policy-approver now, are not disabled and are not the author, count.
    valid = before.valid_approvals(proposal)
    if len(valid) < required:
        await events.record(
            conn,
            "denied",
            f"#{proposal_id}: activation refused, {len(valid)} valid approval(s) of {required}",
            actor=principal.name,
            now=now,
            node=node,
        )
        refused = Conflict(
            f"proposal #{proposal_id} has {len(valid)} valid approval(s) of {required}"
        )
        refused.recorded = True
        raise refused
    version = await versions.get_version(conn, proposal.version)
    in_log = before.in_force.sequence if before.in_force is not None else 0
    sequence = 1 + max(in_log, await _signed_sequence(conn, control, min_approvals))
    # The head's lock (taken by the append) serialises concurrent activations: the second
    # finds the proposal active already and the fold refuses it. Exactly once, whoever asks.
    state = await _append(
        conn,
        control,
        "activation",
        principal,
        {
            "proposal": proposal_id,
            "version": proposal.version,
            "sequence": sequence,
            "required": required,
        },
        now,
    )
    for other in before.proposals.values():
        if other.state == ACTIVE:
            await _cache(conn, state, other.id)
    await _cache(conn, state, proposal_id)
    approvers = tuple(state.name_of(a.approver_id) for a in valid)
    manifest, signature = signer.sign(
        Manifest(
            version=proposal.version,
            sequence=sequence,
            proposal=proposal_id,
            author=state.name_of(proposal.author_id),
            approvers=approvers,
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
        f"approved by {', '.join(approvers)}",
        actor=principal.name,
        now=now,
        node=node,
        reason=proposal.reason,
    )
    return _view(state, state.proposals[proposal_id])


async def _signed_sequence(conn: AsyncConnection, control: ControlLog, min_approvals: int) -> int:
    """The highest activation sequence among published rows that verify in full (signature,
    content, four-eyes: what a node would accept; 0: none). Nodes refuse a sequence at or
    below the one they hold, and a store upgraded from before the control log holds
    activations the log never saw."""
    # Policies as text: a value the JSON column cannot decode is refused here, row by row.
    columns = (documents.c.topology, cast(documents.c.policies, Text), documents.c.manifest)
    rows = await conn.execute(
        select(*columns, documents.c.signature)
        .where(documents.c.sequence.is_not(None))
        .order_by(documents.c.sequence.desc())
        .limit(50)
    )
    for topology, policies, text, signature in rows:
        try:
            manifest = verify(
                topology, orjson.loads(policies), text, signature, control.keys, None,
                min_approvals,
            )  # fmt: skip
        except (Untrusted, TypeError, ValueError, AttributeError):
            continue  # a row written by hand, or malformed: no floor of anyone's
        return manifest.sequence
    return 0


async def schedule(
    conn: AsyncConnection,
    proposal_id: int,
    principal: Principal,
    at: float,
    *,
    now: float,
    node: str,
    control: ControlLog,
) -> Proposal:
    """Activate an approved proposal at ``at`` (any admin node with the signing key does it,
    once): the checks of :func:`activate` run then, not now."""
    proposal = _rec(await control.state(conn), proposal_id)
    if proposal.state != APPROVED:
        raise Conflict(f"proposal #{proposal_id} is {proposal.state}, not approved")
    state = await _append(
        conn, control, "schedule", principal, {"proposal": proposal_id, "at_us": _us(at)}, now
    )
    await _cache(conn, state, proposal_id)
    await events.record(
        conn,
        "schedule",
        f"#{proposal_id} to be activated at {at:.0f}",
        actor=principal.name,
        now=now,
        node=node,
    )
    return _view(state, state.proposals[proposal_id])


def due(state: ControlState, now: float) -> list[tuple[int, str]]:
    """Approved proposals whose scheduled time has come, as the verified log says: (id, the
    scheduler's principal id). A row set to "approved" in the database schedules nothing."""
    return [
        (p.id, p.activate_by)
        for p in state.proposals.values()
        if p.state == APPROVED
        and p.activate_at_us is not None
        and p.activate_at_us <= _us(now)
        and p.activate_by
    ]


__all__ = [
    "ACTIVE",
    "APPROVED",
    "DRAFT",
    "PROPOSED",
    "SUPERSEDED",
    "WITHDRAWN",
    "Approval",
    "Proposal",
    "activate",
    "approve",
    "create",
    "due",
    "get",
    "list_all",
    "schedule",
    "submit",
    "update_content",
    "withdraw",
]
