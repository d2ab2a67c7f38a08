"""What a request's prompt is to a prefix cache: its token ids and its full blocks' hashes.

The simulated server caches what it computes from :func:`prompt_token_ids`, and the balancer
looks the same request's :func:`prompt_block_hashes` up in its KV index, so both sides must cut
a request the same way; this module is the one place that says how. The text is what the model
reads, in order (chat messages as ``role NUL content NUL``, or the completion prompt: the
whole of :func:`regional_lb.balancing.affinity.prompt_prefix`), tokenised by the stand-in
:func:`regional_lb.balancing.kv_blocks.tokens_of` and cut into chained block hashes by
:func:`regional_lb.balancing.kv_blocks.block_hashes`.

A real vLLM names blocks from its own tokenizer's ids after the chat template, with its own
hash (``--prefix-caching-hash-algo``) and a seed for the first block's parent; the balancer
computes none of that, so against real servers the events keep the index current but only
prompts cut this same way match (the regional tier's README, "KV-cache events").
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from regional_lb.balancing.affinity import prompt_prefix
from regional_lb.balancing.cost import CHARS_PER_TOKEN
from regional_lb.balancing.kv_blocks import block_hashes

WHOLE_PROMPT = 1 << 30  # characters: the prefix cache sees every token
_CHUNK = int(CHARS_PER_TOKEN)
# :func:`regional_lb.balancing.kv_blocks.tokens_of` hashes every chunk: ~4 ms of CPU for a
# 2,000-character prompt on the request path. Chunks of real text repeat, so their ids are
# remembered, up to a bound (rule 8): once full, new chunks are hashed and not kept, so a
# flood of unique text costs its own CPU, never memory. The ids are tokens_of's exactly.
MAX_REMEMBERED_CHUNKS = 1 << 16
_ids: dict[bytes, int] = {}


def token_ids(text: str) -> list[int]:
    """:func:`regional_lb.balancing.kv_blocks.tokens_of`, the same ids, remembered."""
    data = text.encode()
    ids, out = _ids, []
    for i in range(0, len(data), _CHUNK):
        chunk = data[i : i + _CHUNK]
        t = ids.get(chunk)
        if t is None:
            t = int.from_bytes(hashlib.blake2b(chunk, digest_size=4).digest(), "big")
            if len(ids) < MAX_REMEMBERED_CHUNKS:
                ids[chunk] = t
        out.append(t)
    return out


def prompt_token_ids(body: dict[str, Any]) -> list[int]:
    """The request's prompt as stand-in token ids ([] when it has no text)."""
    text = prompt_prefix(body, WHOLE_PROMPT)
    return token_ids(text) if text else []


_NONE = b"\xff" * 8  # kv_blocks' parent of a prompt's first block


def chained_hashes(tokens: list[int], block_size: int) -> list[int]:
    """:func:`regional_lb.balancing.kv_blocks.block_hashes`, the same hashes, with the
    block's packing compiled once (the reference packs each block anew: ~9 us a block)."""
    if block_size < 1 or any(t >> 64 for t in tokens):
        return block_hashes(tokens, block_size)  # its errors and its masking, unchanged
    pack = struct.Struct(f">{block_size}Q").pack
    out: list[int] = []
    parent = _NONE
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=8)
        h.update(pack(*tokens[start : start + block_size]))
        parent = h.digest()
        out.append(int.from_bytes(parent, "big"))
    return out


def prompt_block_hashes(body: dict[str, Any], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks of ``block_size`` tokens, in order."""
    return chained_hashes(prompt_token_ids(body), block_size)
