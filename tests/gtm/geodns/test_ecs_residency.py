"""ECS trust over real sockets: an EDNS Client Subnet from a resolver the policy does not trust
never loosens a residency rule on client geography (issue 17: a German client sending ECS
8.8.8.0/24 got a US answer under a "DE stays in the EU" rule).

The test GeoIP database puts 127.0.0.0/24 (the senders) in Germany and 8.8.8.0/24 in the US;
127.0.1.0/24 is a trusted resolver network, also in Germany."""

from __future__ import annotations

from pathlib import Path

import dns.edns
import dns.message
import dns.rcode
import pytest

from gtm.audit import query as audit_query
from gtm.audit.database import make_async_engine
from tests.conftest import POLICIES
from tests.support.geoip import WORLD, build_city_db

from .conftest import StartNode, udp

US_ECS = "8.8.8.0"
UNTRUSTED_DE = "127.0.0.2"  # a client in Germany talking to us directly
TRUSTED_DE = "127.0.1.2"  # a resolver in the policy's trusted_resolvers, also in Germany
EU_V4 = {"192.0.2.30", "192.0.2.40"}  # eu-west, eu-central
US_V4 = {"192.0.2.10", "192.0.2.20"}  # us-east, us-west


@pytest.fixture
def loopback_geoip(tmp_path: Path) -> Path:
    world = {
        **WORLD,
        "127.0.0.0/24": ("DE", "EU", 50.11, 8.68),  # Frankfurt
        "127.0.1.0/24": ("DE", "EU", 52.52, 13.40),  # Berlin
        "8.8.8.0/24": ("US", "NA", 37.39, -122.08),  # Mountain View
    }
    return build_city_db(tmp_path / "loopback-city.mmdb", world)


def de_rule(tmp_path: Path, untrusted_ecs: str) -> Path:
    path = tmp_path / f"de-{untrusted_ecs}.yaml"
    path.write_text(
        f"""
version: "test"
rules:
  - id: de-stays-in-eu
    description: Clients in Germany are served in the EU.
    match: {{client_country: [DE]}}
    allow: {{jurisdictions: [EU]}}
    untrusted_ecs: {untrusted_ecs}
client_subnet:
  trusted_resolvers: [127.0.1.0/24]
"""
    )
    return path


def ecs_query(address: str = US_ECS) -> dns.message.Message:
    return dns.message.make_query(
        "chat.gtm.example.", "A", use_edns=0, options=[dns.edns.ECSOption(address, 24)]
    )


def addresses(r: dns.message.Message) -> set[str]:
    return {item.address for rrset in r.answer for item in rrset}


async def test_untrusted_ecs_cannot_take_a_german_client_out_of_the_eu(
    start_node: StartNode, tmp_path: Path, loopback_geoip: Path
) -> None:
    node = await start_node(
        policies=(POLICIES, de_rule(tmp_path, "stricter")), geoip_path=loopback_geoip
    )
    # Without the attack: the German client is answered in the EU.
    plain = await udp(node, dns.message.make_query("chat.gtm.example.", "A"), source=UNTRUSTED_DE)
    assert addresses(plain) <= EU_V4
    # The attack: the same client claims to be at 8.8.8.0/24. The ECS still steers proximity
    # (Dublin is nearer Mountain View than Frankfurt is) but only inside the EU.
    attacked = await udp(node, ecs_query(), source=UNTRUSTED_DE)
    assert attacked.rcode() == dns.rcode.NOERROR
    assert addresses(attacked) == {"192.0.2.30"}
    # Asked again (the exact-query cache) and over the second-level cache from another sender
    # in the same place: the same.
    again = await udp(node, ecs_query(), source=UNTRUSTED_DE)
    assert addresses(again) == {"192.0.2.30"}
    other = await udp(node, ecs_query(), source="127.0.0.3")
    assert addresses(other) == {"192.0.2.30"}

    # The audit row says residency was judged on the resolver's address as well as the ECS.
    await node.runtime.writer.flush()
    engine = make_async_engine(node.runtime.settings.database_url)
    try:
        rows = await audit_query.tail(engine, 100)
    finally:
        await engine.dispose()
    judged = [r for r in rows if r["ecs_prefix"] == "8.8.8.0/24"]
    assert judged and all(r["region"] == "eu-west" for r in judged)
    assert all(r["matched_rules"] == ["de-stays-in-eu"] for r in judged)
    us = [c for c in judged[0]["candidates"] if c["region"] == "us-west"]
    assert us[0]["reason"] == "untrusted-ecs"
    assert "resolver's address (DE/EU)" in us[0]["detail"]


async def test_untrusted_ecs_is_refused_when_the_rule_says_so(
    start_node: StartNode, tmp_path: Path, loopback_geoip: Path
) -> None:
    node = await start_node(
        policies=(POLICIES, de_rule(tmp_path, "refuse")), geoip_path=loopback_geoip
    )
    attacked = await udp(node, ecs_query(), source=UNTRUSTED_DE)
    assert attacked.rcode() == dns.rcode.REFUSED
    assert not attacked.answer
    # An ECS that agrees with the sender's place is not a dispute: answered in the EU.
    agreeing = await udp(node, ecs_query("127.0.0.0"), source=UNTRUSTED_DE)
    assert agreeing.rcode() == dns.rcode.NOERROR
    assert addresses(agreeing) <= EU_V4


async def test_a_trusted_resolvers_ecs_is_believed(
    start_node: StartNode, tmp_path: Path, loopback_geoip: Path
) -> None:
    node = await start_node(
        policies=(POLICIES, de_rule(tmp_path, "refuse")), geoip_path=loopback_geoip
    )
    # The trusted resolver in Germany asks for its client at 8.8.8.0/24: a US answer.
    trusted = await udp(node, ecs_query(), source=TRUSTED_DE)
    assert trusted.rcode() == dns.rcode.NOERROR
    assert addresses(trusted) <= US_V4
    # That answer is cached under the ECS; the same ECS from an untrusted sender in Germany
    # must not be answered from it.
    untrusted = await udp(node, ecs_query(), source=UNTRUSTED_DE)
    assert untrusted.rcode() == dns.rcode.REFUSED
