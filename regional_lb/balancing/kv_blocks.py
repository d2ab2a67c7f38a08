"""Prompt tokens cut into KV-cache blocks named by chained hashes, as vLLM names them.

vLLM's prefix cache (``vllm/v1/core/kv_cache_utils.py``, ``hash_block_tokens``) keys each
*full* block of ``block_size`` tokens by a hash of its parent block's hash and its own token
ids, so a block's hash names the whole prefix up to its end: two prompts share a block exactly
when they share every token before it. A partial last block has no hash and is never shared.

The simulated server and the balancer must name blocks the same way, and neither has the
model's tokenizer, so :func:`tokens_of` stands in for one: every ``CHARS_PER_TOKEN`` characters
of text become one token id (the same ratio :func:`regional_lb.balancing.cost.estimate_tokens`
assumes). Equal text gives equal ids, which is all prefix matching needs.

Pure: no clock, no I/O. Hashes are 64-bit integers from BLAKE2b (fixed across processes,
unlike Python's ``hash``), the form vLLM's events carried as ``ExternalBlockHash`` before it
moved to bytes; the event decoder accepts both.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence

from regional_lb.balancing.cost import CHARS_PER_TOKEN

DEFAULT_BLOCK_SIZE = 16  # vLLM's default --block-size on CUDA
_CHUNK = int(CHARS_PER_TOKEN)
_NONE = b"\xff" * 8  # the parent of a prompt's first block


# Chunks of real text repeat, so their ids are remembered, up to a bound (rule 8): once full,
# new chunks are hashed and not kept, so a flood of unique text costs its own CPU, never memory.
# Hashing every chunk anew took ~4 ms of CPU for a 2,000-character prompt on the proxy's
# request path.
MAX_REMEMBERED_CHUNKS = 1 << 16
_ids: dict[bytes, int] = {}
_MASK = 0xFFFFFFFFFFFFFFFF


def tokens_of(text: str) -> list[int]:
    """Stand-in token ids: one per ``CHARS_PER_TOKEN`` characters (the last may be shorter)."""
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


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """One block's hash: covers its parent's hash (so the whole prefix) and its token ids."""
    h = hashlib.blake2b(digest_size=8)
    h.update(_NONE if parent is None else parent.to_bytes(8, "big"))
    h.update(struct.pack(f">{len(tokens)}Q", *(t & _MASK for t in tokens)))
    return int.from_bytes(h.digest(), "big")


@functools.lru_cache(maxsize=8)
def _packer(block_size: int) -> Callable[..., bytes]:
    return struct.Struct(f">{block_size}Q").pack


def block_hashes(tokens: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
    """The chained hashes of every full block of ``tokens``, in order: :func:`block_hash`
    along the prompt, with each block's packing compiled once (packed anew, ~9 us a block).

    >>> len(block_hashes(list(range(40)), 16))  # 2 full blocks; 8 tokens left over
    2
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, not {block_size}")
    if any(t < 0 or t > _MASK for t in tokens):
        tokens = [t & _MASK for t in tokens]
    pack = _packer(block_size)
    out: list[int] = []
    parent = _NONE
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=8)
        h.update(pack(*tokens[start : start + block_size]))
        parent = h.digest()
        out.append(int.from_bytes(parent, "big"))
    return out


def cacheable_hit_blocks(prompt_tokens: int, matched_blocks: int, block_size: int) -> int:
    """Blocks of a ``prompt_tokens`` prompt a server can take from its cache when its first
    ``matched_blocks`` blocks are there: vLLM always computes at least the prompt's last
    token (it needs that token's logits), so a prompt that is all cached full blocks recomputes
    its last block (``max_cache_hit_length = num_tokens - 1`` in the KV-cache manager)."""
    if prompt_tokens <= 0:
        return 0
    return max(0, min(matched_blocks, (prompt_tokens - 1) // block_size))
