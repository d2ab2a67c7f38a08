"""Prefix-sharing workloads for ``bench/regional/prefix.py``: one public trace, two synthetic mixes.

Every request is an arrival time, a prompt length, an output length and the ids of its prompt's
full blocks of ``BLOCK`` tokens, where equal leading ids mean an equal prefix (the chained
hashes of :mod:`regional_lb.balancing.kv_blocks`, already computed).

* ``mooncake``: Mooncake's conversation trace (Kimi's production traffic, FAST '25;
  kvcache-ai/Mooncake, ``FAST25-release/traces/conversation_trace.jsonl``, Apache-2.0). Its
  ``hash_ids`` name 512-token blocks, which is why ``BLOCK`` is 512 here. The sample shipped in
  ``data/mooncake_conversation_2000.jsonl.gz`` is the trace's first 2,000 lines, unchanged
  (gzip); ``--trace`` reads the whole file from a path.
* ``system_prompt``: 16 system prompts of 2-6k tokens with Zipf popularity, each followed by a
  question of its own and a short answer (assistants, agents, RAG over a fixed corpus).
* ``conversation``: multi-turn chats; each turn's prompt is the previous turn's prompt, its
  answer and a new message, all after one of four system prompts.

Arrival times are scaled so the offered work (prefill and decode of every request, as if
nothing were cached) is ``load`` times what the fleet can serve.
"""

from __future__ import annotations

import gzip
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BLOCK = 512
SAMPLE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_2000.jsonl.gz"


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
    p = path or SAMPLE
    opener = gzip.open if p.suffix == ".gz" else open
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
