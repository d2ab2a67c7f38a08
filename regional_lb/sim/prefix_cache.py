"""A model server's KV cache with automatic prefix caching, block by block, as vLLM keeps it.

vLLM v1 (``vllm/v1/core/block_pool.py``, ``kv_cache_manager.py``) holds the KV cache as
``capacity_blocks`` blocks of ``block_size`` tokens. A prompt's full blocks are named by chained
hashes (:mod:`regional_lb.balancing.kv_blocks`); when a request arrives its longest run of
leading blocks already in the cache is reused and only the rest is prefilled. A block is pinned
while a running request uses it; when requests end their blocks stay cached, unpinned, on a
free queue, and a block is evicted (its hash forgotten) only when memory is needed, least
recently freed first. A request's blocks are freed tail first, so a long prompt loses its
ends before the prefix it shares with others.

What is modelled, and what is not:

* hits: the leading full blocks present, but never the whole prompt (at least the last token
  is computed: :func:`regional_lb.balancing.kv_blocks.cacheable_hit_blocks`); a partial last
  block is private to its request and never shared;
* a request's generated tokens take private blocks (vLLM also caches full blocks of output;
  here only prompts are shared, which is what the next turn of a conversation reuses anyway);
* ``queries`` and ``hits`` count tokens, like ``vllm:prefix_cache_queries`` and
  ``vllm:prefix_cache_hits``;
* every block entered or evicted becomes a KV event (:mod:`regional_lb.balancing.kv_events`),
  collected until :meth:`PrefixCache.take_events`.

Pure: no clock, no I/O. The simulated server (:mod:`regional_lb.sim.engine`) and the
discrete-event benchmark (``bench/regional``) drive this same model.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from regional_lb.balancing.kv_blocks import (
    DEFAULT_BLOCK_SIZE,
    block_hashes,
    cacheable_hit_blocks,
)
from regional_lb.balancing.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


@dataclass(slots=True)
class _Block:
    parent: int | None
    refs: int = 0


@dataclass(slots=True)
class Admission:
    """One running request's hold on the cache (give it back with :meth:`PrefixCache.release`)."""

    prompt_tokens: int
    hit_tokens: int  # prompt tokens read from the cache: their prefill is skipped
    pinned: list[int] = field(default_factory=list)  # hashes of the shared blocks it holds
    private: int = 0  # blocks of its own: partial prompt tail, uncached blocks, output
    released: bool = False

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens


class PrefixCache:
    """The KV blocks of one instance: shared prompt blocks (pinned or free) and private ones."""

    def __init__(self, capacity_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1 or capacity_blocks < 0:
            raise ValueError("block_size must be >= 1 and capacity_blocks >= 0")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._blocks: dict[int, _Block] = {}
        # Cached blocks no running request uses, least recently freed first: the next to go.
        self._free: OrderedDict[int, None] = OrderedDict()
        self._private = 0
        self._events: list[KvEvent] = []
        self.queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.hits = 0  # of which found cached (vllm:prefix_cache_hits)
        self.evictions = 0

    # -- state ------------------------------------------------------------------------------

    @property
    def cached_blocks(self) -> int:
        return len(self._blocks)

    @property
    def used_blocks(self) -> int:
        """Blocks running requests hold (what vLLM's KV-cache usage counts)."""
        return len(self._blocks) - len(self._free) + self._private

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``' leading blocks are cached (a lookup: nothing changes)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def take_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    # -- requests ---------------------------------------------------------------------------

    def admit(
        self, tokens: Sequence[int], output_tokens: int, force: bool = False
    ) -> Admission | None:
        """Reserve room for a request reading ``tokens`` and writing ``output_tokens``; None
        when it does not fit even after evicting every free block (``force`` admits it anyway,
        caching none of its new blocks: a server with nothing running never refuses)."""
        return self.admit_blocks(
            block_hashes(tokens, self.block_size), len(tokens), output_tokens, force, tokens
        )

    def admit_blocks(
        self,
        hashes: Sequence[int],
        prompt_tokens: int,
        output_tokens: int,
        force: bool = False,
        tokens: Sequence[int] = (),
    ) -> Admission | None:
        """:meth:`admit` for a prompt already cut into blocks: ``hashes`` are its full blocks'
        chained hashes (a trace's block ids serve as well), ``tokens`` only fill the events."""
        bs = self.block_size
        hit = cacheable_hit_blocks(prompt_tokens, self.matched_blocks(hashes), bs)
        # Full blocks after the hits: shared when another request already cached them (the
        # recomputed last block, a block cached since), otherwise new and cached now.
        rest = hashes[hit:]
        new = [h for h in rest if h not in self._blocks]
        tail_tokens = prompt_tokens - len(hashes) * bs + max(output_tokens, 0)
        private = math.ceil(tail_tokens / bs)
        reuse_free = sum(1 for h in hashes if h in self._free)
        pinned_after = len(self._blocks) - len(self._free) + reuse_free + len(new)
        fits = pinned_after + self._private + private <= self.capacity_blocks
        if not fits and not force:
            return None
        self.queries += prompt_tokens
        self.hits += hit * bs
        adm = Admission(prompt_tokens, hit * bs, private=private)
        for h in hashes[:hit]:
            self._pin(h)
            adm.pinned.append(h)
        if fits:
            for i in range(hit, len(hashes)):
                h = hashes[i]
                if h not in self._blocks:
                    parent = hashes[i - 1] if i else None
                    self._store(h, parent, tokens[i * bs : (i + 1) * bs])
                self._pin(h)
                adm.pinned.append(h)
        else:
            adm.private += len(rest)  # forced: computed, not cached
        self._private += adm.private
        self._make_room()
        return adm

    def release(self, adm: Admission) -> None:
        """The request ended (however): its blocks go back, tail first, as vLLM frees them."""
        if adm.released:
            return
        adm.released = True
        self._private -= adm.private
        for h in reversed(adm.pinned):
            block = self._blocks.get(h)
            if block is None:
                continue
            block.refs -= 1
            if block.refs == 0:
                self._free[h] = None
        self._make_room()

    def reset(self) -> bool:
        """Forget every free block (vLLM's ``reset_prefix_cache``): refused while any request
        holds cached blocks, as vLLM refuses it."""
        if len(self._free) != len(self._blocks):
            return False
        self._blocks.clear()
        self._free.clear()
        self._events.append(AllBlocksCleared())
        return True

    # -- internals --------------------------------------------------------------------------

    def _pin(self, h: int) -> None:
        block = self._blocks[h]
        if block.refs == 0:
            self._free.pop(h, None)
        block.refs += 1

    def _store(self, h: int, parent: int | None, tokens: Sequence[int]) -> None:
        self._blocks[h] = _Block(parent)
        last = self._events[-1] if self._events else None
        # Consecutive blocks of one prompt go out as one event, as vLLM batches them.
        if (
            isinstance(last, BlockStored)
            and last.block_hashes
            and last.block_hashes[-1] == parent
            and parent is not None
        ):
            self._events[-1] = BlockStored(
                (*last.block_hashes, h),
                last.parent_block_hash,
                (*last.token_ids, *tokens),
                self.block_size,
            )
        else:
            self._events.append(BlockStored((h,), parent, tuple(tokens), self.block_size))

    def _make_room(self) -> None:
        removed: list[int] = []
        while len(self._blocks) + self._private > self.capacity_blocks and self._free:
            h, _ = self._free.popitem(last=False)
            del self._blocks[h]
            removed.append(h)
        if removed:
            self.evictions += len(removed)
            self._events.append(BlockRemoved(tuple(removed)))
