"""The control log's pure parts: an entry's signature and links, and the fold's rules, which
refuse even a signed entry that breaks four-eyes or grants power alone."""

from __future__ import annotations

from dataclasses import replace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gtm.audit.keys import key_id
from gtm.control.entry import BOOTSTRAP, GENESIS, BadEntry, Entry, check, from_row, sign
from gtm.control.state import APPROVED, DRAFT, ControlState, fold


class Key:
    def __init__(self) -> None:
        self.private = Ed25519PrivateKey.generate()
        self.key_id = key_id(self.private.public_key())

    def sign_bytes(self, body: bytes) -> str:
        return self.private.sign(body).hex()


KEY = Key()
KEYS = {KEY.key_id: KEY.private.public_key()}


class Log:
    """Entries signed, checked and folded one after the other, as a reader does."""

    def __init__(self) -> None:
        self.state = ControlState()
        self.entries: list[Entry] = []

    def add(self, kind: str, principal: str, **body: object) -> Entry:
        entry = sign(
            KEY, seq=self.state.seq + 1, prev_hash=self.state.head, at_us=len(self.entries),
            kind=kind, principal=principal, body=body,
        )  # fmt: skip
        check(entry, KEYS, (self.state.seq, self.state.head))
        fold(self.state, entry)
        self.entries.append(entry)
        return entry

    def refused(self) -> list[str]:
        return [why for _, why in self.state.refused]


def people(log: Log) -> None:
    log.add("principal.create", BOOTSTRAP, id="root", name="root", roles=["admin"])
    log.add("principal.create", BOOTSTRAP, id="ida", name="ida", roles=["admin"])
    log.add("principal.create", BOOTSTRAP, id="alice", name="alice", roles=["policy-author"])
    log.add("principal.create", BOOTSTRAP, id="bob", name="bob", roles=["policy-approver"])


def test_an_author_never_approves_their_own_proposal_even_in_a_signed_entry() -> None:
    log = Log()
    people(log)
    log.add("grant.propose", BOOTSTRAP, grant=1, principal_id="alice", add=["policy-approver"])
    log.add("proposal.create", "alice", id=1, version="v1", reason="r", base=None, required=1)
    log.add("proposal.submit", "alice", id=1)
    log.add("approval", "alice", proposal=1, version="v1", comment="")
    assert log.state.proposals[1].state != APPROVED
    assert any("may not approve" in why for why in log.refused())
    log.add("approval", "bob", proposal=1, version="v2", comment="")  # not the version
    assert log.state.proposals[1].state != APPROVED
    log.add("approval", "bob", proposal=1, version="v1", comment="")
    assert log.state.proposals[1].state == APPROVED


def test_power_is_granted_by_two_admins_and_tokens_only_to_their_own_principal() -> None:
    log = Log()
    people(log)
    # An admin cannot make a principal with power, nor grant it alone.
    log.add("principal.create", "root", id="sock", name="sock", roles=["policy-approver"])
    assert "sock" not in log.state.principals
    log.add("principal.create", "root", id="sock", name="sock", roles=["viewer"])
    log.add("grant.propose", "root", grant=1, principal_id="sock", add=["policy-approver"])
    assert "policy-approver" not in log.state.principals["sock"].roles
    log.add("grant.approve", "root", grant=1)  # the proposer
    assert "policy-approver" not in log.state.principals["sock"].roles
    log.add(
        "token.issue", "root", id="t1", principal_id="sock", secret_hash="h", expires_at_us=None
    )
    assert "t1" not in log.state.tokens
    log.add("grant.approve", "ida", grant=1)  # a second admin
    assert "policy-approver" in log.state.principals["sock"].roles
    log.add(
        "token.issue", "sock", id="t2", principal_id="sock", secret_hash="h", expires_at_us=None
    )
    assert "t2" in log.state.tokens
    # Nobody approves a grant of their own roles.
    log.add("grant.propose", "root", grant=2, principal_id="ida", add=["policy-author"])
    log.add("grant.approve", "ida", grant=2)
    assert "policy-author" not in log.state.principals["ida"].roles


def test_an_activation_needs_a_later_sequence_and_enough_valid_approvals() -> None:
    log = Log()
    people(log)
    log.add("proposal.create", "alice", id=1, version="v1", reason="r", base=None, required=1)
    log.add("proposal.submit", "alice", id=1)
    log.add("activation", "bob", proposal=1, version="v1", sequence=1, required=1)
    assert log.state.in_force is None  # never approved
    log.add("approval", "bob", proposal=1, version="v1", comment="")
    log.add("activation", "bob", proposal=1, version="v1", sequence=0, required=1)
    assert log.state.in_force is None  # not after the one in force
    # Later than the next is allowed: a store upgraded from before the log held activations.
    log.add("activation", "bob", proposal=1, version="v1", sequence=4, required=1)
    assert log.state.in_force is not None and log.state.in_force.sequence == 4
    # An edit after approval is refused (active now), and a fresh draft starts with nothing.
    log.add("proposal.edit", "alice", id=1, version="v9")
    assert log.state.proposals[1].version == "v1"
    log.add("proposal.create", "alice", id=2, version="v2", reason="r", base="v1", required=1)
    assert log.state.proposals[2].state == DRAFT and log.state.proposals[2].approvals == ()
    log.add("proposal.submit", "alice", id=2)
    log.add("approval", "bob", proposal=2, version="v2", comment="")
    log.add("activation", "bob", proposal=2, version="v2", sequence=4, required=1)  # a replay
    assert log.state.in_force.version == "v1"
    log.add("activation", "bob", proposal=2, version="v2", sequence=5, required=1)
    assert log.state.in_force.version == "v2" and log.state.proposals[1].state == "superseded"


def test_an_edited_reordered_or_missing_entry_does_not_verify() -> None:
    log = Log()
    people(log)
    first, second, third = log.entries[:3]
    after_first = (first.seq, first.entry_hash)
    check(second, KEYS, after_first)
    with pytest.raises(BadEntry, match="missing"):
        check(third, KEYS, after_first)
    edited = replace(second, body={**second.body, "roles": ["admin", "policy-approver"]})
    with pytest.raises(BadEntry, match="signature"):
        check(edited, KEYS, after_first)
    with pytest.raises(BadEntry, match="link"):
        check(second, KEYS, (1, GENESIS))
    with pytest.raises(BadEntry, match="trusted"):
        check(second, {}, after_first)


@pytest.mark.parametrize(
    ("row", "why"),
    [
        ({"seq": 1, "body": "not json"}, "not JSON"),
        ({"seq": 1, "body": '"a string"'}, "not a JSON object"),
        ({"seq": "1", "body": "{}", "at_us": 0}, "not an integer"),
        ({"seq": 1, "body": "{}", "at_us": 0, "prev_hash": 7}, "not text"),
    ],
)
def test_a_hostile_row_is_refused_with_its_reason(row: dict[str, object], why: str) -> None:
    with pytest.raises(BadEntry, match=why):
        from_row(row)


def test_an_entry_of_an_unknown_kind_is_refused_and_the_chain_goes_on() -> None:
    log = Log()
    log.add("principal.mint_superuser", BOOTSTRAP, id="x")
    log.add("principal.create", BOOTSTRAP, id="root", name="root", roles=["admin"])
    assert log.refused() == ["unknown kind 'principal.mint_superuser'"]
    assert "root" in log.state.principals and log.state.seq == 2
