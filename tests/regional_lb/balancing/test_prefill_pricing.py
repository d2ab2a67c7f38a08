"""Queued prompts are priced as the serial prefill they are, in the same seconds as a cache hit.

A server prefills one prompt after another at its single-sequence speed; a second of prompt
queued on an instance delays the next first token there by a second, whatever the batch size.
The pick used to divide it by the full-batch speed (~28x on a 64-slot GPU), so a small cache
hit outweighed many seconds of queued prompts and requests piled up behind them.
"""

from __future__ import annotations

import pytest

from regional_lb.balancing.instance import InstanceState, SpeedLearner
from regional_lb.balancing.kv_events import BlockStored, KvEventBatch
from regional_lb.balancing.kv_index import KvIndex, prefill_saved
from regional_lb.balancing.pick import PickParams, PickRequest, pick

PARAMS = PickParams(slow_start_s=0.0)
PREFILL = 0.0002  # reference seconds per prompt token
PROMPT = 8_000  # tokens: 500 blocks of 16, 1.6 s of prefill on a speed-1.0 GPU
HASHES = list(range(1, 501))
DECODE = 2.0  # reference seconds of this request's decode


def _gpu(iid: str) -> InstanceState:
    # A 64-slot GPU: full-batch speed ~28x its single-sequence speed.
    return InstanceState(id=iid, speed=SpeedLearner(unit_speed=1.0, slots=64, penalty=0.02))


def _pool(queued_prompt_s: float) -> tuple[list[InstanceState], KvIndex]:
    """``a`` holds the request's whole prompt in its cache and has a prompt of
    ``queued_prompt_s`` seconds queued (routed at t=0, no first token yet); ``b`` is idle."""
    a, b = _gpu("a"), _gpu("b")
    a.add(1, queued_prompt_s + 0.5, 0.0, model="m", prefill=queued_prompt_s)
    b.loaded["m"] = 0.0
    index = KvIndex(block_size=16)
    for iid in ("a", "b"):
        index.track(iid)
    index.apply("a", 0, KvEventBatch(0.0, (BlockStored(tuple(HASHES), None, (), 16),)), 0.0)
    return [a, b], index


def _choose(instances: list[InstanceState], index: KvIndex, now: float = 0.0) -> str:
    ids = [i.id for i in instances]
    req = PickRequest(
        model="m",
        cost=PROMPT * PREFILL + DECODE,
        mean_cost=2.0,
        prefill_saved=prefill_saved(index, ids, HASHES, PROMPT, PREFILL),
        prefill=PROMPT * PREFILL,
        tiebreak=1,
    )
    choice = pick(instances, req, now, PARAMS)
    assert choice is not None
    return choice.instance.id


def test_queued_prompts_outweigh_a_smaller_cache_hit() -> None:
    # The hit saves 1.6 s (less the last block, recomputed); 3 s of prompt is queued there:
    # the first token comes ~1.4 s sooner on the idle instance. The old pick counted the 3 s
    # at full-batch speed (~0.1 s) and sent the request behind it.
    instances, index = _pool(queued_prompt_s=3.0)
    assert _choose(instances, index) == "b"


def test_a_cache_hit_outweighs_less_queued_prompt_than_it_saves() -> None:
    instances, index = _pool(queued_prompt_s=1.0)
    assert _choose(instances, index) == "a"


def test_the_queued_prompt_drains_at_the_single_sequence_speed() -> None:
    # 3 s of prompt queued at t=0: by t=2.5 about 0.5 s is left, less than the hit saves.
    instances, index = _pool(queued_prompt_s=3.0)
    assert instances[0].prefill_backlog(2.5) == pytest.approx(0.5)
    assert _choose(instances, index, now=2.5) == "a"


def test_the_first_token_ends_the_prompt_and_its_price() -> None:
    a = _gpu("a")
    a.add(1, 3.5, 0.0, prefill=3.0)
    a.add(2, 1.2, 0.0, prefill=1.0)
    assert a.pending_prefill == pytest.approx(4.0) and a.outstanding == pytest.approx(4.7)
    a.first_token(1, 3.0)  # its prompt is done; what is left is its decode
    assert a.pending_prefill == pytest.approx(1.0) and a.outstanding == pytest.approx(1.7)
    assert a.prefill_backlog(3.0) == pytest.approx(1.0)  # the next prompt starts now
    a.first_token(1, 3.5)  # a second first token changes nothing
    assert a.pending_prefill == pytest.approx(1.0)
    a.release(2, 3.6)  # cancelled before its first token: its prompt goes with it
    assert a.pending_prefill == pytest.approx(0.0) and a.outstanding == pytest.approx(0.5)
    a.release(1, 4.0, actual_cost=3.5)
    assert a.pending_prefill == 0.0 and a.outstanding == 0.0


def test_a_prefill_share_is_clamped_to_the_cost() -> None:
    a = _gpu("a")
    a.add(1, 1.0, 0.0, prefill=5.0)
    a.add(2, 1.0, 0.0, prefill=float("nan"))
    a.add(3, 1.0, 0.0, prefill=-1.0)
    assert a.pending_prefill == pytest.approx(1.0)
    a.update_remaining(1, 0.25, 0)  # the estimate of what is left shrank below the prompt
    assert a.pending_prefill == pytest.approx(0.25)
    a.recompute()
    assert a.pending_prefill == pytest.approx(0.25)


def test_without_the_split_the_score_is_the_old_one() -> None:
    # A caller that does not split its cost (prefill None) gets the score it always got:
    # everything at full-batch speed, the hit subtracted at the single-sequence speed.
    a, b = _gpu("a"), _gpu("b")
    a.add(1, 3.5, 0.0, model="m")
    b.add(2, 0.7, 0.0, model="m")
    req = PickRequest(model="m", cost=3.6, mean_cost=2.0, prefill_saved={"a": 1.0}, tiebreak=1)
    choice = pick([a, b], req, 0.0, PARAMS)
    assert choice is not None and choice.instance.id == "a"
    speed = a.speed.speed
    assert choice.score == pytest.approx((3.5 + 3.6) / speed - 1.0)
