"""Session and prefix affinity under a load bound: the pure ranking and pick, then the balancer
in front of simulated instances on loopback."""

from __future__ import annotations

from collections import Counter

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from regional_lb.balancing.affinity import key_of, prompt_prefix, rank
from regional_lb.balancing.instance import InstanceState, SpeedLearner
from regional_lb.balancing.pick import PickParams, PickRequest, pick
from tests.regional_lb.balancing.test_pick_properties import _spec_eligible, instance_st
from tests.regional_lb.conftest import balancer, balancer_config, chat, sim

PARAMS = PickParams(slow_start_s=10.0)
CHAT = "/v1/chat/completions"


def _pool(n: int = 4) -> list[InstanceState]:
    return [InstanceState(id=f"i{k}", speed=SpeedLearner(unit_speed=1.0)) for k in range(n)]


def _req(key: int | None, cost: float = 1.0) -> PickRequest:
    return PickRequest(model="m", cost=cost, mean_cost=1.0, affinity=key)


def test_keys_stick_and_spread_over_an_idle_pool() -> None:
    pool = _pool()
    homes = {}
    for k in range(200):
        key = key_of(f"session-{k}")
        first = pick(pool, _req(key), 100.0, PARAMS)
        again = pick(pool, _req(key), 100.0, PARAMS)
        assert first is not None and again is not None
        assert first.instance is again.instance
        homes[k] = first.instance.id
    spread = Counter(homes.values())
    assert set(spread) == {"i0", "i1", "i2", "i3"}
    assert min(spread.values()) >= 25  # 50 each on average: rendezvous hashing is even


def test_the_load_bound_moves_a_key_off_a_busy_instance_and_back() -> None:
    pool = _pool()
    key = key_of("conversation-7")
    choice = pick(pool, _req(key), 100.0, PARAMS)
    assert choice is not None
    home = choice.instance
    home.add(1, 30.0, 100.0)  # 30 s queued there, idle elsewhere: far past 1.25x the mean
    moved = pick(pool, _req(key), 100.0, PARAMS)
    assert moved is not None and moved.instance is not home
    for other in pool:  # everyone as busy: the key goes home again
        if other is not home:
            other.add(1, 30.0, 100.0)
    back = pick(pool, _req(key), 100.0, PARAMS)
    assert back is not None and back.instance is home


def test_removing_an_instance_moves_only_its_keys() -> None:
    pool = _pool(5)
    keys = [key_of(f"k{k}") for k in range(300)]
    before = {k: pick(pool, _req(k), 100.0, PARAMS).instance.id for k in keys}  # type: ignore[union-attr]
    pool[2].healthy = False
    after = {k: pick(pool, _req(k), 100.0, PARAMS).instance.id for k in keys}  # type: ignore[union-attr]
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "i2" for k in moved)


@settings(max_examples=300, deadline=None)
@given(st.lists(instance_st, max_size=8), st.integers(0, 2**64 - 1), st.floats(0.001, 30.0))
def test_affinity_stays_eligible_and_within_the_bound(
    pool: list[InstanceState], key: int, cost: float
) -> None:
    req = PickRequest(model="a", cost=cost, mean_cost=1.0, affinity=key)
    choice = pick(pool, req, 100.0, PARAMS)
    ok = [i for i in pool if _spec_eligible(i, req, 100.0)]
    if choice is None:
        assert ok == []
        return
    assert choice.instance in ok
    scores = [pick([i], req, 100.0, PARAMS).score for i in ok]  # type: ignore[union-attr]
    mean = sum(scores) / len(scores)
    # Within the bound, and the key's best-ranked instance among those that are.
    assert choice.score <= PARAMS.affinity_bound * mean + 1e-9
    under = [i for i, s in zip(ok, scores, strict=True) if s <= PARAMS.affinity_bound * mean + 1e-9]
    if len(ok) > 1:
        assert choice.instance is max(under, key=lambda i: rank(key, i.id))


def test_prompt_prefix_reads_what_the_model_reads_first() -> None:
    system = {"role": "system", "content": "You are a contracts assistant. " * 40}
    a = {"messages": [system, {"role": "user", "content": "clause 4?"}]}
    b = {"messages": [system, {"role": "user", "content": "clause 9?"}]}
    assert prompt_prefix(a, 256) == prompt_prefix(b, 256)  # the shared system prompt
    assert prompt_prefix(a, 4096) != prompt_prefix(b, 4096)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_prefix(parts, 64) == "user\x00hi\x00"
    assert prompt_prefix({"prompt": "once upon"}, 4) == "once"
    assert prompt_prefix({"prompt": ["first", "second"]}, 64) == "first"
    assert prompt_prefix({"input": "embed me"}, 64) == "embed me"
    assert prompt_prefix({"messages": []}, 64) is None
    assert prompt_prefix({"prompt": [1, 2, 3]}, 64) is None


async def test_sessions_stick_to_an_instance_through_the_balancer() -> None:
    # Stickiness, not the load bound (tested above with exact scores): scores through a live
    # balancer carry the speeds it learns from observed latencies and the probes in flight, and
    # on a loaded machine those alone pushed an idle instance past a 1.25x bound.
    affinity = {"mode": "session", "load_bound": 100.0}
    async with (
        sim() as (u1, _),
        sim() as (u2, _),
        sim() as (u3, _),
        balancer(balancer_config([u1, u2, u3], affinity=affinity)) as (url, pool),
        httpx.AsyncClient(base_url=url, timeout=10) as c,
    ):
        seen: dict[str, set[str]] = {}
        for _ in range(4):
            for session in ("alice", "bob", "carol", "dave", "erin", "frank"):
                r = await c.post(CHAT, json=chat(max_tokens=2), headers={"x-session-id": session})
                assert r.status_code == 200
                seen.setdefault(session, set()).add(r.headers["x-regional-instance"])
        assert all(len(instances) == 1 for instances in seen.values()), seen
        assert len({next(iter(s)) for s in seen.values()}) >= 2  # not one hot instance
        # The body's "user" field names the session when no header does.
        homes = set()
        for _ in range(3):
            r = await c.post(CHAT, json=chat(max_tokens=2, user="alice"))
            homes.add(r.headers["x-regional-instance"])
        assert len(homes) == 1
        assert all(i.in_flight == 0 for i in pool.instances)


async def test_a_shared_prompt_prefix_lands_on_one_instance() -> None:
    system = {"role": "system", "content": "Summarise the attached contract. " * 50}
    # As above: the bound is not what this test is about, and live scores carry noise.
    prefix_affinity = {"mode": "prefix", "prefix_chars": 512, "load_bound": 100.0}
    async with (
        sim() as (u1, _),
        sim() as (u2, _),
        balancer(balancer_config([u1, u2], affinity=prefix_affinity)) as (
            url,
            _,
        ),
        httpx.AsyncClient(base_url=url, timeout=10) as c,
    ):
        homes = set()
        for question in ("clause 1", "clause 2", "clause 3", "clause 4"):
            body = chat(max_tokens=2)
            body["messages"] = [system, {"role": "user", "content": question}]
            r = await c.post(CHAT, json=body)
            assert r.status_code == 200
            homes.add(r.headers["x-regional-instance"])
        assert len(homes) == 1
