"""The roster (gtm.fleet.roster): every configured member, silent ones included, and a rollout
complete only when each has acknowledged; pure, so each state is one call with its own clock."""

from __future__ import annotations

from gtm.fleet import roster
from gtm.fleet.roster import Bounds
from gtm.fleet.shared_state import NodeStatus

BOUNDS = Bounds(live_within_s=5.0, fence_after_s=10.0, fence_slack_s=2.0)


def report(node: str, at: float, sequence: int | None, observer: str | None = None) -> NodeStatus:
    return NodeStatus(node, observer or node, at, sequence, 1, "t", "p", {"eu-west": "up"})


def test_each_member_state_and_what_the_rollout_says() -> None:
    members = frozenset({"a", "b", "c", "d"})
    reports = [
        report("a", 100.0, 7),  # live, has it
        report("b", 96.0, 6),  # live, behind
        report("c", 80.0, 6),  # silent 20 s: past 10 + 2, surely fenced since 92
        report("x", 99.0, 6),  # live, outside the membership: it answers, so it counts
        report("y", 10.0, 6),  # long gone, outside the membership: not listed
    ]  # "d" never reported
    entries = roster.roster(members, reports, 100.0, BOUNDS)
    states = {e.member: (e.state, e.configured) for e in entries}
    assert states == {
        "a": ("live", True),
        "b": ("live", True),
        "c": ("fenced", True),
        "d": ("never reported", True),
        "x": ("live", False),
    }
    reached = roster.rollout(entries, 7)
    assert not reached.complete
    assert reached.acknowledged == ["a"]
    assert reached.pending == {"b": 6, "d": None, "x": 6}
    assert reached.fenced == {"c": 92.0}
    held = roster.held_by(entries, "eu-west")
    assert held == {"a": "up", "b": "up", "c": "fenced", "d": "never reported", "x": "up"}


def test_silent_is_pending_until_the_fence_is_sure_and_never_fenced_without_a_bound() -> None:
    entries = roster.roster(frozenset({"a"}), [report("a", 100.0, 3)], 111.9, BOUNDS)
    assert entries[0].state == "silent" and roster.rollout(entries, 4).pending == {"a": 3}
    never = Bounds(5.0, 0.0, 2.0)  # fence_after_s 0: a node never fences
    entries = roster.roster(frozenset({"a"}), [report("a", 100.0, 3)], 10_000.0, never)
    assert entries[0].state == "silent" and roster.rollout(entries, 4).fenced == {}


def test_a_silent_member_that_had_it_still_has_it_and_workers_count_by_their_lowest() -> None:
    members = frozenset({"n"})
    workers = [report("n/w0", 100.0, 5, "n"), report("n/w1", 100.0, 4, "n")]
    assert not roster.rollout(roster.roster(members, workers, 100.0, BOUNDS), 5).complete
    workers[1] = report("n/w1", 100.0, 5, "n")
    assert roster.rollout(roster.roster(members, workers, 100.0, BOUNDS), 5).complete
    # Silent after acknowledging: sequences never go back on a node, so it holds it still.
    assert roster.rollout(roster.roster(members, workers, 500.0, BOUNDS), 5).complete


def test_without_a_membership_the_roster_is_the_live_nodes() -> None:
    reports = [report("a", 100.0, 2), report("b", 50.0, 1)]
    entries = roster.roster(frozenset(), reports, 100.0, BOUNDS)
    assert [e.member for e in entries] == ["a"]
    assert roster.rollout(entries, 2).complete
    assert not roster.rollout([], 2).complete  # nobody reported: nothing is confirmed
