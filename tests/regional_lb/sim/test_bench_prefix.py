"""The prefix-sharing benchmark drives the real pick(), KV index and prefix-cache model,
deterministically, on the shipped Mooncake sample and the synthetic mixes."""

from __future__ import annotations

from bench.regional.prefix import POLICY_NAMES, Gpu, at_load, simulate
from bench.regional.prefix_workloads import BLOCK, conversation, mooncake, system_prompt


def test_the_shipped_mooncake_sample_reads_as_the_trace_says() -> None:
    reqs = mooncake(limit=50)
    assert len(reqs) == 50 and reqs[0].arrival == 0.0
    # First line of the trace: 6,758 input tokens, 500 output, 14 block ids of which the
    # first 13 are full 512-token blocks.
    assert (reqs[0].prompt, reqs[0].output, len(reqs[0].blocks)) == (6758, 500, 6758 // BLOCK)
    assert all(r.blocks[0] == 0 for r in reqs if r.blocks)  # a shared first block


def test_runs_are_deterministic_and_cache_awareness_finds_more_hits() -> None:
    gpu = Gpu()
    reqs = at_load(conversation(300, seed=3), 0.8, 4, gpu)
    a = simulate(reqs, "cache_aware", 4, gpu)
    b = simulate(reqs, "cache_aware", 4, gpu)
    assert a.ttft == b.ttft and a.hit_rate == b.hit_rate
    ours = simulate(reqs, "ours", 4, gpu)
    assert a.hit_rate > ours.hit_rate
    for name in POLICY_NAMES:  # every policy serves every measured request
        r = simulate(reqs, name, 4, gpu)
        assert len(r.ttft) == len(a.ttft) and all(t > 0 for t in r.ttft)


def test_system_prompt_mix_shares_its_prompts() -> None:
    reqs = system_prompt(200, seed=1)
    firsts = {r.blocks[0] for r in reqs}
    assert len(firsts) <= 16 and all(r.prompt >= len(r.blocks) * BLOCK for r in reqs)
