"""The pick prices a prefix-cache hit as prefill the instance would not need: a hit wins while
it saves more than the extra work queued there, and load wins beyond."""

from __future__ import annotations

from typing import TYPE_CHECKING

from regional_lb.balancing.instance import InstanceState
from regional_lb.balancing.kv_events import BlockStored, KvEventBatch
from regional_lb.balancing.kv_index import KvIndex, prefill_saved
from regional_lb.balancing.pick import PickParams, PickRequest, pick

if TYPE_CHECKING:
    from regional_lb.upstream.pool import Pool

PARAMS = PickParams(slow_start_s=0.0)
PREFILL = 0.0002  # reference seconds per prompt token
PROMPT = 8_000  # tokens: 500 blocks, 1.6 s of prefill
HASHES = list(range(1, 501))


def _pool(queued_on_cached: float) -> tuple[list[InstanceState], KvIndex]:
    a, b = InstanceState(id="a"), InstanceState(id="b")
    a.add(1, queued_on_cached, 0.0)
    index = KvIndex(block_size=16)
    for iid in ("a", "b"):
        index.track(iid)
    index.apply("a", 0, KvEventBatch(0.0, (BlockStored(tuple(HASHES), None, (), 16),)), 0.0)
    return [a, b], index


def _choose(instances: list[InstanceState], index: KvIndex | None) -> str:
    saved = (
        prefill_saved(index, [i.id for i in instances], HASHES, PROMPT, PREFILL) if index else None
    )
    req = PickRequest(
        model="m", cost=PROMPT * PREFILL + 0.5, mean_cost=2.0, prefill_saved=saved, tiebreak=1
    )
    choice = pick(instances, req, 0.0, PARAMS)
    assert choice is not None
    return choice.instance.id


def test_a_cache_hit_outweighs_a_little_queued_work() -> None:
    instances, index = _pool(queued_on_cached=1.0)  # less than the 1.6 s of prefill it saves
    assert _choose(instances, None) == "b"  # without the index: least work
    assert _choose(instances, index) == "a"


def test_load_wins_when_the_cached_instance_is_busier_than_the_hit_is_worth() -> None:
    instances, index = _pool(queued_on_cached=3.0)
    assert _choose(instances, index) == "b"


def test_a_forgotten_instance_gets_no_credit() -> None:
    instances, index = _pool(queued_on_cached=1.0)
    index.forget("a")  # it failed or drains
    assert _choose(instances, index) == "b"


def _indexed_pool() -> tuple[Pool, KvIndex]:
    """Two instances, a and b, serving model m, with a KV index tracking both."""
    from regional_lb.config import parse_config
    from regional_lb.upstream.pool import Pool

    cfg = parse_config(
        {
            "region": "r",
            "instances": [
                {"id": iid, "url": "http://127.0.0.1:1", "models": ["m"]} for iid in ("a", "b")
            ],
        }
    )
    pool = Pool(cfg, clock=lambda: 100.0)
    index = pool.kv_index = KvIndex(block_size=16)
    for iid in ("a", "b"):
        index.track(iid)
    return pool, index


def test_the_pool_routes_to_the_cache_and_forgets_an_instance_out_of_service() -> None:
    from regional_lb.balancing.cost import RequestShape

    pool, index = _indexed_pool()
    index.apply("b", 0, KvEventBatch(0.0, (BlockStored(tuple(HASHES), None, (), 16),)), 0.0)
    shape = RequestShape("m", "chat", prompt_tokens=PROMPT, max_tokens=100)
    cost = pool.estimate(shape)
    firsts = set()
    for _ in range(4):  # without blocks the tie-break spreads requests over both
        cost = pool.estimate(shape)  # (each estimate turns the tie-break)
        lease = pool.route(shape, cost)
        firsts.add(lease.instance.id)
        lease.end("cancelled")
    assert firsts == {"a", "b"}
    for _ in range(4):  # with them, the instance holding the prompt wins every time
        cost = pool.estimate(shape)
        lease = pool.route(shape, cost, blocks=HASHES)
        assert lease.instance.id == "b"
        # ...and is charged only the prefill it still has to do.
        assert lease.instance.outstanding < cost
        lease.end("cancelled")
    pool.by_id("b").healthy = False
    lease = pool.route(shape, cost, blocks=HASHES)
    assert lease.instance.id == "a" and index.blocks_held("b") == 0


def test_the_pool_prices_prompts_queued_on_the_cached_instance_second_for_second() -> None:
    """Through Pool.route: prompts queued on the instance holding the prefix cost it their
    prefill at the single-sequence speed. Before the pool split its cost, that queue was divided
    by the full-batch speed and a 0.8 s hit outweighed about 8 s of prompts waiting there."""
    from regional_lb.balancing.cost import RequestShape

    pool, index = _indexed_pool()
    cached = HASHES[:250]  # half the prompt's blocks
    index.apply("b", 0, KvEventBatch(0.0, (BlockStored(tuple(cached), None, (), 16),)), 0.0)
    shape = RequestShape("m", "chat", prompt_tokens=PROMPT, max_tokens=1)
    per_token = pool.estimator.coeffs("m").prefill_per_token
    saved = pool.prefill_saved(shape, HASHES)["b"]
    # Prompts with nothing cached anywhere queue on b (a out of service meanwhile) until they
    # outweigh the hit there three times over.
    pool.by_id("a").healthy = False
    other = RequestShape("m", "chat", prompt_tokens=PROMPT, max_tokens=1)
    while pool.by_id("b").pending_prefill <= 3 * saved:
        lease = pool.route(other, pool.estimate(other), blocks=[10_000 + pool.by_id("b").in_flight])
        assert lease.instance.id == "b"
    pool.by_id("a").healthy = True
    assert per_token * PROMPT > saved > 0  # a partial hit, smaller than the whole prompt
    lease = pool.route(shape, pool.estimate(shape), blocks=HASHES)
    assert lease.instance.id == "a"
