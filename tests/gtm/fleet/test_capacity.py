from __future__ import annotations

from gtm.fleet.capacity import CapacityIntake, Rejected
from regional_lb.capacity_report import CapacityReport, sign

SECRET = b"s3cret"
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
    accepted = intake().accept(body, sign(body, SECRET), NOW)
    assert isinstance(accepted, CapacityReport) and accepted.utilisation == 0.5


def test_forged_malformed_unknown_stale_and_future_reports_are_rejected() -> None:
    i = intake()
    body = report()
    cases = {
        "signature": (body, sign(body, b"wrong")),
        "no signature": (body, None),
        "tampered": (body.replace(b"0.5", b"0.1"), sign(body, SECRET)),
        "malformed": (b"{not json", sign(b"{not json", SECRET)),
        "unknown region": (report(region="mars"), None),
        "stale": (report(ts=NOW - 11), None),
        "future": (report(ts=NOW + 5), None),
    }
    for label, (data, signature) in cases.items():
        if signature is None and label not in ("no signature",):
            signature = sign(data, SECRET)
        assert isinstance(i.accept(data, signature, NOW), Rejected), label
    assert i.rejected == len(cases)


def test_replays_and_reordering_are_rejected_but_a_restart_is_not() -> None:
    i = intake()

    def offer(seq: int, ts: float) -> bool:
        body = report(seq=seq, ts=ts)
        return isinstance(i.accept(body, sign(body, SECRET), NOW), CapacityReport)

    assert offer(5, NOW - 2)
    assert not offer(5, NOW - 2)  # the same report again
    assert not offer(4, NOW - 3)  # an older one, late
    assert offer(6, NOW - 1)
    assert offer(1, NOW)  # the balancer restarted: sequence from 1, but newer


def test_unsigned_reports_only_without_a_secret() -> None:
    open_intake = CapacityIntake(None, {"eu-west"}, stale_after_s=10)
    assert isinstance(open_intake.accept(report(), None, NOW), CapacityReport)
