"""The pick prices a prefix-cache hit as prefill the instance would not need: a hit wins while
it saves more than the extra work queued there, and load wins beyond."""

from __future__ import annotations

from regional_lb.balancing.instance import InstanceState
from regional_lb.balancing.kv_events import BlockStored, KvEventBatch
from regional_lb.balancing.kv_index import KvIndex, prefill_saved
from regional_lb.balancing.pick import PickParams, PickRequest, pick

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
