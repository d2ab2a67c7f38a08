"""The fold: verified control-log entries in, the control plane's current state out. Pure.

Each kind of entry has one rule here, and the rules check again what the admin service checked
before it signed (who may do what, four-eyes, the proposal's state and version): an entry that
breaks a rule is *refused* (kept in :attr:`ControlState.refused` with its reason) and changes
nothing, so even a signed entry cannot make an author approve their own change or an admin grant
power alone.

Kinds and bodies::

    principal.create  {id, name, roles, oidc_subject}   power roles only from bootstrap
    principal.bind    {id, oidc_subject}
    grant.propose     {grant, principal_id, add, remove}   an admin; power needs a second
    grant.approve     {grant}                              another admin, not the subject
    token.issue       {id, principal_id, secret_hash, expires_at_us}   to its own principal
    token.revoke      {id}
    proposal.create   {id, version, reason, base, required}
    proposal.edit     {id, version}                        approvals cleared, back to draft
    proposal.submit   {id}      proposal.withdraw {id}
    approval          {proposal, version, comment}         not the author, this version
    schedule          {proposal, at_us}
    activation        {proposal, version, sequence}        enough valid approvals, a later serial
    override.set      {region, drain, weight, force, force_until_us, expires_at_us, reason,
                       broke}                              operator; breaking rules: admin too
    override.clear    {region, reason}
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gtm.control.entry import BOOTSTRAP, GENESIS, Entry

# Role names (gtm.admin.permissions.Role values; the admin layer sits above this one).
VIEWER, AUDITOR, AUTHOR, APPROVER = "viewer", "auditor", "policy-author", "policy-approver"
OPERATOR, ADMIN = "operator", "admin"
ROLES = frozenset({VIEWER, AUDITOR, AUTHOR, APPROVER, OPERATOR, ADMIN})
# Roles that move traffic or grant power: granting or removing one takes a second admin.
POWER = frozenset({AUTHOR, APPROVER, ADMIN})

DRAFT, PROPOSED, APPROVED, ACTIVE = "draft", "proposed", "approved", "active"
SUPERSEDED, WITHDRAWN = "superseded", "withdrawn"
PENDING, GRANTED = "pending", "granted"


class Refusal(Exception):
    """An entry the fold will not apply, and why."""


@dataclass(frozen=True, slots=True)
class PrincipalRec:
    id: str
    name: str
    roles: frozenset[str]
    created_at_us: int
    created_by: str
    disabled: bool = False
    oidc_subject: str | None = None


@dataclass(frozen=True, slots=True)
class TokenRec:
    id: str
    principal_id: str
    secret_hash: str
    created_at_us: int
    created_by: str
    expires_at_us: int | None
    revoked_at_us: int | None = None


@dataclass(frozen=True, slots=True)
class ApprovalRec:
    approver_id: str
    version: str
    at_us: int
    comment: str


@dataclass(frozen=True, slots=True)
class ProposalRec:
    id: int
    version: str
    state: str
    author_id: str
    reason: str
    base_version: str | None
    required: int
    created_at_us: int
    updated_at_us: int
    approvals: tuple[ApprovalRec, ...] = ()
    activate_at_us: int | None = None
    activate_by: str | None = None
    activated_at_us: int | None = None
    sequence: int | None = None


@dataclass(frozen=True, slots=True)
class GrantRec:
    id: int
    principal_id: str
    add: frozenset[str]
    remove: frozenset[str]
    proposer_id: str
    at_us: int
    state: str = PENDING
    approver_id: str | None = None


@dataclass(frozen=True, slots=True)
class OverrideRec:
    region: str
    drain: bool
    weight: float | None
    force: str | None
    force_until_us: int | None
    expires_at_us: int | None
    actor: str  # the principal's name, for people
    actor_id: str
    reason: str
    set_at_us: int


@dataclass(frozen=True, slots=True)
class InForce:
    proposal: int
    version: str
    sequence: int
    at_us: int


@dataclass
class ControlState:
    seq: int = 0
    head: str = GENESIS
    principals: dict[str, PrincipalRec] = field(default_factory=dict)
    tokens: dict[str, TokenRec] = field(default_factory=dict)
    proposals: dict[int, ProposalRec] = field(default_factory=dict)
    grants: dict[int, GrantRec] = field(default_factory=dict)
    overrides: dict[str, OverrideRec] = field(default_factory=dict)
    in_force: InForce | None = None
    refused: list[tuple[int, str]] = field(default_factory=list)

    def copy(self) -> ControlState:
        # Records are frozen: copying the dicts is enough for a fold that replaces them.
        return ControlState(
            self.seq,
            self.head,
            dict(self.principals),
            dict(self.tokens),
            dict(self.proposals),
            dict(self.grants),
            dict(self.overrides),
            self.in_force,
            copy.copy(self.refused),
        )

    def principal_named(self, name: str) -> PrincipalRec | None:
        return next((p for p in self.principals.values() if p.name == name), None)

    def name_of(self, principal_id: str) -> str:
        if principal_id == BOOTSTRAP:
            return BOOTSTRAP
        found = self.principals.get(principal_id)
        return found.name if found is not None else principal_id

    def holds(self, principal_id: str, role: str) -> bool:
        found = self.principals.get(principal_id)
        return found is not None and not found.disabled and role in found.roles

    def valid_approvals(self, proposal: ProposalRec) -> list[ApprovalRec]:
        """Approvals that count now: of this version, by distinct principals who are not the
        author and hold policy-approver today."""
        seen: set[str] = set()
        valid = []
        for a in proposal.approvals:
            if (
                a.version == proposal.version
                and a.approver_id != proposal.author_id
                and a.approver_id not in seen
                and self.holds(a.approver_id, APPROVER)
            ):
                seen.add(a.approver_id)
                valid.append(a)
        return valid

    def next_proposal_id(self) -> int:
        return max(self.proposals, default=0) + 1

    def next_grant_id(self) -> int:
        return max(self.grants, default=0) + 1


def fold(state: ControlState, entry: Entry) -> None:
    """Apply one verified entry to ``state`` in place (its place in the chain was checked by the
    caller). A refused entry is recorded, changes nothing else, and the chain goes on."""
    try:
        _RULES[entry.kind](state, entry, entry.body)
    except KeyError as exc:
        reason = f"unknown kind {entry.kind!r}" if entry.kind not in _RULES else f"no {exc}"
        state.refused.append((entry.seq, reason))
    except (Refusal, TypeError, ValueError) as exc:
        state.refused.append((entry.seq, str(exc) or type(exc).__name__))
    state.seq, state.head = entry.seq, entry.entry_hash


def check_applies(state: ControlState, entry: Entry) -> None:
    """:class:`Refusal` when ``entry`` would be refused by the fold (the writer's last check
    before it signs)."""
    trial = state.copy()
    before = len(trial.refused)
    fold(trial, entry)
    if len(trial.refused) > before:
        raise Refusal(trial.refused[-1][1])


def _require(condition: bool, reason: str) -> None:
    if not condition:
        raise Refusal(reason)


def _str(body: Mapping[str, Any], key: str) -> str:
    value = body[key]
    if not isinstance(value, str):
        raise Refusal(f"{key} is not text")
    return value


def _opt_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise Refusal(f"{key} is not an integer")
    return value


def _int(body: Mapping[str, Any], key: str) -> int:
    value = _opt_int(body, key)
    if value is None:
        raise Refusal(f"{key} is missing")
    return value


def _roles(body: Mapping[str, Any], key: str) -> frozenset[str]:
    value = body.get(key, [])
    if not isinstance(value, list) or not all(isinstance(r, str) and r in ROLES for r in value):
        raise Refusal(f"{key} is not a list of roles")
    return frozenset(value)


def _principal_create(state: ControlState, e: Entry, body: Mapping[str, Any]) -> None:
    pid, name, roles = _str(body, "id"), _str(body, "name"), _roles(body, "roles")
    subject = body.get("oidc_subject")
    _require(pid not in state.principals and pid != BOOTSTRAP, f"principal {pid} exists")
    _require(state.principal_named(name) is None, f"a principal named {name!r} exists")
    if e.principal != BOOTSTRAP:
        _require(state.holds(e.principal, ADMIN), "only an admin creates principals")
        # Power is granted by two admins (grant.propose + grant.approve), never at creation.
        _require(not roles & POWER, "power roles are granted by a second admin, not at creation")
    if subject is not None:
        _require(isinstance(subject, str), "oidc_subject is not text")
        _require(
            all(p.oidc_subject != subject for p in state.principals.values()),
            f"OIDC subject {subject!r} is bound already",
        )
    state.principals[pid] = PrincipalRec(
        pid, name, roles, e.at_us, state.name_of(e.principal), oidc_subject=subject
    )


def _principal_bind(state: ControlState, e: Entry, body: Mapping[str, Any]) -> None:
    pid, subject = _str(body, "id"), _str(body, "oidc_subject")
    _require(pid in state.principals, f"no principal {pid}")
    _require(e.principal == BOOTSTRAP or state.holds(e.principal, ADMIN), "only an admin binds")
    _require(
        all(p.oidc_subject != subject for p in state.principals.values()),
        f"OIDC subject {subject!r} is bound already",
    )
    state.principals[pid] = replace(state.principals[pid], oidc_subject=subject)


def _grant_propose(state: ControlState, e: Entry, body: Mapping[str, Any]) -> None:
    gid, pid = _int(body, "grant"), _str(body, "principal_id")
    add, remove = _roles(body, "add"), _roles(body, "remove")
    _require(gid not in state.grants, f"grant {gid} exists")
    _require(pid in state.principals, f"no principal {pid}")
    _require(bool(add | remove), "a grant changes at least one role")
    _require(e.principal == BOOTSTRAP or state.holds(e.principal, ADMIN), "only an admin grants")
    grant = GrantRec(gid, pid, add, remove, e.principal, e.at_us)
    state.grants[gid] = grant
    if e.principal == BOOTSTRAP or not (add | remove) & POWER:
        _apply_grant(state, grant, None)


def _grant_approve(state: ControlState, e: Entry, body: Mapping[str, Any]) -> None:
    gid = _int(body, "grant")
    grant = state.grants.get(gid)
    _require(grant is not None, f"no grant {gid}")
    assert grant is not None
    _require(grant.state == PENDING, f"grant {gid} is {grant.state}")
    _require(state.holds(e.principal, ADMIN), "only an admin approves a grant")
    _require(e.principal != grant.proposer_id, "the admin who proposed a grant may not approve it")
    _require(e.principal != grant.principal_id, "no one approves a grant of their own roles")
    _apply_grant(state, grant, e.principal)


def _apply_grant(state: ControlState, grant: GrantRec, approver: str | None) -> None:
    who = state.principals[grant.principal_id]
    roles = (who.roles | grant.add) - grant.remove
    state.principals[who.id] = replace(who, roles=frozenset(roles))
    state.grants[grant.id] = replace(grant, state=GRANTED, approver_id=approver)


def _token_issue(state: ControlState, e: Entry, body: Mapping[str, Any]) -> None:
    tid, pid, secret = _str(body, "id"), _str(body, "principal_id"), _str(body, "secret_hash")
    _require(tid not in state.tokens, f"token {tid} exists")
    _require(pid in state.principals, f"no principal {pid}")
    # Nobody mints a token for someone else: only its own principal, or the key file's holder.
    _require(e.principal in (pid, BOOTSTRAP), "a token is issued only to its own principal")
    state.tokens[tid] = TokenRec(
        tid, pid, secret, e.at_us, state.name_of(e.principal), _opt_int(body, "expires_at_us")
    )


def _token_revoke(state: ControlState, e: Entry, body: Mapping[str, Any]) -> None:
    tid = _str(body, "id")
    token = state.tokens.get(tid)
    _require(token is not None and token.revoked_at_us is None, f"no live token {tid}")
    assert token is not None
    _require(
        e.principal in (token.principal_id, BOOTSTRAP) or state.holds(e.principal, ADMIN),
        "only its owner or an admin revokes a token",
    )
    state.tokens[tid] = replace(token, revoked_at_us=e.at_us)


def _proposal(state: ControlState, body: Mapping[str, Any], key: str = "id") -> ProposalRec:
    pid = _int(body, key)
    found = state.proposals.get(pid)
    _require(found is not None, f"no proposal {pid}")
    assert found is not None
    return found


def _proposal_create(state: ControlState, e: Entry, body: Mapping[str, Any]) -> None:
    pid = _int(body, "id")
    _require(pid not in state.proposals, f"proposal {pid} exists")
    _require(state.holds(e.principal, AUTHOR), "only a policy author drafts")
    base = body.get("base")
    _require(base is None or isinstance(base, str), "base is not a version")
    state.proposals[pid] = ProposalRec(
        pid,
        _str(body, "version"),
        DRAFT,
        e.principal,
        _str(body, "reason"),
        base,
        max(1, _int(body, "required")),
        e.at_us,
        e.at_us,
    )


def _author_step(
    state: ControlState, e: Entry, body: Mapping[str, Any], allowed: tuple[str, ...]
) -> ProposalRec:
    p = _proposal(state, body)
    _require(e.principal == p.author_id, f"only the author of proposal #{p.id} may change it")
    _require(p.state in allowed, f"proposal #{p.id} is {p.state}")
    return p


def _proposal_edit(state: ControlState, e: Entry, body: Mapping[str, Any]) -> None:
    p = _author_step(state, e, body, (DRAFT, PROPOSED))
    state.proposals[p.id] = replace(
        p, version=_str(body, "version"), state=DRAFT, approvals=(), updated_at_us=e.at_us
    )


def _proposal_submit(state: ControlState, e: Entry, body: Mapping[str, Any]) -> None:
    p = _author_step(state, e, body, (DRAFT,))
    state.proposals[p.id] = replace(p, state=PROPOSED, updated_at_us=e.at_us)


def _proposal_withdraw(state: ControlState, e: Entry, body: Mapping[str, Any]) -> None:
    p = _author_step(state, e, body, (DRAFT, PROPOSED, APPROVED))
    state.proposals[p.id] = replace(p, state=WITHDRAWN, updated_at_us=e.at_us)


def _approval(state: ControlState, e: Entry, body: Mapping[str, Any]) -> None:
    p = _proposal(state, body, "proposal")
    version = _str(body, "version")
    _require(state.holds(e.principal, APPROVER), "only a policy approver approves")
    _require(e.principal != p.author_id, f"the author of proposal #{p.id} may not approve it")
    _require(p.state == PROPOSED, f"proposal #{p.id} is {p.state}, not proposed")
    _require(version == p.version, f"proposal #{p.id} is version {p.version}, not {version}")
    _require(
        all(a.approver_id != e.principal for a in p.approvals), "already approved by this principal"
    )
    comment = body.get("comment") or ""
    _require(isinstance(comment, str), "comment is not text")
    p = replace(
        p,
        approvals=(*p.approvals, ApprovalRec(e.principal, version, e.at_us, comment)),
        updated_at_us=e.at_us,
    )
    if len(state.valid_approvals(p)) >= p.required:
        p = replace(p, state=APPROVED)
    state.proposals[p.id] = p


def _schedule(state: ControlState, e: Entry, body: Mapping[str, Any]) -> None:
    p = _proposal(state, body, "proposal")
    _require(state.holds(e.principal, APPROVER), "only a policy approver schedules")
    _require(p.state == APPROVED, f"proposal #{p.id} is {p.state}, not approved")
    state.proposals[p.id] = replace(
        p, activate_at_us=_int(body, "at_us"), activate_by=e.principal, updated_at_us=e.at_us
    )


def _activation(state: ControlState, e: Entry, body: Mapping[str, Any]) -> None:
    p = _proposal(state, body, "proposal")
    version, sequence = _str(body, "version"), _int(body, "sequence")
    _require(state.holds(e.principal, APPROVER), "only a policy approver activates")
    _require(p.state == APPROVED, f"proposal #{p.id} is {p.state}, not approved")
    _require(version == p.version, f"proposal #{p.id} is version {p.version}, not {version}")
    required = max(p.required, _int(body, "required"))
    valid = state.valid_approvals(p)
    _require(len(valid) >= required, f"{len(valid)} valid approval(s) of {required}")
    # Above the one in force: an older sequence is a replay. Not necessarily the next one: a
    # store upgraded from before the log has activations the log never saw, and nodes refuse
    # a sequence at or below the one they hold.
    current = state.in_force.sequence if state.in_force is not None else 0
    _require(sequence > current, f"sequence {sequence} is not after {current}")
    for other in list(state.proposals.values()):
        if other.state == ACTIVE:
            state.proposals[other.id] = replace(other, state=SUPERSEDED, updated_at_us=e.at_us)
    state.proposals[p.id] = replace(
        p, state=ACTIVE, activated_at_us=e.at_us, sequence=sequence, updated_at_us=e.at_us
    )
    state.in_force = InForce(p.id, version, sequence, e.at_us)


def _operates(state: ControlState, principal: str) -> bool:
    # The key file's holder at the command line (`gtm region drain`) acts as an operator.
    return principal == BOOTSTRAP or state.holds(principal, OPERATOR)


def _override_set(state: ControlState, e: Entry, body: Mapping[str, Any]) -> None:
    region = _str(body, "region")
    _require(_operates(state, e.principal), "only an operator overrides a region")
    broke = body.get("broke") or []
    _require(isinstance(broke, list), "broke is not a list")
    if broke:
        _require(
            e.principal == BOOTSTRAP or state.holds(e.principal, ADMIN),
            "only an admin overrides the safety rules",
        )
    force = body.get("force")
    _require(force in (None, "up", "down"), f"force {force!r} is not up or down")
    weight = body.get("weight")
    _require(
        weight is None or (isinstance(weight, int | float) and not isinstance(weight, bool)),
        "weight is not a number",
    )
    drain = body.get("drain")
    _require(isinstance(drain, bool), "drain is not true or false")
    state.overrides[region] = OverrideRec(
        region,
        bool(drain),
        None if weight is None else float(weight),
        force,
        _opt_int(body, "force_until_us"),
        _opt_int(body, "expires_at_us"),
        state.name_of(e.principal),
        e.principal,
        _str(body, "reason"),
        e.at_us,
    )


def _override_clear(state: ControlState, e: Entry, body: Mapping[str, Any]) -> None:
    region = _str(body, "region")
    _require(_operates(state, e.principal), "only an operator clears a region")
    _require(region in state.overrides, f"region {region} has no override")
    del state.overrides[region]


_RULES = {
    "principal.create": _principal_create,
    "principal.bind": _principal_bind,
    "grant.propose": _grant_propose,
    "grant.approve": _grant_approve,
    "token.issue": _token_issue,
    "token.revoke": _token_revoke,
    "proposal.create": _proposal_create,
    "proposal.edit": _proposal_edit,
    "proposal.submit": _proposal_submit,
    "proposal.withdraw": _proposal_withdraw,
    "approval": _approval,
    "schedule": _schedule,
    "activation": _activation,
    "override.set": _override_set,
    "override.clear": _override_clear,
}
KINDS = frozenset(_RULES)

__all__ = [
    "KINDS",
    "POWER",
    "ApprovalRec",
    "ControlState",
    "GrantRec",
    "InForce",
    "OverrideRec",
    "PrincipalRec",
    "ProposalRec",
    "Refusal",
    "TokenRec",
    "check_applies",
    "fold",
]
