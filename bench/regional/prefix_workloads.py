"""Prefix-sharing workloads for ``bench/regional/prefix.py``: public traces and synthetic mixes.

Every request is an arrival time, a prompt length, an output length and the ids of its prompt's
full blocks of ``BLOCK`` tokens, where equal leading ids mean an equal prefix (the chained
hashes of :mod:`regional_lb.balancing.kv_blocks`, already computed).

* ``mooncake``: Mooncake's conversation trace (Kimi's production traffic, one hour, FAST '25;
  kvcache-ai/Mooncake, ``FAST25-release/traces/conversation_trace.jsonl``, Apache-2.0). Its
  ``hash_ids`` name 512-token blocks, which is why ``BLOCK`` is 512 here. Shipped whole and
  unchanged (12,031 lines, xz) in ``data/mooncake_conversation_trace.jsonl.xz``.
* ``mooncake_synthetic``: the same release's ``synthetic_trace.jsonl`` (3,993 requests built
  from public datasets, Poisson arrivals), shipped whole and unchanged in
  ``data/mooncake_synthetic_trace.jsonl.xz``.
* ``toolagent``: the release's tool-and-agent trace (``toolagent_trace.jsonl``, 23,608
  requests) is not shipped: read it with ``--trace PATH`` (same format).
* ``system_prompt``: 16 system prompts of 2-6k tokens with Zipf popularity, each followed by a
  question of its own and a short answer (assistants, agents).
* ``rag``: a system prompt, then three passages retrieved from a corpus of 400 (Zipf
  popularity, most relevant first), then the question: prompts share a prefix up to the
  first passage that differs.
* ``conversation``: multi-turn chats; each turn's prompt is the previous turn's prompt, its
  answer and a new message, all after one of four system prompts.
* ``chat_mix``: the seed's prefix-free chat and summarisation mix (no two prompts share a
  block), to check that pricing caches costs nothing where there are none.

Arrival times are scaled by the benchmark to a chosen share of the fleet's capacity.
"""

from __future__ import annotations

import gzip
import json
import lzma
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BLOCK = 512
DATA = Path(__file__).resolve().parent / "data"
CONVERSATION = DATA / "mooncake_conversation_trace.jsonl.xz"
SYNTHETIC = DATA / "mooncake_synthetic_trace.jsonl.xz"


@dataclass(frozen=True, slots=True)
class Request:
    arrival: float
    prompt: int  # tokens
    output: int  # tokens
    blocks: tuple[int, ...]  # ids of the prompt's full blocks, in order
    first: int  # what a 1,024-character prefix key sees: the first block's id


def _ids(prefix: int, n: int, start: int = 0) -> tuple[int, ...]:
    return tuple((prefix << 24) | j for j in range(start, start + n))


def mooncake(path: Path | None = None, limit: int = 0) -> list[Request]:
    """The trace's requests (``limit`` first lines, all when 0), arrival in seconds."""
    p = path or CONVERSATION
    opener = {".gz": gzip.open, ".xz": lzma.open}.get(p.suffix, open)
    out: list[Request] = []
    with opener(p, "rt") as f:
        for line in f:
            if limit and len(out) >= limit:
                break
            row = json.loads(line)
            prompt, ids = int(row["input_length"]), [int(h) for h in row["hash_ids"]]
            full = tuple(ids[: prompt // BLOCK])
            out.append(
                Request(
                    float(row["timestamp"]) / 1000.0,
                    prompt,
                    max(1, int(row["output_length"])),
                    full,
                    ids[0] if ids else -1,
                )
            )
    return out


def system_prompt(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    sizes = [rng.randint(4, 12) for _ in range(16)]  # blocks: 2-6k tokens
    weights = [1.0 / (k + 1) for k in range(16)]
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(1.0)
        s = rng.choices(range(16), weights)[0]
        question = rng.randint(100, 1500)
        prompt = sizes[s] * BLOCK + question
        blocks = _ids(s + 1, sizes[s]) + _ids(1000 + i, question // BLOCK)
        out.append(Request(t, prompt, rng.randint(50, 400), blocks, s + 1))
    return out


def rag(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    corpus = [rng.randint(1, 4) for _ in range(400)]  # passage sizes in blocks
    weights = [1.0 / (k + 1) ** 0.8 for k in range(400)]
    system = _ids(1, 3)  # a 1.5k-token instruction every request starts with
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(1.0)
        passages: list[int] = []
        while len(passages) < 3:
            d = rng.choices(range(400), weights)[0]
            if d not in passages:
                passages.append(d)
        blocks = system
        for d in passages:
            # A passage's blocks depend on what precedes it (chained hashes): the same
            # passage after another first passage is a different block.
            blocks += _ids(hash((blocks[-1], d)) & 0xFFFFFF, corpus[d])
        question = rng.randint(50, 400)
        prompt = len(blocks) * BLOCK + question
        out.append(Request(t, prompt, rng.randint(100, 500), blocks, 1))
    return out


def conversation(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    out: list[Request] = []
    t, session = 0.0, 0
    while len(out) < n:
        t += rng.expovariate(0.25)
        session += 1
        system = rng.randint(1, 4)
        length = 4 * BLOCK  # the system prompt
        at = t
        for _ in range(rng.randint(2, 10)):
            length += rng.randint(100, 1200)  # the new message
            reply = rng.randint(100, 600)
            full = length // BLOCK
            blocks = _ids(system, min(4, full)) + _ids(100 + session, max(0, full - 4), 4)
            out.append(Request(at, length, reply, blocks, system))
            length += reply
            at += rng.uniform(15.0, 90.0)  # reading, typing, the answer streaming
    out.sort(key=lambda r: r.arrival)
    return out[:n]


def chat_mix(n: int, seed: int) -> list[Request]:
    """The seed's chat and summarisation mix (``bench/regional/scenarios.py``): 70% chats of
    ~200 prompt and ~150 output tokens, 30% summaries of ~3,000 and ~300, log-normal sizes,
    Poisson arrivals, and no prefix shared between any two prompts."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(1.0)
        if rng.random() < 0.3:
            prompt, output = 3000 * math.exp(rng.gauss(0, 0.4)), 300 * math.exp(rng.gauss(0, 0.3))
        else:
            prompt, output = 200 * math.exp(rng.gauss(0, 0.5)), 150 * math.exp(rng.gauss(0, 0.7))
        p, o = max(1, round(prompt)), max(1, round(output))
        out.append(Request(t, p, o, _ids(5000 + i, p // BLOCK), -1 - i))
    return out


def scaled(requests: list[Request], factor: float) -> Iterator[Request]:
    t0 = requests[0].arrival if requests else 0.0
    for r in requests:
        yield Request((r.arrival - t0) * factor, r.prompt, r.output, r.blocks, r.first)
