from __future__ import annotations

from gtm.fleet.capacity import CapacityIntake, Rejected
from regional_lb.capacity_report import CapacityReport, region_secret, sign

SECRET = b"s3cret"  # the fleet's; each region's balancer holds only its own key
EU_WEST = region_secret(SECRET, "eu-west")
US_EAST = region_secret(SECRET, "us-east")
NOW = 10_000.0


def report(seq: int = 1, ts: float = NOW, region: str = "eu-west", **kw: object) -> bytes:
    fields = {
        "region": region,
        "seq": seq,
        "ts": ts,
        "instances_healthy": 2,
        "instances_total": 2,
        "capacity": 100.0,
        "outstanding": 50.0,
        "utilisation": 0.5,
    } | kw
    return CapacityReport.model_validate(fields).model_dump_json().encode()


def intake() -> CapacityIntake:
    return CapacityIntake(SECRET, {"eu-west", "us-east"}, stale_after_s=10)


def test_a_signed_fresh_report_is_accepted() -> None:
    body = report()
    accepted = intake().accept(body, sign(body, EU_WEST), NOW)
    assert isinstance(accepted, CapacityReport) and accepted.utilisation == 0.5


def test_forged_malformed_unknown_stale_and_future_reports_are_rejected() -> None:
    i = intake()
    body = report()
    cases = {
        "signature": (body, sign(body, b"wrong")),
        "no signature": (body, None),
        "tampered": (body.replace(b"0.5", b"0.1"), sign(body, EU_WEST)),
        "malformed": (b"{not json", sign(b"{not json", EU_WEST)),
        "signed with the fleet secret itself": (body, sign(body, SECRET)),
        "unknown region": (report(region="mars"), None),
        "stale": (report(ts=NOW - 11), None),
        "future": (report(ts=NOW + 5), None),
    }
    for label, (data, signature) in cases.items():
        if signature is None and label not in ("no signature",):
            signature = sign(data, EU_WEST)
        assert isinstance(i.accept(data, signature, NOW), Rejected), label
    assert i.rejected == len(cases)


def test_replays_and_reordering_are_rejected_but_a_restart_is_not() -> None:
    i = intake()

    def offer(seq: int, ts: float) -> bool:
        body = report(seq=seq, ts=ts)
        return isinstance(i.accept(body, sign(body, EU_WEST), NOW), CapacityReport)

    assert offer(5, NOW - 2)
    assert not offer(5, NOW - 2)  # the same report again
    assert not offer(4, NOW - 3)  # an older one, late
    assert offer(6, NOW - 1)
    assert offer(1, NOW)  # the balancer restarted: sequence from 1, but newer


def test_unsigned_reports_only_with_the_insecure_setting() -> None:
    """Before: with no secret set (the default) unsigned reports were accepted silently."""
    default = CapacityIntake(None, {"eu-west"}, stale_after_s=10)
    refused = default.accept(report(), None, NOW)
    assert isinstance(refused, Rejected) and "GTM_REPORT_SECRET is unset" in refused.reason
    insecure = CapacityIntake(None, {"eu-west"}, stale_after_s=10, insecure_unsigned=True)
    assert isinstance(insecure.accept(report(), None, NOW), CapacityReport)
    # The insecure setting never weakens a configured secret.
    signed = CapacityIntake(SECRET, {"eu-west"}, stale_after_s=10, insecure_unsigned=True)
    assert isinstance(signed.accept(report(), None, NOW), Rejected)


def test_one_regions_balancer_cannot_speak_for_another() -> None:
    """Before: one fleet-wide secret, so us-east's balancer drained eu-west with a valid
    signature (204)."""
    i = intake()
    drain_eu = report(region="eu-west", can_take_work=False, draining=True)
    result = i.accept(drain_eu, sign(drain_eu, US_EAST), NOW)
    assert isinstance(result, Rejected) and "for region eu-west" in result.reason
    own = report(region="us-east")
    assert isinstance(i.accept(own, sign(own, US_EAST), NOW), CapacityReport)


def test_non_finite_and_out_of_range_numbers_are_refused() -> None:
    """Before: ts=NaN skipped the freshness and order checks (NaN compares false)."""
    i = intake()
    base = report().decode()
    for bad in (
        base.replace(f'"ts":{NOW}', '"ts":NaN'),
        base.replace(f'"ts":{NOW}', '"ts":Infinity'),
        base.replace('"utilisation":0.5', '"utilisation":NaN'),
        base.replace('"capacity":100.0', '"capacity":-Infinity'),
        base.replace('"utilisation":0.5', '"utilisation":1e300'),
        base.replace(f'"ts":{NOW}', '"ts":-1'),
    ):
        assert bad != base
        body = bad.encode()
        result = i.accept(body, sign(body, EU_WEST), NOW)
        assert isinstance(result, Rejected) and "not a capacity report" in result.reason, bad


def test_marks_from_the_database_refuse_a_replay_after_restart_and_on_another_node() -> None:
    first = intake()
    body = report(seq=7, ts=NOW - 1)
    assert isinstance(first.accept(body, sign(body, EU_WEST), NOW), CapacityReport)
    # A restarted node reads its own mark back: the captured report is a replay.
    restarted = intake()
    restarted.remember(first.own_marks(), first.fleet)
    assert isinstance(restarted.accept(body, sign(body, EU_WEST), NOW), Rejected)
    # Another node saw a newer report of the region: an older captured one is refused there,
    # while the newest (pushed to every node) is accepted by each.
    newer = report(seq=8, ts=NOW - 0.5)
    assert isinstance(first.accept(newer, sign(newer, EU_WEST), NOW), CapacityReport)
    other = intake()
    other.remember({}, first.fleet)
    assert isinstance(other.accept(body, sign(body, EU_WEST), NOW), Rejected)
    assert isinstance(other.accept(newer, sign(newer, EU_WEST), NOW), CapacityReport)
