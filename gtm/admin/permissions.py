"""Who may do what: the roles and the one table of operations the routes and the tests read.

Every admin endpoint names its operation (its OpenAPI ``operationId``) and is allowed to the
roles listed here and to no one else; a route without an entry cannot be served (the app
refuses to build) and the role matrix test fails. Roles do not nest: ``admin`` manages
principals and tokens, and approves nothing unless it also holds ``policy-approver``. Four-eyes
is not a role: the author of a proposal can never approve it, whatever roles it holds
(:mod:`gtm.admin.lifecycle`).
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    VIEWER = "viewer"  # read the fleet, versions and proposals
    AUDITOR = "auditor"  # read and export the audit and the event log
    POLICY_AUTHOR = "policy-author"  # write drafts, propose, withdraw their own
    POLICY_APPROVER = "policy-approver"  # approve others' proposals, activate approved ones
    OPERATOR = "operator"  # region controls
    ADMIN = "admin"  # principals and tokens


_ALL = frozenset(Role)
_READERS = frozenset(
    {Role.VIEWER, Role.AUDITOR, Role.POLICY_AUTHOR, Role.POLICY_APPROVER, Role.OPERATOR}
)
_AUTHOR = frozenset({Role.POLICY_AUTHOR})
_APPROVER = frozenset({Role.POLICY_APPROVER})
_ADMIN = frozenset({Role.ADMIN})
_OPERATOR = frozenset({Role.OPERATOR})
# Decisions name client networks: personal data, read by auditors only.
_AUDITOR = frozenset({Role.AUDITOR})

# operationId -> the roles allowed.
OPERATIONS: dict[str, frozenset[Role]] = {
    "whoami": _ALL,
    "list_principals": _ADMIN,
    "create_principal": _ADMIN,
    "create_token": _ADMIN,
    "revoke_token": _ADMIN,
    # Power (author, approver, admin) is granted by one admin and approved by another.
    "list_grants": _ADMIN,
    "propose_grant": _ADMIN,
    "approve_grant": _ADMIN,
    "list_tokens": _ADMIN,
    "list_events": _READERS | _ADMIN,
    "get_active_version": _READERS,
    "get_version": _READERS,
    "get_current_documents": _READERS,
    "list_proposals": _READERS,
    "get_proposal": _READERS,
    "get_proposal_diff": _READERS,
    "get_proposal_impact": _READERS,
    "create_proposal": _AUTHOR,
    "update_proposal": _AUTHOR,
    "submit_proposal": _AUTHOR,
    "withdraw_proposal": _AUTHOR,
    "approve_proposal": _APPROVER,
    "activate_proposal": _APPROVER,
    "list_regions": _READERS | _ADMIN,
    "list_nodes": _READERS | _ADMIN,
    # Countries and regions only, no client networks: not personal data.
    "get_traffic": _READERS | _ADMIN,
    "get_proposal_rollout": _READERS,
    "search_decisions": _AUDITOR,
    "export_decisions": _AUDITOR,
    "get_decision": _AUDITOR,
    "replay_decision": _AUDITOR,
    "compliance_report": _AUDITOR,
    # Chains, checkpoints and verification: no client data; operators watch the evidence too.
    "list_audit_chains": _AUDITOR | _OPERATOR,
    "drain_region": _OPERATOR,
    "undrain_region": _OPERATOR,
    "weight_region": _OPERATOR,
    "force_region": _OPERATOR,
    "clear_region": _OPERATOR,
}


# The operations that change nothing: every GET, and the two POSTs that only compute (an impact
# replay, a decision replay). A refusal of one is a page view refused, not an attempted change,
# and the compliance report does not list it among the operators' actions. Checked against the
# routes' methods in tests/gtm/admin/test_permissions.py.
READS: frozenset[str] = frozenset(
    {"get_proposal_impact", "replay_decision"}
    | {op for op in OPERATIONS if op.startswith(("get_", "list_", "search_", "export_"))}
    | {"whoami", "compliance_report"}
)


def allowed(operation: str, roles: frozenset[Role]) -> bool:
    return bool(OPERATIONS[operation] & roles)


__all__ = ["OPERATIONS", "READS", "Role", "allowed"]
