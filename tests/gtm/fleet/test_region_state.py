"""Region state in force: quorum of fresh observations, operator overrides, re-admission."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gtm.decision.snapshot import HealthState
from gtm.fleet.region_state import (
    Force,
    Observation,
    Override,
    RegionBook,
    admitted_share,
    agree,
    in_force,
)

UP, DOWN, DRAINING, UNKNOWN = (
    HealthState.UP,
    HealthState.DOWN,
    HealthState.DRAINING,
    HealthState.UNKNOWN,
)
NOW = 1000.0


def obs(node: str, state: HealthState, age: float = 0.0, region: str = "r1") -> Observation:
    return Observation(node, region, state, NOW - 100, NOW - age)


def test_a_quorum_of_fresh_observations_decides() -> None:
    votes = [obs("a", DOWN), obs("b", DOWN), obs("c", UP)]
    assert agree(votes, NOW, 3.0, 2, UP) is DOWN
    # One voice against the previous state is not a quorum of two.
    assert agree([obs("a", DOWN), obs("b", UP), obs("c", DRAINING)], NOW, 3.0, 2, UP) is UP


def test_stale_and_unknown_observations_do_not_vote() -> None:
    votes = [obs("a", DOWN, age=10), obs("b", DOWN, age=10), obs("c", UP), obs("d", UNKNOWN)]
    assert agree(votes, NOW, 3.0, 2, DOWN) is UP  # c is alone and fresh: it decides
    assert agree([obs("a", DOWN, age=10)], NOW, 3.0, 1, UP) is UP  # nothing fresh: unchanged


def test_a_node_left_alone_decides_by_itself() -> None:
    assert agree([obs("a", DOWN), obs("b", UP, age=60)], NOW, 3.0, 2, UP) is DOWN


def test_with_a_configured_membership_a_majority_of_it_decides() -> None:
    two = frozenset({"a", "b"})
    # Quorum 2 on two nodes while b restarts: a alone does not move the fleet (it did without
    # a membership: the quorum shrank to the one node alive).
    assert agree([obs("a", DOWN), obs("b", UP, age=60)], NOW, 3.0, 2, UP, two) is UP
    assert agree([obs("a", DOWN), obs("b", DOWN)], NOW, 3.0, 2, UP, two) is DOWN
    three = frozenset({"a", "b", "c"})
    # A majority of three is two, even with health_quorum 1; one node with a bad probe path
    # cannot move the fleet, and a node outside the membership has no vote at all.
    assert agree([obs("a", DOWN), obs("b", UP), obs("c", UP)], NOW, 3.0, 1, UP, three) is UP
    assert agree([obs("a", DOWN)], NOW, 3.0, 1, UP, three) is UP
    assert agree([obs("a", DOWN), obs("x", DOWN)], NOW, 3.0, 1, UP, three) is UP
    assert agree([obs("a", DOWN), obs("c", DOWN)], NOW, 3.0, 1, UP, three) is DOWN
    # One of three away: the other two still decide.
    assert (
        agree([obs("a", DOWN), obs("b", DOWN, age=60), obs("c", DOWN)], NOW, 3.0, 1, UP, three)
        is DOWN
    )


def test_ties_keep_the_previous_state_else_the_cautious_one() -> None:
    tie = [obs("a", DOWN), obs("b", UP)]
    assert agree(tie, NOW, 3.0, 1, UP) is UP
    assert agree(tie, NOW, 3.0, 1, DOWN) is DOWN
    assert agree(tie, NOW, 3.0, 1, UNKNOWN) is DOWN


@given(
    st.lists(st.sampled_from([UP, DOWN, DRAINING, UNKNOWN]), max_size=7),
    st.integers(1, 5),
    st.sampled_from([UP, DOWN, DRAINING, UNKNOWN]),
)
def test_agreement_is_a_state_some_fresh_node_holds_or_the_previous(
    states: list[HealthState], quorum: int, previous: HealthState
) -> None:
    votes = [obs(f"n{i}", s) for i, s in enumerate(states)]
    result = agree(votes, NOW, 3.0, quorum, previous)
    assert result is previous or result in states
    if result is not previous:
        assert states.count(result) >= min(quorum, sum(s is not UNKNOWN for s in states))


def test_overrides_rank_force_down_then_drain_then_force_up() -> None:
    both = Override("r1", drain=True, force=Force.UP, actor="ops", reason="x")
    assert in_force(UP, both)[0] is DRAINING
    assert in_force(UP, Override("r1", drain=True, force=Force.DOWN))[0] is DOWN
    state, detail = in_force(DOWN, Override("r1", force=Force.UP, actor="ops", reason="probe bug"))
    assert state is UP and detail == "forced up by ops: probe bug"
    assert in_force(DOWN, Override("r1", weight=2.0)) == (DOWN, "")


def test_parts_of_an_override_lapse_on_their_own() -> None:
    o = Override("r1", drain=True, weight=0.5, force=Force.DOWN, force_until=10, expires_at=20)
    assert o.effective(5) is o
    later = o.effective(15)
    assert later is not None and later.force is None and later.drain and later.weight == 0.5
    assert o.effective(25) is None
    assert Override("r1", drain=True).effective(1e12) is not None  # no expiry: until cleared


def test_readmission_ramps_linearly() -> None:
    assert [admitted_share(100, t, 10) for t in (100, 105, 110, 200)] == [0.0, 0.5, 1.0, 1.0]
    assert admitted_share(100, 100, 0) == 1.0


def book(**kwargs: object) -> RegionBook:
    return RegionBook("a", ("r1", "r2"), readmit_window_s=10.0, **kwargs)  # type: ignore[arg-type]


def test_book_records_changes_in_force_and_ramps_a_recovered_region() -> None:
    b = book()
    b.observe(Observation("a", "r1", UP, 0, 0))
    first = b.compose(0)
    assert first.health["r1"].state is UP and first.health["r1"].admitted == 1.0  # cold start
    assert [(e.region, e.state, e.previous) for e in first.events] == [("r1", UP, UNKNOWN)]
    b.observe(Observation("a", "r1", DOWN, 1, 1))
    assert b.compose(1).health["r1"].state is DOWN
    b.observe(Observation("a", "r1", UP, 2, 2))
    back = b.compose(2)
    assert back.health["r1"].state is UP and back.health["r1"].admitted == 0.0 and back.ramping
    b.observe(Observation("a", "r1", UP, 2, 7))
    assert b.compose(7).health["r1"].admitted == 0.5
    b.observe(Observation("a", "r1", UP, 2, 12))
    done = b.compose(12)
    assert done.health["r1"].admitted == 1.0 and not done.ramping and not done.events


def test_book_notes_a_lapsed_override_once_and_applies_weights() -> None:
    b = book()
    o = Override("r2", weight=3.0, force=Force.DOWN, force_until=5, actor="ops", reason="x")
    b.set_overrides([o])
    c = b.compose(1)
    assert c.health["r2"].state is DOWN and c.weights == {"r2": 3.0}
    b.set_overrides([o])  # the same row read again from the database
    lapsed = b.compose(6)
    assert [e.detail for e in lapsed.events if e.kind == "override"] == [
        "lapsed: forced down, weight 3 -> weight 3"
    ]
    assert lapsed.health["r2"].state is UNKNOWN and lapsed.weights == {"r2": 3.0}
    b.set_overrides([o])
    assert not [e for e in b.compose(7).events if e.kind == "override"]


def test_worker_processes_of_one_node_are_one_vote() -> None:
    from gtm.node import worker_settings
    from gtm.settings import Settings

    base = Settings(node_id="gtm-1")
    workers = [worker_settings(base, i) for i in range(3)]
    assert {w.node_id for w in workers} == {"gtm-1/w0", "gtm-1/w1", "gtm-1/w2"}
    assert {w.observer_id for w in workers} == {"gtm-1"}
    # Their observations share one key, so three workers saying "down" are one vote.
    b = RegionBook("gtm-2", ("r1",), quorum=2)
    b.observe(Observation("gtm-2", "r1", UP, 0, 0))
    b.compose(0)
    for _ in workers:
        b.observe(Observation("gtm-1", "r1", DOWN, 1, 1))
    b.observe(Observation("gtm-3", "r1", UP, 1, 1))
    assert b.compose(1).health["r1"].state is UP
