"""gtm_answers_by_jurisdiction: every answer counted once, under labels the policy bounds."""

from __future__ import annotations

from ipaddress import ip_address
from pathlib import Path

from prometheus_client import REGISTRY

from gtm.answer_labels import class_label, jurisdictions
from gtm.audit.record import record_of
from gtm.decision.policy import PolicySet
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.runtime import Runtime
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES

FRANKFURT = ip_address("198.51.100.7")  # nearest region: eu-central


def answers(channel: str, jurisdiction: str, residency_class: str) -> float:
    labels = {"channel": channel, "jurisdiction": jurisdiction, "residency_class": residency_class}
    return REGISTRY.get_sample_value("gtm_answers_by_jurisdiction_total", labels) or 0.0


def test_labels_come_from_the_policy(policy: PolicySet) -> None:
    groups = jurisdictions(policy)
    assert groups["eu-central"] == "EU" and groups["ap-south"] == "IN"
    known = policy.known_classes
    assert class_label((), known) == "unclassified"
    assert class_label(("eu-personal",), known) == "eu-personal"
    # Whatever a client makes up is one value, however many distinct names it sends.
    assert {class_label((f"made-up-{i}",), known) for i in range(100)} == {"unknown"}


async def test_answers_are_counted_by_jurisdiction_and_class(
    tmp_path: Path, geoip_path: Path
) -> None:
    runtime = Runtime(
        Settings(
            config=DEMO,
            policies=(POLICIES,),
            geoip_path=geoip_path,
            database_url=f"sqlite:///{tmp_path / 'gtm.sqlite3'}",
            spool_dir=tmp_path / "spool",
            node_id="labels-test",
            audit_flush_interval_s=0.05,
            probes=False,
        )
    )
    cases = [
        # (channel, service, classes a header named, answers, expected labels)
        ("dns", "chat", (), 3, ("EU", "unclassified")),
        ("dns", "chat-eu", (), 2, ("EU", "eu-personal")),
        ("http", "chat", ("made-up",), 4, ("none", "unknown")),  # allowed nowhere: 451
    ]
    before = {c: answers(c[0], *c[4]) for c in cases}
    await runtime.start()
    try:
        snapshot = runtime.store.current
        for channel, service, classes, n, _ in cases:
            request = DecisionRequest(
                Channel(channel), FRANKFURT, service, service, residency_classes=frozenset(classes)
            )
            decision = decide(request, snapshot, 0.0)
            for _ in range(n):
                runtime.count(record_of(decision, channel=channel, name=service))
    finally:
        await runtime.stop()  # flushes: every counted answer is sealed into a row
    for case in cases:
        assert answers(case[0], *case[4]) - before[case] == case[3], case
