"""Online cost coefficients: the pure fit (converges, stays sane, shrugs off outliers), the
timing the instances hand it, and the whole loop through the proxy against simulated
instances on loopback."""

from __future__ import annotations

import asyncio
import math
import random
import time

import httpx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from regional_lb.balancing.cost import (
    CoefficientFit,
    CostEstimator,
    LearnParams,
    ModelCoefficients,
    RequestShape,
    TimingSample,
)
from regional_lb.balancing.gpus import batch_slowdown
from regional_lb.balancing.instance import InstanceState, SpeedLearner, speed_anchor, timing_speed
from tests.regional_lb.conftest import balancer, balancer_config, chat, eventually, idle, sim

CHAT = "/v1/chat/completions"


def _sample(
    rng: random.Random,
    true: ModelCoefficients,
    noise: float,
    outlier: bool = False,
) -> TimingSample:
    """One stream's timing as the proxy would see it from a server whose costs are ``true``:
    multiplicative noise on every part, a random batch, a random wait for the running step."""
    prompt = rng.randint(1, 4000)
    out = rng.randint(2, 600)
    batch = rng.randint(1, 32)
    steps = batch_slowdown(batch, 0.15) * (1.5 if batch > 1 else 1.0)

    def jitter() -> float:
        return math.exp(rng.gauss(0.0, noise))

    first = (
        true.overhead * jitter()
        + true.prefill_per_token * prompt * jitter()
        + true.decode_per_token * steps * rng.uniform(0.67, 1.33)
    )
    decode = true.decode_per_token * (out - 1) * jitter()
    if outlier:  # a stall mid-stream, or a queue at the instance nobody saw
        decode *= rng.uniform(5, 100)
        first *= rng.uniform(5, 100)
    return TimingSample(prompt, out, first, steps, decode, queued=False)


coeffs_st = st.builds(
    ModelCoefficients,
    prefill_per_token=st.floats(1e-6, 1e-3),
    decode_per_token=st.floats(2e-3, 0.2),
    overhead=st.floats(0.0, 0.2),
)
factor_st = st.floats(1 / 20, 20)


@settings(max_examples=40, deadline=None)
@given(coeffs_st, factor_st, factor_st, factor_st, st.integers(0, 2**32 - 1))
@example(
    ModelCoefficients(
        prefill_per_token=0.0006738880711942304, decode_per_token=0.03125, overhead=0.0
    ),
    1.0,
    1.0,
    1.0,
    9502,
)
def test_fit_converges_to_the_true_coefficients_from_noisy_samples(
    true: ModelCoefficients, fd: float, fp: float, fo: float, seed: int
) -> None:
    # Configured values up to 20x off in either direction, independently.
    prior = ModelCoefficients(
        prefill_per_token=true.prefill_per_token * fp,
        decode_per_token=true.decode_per_token * fd,
        overhead=true.overhead * fo,
    )
    fit = CoefficientFit(prior)
    rng = random.Random(seed)
    for k in range(1500):
        fit.observe(_sample(rng, true, noise=0.1, outlier=k % 20 == 7))  # 5% outliers
    got = fit.current()
    assert math.isclose(got.decode_per_token, true.decode_per_token, rel_tol=0.1)
    # The line through time-to-first-token, judged where it is used: the cost of a prompt of
    # the sizes seen, to 15% or a generated token: the samples carry a wait of up to a batch
    # step (a third of a step either side of its mean, times up to 8.5 steps at batch 32),
    # which the forgetting fit can only average out. At half a token, an exact prior and
    # seed 9502 failed (the intercept 0.9 of a step off, 28 ms for a 100-token prompt: the
    # example below), one CI run in a few.
    for prompt in (100, 2000, 4000):
        want = true.overhead + true.prefill_per_token * prompt
        have = got.overhead + got.prefill_per_token * prompt
        assert abs(have - want) <= 0.15 * want + true.decode_per_token, prompt


def test_untrusted_until_enough_samples_then_learned() -> None:
    true = ModelCoefficients(prefill_per_token=0.0004, decode_per_token=0.05, overhead=0.01)
    prior = ModelCoefficients()
    fit = CoefficientFit(prior, LearnParams(min_samples=16))
    rng = random.Random(3)
    for _ in range(15):
        fit.observe(_sample(rng, true, 0.05))
    assert fit.current() == prior  # 15 decode samples, no trusted line yet: configured values
    fit.observe(_sample(rng, true, 0.05))
    assert fit.current().decode_per_token != prior.decode_per_token  # decode trusted at 16
    assert fit.current().prefill_per_token == prior.prefill_per_token  # line not yet
    for _ in range(16):
        fit.observe(_sample(rng, true, 0.05))
    assert fit.current().prefill_per_token != prior.prefill_per_token


def test_queued_requests_and_short_streams_teach_nothing_misleading() -> None:
    true = ModelCoefficients(prefill_per_token=0.0002, decode_per_token=0.02, overhead=0.005)
    fit = CoefficientFit(true)
    rng = random.Random(5)
    for _ in range(300):
        fit.observe(_sample(rng, true, 0.05))
    before = fit.current()
    for _ in range(300):
        s = _sample(rng, true, 0.05)
        # Queued at the instance: a time to first token 100x too long, flagged as such.
        fit.observe(
            TimingSample(
                s.prompt_tokens,
                3,
                s.first_token and s.first_token * 100,
                s.first_token_steps,
                1e6,
                queued=True,
            )
        )
    after = fit.current()
    assert after.overhead == before.overhead and after.prefill_per_token == before.prefill_per_token
    assert after.decode_per_token == before.decode_per_token  # 2 tokens after the first: < 4


def test_one_stalled_stream_barely_moves_a_settled_fit() -> None:
    true = ModelCoefficients(prefill_per_token=0.0002, decode_per_token=0.02, overhead=0.005)
    fit = CoefficientFit(ModelCoefficients())
    rng = random.Random(11)
    for _ in range(400):
        fit.observe(_sample(rng, true, 0.1))
    settled = fit.current()
    fit.observe(TimingSample(200, 300, 60.0, 3.0, 0.02 * 299 * 200, queued=False))
    moved = fit.current()
    assert abs(moved.decode_per_token / settled.decode_per_token - 1) < 0.03
    at_2000 = settled.overhead + settled.prefill_per_token * 2000
    assert abs(moved.overhead + moved.prefill_per_token * 2000 - at_2000) < 0.03 * at_2000


anything = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-1e6, 1e6),
    st.floats(0, 1e-9),
)
sample_st = st.builds(
    TimingSample,
    prompt_tokens=st.integers(-5, 10**7),
    output_tokens=st.integers(-5, 10**6),
    first_token=st.none() | anything,
    first_token_steps=anything,
    decode=st.none() | anything,
    queued=st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(coeffs_st, st.lists(sample_st, max_size=120), st.integers(1, 20))
def test_never_negative_nan_or_out_of_bounds_whatever_it_is_fed(
    prior: ModelCoefficients, samples: list[TimingSample], min_samples: int
) -> None:
    fit = CoefficientFit(prior, LearnParams(min_samples=min_samples))
    f = fit.params.max_factor
    for s in samples:
        fit.observe(s)
        c = fit.current()
        for v in (c.decode_per_token, c.prefill_per_token, c.overhead):
            assert math.isfinite(v) and v >= 0
        assert prior.decode_per_token / f * (1 - 1e-9) <= c.decode_per_token
        assert c.decode_per_token <= max(prior.decode_per_token, 1e-3) * f * (1 + 1e-9)
        assert c.prefill_per_token <= c.decode_per_token * (1 + 1e-9)
        assert c.overhead <= max(prior.overhead, 0.02) * f * (1 + 1e-9)
        assert c.load_time_s == prior.load_time_s and c.memory_gb == prior.memory_gb


def test_estimator_uses_learned_coefficients_and_can_be_told_not_to() -> None:
    true = ModelCoefficients(prefill_per_token=0.0005, decode_per_token=0.06, overhead=0.02)
    shape = RequestShape("big", "chat", prompt_tokens=1000, max_tokens=200)
    on, off = CostEstimator(), CostEstimator(learn_coefficients=False)
    rng = random.Random(2)
    for _ in range(400):
        s = _sample(rng, true, 0.05)
        on.learn("big", s)
        off.learn("big", s)
    assert math.isclose(on.coeffs("big").decode_per_token, 0.06, rel_tol=0.05)
    assert off.coeffs("big") == ModelCoefficients()
    assert on.coeffs("other") == ModelCoefficients()  # per model
    out = on.expected_output_tokens(shape)
    assert math.isclose(on.estimate(shape), on.cost_of(shape, out))
    assert on.estimate(shape) > 2 * off.estimate(shape)
    assert on.prefill_stall(shape) > 0 and off.prefill_stall(shape) == 0
    assert on.prefill_stall(RequestShape("big", "embedding", 1000, 0)) == 0


def test_error_spread_is_not_fooled_by_a_coefficient_change_mid_request() -> None:
    est = CostEstimator()
    shape = RequestShape("m", "chat", prompt_tokens=100, max_tokens=100)
    predicted, tokens = est.estimate(shape), est.expected_output_tokens(shape)
    true = ModelCoefficients(decode_per_token=0.002, prefill_per_token=0.00002, overhead=0.0005)
    rng = random.Random(4)
    for _ in range(100):
        est.learn("m", _sample(rng, true, 0.05))  # coefficients now 10x smaller
    sigma = est.sigma
    est.observe(shape, predicted, int(tokens), predicted_tokens=tokens)
    assert est.sigma <= sigma  # exact output length: no error, whatever the coefficients did
    est.observe(shape, predicted, int(tokens))  # the old-coefficient estimate, unadjusted
    assert est.sigma > 1.0


# -- what the instances hand the fit ---------------------------------------------------------


def test_timing_takes_the_batch_slowdown_and_prefill_stalls_out_of_decode_time() -> None:
    inst = InstanceState(id="i", speed=SpeedLearner(unit_speed=0.5, slots=8, penalty=0.2))
    inst.add(1, 1.0, now=0.0)
    inst.first_token(1, now=0.3)  # alone: 1 sequence
    inst.add(2, 1.0, now=1.0)  # from 1.0: 2 sequences, each at 1 / 1.2
    inst.prefill_stall(1.0, 0.5)  # request 2's prompt stalls the batch for 0.5 s
    inst.first_token(2, now=1.6)
    inst.add(3, 1.0, now=2.0)  # from 2.0: 3 sequences, each at 1 / 1.4
    sample = inst.timing(1, now=3.4, speed=0.5, prompt_tokens=10, output_tokens=50)
    assert sample is not None and not sample.queued
    assert sample.first_token is not None and sample.decode is not None
    assert math.isclose(sample.first_token, 0.3 * 0.5)
    assert sample.first_token_steps == 1.0  # it found the instance idle
    alone = 0.7 + 0.5 / 1.2 + 1.4 / 1.4  # 0.3..1.0 alone, 1.5..2.0 in two, 2.0..3.4 in three
    assert math.isclose(sample.decode, alone * 0.5)
    second = inst.timing(2, now=3.4, speed=0.5, prompt_tokens=10, output_tokens=50)
    assert second is not None and second.first_token_steps == 1.2 * 1.5
    assert inst.timing(3, now=3.4, speed=0.5, prompt_tokens=1, output_tokens=1) is None


def test_a_flight_beyond_the_batch_or_behind_a_queue_is_marked_queued() -> None:
    inst = InstanceState(id="i", speed=SpeedLearner(slots=2, penalty=0.1))
    inst.add(1, 1.0, 0.0)
    inst.add(2, 1.0, 0.0)
    inst.add(3, 1.0, 0.0)
    assert [f.queued for f in inst.flights.values()] == [False, False, True]
    inst.release(3, 0.1)
    inst.apply_load(running=2, waiting=4, kv_usage=0.5, now=0.2)  # other replicas' work
    inst.add(4, 1.0, 0.3)
    assert inst.flights[4].queued


def test_batch_size_follows_a_fresh_scrape_when_the_instance_holds_fewer_or_more() -> None:
    inst = InstanceState(id="i", speed=SpeedLearner(slots=32, penalty=0.15))
    for k in range(20):
        inst.add(k, 1.0, 0.0)
    assert inst.batch_size() == 20
    inst.apply_load(running=9, waiting=11, kv_usage=0.96, now=1.0)  # KV-bound: 9 run
    assert inst.batch_size() == 9
    inst.apply_load(running=40, waiting=0, kv_usage=0.5, now=2.0)  # others' requests too
    assert inst.batch_size() == 32
    inst.apply_load(None, None, None, now=3.0)  # stale: back to our own count
    assert inst.batch_size() == 20


def _learned(declared: float, unit: float, samples: int) -> InstanceState:
    sp = SpeedLearner(unit_speed=declared, slots=8, penalty=0.15)
    sp.unit_speed, sp.samples = unit, samples
    return InstanceState(id=f"{declared}-{unit}", speed=sp)


def test_speed_normalisation_pins_the_scale_to_declared_speeds() -> None:
    # Every learned speed 3x its declared one (coefficients 3x too high): no correction in the
    # fit's eyes, each instance is measured at its declared speed.
    fleet = [_learned(1.0, 3.0, 50), _learned(0.2, 0.6, 50), _learned(0.4, 1.2, 50)]
    anchor = speed_anchor(fleet)
    assert math.isclose(anchor, 3.0)
    for inst in fleet:
        assert math.isclose(timing_speed(inst, anchor), inst.speed.declared)
    # One instance at half its peers (throttled): measured at its own, slower speed.
    fleet.append(_learned(1.0, 1.5, 50))
    anchor = speed_anchor(fleet)
    assert timing_speed(fleet[3], anchor) < 0.7 * timing_speed(fleet[0], anchor)
    # Nothing completed yet: declared speeds.
    fresh = InstanceState(id="n", speed=SpeedLearner(unit_speed=0.4))
    assert speed_anchor([fresh]) == 0.0 and timing_speed(fresh, 0.0) == 0.4


# -- the whole loop on loopback ---------------------------------------------------------------


async def _sim_token_time(url: str) -> float:
    """Seconds per token of one stream alone, measured straight at the simulated instance
    (its event loop adds a little to the nominal step)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        times: list[float] = []
        async with c.stream("POST", CHAT, json=chat(max_tokens=120, stream=True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    times.append(time.monotonic())
    return (times[-3] - times[0]) / (len(times) - 4)


async def _stream_mix(
    url: str, n: int, concurrency: int, prompts: tuple[int, ...], model: str = "m1"
) -> None:
    rng = random.Random(7)
    gate = asyncio.Semaphore(concurrency)
    tags = iter(range(n))

    async def one() -> None:
        prompt = rng.choice(prompts)
        body = chat(model=model, max_tokens=rng.randint(24, 64), stream=True)
        # A tag of its own first: no prompt shares a KV block with another in the simulator's
        # prefix cache, so every prompt token is prefilled and the fit sees the true rate.
        body["messages"] = [
            {"role": "user", "content": f"{next(tags):04d}" + "x" * (4 * prompt - 8)}
        ]
        async with (
            gate,
            httpx.AsyncClient(base_url=url, timeout=30) as c,
            c.stream("POST", CHAT, json=body) as r,
        ):
            assert r.status_code == 200
            async for _ in r.aiter_bytes():
                pass

    await asyncio.gather(*(one() for _ in range(n)))


# One stream at a time: with several, the simulator, the balancer and the client share one
# Python process here and each stream adds CPU time to every step, which the fit would rightly
# learn but a wall-clock reference could not predict. Batches are covered above. For the same
# reason these run alone (marked timing): other tests' load during the mix, and not during the
# reference measured around it, is learned too.


@pytest.mark.timing
async def test_a_misconfigured_model_is_corrected_from_its_streams() -> None:
    speedup = 10.0
    # Configured 4x too dear to decode, 10x too cheap to prefill.
    models = {"m1": {"decode_per_token": 0.08, "prefill_per_token": 0.00002, "overhead": 0.005}}
    async with sim(speedup=speedup) as (u1, _):
        token_s = await _sim_token_time(u1)
        async with balancer(balancer_config([u1], models=models)) as (url, pool):
            before = pool.estimator.estimate(RequestShape("m1", "chat", 3000, 50))
            await _stream_mix(url, 36, 1, prompts=(10, 400, 1500, 3000))
            await eventually(lambda: idle(pool))
            fit = pool.estimator.fit("m1")
            assert fit is not None and fit.decode_trusted and fit.line_trusted
            got = pool.estimator.coeffs("m1")
            # One A100 (declared 1.0): reference seconds are its seconds with one sequence. The
            # reference is wall-clock, so it is taken before and after the mix: on a loaded
            # machine a step takes longer, and the fit rightly learns what the steps took.
            token_s_after = await _sim_token_time(u1)
            low, high = sorted((token_s, token_s_after))
            assert 0.8 * low <= got.decode_per_token <= 1.2 * high, (got, token_s, token_s_after)
            prefill_true = 0.0002 / speedup  # the simulator's prompt rate on an A100
            assert math.isclose(got.prefill_per_token, prefill_true, rel_tol=0.2), got
            after = pool.estimator.estimate(RequestShape("m1", "chat", 3000, 50))
            assert after < before / 3
            async with httpx.AsyncClient(base_url=url) as c:
                metrics = (await c.get("/metrics")).text
            line = next(
                ln
                for ln in metrics.splitlines()
                if ln.startswith("regional_lb_cost_coefficient{")
                and 'term="decode_per_token"' in ln
            )
            assert math.isclose(float(line.split()[-1]), got.decode_per_token)
            # Idle but for the balancer's own one-token health probes.
            util = next(ln for ln in metrics.splitlines() if ln.startswith("regional_lb_region_u"))
            assert 0.0 <= float(util.split()[-1]) < 0.5


@pytest.mark.timing
async def test_a_slow_gpu_does_not_make_the_model_look_expensive() -> None:
    learned: dict[str, float] = {}
    # Wall-clock seconds per token, measured before and after the mix (a loaded machine makes
    # every step longer, and the fit rightly learns what the steps took).
    wall: dict[str, tuple[float, float]] = {}
    for gpu in ("A100", "T4"):
        async with sim(gpu=gpu, speedup=20.0) as (u, _):
            before = await _sim_token_time(u)
            cfg = balancer_config([u])
            cfg = cfg.model_copy(
                update={"instances": [cfg.instances[0].model_copy(update={"gpu": gpu})]}
            )
            async with balancer(cfg) as (url, pool):
                await _stream_mix(url, 20, 1, prompts=(10, 200, 800))
                await eventually(lambda: idle(pool))
                learned[gpu] = pool.estimator.coeffs("m1").decode_per_token
            wall[gpu] = tuple(sorted((before, await _sim_token_time(u))))  # type: ignore[assignment]
    # A T4 takes ~5x as long per token (a little less: the simulator's event loop adds a fixed
    # ~0.5 ms to every step), but its seconds are worth 0.2 reference seconds. The bands are
    # wide on purpose: these are wall-clock steps, and a loaded machine stretches some of them
    # (the test failed under load with 0.8-1.2x bands). Unnormalised, the T4 would learn ~5x
    # the A100's cost; normalised, about the same: 2x tells the two apart with room to spare.
    assert min(wall["T4"]) > 2 * min(wall["A100"]), wall
    a100_low, a100_high = wall["A100"]
    t4_low, t4_high = wall["T4"]
    assert 0.5 * a100_low <= learned["A100"] <= 2 * a100_high, (learned, wall)
    assert 0.5 * 0.2 * t4_low <= learned["T4"] <= 2 * 0.2 * t4_high, (learned, wall)
    assert learned["T4"] < 2 * learned["A100"], learned
