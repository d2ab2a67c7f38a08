"""Static records in the topology (``zone.records``): malformed ones fail at load, each problem
with the path of the record and field it is about."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gtm.decision.static_records import absolute_owner
from gtm.decision.topology import parse_topology
from gtm.errors import ConfigError
from tests.conftest import DEMO


def load(*records: dict[str, Any]) -> Any:
    data = yaml.safe_load(DEMO.read_text())
    data["zone"]["records"] = list(records)
    return parse_topology(data, "t.yaml")


def problems(*records: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load(*records)
    assert all(p.source == "t.yaml" for p in info.value.problems)
    return {p.location: p.message for p in info.value.problems}


MAIL = {"name": "mail", "type": "A", "address": "192.0.2.25"}


def test_the_demo_records_load_with_their_owners() -> None:
    topology = load(
        {"name": "@", "type": "txt", "text": "x"},  # types are case-insensitive
        {"name": "WWW", "type": "CNAME", "target": "Chat.GTM.example"},
        {"name": "abs.gtm.example.", "type": "AAAA", "address": "2001:db8::1"},
        {"name": "null", "type": "MX", "preference": 0, "exchange": "."},
        {"name": "_x._udp", "type": "SRV", "priority": 1, "weight": 2, "port": 3, "target": "."},
    )
    apex = topology.zone.apex
    owners = [absolute_owner(r.name, apex) for r in topology.zone.records]
    assert owners == [
        "gtm.example.",
        "www.gtm.example.",
        "abs.gtm.example.",
        "null.gtm.example.",
        "_x._udp.gtm.example.",
    ]
    assert topology.zone.records[1].target == "chat.gtm.example."


def test_field_errors_name_the_record_and_field() -> None:
    found = problems(
        {"name": "a", "type": "A", "address": "2001:db8::1"},
        {"name": "b", "type": "MX", "preference": 70000, "exchange": "mail.gtm.example."},
        {"name": "c", "type": "SRV", "priority": 0, "weight": 0, "port": -1, "target": "x."},
        {"name": "d", "type": "CAA", "tag": "isue", "value": "letsencrypt.org"},
        {"name": "e", "type": "CAA", "tag": "issue", "value": "lets encrypt;"},
        {"name": "f", "type": "CAA", "tag": "iodef", "value": "security@gtm.example"},
        {"name": "g", "type": "CAA", "flags": 1, "tag": "issue", "value": ";"},
        {"name": "h", "type": "TXT", "text": ["ok", "x" * 256]},
        {"name": "i", "type": "TXT", "text": "x" * 9000},
        {"name": "j", "type": "TXT", "text": []},
        {"name": "k", "type": "CNAME", "target": "a b."},
        {"name": "*.l", "type": "TXT", "text": "wild"},
        {"name": "m", "type": "NS", "target": "x."},
        {"name": "n", "type": "A", "address": "192.0.2.1", "extra": 1},
        {"name": "o", "type": "A", "address": "192.0.2.1", "ttl": -5},
        {"name": "p", "type": "CNAME"},
    )
    assert set(found) == {
        "zone.records[0].address",
        "zone.records[1].preference",
        "zone.records[2].port",
        "zone.records[3].tag",
        "zone.records[4].value",
        "zone.records[5].value",
        "zone.records[6].flags",
        "zone.records[7].text",
        "zone.records[8].text",
        "zone.records[9].text",
        "zone.records[10].target",
        "zone.records[11].name",
        "zone.records[12]",
        "zone.records[13].extra",
        "zone.records[14].ttl",
        "zone.records[15].target",
    }
    assert "unknown CAA tag 'isue'" in found["zone.records[3].tag"]
    assert "text[1] is 256 octets" in found["zone.records[7].text"]
    assert "wildcard" in found["zone.records[11].name"]


def test_owners_must_be_in_the_zone() -> None:
    found = problems(
        {"name": "www.example.com.", "type": "TXT", "text": "x"},
        {"name": "www.gtm.example", "type": "TXT", "text": "x"},  # relative: a typo
    )
    assert "outside the zone" in found["zone.records[0].name"]
    assert "write 'www', or 'www.gtm.example.'" in found["zone.records[1].name"]


def test_cname_rules() -> None:
    found = problems(
        {"name": "@", "type": "CNAME", "target": "chat.gtm.example."},
        {"name": "a", "type": "CNAME", "target": "chat.gtm.example."},
        {"name": "a", "type": "TXT", "text": "not beside a CNAME"},
        {"name": "a", "type": "CNAME", "target": "mail.gtm.example."},
        {"name": "chat", "type": "CNAME", "target": "mail.gtm.example."},
        {"name": "ns1", "type": "CNAME", "target": "mail.gtm.example."},
        MAIL,
        {"name": "loop1", "type": "CNAME", "target": "loop2.gtm.example."},
        {"name": "loop2", "type": "CNAME", "target": "loop1.gtm.example."},
        {"name": "dangling", "type": "CNAME", "target": "nothing.gtm.example."},
    )
    assert "apex" in found["zone.records[0].type"]
    assert "has a CNAME (zone.records[1])" in found["zone.records[2].name"]
    assert "has a CNAME (zone.records[1])" in found["zone.records[3].name"]
    assert "service 'chat'" in found["zone.records[4].name"]
    assert "nameserver" in found["zone.records[5].name"]
    assert "CNAME loop" in found["zone.records[7].target"]
    assert "does not exist" in found["zone.records[9].target"]
    assert "zone.records[6]" not in str(found)


def test_a_long_chain_is_refused() -> None:
    chain = [
        {"name": f"c{i}", "type": "CNAME", "target": f"c{i + 1}.gtm.example."} for i in range(10)
    ]
    found = problems(*chain, {"name": "c10", "type": "TXT", "text": "end"})
    assert "more than 8 CNAMEs" in found["zone.records[0].target"]
    load(*chain[2:], {"name": "c10", "type": "TXT", "text": "end"})  # eight is fine


def test_addresses_services_and_glue() -> None:
    found = problems(
        {"name": "chat", "type": "A", "address": "192.0.2.1"},
        {"name": "chat.eu", "type": "AAAA", "address": "2001:db8::1"},
        {"name": "ns2", "type": "A", "address": "192.0.2.1"},
    )
    assert "addresses come from the decision" in found["zone.records[0].name"]
    assert "service 'chat-eu'" in found["zone.records[1].name"]
    assert "nameserver" in found["zone.records[2].name"]
    # Other types at a service or a nameserver name are fine.
    load(
        {"name": "chat", "type": "TXT", "text": "x"},
        {"name": "ns2", "type": "TXT", "text": "x"},
        {"name": "www", "type": "A", "address": "192.0.2.80"},
    )


def test_duplicates_ttls_and_rrset_size() -> None:
    found = problems(
        MAIL,
        {**MAIL, "ttl": 3600},  # identical to the first (3600 is the zone's TTL)
        {"name": "mail", "type": "A", "address": "192.0.2.26", "ttl": 60},
        {"name": "t", "type": "TXT", "text": "a"},
        {"name": "t", "type": "TXT", "text": ["a"]},  # the same character-strings
        *({"name": "big", "type": "TXT", "text": f"{i}" + "x" * 8000} for i in range(3)),
    )
    assert "duplicates zone.records[0]" in found["zone.records[1]"]
    assert "differs from zone.records[0]'s 3600" in found["zone.records[2].ttl"]
    assert "duplicates zone.records[3]" in found["zone.records[4]"]
    assert "over 16384 octets" in found["zone.records[7]"]


def test_mx_and_srv_targets() -> None:
    found = problems(
        {"name": "alias", "type": "CNAME", "target": "mail.gtm.example."},
        MAIL,
        {"name": "@", "type": "MX", "preference": 10, "exchange": "alias.gtm.example."},
        {
            "name": "_a._tcp",
            "type": "SRV",
            "priority": 0,
            "weight": 0,
            "port": 1,
            "target": "alias.gtm.example.",
        },
        {"name": "@", "type": "MX", "preference": 20, "exchange": "nohost.gtm.example."},
        {"name": "nomx", "type": "MX", "preference": 5, "exchange": "."},
        {"name": "srv", "type": "SRV", "priority": 0, "weight": 0, "port": 1, "target": "."},
    )
    assert "RFC 2181 §10.3" in found["zone.records[2].exchange"]
    assert "RFC 2181 §10.3" in found["zone.records[3].target"]
    assert "has no addresses" in found["zone.records[4].exchange"]
    assert "null MX" in found["zone.records[5].exchange"]
    assert "_service._proto" in found["zone.records[6].name"]
    # Out-of-zone targets, service names and a lone null MX are fine.
    load(
        {"name": "@", "type": "MX", "preference": 10, "exchange": "mx.example.net"},
        {"name": "@", "type": "MX", "preference": 20, "exchange": "chat.gtm.example."},
        {"name": "nomail", "type": "MX", "preference": 0, "exchange": "."},
    )


def test_every_problem_is_reported_at_once() -> None:
    data = yaml.safe_load(DEMO.read_text())
    data["zone"]["records"] = [{"name": "a", "type": "MX", "preference": -1, "exchange": "x."}]
    data["regions"][0]["lat"] = 123
    with pytest.raises(ConfigError) as info:
        parse_topology(data, "t.yaml")
    assert {p.location for p in info.value.problems} == {
        "zone.records[0].preference",
        "regions[0].lat",
    }
