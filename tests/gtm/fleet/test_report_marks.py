"""Capacity-report marks in the shared database: a captured report replayed after a restart,
or to another node, is refused (before, replay state lived in each node's memory only)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.fleet.capacity import CapacityIntake, Rejected
from gtm.fleet.report_marks import MarkSync, load, store
from regional_lb.capacity_report import CapacityReport, region_secret, sign
from tests.gtm.fleet.test_capacity import NOW, SECRET, report

KEY = region_secret(SECRET, "eu-west")


async def _node(engine: AsyncEngine, name: str) -> tuple[CapacityIntake, MarkSync]:
    intake = CapacityIntake(SECRET, {"eu-west"}, stale_after_s=10)
    marks = MarkSync(engine, name, intake)
    await marks.start()
    return intake, marks


async def test_a_replay_is_refused_after_a_restart_and_on_another_node(engine: AsyncEngine) -> None:
    captured = report(seq=3, ts=NOW - 2, utilisation=0.99)
    a, a_marks = await _node(engine, "node-a")
    assert isinstance(a.accept(captured, sign(captured, KEY), NOW), CapacityReport)
    newer = report(seq=4, ts=NOW - 1, utilisation=0.2)
    assert isinstance(a.accept(newer, sign(newer, KEY), NOW), CapacityReport)
    await a_marks.sync()
    # node-a restarts: a new intake, marks read back from the database.
    a2, _ = await _node(engine, "node-a")
    assert isinstance(a2.accept(captured, sign(captured, KEY), NOW), Rejected)
    assert isinstance(a2.accept(newer, sign(newer, KEY), NOW), Rejected)
    # node-b never saw either: the old one is refused, the newest is accepted (the balancer
    # pushes each report to every node).
    b, _ = await _node(engine, "node-b")
    assert isinstance(b.accept(captured, sign(captured, KEY), NOW), Rejected)
    assert isinstance(b.accept(newer, sign(newer, KEY), NOW), CapacityReport)
    # A mark never moves back, whoever writes an older one (a worker of the same node that
    # saw less, say).
    await store(engine, "node-a", {"eu-west": (NOW - 5, 1)})
    own, fleet = await load(engine, "node-a")
    assert own["eu-west"] == fleet["eu-west"] == (NOW - 1, 4)
    a3, _ = await _node(engine, "node-a")
    assert isinstance(a3.accept(newer, sign(newer, KEY), NOW), Rejected)
