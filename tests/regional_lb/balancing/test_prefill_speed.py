"""An instance's prefill speed is learned from its prompts, apart from its batched speed.

A server prefills prompts one after another (vLLM fills each step's token budget with the
oldest prompts first), so prompt prefill is done at gain 1 whatever the batch. The batched
learner (:class:`SpeedLearner`) counts every busy second at the gain of the batch in flight;
credited with prompts finished under a busy batch it learns a single-sequence speed far below
the GPU's, and the pick, dividing queued prompts by it, overpriced them on the busy instance
(on the Mooncake trace: 0.16-0.75 learned for GPUs of speed 1.0, queued prompts overpriced by
2.4 s on average, P90 time to first token 3.72 s instead of 3.35 s).
"""

from __future__ import annotations

import pytest

from regional_lb.balancing.instance import InstanceState, SpeedLearner
from regional_lb.balancing.pick import PickParams, PickRequest, pick

PARAMS = PickParams(slow_start_s=0.0)
PROMPT_S = 1.0  # reference seconds of prefill per prompt
DECODE_S = 0.1  # reference seconds of decode per prompt's request


def _gpu(iid: str) -> InstanceState:
    return InstanceState(
        id=iid, speed=SpeedLearner(unit_speed=1.0, slots=64, penalty=0.02), max_concurrency=1000
    )


def _history(inst: InstanceState, prompts: int, true_speed: float, decoders: int) -> float:
    """``prompts`` prompts prefilled back to back at ``true_speed`` (each routed half a prompt
    before the one ahead of it is done, so one always waits), while ``decoders`` long
    requests decode alongside (cancelled at the end: what they did is not credited). Returns
    the time it ends."""
    dur = PROMPT_S / true_speed
    events: list[tuple[float, int, int]] = []  # (time, order, request): 0 add, 1 first, 2 end
    for k in range(prompts):
        events.append((max(0.0, (k - 0.5) * dur), 0, k))
        events.append(((k + 1) * dur, 1, k))
        events.append(((k + 1) * dur + 0.05, 2, k))
    for d in range(decoders):
        inst.add(10_000 + d, 50.0, 0.0, model="m")
    for t, kind, k in sorted(events):
        if kind == 0:
            inst.add(k, PROMPT_S + DECODE_S, t, model="m", prefill=PROMPT_S)
        elif kind == 1:
            inst.first_token(k, t)
        else:
            inst.release(k, t, actual_cost=PROMPT_S + DECODE_S)
    end = prompts * dur + 1.0
    for d in range(decoders):
        inst.release(10_000 + d, end)
    return end


@pytest.mark.parametrize("true_speed", [1.0, 0.5])
def test_the_prefill_speed_is_the_prompts_own_under_a_busy_batch(true_speed: float) -> None:
    inst = _gpu("a")
    _history(inst, prompts=100, true_speed=true_speed, decoders=40)
    # The prompts' own rate (a throttled GPU's too), within the declared prior's pull.
    assert inst.prefill_speed == pytest.approx(true_speed, rel=0.06)
    assert inst.split_speeds() == (inst.prefill_speed * inst.speed.gain, inst.prefill_speed)
    # What the batched learner made of the same history: nowhere near it.
    assert inst.speed.unit_speed < 0.5 * true_speed


def test_without_split_prompts_the_speeds_are_the_batched_learners() -> None:
    inst = _gpu("a")
    inst.add(1, 3.0, 0.0, model="m")  # no prefill split: nothing to learn a prefill speed from
    inst.release(1, 2.0, actual_cost=3.0)
    assert inst.prefill_speed == inst.speed.unit_speed
    assert inst.split_speeds() == (inst.speed.speed, inst.speed.unit_speed)


def test_queued_prompts_are_priced_at_the_learned_prefill_speed() -> None:
    # Two identical GPUs. ``busy`` prefilled its prompts beside a batch of 40 long decodes,
    # ``quiet`` alone; both did them at speed 1.0. Now ``busy`` has 1 s of prompt queued,
    # ``quiet`` 1.5 s: the next first token comes sooner on ``busy``. Priced at the batched
    # learner's speed, ``busy``'s second looked like more than two.
    busy, quiet = _gpu("busy"), _gpu("quiet")
    now = max(_history(busy, 60, 1.0, decoders=40), _history(quiet, 60, 1.0, decoders=0))
    busy.add(500, 1.0 + DECODE_S, now, model="m", prefill=1.0)
    quiet.add(500, 1.5 + DECODE_S, now, model="m", prefill=1.5)
    req = PickRequest(
        model="m", cost=PROMPT_S + DECODE_S, mean_cost=1.0, prefill=PROMPT_S, tiebreak=1
    )
    choice = pick([quiet, busy], req, now, PARAMS)
    assert choice is not None and choice.instance.id == "busy"


def test_answers_not_streamed_still_count_their_prompts() -> None:
    # No first token is ever seen: each prompt's prefill is credited when it completes, so the
    # time it was pending does not read as an instance that never prefills anything.
    inst = _gpu("a")
    for k in range(50):
        inst.add(k, PROMPT_S + DECODE_S, 2.0 * k, model="m", prefill=PROMPT_S)
        inst.release(k, 2.0 * k + PROMPT_S + DECODE_S, actual_cost=PROMPT_S + DECODE_S)
    # Pending until the answer, decode included: a little under the true 1.0.
    assert inst.prefill_speed == pytest.approx(PROMPT_S / (PROMPT_S + DECODE_S), rel=0.05)
