"""ECS trust in the decision: an EDNS Client Subnet from a resolver outside the policy's
``client_subnet.trusted_resolvers`` may steer proximity but never loosens residency."""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network, ip_address, ip_network
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from gtm.decision.geoip import GeoDatabase
from gtm.decision.model import Basis, Decision, Reason, Status
from gtm.decision.policy import (
    NetworkSet,
    PolicyDocument,
    PolicySet,
    compile_policy,
    load_policy,
    parse_policies,
)
from gtm.decision.routing import Channel, DecisionRequest, Outcome, decide
from gtm.decision.snapshot import Snapshot
from gtm.decision.topology import Topology
from gtm.errors import ConfigError
from tests.conftest import POLICIES
from tests.gtm.decision.test_routing_properties import CLIENTS, NOW, SETTINGS, build, worlds

DE, US, JP = "198.51.100.10", "203.0.113.10", "192.0.2.10"
UNKNOWN = "100.99.1.1"  # in no GeoIP network
DE_ECS, US_ECS = ip_network("198.51.100.0/24"), ip_network("203.0.113.0/24")
EU = {"eu-west", "eu-central"}


def rule_doc(untrusted_ecs: str = "stricter", trusted: tuple[str, ...] = ()) -> str:
    doc: dict[str, Any] = {
        "version": "t",
        "rules": [
            {
                "id": "de-stays-in-eu",
                "match": {"client_country": ["DE"]},
                "allow": {"jurisdictions": ["EU"]},
                "untrusted_ecs": untrusted_ecs,
            }
        ],
    }
    if trusted:
        doc["client_subnet"] = {"trusted_resolvers": list(trusted)}
    return yaml.safe_dump(doc)


def shipped_with(extra: str, topology: Topology) -> PolicySet:
    texts = [(str(p), p.read_text()) for p in sorted(POLICIES.glob("*.yaml"))]
    return parse_policies([*texts, ("de.yaml", extra)], topology)


def ask(snap: Snapshot, client: str, ecs: IPv4Network | IPv6Network | None = None) -> Decision:
    return decide(DecisionRequest(Channel.DNS, ip_address(client), "chat", "chat", ecs), snap, NOW)


@pytest.fixture
def stricter(snapshot: Snapshot, topology: Topology) -> Snapshot:
    policy = shipped_with(rule_doc("stricter", ("203.0.113.0/24",)), topology)
    return snapshot.evolve(NOW, policy=policy)


@pytest.fixture
def refusing(snapshot: Snapshot, topology: Topology) -> Snapshot:
    policy = shipped_with(rule_doc("refuse", ("203.0.113.0/24",)), topology)
    return snapshot.evolve(NOW, policy=policy)


def test_an_untrusted_ecs_cannot_loosen_a_country_rule(stricter: Snapshot) -> None:
    # The attack: a client in Germany claims a US subnet.
    d = ask(stricter, DE, US_ECS)
    assert d.region in EU
    assert d.residency_basis is Basis.ECS_AND_ADDRESS
    assert d.matched_rules == ("de-stays-in-eu",)
    dropped = {c.region: c for c in d.candidates if c.reason is Reason.UNTRUSTED_ECS}
    assert set(dropped) == {"us-east", "us-west", "ap-south", "ap-northeast"}
    assert "resolver's address (DE/EU)" in dropped["us-east"].detail
    # The ECS still steers proximity inside the allowed set: from the US, Dublin is nearer.
    assert d.region == "eu-west"
    assert ask(stricter, DE).region == "eu-central"
    # The location (and so the ECS scope and the audit's country) stays the ECS's.
    assert d.location.country == "US"


def test_an_untrusted_ecs_can_narrow_residency(stricter: Snapshot, refusing: Snapshot) -> None:
    # A resolver nobody can place sends a German client's subnet: the DE rule applies.
    d = ask(stricter, UNKNOWN, DE_ECS)
    assert d.region in EU
    assert by_reason(d, Reason.RESIDENCY)
    # Under "refuse" the two places disagree on the rule: allowed nowhere.
    r = ask(refusing, UNKNOWN, DE_ECS)
    assert r.outcome is Outcome.DENIED
    assert r.dns_failure is not None and r.dns_failure.value == "refused"
    # The EU regions were dropped only because the ECS was not believed; the rest would be
    # dropped by the ECS's own place as well.
    assert set(by_reason(r, Reason.UNTRUSTED_ECS)) == EU
    assert set(by_reason(r, Reason.RESIDENCY)) == {"us-east", "us-west", "ap-south", "ap-northeast"}
    assert all("refused by de-stays-in-eu" in c.detail for c in r.candidates if c.region in EU)


def test_refuse_when_the_places_disagree_answer_when_they_agree(refusing: Snapshot) -> None:
    assert ask(refusing, DE, US_ECS).outcome is Outcome.DENIED
    agreeing = ask(refusing, "198.51.100.77", DE_ECS)
    assert agreeing.outcome is Outcome.ANSWER and agreeing.region == "eu-central"
    # A rule that neither place matches is no dispute: a Japanese resolver for a US client.
    assert ask(refusing, JP, US_ECS).region in {"us-east", "us-west"}


def test_a_trusted_resolvers_ecs_is_believed(stricter: Snapshot, refusing: Snapshot) -> None:
    for snap in (stricter, refusing):
        # 203.0.113.0/24 is trusted (and itself in the US) and speaks for a client in Germany.
        d = ask(snap, US, DE_ECS)
        assert d.residency_basis is Basis.ECS
        assert d.region == "eu-central"
        assert not by_reason(d, Reason.UNTRUSTED_ECS)
    # A trusted resolver in the US, its client in the US: the DE rule does not apply.
    us = ask(stricter, "203.0.113.99", US_ECS)
    assert us.region in {"us-east", "us-west"} and us.matched_rules == ()


def test_without_ecs_residency_is_judged_on_the_address(stricter: Snapshot) -> None:
    d = ask(stricter, DE)
    assert d.residency_basis is Basis.ADDRESS
    # An ECS of source prefix 0 says nothing about the client (RFC 7871 7.1.2).
    zero = ask(stricter, DE, ip_network("0.0.0.0/0"))
    assert zero.residency_basis is Basis.ADDRESS and zero.region == "eu-central"


def test_the_shipped_policies_trust_no_resolver(snapshot: Snapshot) -> None:
    assert not snapshot.policy.trusted_resolvers
    assert ask(snapshot, US, DE_ECS).residency_basis is Basis.ECS_AND_ADDRESS


def by_reason(d: Decision, reason: Reason) -> list[str]:
    return [c.region for c in d.candidates if c.reason is reason]


# -- the policy document -----------------------------------------------------------------------


def test_the_new_fields_at_their_defaults_keep_the_policy_version(topology: Topology) -> None:
    """Audit rows name policy versions and the compliance report finds policies by them: a
    document that does not use the new fields must hash as it always did."""
    plain = yaml.safe_load(rule_doc())
    del plain["rules"][0]["untrusted_ecs"]
    explicit = yaml.safe_load(rule_doc("stricter"))
    refusing = yaml.safe_load(rule_doc("refuse"))

    def version(doc: dict[str, Any]) -> str:
        doc = doc | {"jurisdictions": {"EU": ["eu-west", "eu-central"]}}
        return compile_policy([("d.yaml", PolicyDocument.model_validate(doc))]).version

    assert version(plain) == version(explicit)
    assert version(refusing) != version(plain)
    trusting = plain | {"client_subnet": {"trusted_resolvers": ["192.0.2.0/24"]}}
    assert version(trusting) != version(plain)


def test_bad_trust_settings_are_refused_with_every_reason(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(
        yaml.safe_dump(
            {
                "version": "1",
                "rules": [
                    {
                        "id": "class-only",
                        "match": {"residency_class": ["x"]},
                        "allow": {"regions": ["eu-west"]},
                        "untrusted_ecs": "refuse",
                    },
                    {
                        "id": "typo",
                        "match": {"client_country": ["DE"]},
                        "allow": {"regions": ["eu-west"]},
                        "untrusted_ecs": "lenient",
                    },
                ],
                "client_subnet": {"trusted_resolvers": ["192.0.2.1/24", "not-a-network"]},
            }
        )
    )
    with pytest.raises(ConfigError) as info:
        load_policy([tmp_path])
    text = str(info.value)
    assert "rules[0]" in text and "cannot disagree" in text
    assert "rules[1].untrusted_ecs" in text
    assert "client_subnet.trusted_resolvers[0]" in text  # host bits set
    assert "client_subnet.trusted_resolvers[1]" in text


def test_only_one_document_says_whose_ecs_is_believed(tmp_path: Path) -> None:
    for name in ("a.yaml", "b.yaml"):
        (tmp_path / name).write_text(
            yaml.safe_dump({"version": "1", "client_subnet": {"trusted_resolvers": ["::/0"]}})
        )
    with pytest.raises(ConfigError) as info:
        load_policy([tmp_path])
    assert "b.yaml: client_subnet" in str(info.value)
    assert "already set in" in str(info.value)


# -- properties --------------------------------------------------------------------------------

V4 = [c for c in CLIENTS if ":" not in c]
V6 = [c for c in CLIENTS if ":" in c]


@st.composite
def networks(draw: st.DrawFn) -> IPv4Network | IPv6Network:
    v6 = draw(st.booleans())
    bits = 128 if v6 else 32
    prefix = draw(st.integers(0, bits))
    address = draw(st.integers(0, 2**bits - 1)) >> (bits - prefix) << (bits - prefix)
    return ip_network((address, prefix)) if prefix else ip_network(("::" if v6 else "0.0.0.0", 0))


@given(nets=st.lists(networks(), max_size=6), probe=st.integers(0, 2**128 - 1), v6=st.booleans())
def test_network_set_membership_is_any_network_containing(
    nets: list[IPv4Network | IPv6Network], probe: int, v6: bool
) -> None:
    address = ip_address(probe if v6 else probe % 2**32)
    assert (address in NetworkSet(nets)) == any(
        n.version == address.version and address in n for n in nets
    )
    if not v6:  # the same peer seen on a dual-stack socket
        mapped = ip_address(f"::ffff:{address}")
        assert (mapped in NetworkSet(nets)) == (address in NetworkSet(nets))


@st.composite
def trust_worlds(draw: st.DrawFn) -> dict[str, Any]:
    """A random world (test_routing_properties) with a country rule, an ECS and a sender
    anywhere, and the sender trusted or not."""
    world = draw(worlds())
    ids = [r["id"] for r in world["topology"]["regions"]]
    world["policy"]["rules"].append(
        {
            "id": "country-rule",
            "match": {
                "client_country": draw(
                    st.lists(st.sampled_from(["DE", "US", "JP", "IN"]), min_size=1, unique=True)
                )
            },
            "allow": {"regions": draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))},
            "untrusted_ecs": draw(st.sampled_from(["stricter", "refuse"])),
        }
    )
    family = draw(st.sampled_from([V4, V6]))
    world["ecs_at"] = draw(st.sampled_from(family))
    world["sender"] = draw(st.sampled_from(family))
    world["trusted"] = draw(st.booleans())
    if world["trusted"]:
        world["policy"]["client_subnet"] = {"trusted_resolvers": [world["sender"]]}
    return world


def _ecs(world: dict[str, Any]) -> IPv4Network | IPv6Network:
    at = ip_address(world["ecs_at"])
    return ip_network(f"{at}/{24 if at.version == 4 else 56}", strict=False)


def _request(world: dict[str, Any], req: DecisionRequest, sender: str) -> DecisionRequest:
    return DecisionRequest(
        Channel.DNS,
        ip_address(sender),
        req.service,
        req.name,
        _ecs(world),
        req.residency_classes,
        req.tenant,
    )


def _allowed_at(snap: Snapshot, req: DecisionRequest, address: str) -> set[str]:
    """The regions the policy allows a client at ``address``, judged on that place alone."""
    svc = snap.topology.service("svc")
    assert svc is not None
    classes = set(req.residency_classes) | ({svc.residency_class} - {None})
    place = snap.geo.locate(ip_address(address))
    verdict = snap.policy.evaluate(frozenset(classes), req.tenant, place.country, place.continent)
    return set(svc.regions) if verdict.allowed is None else set(svc.regions) & verdict.allowed


@SETTINGS
@given(world=trust_worlds())
def test_an_untrusted_ecs_answer_stays_inside_both_places_allowed_sets(
    world: dict[str, Any], geo: GeoDatabase
) -> None:
    snap, base = build(world, geo)
    req = _request(world, base, world["sender"])
    d = decide(req, snap, NOW)
    # The ECS is located by its network address (which a /28 in the test GeoIP can put
    # elsewhere than the address it was drawn from).
    ecs_at = str(_ecs(world).network_address)
    ecs_allowed = _allowed_at(snap, req, ecs_at)
    assert set(d.regions) <= ecs_allowed  # the ECS never widens what its own place allows
    if world["trusted"]:
        assert d.residency_basis is Basis.ECS
        # Believed: decided exactly as for a client asking from the ECS's place itself.
        direct = decide(_request(world, base, ecs_at), snap, NOW)
        assert (d.outcome, d.regions, d.candidates) == (
            direct.outcome,
            direct.regions,
            direct.candidates,
        )
    else:
        assert d.residency_basis is Basis.ECS_AND_ADDRESS
        # Not believed: the sender's own place constrains the answer as well, and every region
        # outside what both places allow is dropped, whatever the regions' health.
        both = ecs_allowed & _allowed_at(snap, req, world["sender"])
        assert set(d.regions) <= both
        assert all(c.status is Status.DROPPED for c in d.candidates if c.region not in both)


@pytest.fixture(scope="module")
def geo(geoip_path: Path) -> GeoDatabase:
    return GeoDatabase(geoip_path)
