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

from typing import Any

from regional_lb.balancing.affinity import prompt_prefix
from regional_lb.balancing.kv_blocks import block_hashes, tokens_of

WHOLE_PROMPT = 1 << 30  # characters: the prefix cache sees every token


def prompt_token_ids(body: dict[str, Any]) -> list[int]:
    """The request's prompt as stand-in token ids ([] when it has no text)."""
    text = prompt_prefix(body, WHOLE_PROMPT)
    return tokens_of(text) if text else []


def prompt_block_hashes(body: dict[str, Any], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks of ``block_size`` tokens, in order."""
    return block_hashes(prompt_token_ids(body), block_size)
