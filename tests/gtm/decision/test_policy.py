from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from gtm.decision.policy import Action, DnsFailure, json_schema, load_policy
from gtm.errors import ConfigError
from tests.conftest import POLICIES

EU = frozenset({"eu-west", "eu-central"})


def test_checked_in_schema_matches_the_code() -> None:
    checked_in = json.loads((POLICIES / "schema.json").read_text())
    assert checked_in == json.loads(json.dumps(json_schema())), (
        "policies/schema.json is stale: regenerate with `gtm policy schema > policies/schema.json`"
    )


def test_shipped_policies_validate_against_the_json_schema() -> None:
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    for path in sorted(POLICIES.glob("*.yaml")):
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)


def test_json_schema_rejects_what_the_model_rejects() -> None:
    bad = {"version": "1", "rules": [{"id": "x", "match": {}, "allow": {}, "extra": 1}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, json_schema())


def test_eu_personal_stays_in_eu(policy) -> None:  # type: ignore[no-untyped-def]
    v = policy.evaluate(frozenset({"eu-personal"}), None, "US", "NA")
    assert v.allowed == EU
    assert v.matched_rules == ("eu-personal-stays-in-eu",)
    assert v.restricted
    assert v.dns_failure is DnsFailure.NODATA


def test_unrestricted_traffic_is_unconstrained_and_fails_static(policy) -> None:  # type: ignore[no-untyped-def]
    v = policy.evaluate(frozenset(), None, "DE", "EU")
    assert v.allowed is None
    assert not v.restricted
    assert v.action is Action.FAIL_STATIC


def test_matching_rules_intersect(policy) -> None:  # type: ignore[no-untyped-def]
    # The usgov tenant is US-only; with EU personal data that leaves nothing.
    v = policy.evaluate(frozenset({"eu-personal"}), "usgov", "US", "NA")
    assert v.allowed == frozenset()
    assert set(v.matched_rules) == {"eu-personal-stays-in-eu", "tenant-usgov-us-only"}
    v = policy.evaluate(frozenset(), "usgov", "DE", "EU")
    assert v.allowed == frozenset({"us-east", "us-west"})
    assert v.restricted


def test_a_class_no_rule_names_is_allowed_nowhere(policy) -> None:  # type: ignore[no-untyped-def]
    v = policy.evaluate(frozenset({"eu-personnal"}), None, "DE", "EU")
    assert v.allowed == frozenset()
    assert v.unknown_classes == ("eu-personnal",)
    assert v.restricted


def _write(tmp_path: Path, name: str, doc: object) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def test_geographic_rules_match_on_country_and_never_on_unknown(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "a.yaml",
        {
            "version": "1",
            "jurisdictions": {"JP": ["ap-northeast"]},
            "rules": [
                {
                    "id": "jp-local",
                    "match": {"client_country": ["jp"]},
                    "allow": {"jurisdictions": ["JP"]},
                }
            ],
        },
    )
    p = load_policy([tmp_path])
    assert p.uses_location
    assert p.evaluate(frozenset(), None, "JP", "AS").allowed == frozenset({"ap-northeast"})
    assert p.evaluate(frozenset(), None, None, None).allowed is None


def test_every_problem_in_every_file_at_once(tmp_path: Path, topology) -> None:  # type: ignore[no-untyped-def]
    _write(
        tmp_path,
        "a.yaml",
        {
            "version": "1",
            "jurisdictions": {"EU": ["eu-west", "atlantis"]},
            "rules": [
                {"id": "r1", "match": {"residency_class": ["x"]}, "allow": {"regions": ["mars"]}}
            ],
        },
    )
    _write(
        tmp_path,
        "b.yaml",
        {
            "version": "1",
            "rules": [
                {
                    "id": "r2",
                    "match": {"residency_class": ["y"]},
                    "allow": {"regions": ["eu-west"]},
                    "on_unavailable": "fail_static",
                },
                {"id": "Bad Id", "match": {}, "allow": {"regions": ["eu-west"]}},
            ],
        },
    )
    with pytest.raises(ConfigError) as info:
        load_policy([tmp_path], topology)
    text = str(info.value)
    assert "b.yaml: rules[0]" in text
    assert "never fails open" in text
    assert "b.yaml: rules[1].id" in text
    # File-level problems stop before cross-references; fix b.yaml and the rest shows.
    (tmp_path / "b.yaml").unlink()
    with pytest.raises(ConfigError) as info:
        load_policy([tmp_path], topology)
    messages = [str(p) for p in info.value.problems]
    assert any("jurisdictions.EU[1]" in m and "atlantis" in m for m in messages)
    assert any("rules[0].allow.regions[0]" in m and "mars" in m for m in messages)
    # The demo topology's eu-personal service is now covered by no rule.
    assert any("'eu-personal' is named by no policy rule" in m for m in messages)


def test_conflicting_jurisdictions_and_duplicate_rules(tmp_path: Path) -> None:
    rule = {"id": "same", "match": {"tenant": ["t"]}, "allow": {"jurisdictions": ["EU"]}}
    _write(
        tmp_path,
        "a.yaml",
        {"version": "1", "jurisdictions": {"EU": ["eu-west"]}, "rules": [rule], "default": {}},
    )
    _write(
        tmp_path,
        "b.yaml",
        {"version": "1", "jurisdictions": {"EU": ["eu-central"]}, "rules": [rule], "default": {}},
    )
    with pytest.raises(ConfigError) as info:
        load_policy([tmp_path])
    text = str(info.value)
    assert "jurisdictions.EU" in text
    assert "conflicts" in text
    assert "rule id 'same' is also used" in text
    assert "a default is already set" in text


def test_version_is_a_content_hash(tmp_path: Path) -> None:
    doc = {"version": "1", "jurisdictions": {"EU": ["eu-west"]}}
    path = _write(tmp_path, "a.yaml", doc)
    first = load_policy([path]).version
    assert load_policy([path]).version == first
    doc["jurisdictions"]["EU"].append("eu-central")  # type: ignore[index]
    _write(tmp_path, "a.yaml", doc)
    assert load_policy([path]).version != first


def test_no_documents_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no policy documents"):
        load_policy([tmp_path])
