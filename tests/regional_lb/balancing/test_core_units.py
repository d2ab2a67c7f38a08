"""Cost estimator, admission, token buckets, capacity report signing, load signals, config."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from regional_lb.balancing.admission import (
    AdmissionController,
    PoolLoad,
    RetryBudget,
    TierSpec,
    TokenBucket,
    predicted_wait,
    retry_after_header,
)
from regional_lb.balancing.cost import (
    CostEstimator,
    ModelCoefficients,
    RequestShape,
    estimate_tokens,
)
from regional_lb.balancing.instance import SpeedLearner
from regional_lb.capacity_report import CapacityReport, ModelAvailability, sign, verify
from regional_lb.cli import app
from regional_lb.config import load_config, parse_config
from regional_lb.errors import ConfigError, Overloaded
from regional_lb.protocol.openai_io import parse_request
from regional_lb.upstream.load_signals import parse_metrics
from tests.conftest import ROOT

EXAMPLE = ROOT / "regional_lb" / "examples" / "eu-west.yaml"


def test_estimator_learns_output_ratio_and_error_spread() -> None:
    est = CostEstimator(coefficients={"m": ModelCoefficients(0.001, 0.02, 0.0)})
    shape = RequestShape("m", "chat", prompt_tokens=100, max_tokens=1000)
    before = est.estimate(shape)
    assert math.isclose(before, 0.1 + 0.02 * 500)  # prior: half of max_tokens
    rng = random.Random(1)
    for _ in range(400):  # clients get ~10% of max_tokens back
        est.observe(shape, est.estimate(shape), int(1000 * rng.uniform(0.08, 0.12)))
    after = est.estimate(shape)
    assert 0.1 + 0.02 * 80 < after < 0.1 + 0.02 * 120
    assert est.sigma < 0.3
    # While streaming: remaining work falls as tokens arrive, and never goes negative.
    assert est.remaining(shape, 0) > est.remaining(shape, 50) > 0
    assert est.remaining(shape, 999) >= 0 and est.remaining(shape, 1000) == 0


def test_estimate_tokens_from_characters_and_ids() -> None:
    assert estimate_tokens(400) == 100
    p = parse_request("completion", b'{"model": "m", "prompt": [1, 2, 3, 4, 5]}')
    assert p.shape.prompt_tokens == 5
    p = parse_request(
        "chat",
        b'{"model": "m", "messages": [{"role": "user", "content": "'
        + b"x" * 396
        + b'"}], "max_tokens": 7}',
    )
    assert p.shape.prompt_tokens == 100 and p.shape.max_tokens == 7


def test_speed_learner_finds_the_unit_speed_of_a_batching_instance() -> None:
    # 4 sequences at a time with penalty 0.2: each progresses at speed / 1.6.
    learner = SpeedLearner(unit_speed=1.0, slots=8, penalty=0.2)
    true_speed, now = 3.0, 0.0
    for _ in range(300):
        learner.busy(now, 4)
        now += 1.0
        learner.completed(now, true_speed * 4 / 1.6)
    assert math.isclose(learner.unit_speed, true_speed, rel_tol=0.05)
    assert learner.speed > learner.unit_speed  # a full batch drains faster than one sequence


def test_token_bucket() -> None:
    b = TokenBucket(rate=2.0, burst=2.0)
    assert b.take(0.0) == 0 and b.take(0.0) == 0
    assert math.isclose(b.take(0.0), 0.5)
    assert b.take(0.5) == 0


def test_retry_after_header_rounds_up() -> None:
    assert retry_after_header(0.1) == "1"
    assert retry_after_header(2.01) == "3"
    assert retry_after_header(math.inf) == "60"


def test_predicted_wait_counts_queue_and_excess() -> None:
    tier = TierSpec("standard", 1, 0.5)
    load = PoolLoad(slots=10, outstanding=20.0, capacity=4.0)
    # 6 running, 5 allowed: 2 over (with this one) -> 2/6 of the running work must finish.
    w = predicted_wait(tier, 6, queued_ahead_work=8.0, cost=2.0, load=load)
    assert math.isclose(w, (8.0 + 20.0 * 2 / 6 + 2.0) / 4.0)


async def test_top_tier_uses_reserved_capacity_lower_tiers_wait() -> None:
    tiers = {
        "realtime": TierSpec("realtime", 0, 1.0, queue_limit=10, queue_timeout_s=5),
        "batch": TierSpec("batch", 1, 0.5, queue_limit=10, queue_timeout_s=5),
    }
    ctl = AdmissionController(tiers, lambda: PoolLoad(slots=4, outstanding=4.0, capacity=4.0))
    await ctl.acquire("batch", 1.0)
    await ctl.acquire("batch", 1.0)
    waiting = asyncio.create_task(ctl.acquire("batch", 1.0))  # 2 of 4 is batch's limit
    await asyncio.sleep(0.01)
    assert not waiting.done() and ctl.depth()["batch"] == 1
    await ctl.acquire("realtime", 1.0)  # the reserved half is still there
    await ctl.acquire("realtime", 1.0)
    assert ctl.running == 4
    ctl.release()
    ctl.release()
    await asyncio.sleep(0.01)
    assert not waiting.done()  # 2 running: batch is still at its limit
    ctl.release()  # 1 running: under the limit, the waiter starts
    await asyncio.wait_for(waiting, 1)
    assert ctl.running == 2 and ctl.depth()["batch"] == 0


async def test_a_client_gone_as_its_slot_is_granted_gives_the_slot_back() -> None:
    # The queued request's client leaves in the same instant a completion grants it the slot
    # (Python 3.11's wait_for would return normally and swallow the cancellation).
    tiers = {"s": TierSpec("s", 0, 1.0, queue_limit=5, queue_timeout_s=5)}
    ctl = AdmissionController(tiers, lambda: PoolLoad(slots=2, outstanding=1.0, capacity=1.0))
    await ctl.acquire("s", 1.0)
    await ctl.acquire("s", 1.0)
    waiter = asyncio.create_task(ctl.acquire("s", 1.0))
    await asyncio.sleep(0.01)
    assert ctl.depth()["s"] == 1
    ctl.release()  # one of the two finishes: the waiter is granted its slot...
    waiter.cancel()  # ...as its client goes away
    (result,) = await asyncio.gather(waiter, return_exceptions=True)
    assert isinstance(result, asyncio.CancelledError)
    assert ctl.running == 1 and ctl.depth()["s"] == 0


async def test_queue_full_and_predicted_timeout_are_429s_with_retry_after() -> None:
    tiers = {"s": TierSpec("s", 0, 1.0, queue_limit=1, queue_timeout_s=2.0)}
    ctl = AdmissionController(tiers, lambda: PoolLoad(slots=1, outstanding=1.0, capacity=1.0))
    await ctl.acquire("s", 1.0)
    queued = asyncio.create_task(ctl.acquire("s", 0.5))
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded) as full:
        await ctl.acquire("s", 0.5)
    assert full.value.retry_after > 0
    queued.cancel()  # a client that leaves the queue takes nothing with it
    await asyncio.gather(queued, return_exceptions=True)
    assert ctl.depth()["s"] == 0 and ctl.running == 1
    ctl.release()
    assert ctl.running == 0


async def test_retry_after_is_the_drain_time_of_the_line_and_refusals_spread() -> None:
    # Premise changed with issue 19: Retry-After is when a slot would be free for the refused
    # request (its place in line x the time a slot is held / the slots), not a constant.
    tiers = {"s": TierSpec("s", 0, 1.0, queue_limit=5, queue_timeout_s=2.0)}
    load = PoolLoad(slots=1, outstanding=1.0, capacity=1.0, service_s_hint=1.5)
    now = [0.0]
    ctl = AdmissionController(tiers, lambda: load, clock=lambda: now[0])
    await ctl.acquire("s", 1.0)
    queued = asyncio.create_task(ctl.acquire("s", 1.0))  # 0.75 s predicted: it waits
    await asyncio.sleep(0.01)
    assert ctl.depth()["s"] == 1
    refusals = []
    for _ in range(3):  # second, third and fourth in line: past the 2 s timeout
        with pytest.raises(Overloaded) as slow:
            await ctl.acquire("s", 1.0)
        refusals.append(slow.value.retry_after)
    # 1.5 releases (half of one already gone), then 2.5, 3.5: each refusal promised a
    # return, and the next refused request is told to come after it.
    assert refusals == pytest.approx([1.5 * 1.5, 2.5 * 1.5, 3.5 * 1.5])
    now[0] = 10.0  # the promises are due: the backlog they stood for is gone
    with pytest.raises(Overloaded) as later:
        await ctl.acquire("s", 1.0)
    assert later.value.retry_after == pytest.approx(1.5 * 1.5)
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)


async def test_retry_after_learns_how_long_slots_are_held_and_jitters() -> None:
    tiers = {"s": TierSpec("s", 0, 1.0, queue_limit=0, queue_timeout_s=1.0)}
    now = [0.0]
    ctl = AdmissionController(
        tiers,
        lambda: PoolLoad(slots=2, outstanding=0.0, capacity=1.0),
        clock=lambda: now[0],
        jitter=0.2,
    )
    for _ in range(4):  # slots held 4 s each, observed
        a, b = await ctl.acquire("s", 1.0), await ctl.acquire("s", 1.0)
        now[0] += 4.0
        ctl.release(a)
        ctl.release(b)
    assert ctl.service_s == pytest.approx(4.0)
    await ctl.acquire("s", 1.0)
    await ctl.acquire("s", 1.0)
    told = []
    for _ in range(20):
        with pytest.raises(Overloaded) as full:
            await ctl.acquire("s", 1.0)
        told.append(full.value.retry_after)
        ctl.promised.clear()  # the same place in line every time: only the jitter differs
    assert all(0.8 * 1.0 <= t <= 1.2 * 1.0 for t in told)  # half of one 4 s slot over 2 slots
    assert len(set(told)) > 10


def test_retry_budget_bounds_balancer_retries() -> None:
    budget = RetryBudget(ratio=0.25, min_per_s=0.0)
    for _ in range(20):
        budget.deposit(0.0)
    granted = sum(budget.withdraw(0.0) for _ in range(100))
    assert granted == 5  # a quarter of the 20 requests received


def test_capacity_report_sign_and_verify() -> None:
    report = CapacityReport(
        region="r",
        seq=1,
        ts=1.0,
        instances_healthy=1,
        instances_total=2,
        capacity=3.0,
        outstanding=1.0,
        utilisation=0.5,
        queue_depth={"standard": 0},
        models=[ModelAvailability(name="m", versions=["m-v2"])],
        draining=False,
        can_take_work=True,
    )
    body = report.model_dump_json().encode()
    sig = sign(body, b"k")
    assert sig.startswith("sha256=") and len(sig) == 7 + 64
    assert verify(body, sig, b"k")
    assert not verify(body + b" ", sig, b"k")
    assert not verify(body, sig, b"other")
    assert not verify(body, sig.removeprefix("sha256="), b"k")
    assert CapacityReport.model_validate_json(body) == report


def test_load_signals_vllm_tgi_and_percentages() -> None:
    vllm = (
        'vllm:num_requests_running{model_name="a"} 2\n'
        'vllm:num_requests_running{model_name="b"} 1\n'
        'vllm:num_requests_waiting{model_name="a"} 4\n'
        'vllm:gpu_cache_usage_perc{model_name="a"} 0.7\n'
    )
    s = parse_metrics(vllm, at=10.0)
    assert (s.running, s.waiting, s.kv_usage) == (3, 4, 0.7)
    assert s.fresh(12.0, 3.0) and not s.fresh(14.0, 3.0)
    tgi = "tgi_batch_current_size 5\ntgi_queue_size 1\n"
    assert (parse_metrics(tgi, 0, "tgi").running, parse_metrics(tgi, 0, "tgi").waiting) == (5, 1)
    assert parse_metrics(tgi, 0, "vllm").running is None  # each kind reads its own names
    pct = "vllm:kv_cache_usage_perc 85\n"
    assert parse_metrics(pct, 0).kv_usage == 0.85
    assert parse_metrics("other_metric 1\n", 0).running is None


def test_example_config_loads_and_bad_config_lists_every_problem(tmp_path: Path) -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.region == "eu-west" and len(cfg.instances) == 4
    assert all(i.url.startswith("http://127.0.0.1:") for i in cfg.instances)
    with pytest.raises(ConfigError) as exc:
        parse_config(
            {
                "region": "",
                "instances": [{"id": "a", "url": "ftp://x", "gpu": "Z80"}],
                "tiers": [{"name": "t", "max_utilisation": 3}],
            },
            "f.yaml",
        )
    text = "\n".join(exc.value.problems)
    assert "region" in text and "instances.0.url" in text and "tiers.0.max_utilisation" in text
    with pytest.raises(ConfigError) as exc:
        parse_config({"region": "r", "instances": [{"id": "a", "url": "http://x", "gpu": "Z80"}]})
    assert "Z80" in str(exc.value)
    bad = tmp_path / "bad.yaml"
    bad.write_text("region: r\ninstances: []\ndefault_tier: nope\n")
    result = CliRunner().invoke(app, ["check", "--config", str(bad)])
    assert result.exit_code == 2 and "instances" in result.output
    result = CliRunner().invoke(app, ["check", "--config", str(EXAMPLE)])
    assert result.exit_code == 0 and "eu-west" in result.output


def test_pool_canary_share_tiers_and_known_models() -> None:
    from regional_lb.upstream.pool import Pool

    cfg = parse_config(
        {
            "region": "r",
            "instances": [{"id": "a", "url": "http://127.0.0.1:1", "models": ["m", "m-v2"]}],
            "models": {
                "m": {"versions": [{"name": "m", "weight": 90}, {"name": "m-v2", "weight": 10}]}
            },
            "tenants": {"acme": {"tier": "realtime"}},
        }
    )
    pool = Pool(cfg)
    picks = [pool.resolve_model("m") for _ in range(2000)]
    assert 0.07 < picks.count("m-v2") / len(picks) < 0.13
    assert pool.resolve_model("other") == "other"
    acme = pool.config.tenants["acme"]
    assert pool.tier_for(None, acme) == "realtime"
    assert pool.tier_for("batch", acme) == "batch"  # a tenant may ask for less
    assert pool.tier_for(None, pool.config.default_tenant) == "standard"
    # ...never for more: the header cannot raise a tier (rule 6).
    assert pool.tier_for("realtime", pool.config.default_tenant) == "standard"
    assert pool.known_model("m-v2") and not pool.known_model("zzz")
    report = pool.capacity_report(1)
    assert report.models[0].name == "m" and report.models[0].versions == ["m", "m-v2"]


def test_busy_not_stuck_gives_a_busy_instance_a_request_s_patience() -> None:
    from regional_lb.balancing.health import busy_not_stuck
    from regional_lb.balancing.instance import InstanceState

    inst = InstanceState(id="i0")
    assert not busy_not_stuck(inst, 100.0, 10.0)  # nothing in flight: a silent model is down
    inst.add(1, 1.0, now=50.0)
    assert not busy_not_stuck(inst, 100.0, 10.0)  # waiting 50 s with no sign of work
    inst.progress_at = 95.0
    assert busy_not_stuck(inst, 100.0, 10.0)  # a token 5 s ago: busy
    inst.add(2, 1.0, now=99.0)
    assert busy_not_stuck(inst, 111.0, 10.0) is False  # progress 16 s ago, oldest 61 s
    inst.release(1, 111.0)
    assert busy_not_stuck(inst, 105.0, 10.0)  # the only request is 6 s old: not overdue
