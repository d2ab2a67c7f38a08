"""The prefix-sharing benchmark drives the real pick(), KV index and prefix-cache model,
deterministically, on the shipped Mooncake traces and the synthetic mixes."""

from __future__ import annotations

import lzma

from bench.regional.prefix import POLICY_NAMES, Gpu, at_load, simulate
from bench.regional.prefix_report import floor_p90, pct
from bench.regional.prefix_workloads import (
    BLOCK,
    CONVERSATION,
    SYNTHETIC,
    chat_mix,
    conversation,
    mooncake,
    rag,
    system_prompt,
)


def test_the_shipped_mooncake_traces_read_as_the_release_says() -> None:
    reqs = mooncake(limit=50)
    assert len(reqs) == 50 and reqs[0].arrival == 0.0
    # First line of the conversation trace: 6,758 input tokens, 500 output, 14 block ids of
    # which the first 13 are full 512-token blocks.
    assert (reqs[0].prompt, reqs[0].output, len(reqs[0].blocks)) == (6758, 500, 6758 // BLOCK)
    assert all(r.blocks[0] == 0 for r in reqs if r.blocks)  # a shared first block
    # The whole release files, unchanged: the line counts its README gives.
    for path, lines in ((CONVERSATION, 12_031), (SYNTHETIC, 3_993)):
        with lzma.open(path, "rt") as f:
            assert sum(1 for _ in f) == lines


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
        assert all(w >= 0 for w in r.waits) and all(p > 0 for p in r.prefills)


def test_no_policy_beats_the_infinite_cache_bound() -> None:
    gpu = Gpu()
    reqs = at_load(mooncake(limit=400), 0.8, 4, gpu)
    floor = floor_p90(reqs, int(len(reqs) * 0.05), gpu.prefill_s)
    for name in ("ours", "cache_aware", "oracle"):
        assert pct(simulate(reqs, name, 4, gpu).ttft, 0.9) >= floor


def test_the_synthetic_mixes_share_what_they_say() -> None:
    reqs = system_prompt(200, seed=1)
    firsts = {r.blocks[0] for r in reqs}
    assert len(firsts) <= 16 and all(r.prompt >= len(r.blocks) * BLOCK for r in reqs)
    docs = rag(300, seed=1)
    assert all(r.blocks[:3] == docs[0].blocks[:3] for r in docs)  # the shared instruction
    assert len({r.blocks[:4] for r in docs}) < len(docs)  # popular first passages recur
    free = chat_mix(300, seed=1)
    blocks = [h for r in free for h in r.blocks]
    assert len(blocks) == len(set(blocks))  # prefix-free: no block shared
