from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gtm.decision.topology import load_topology, normalise_dns_name, parse_topology
from gtm.errors import ConfigError
from tests.conftest import DEMO


def demo_data() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load(DEMO.read_text())


def test_demo_topology_loads_with_the_six_regions(topology) -> None:  # type: ignore[no-untyped-def]
    assert [r.id for r in topology.regions] == [
        "us-east",
        "us-west",
        "eu-west",
        "eu-central",
        "ap-south",
        "ap-northeast",
    ]
    assert topology.zone.apex == "gtm.example."
    assert topology.service_by_dns_name("chat.eu.gtm.example.").residency_class == "eu-personal"
    assert topology.service_by_host("CHAT.gtm.example.").id == "chat"
    assert topology.region("eu-central").jurisdiction == "EU"


def test_every_error_is_reported_at_once_with_its_location() -> None:
    data = demo_data()
    data["regions"][0]["lat"] = 123  # out of range
    data["regions"][1]["base_url"] = "not a url"
    data["services"][0]["ttl"] = -1
    data["zone"]["bogus"] = 1
    with pytest.raises(ConfigError) as info:
        parse_topology(data, "demo.yaml")
    where = {p.location for p in info.value.problems}
    assert {"regions[0].lat", "regions[1].base_url", "services[0].ttl", "zone.bogus"} <= where
    assert all(p.source == "demo.yaml" for p in info.value.problems)


def test_cross_references_are_each_reported() -> None:
    data = demo_data()
    data["services"][0]["regions"].append("mars-1")
    data["services"][1]["dns_names"].append("chat.other.example.")
    data["regions"][1]["id"] = "us-east"  # duplicate
    data["routing"]["latency_map"] = {"country:DE": ["nowhere"]}
    with pytest.raises(ConfigError) as info:
        parse_topology(data, "demo.yaml")
    messages = [str(p) for p in info.value.problems]
    assert any("unknown region 'mars-1'" in m and "services[0].regions[6]" in m for m in messages)
    assert any("outside the zone" in m for m in messages)
    assert any("'us-east' is defined more than once" in m for m in messages)
    assert any("latency_map.country:DE" in m for m in messages)


def test_glue_is_required_for_in_zone_nameservers() -> None:
    data = demo_data()
    data["zone"]["nameservers"][0] = {"name": "ns1.gtm.example."}
    with pytest.raises(ConfigError, match="needs glue"):
        parse_topology(data)


def test_bad_yaml_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text("zone:\n  apex: [unclosed\n")
    with pytest.raises(ConfigError) as info:
        load_topology(bad)
    assert str(bad) in str(info.value)
    assert "line" in str(info.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read file"):
        load_topology(tmp_path / "absent.yaml")


@pytest.mark.parametrize(
    ("raw", "expected"), [("Chat.GTM.example", "chat.gtm.example."), ("a.b.", "a.b.")]
)
def test_dns_names_are_normalised(raw: str, expected: str) -> None:
    assert normalise_dns_name(raw) == expected


@pytest.mark.parametrize("raw", ["", ".", "a..b", "x" * 64 + ".example"])
def test_invalid_dns_names_are_rejected(raw: str) -> None:
    with pytest.raises(ValueError, match="DNS name"):
        normalise_dns_name(raw)


def test_fingerprint_changes_with_content() -> None:
    data = demo_data()
    a = parse_topology(data).fingerprint()
    data["services"][0]["ttl"] = 31
    assert parse_topology(data).fingerprint() != a
