"""Which instance holds which KV blocks, from the instances' own KV-cache events.

Fed by vLLM's events (:mod:`regional_lb.balancing.kv_events`, read by
:mod:`regional_lb.upstream.kv_subscriber`), like llm-d's KV-cache indexer: each instance's
block hashes in a bounded LRU. The picker asks how many of a prompt's leading blocks an
instance holds (:meth:`KvIndex.matched_blocks`) and prices them as the prefill time it would
not spend there (:func:`prefill_saved`).

Nothing an event says can hurt more than the hit rate: events for an instance the index does
not know, batches that repeat or go back in sequence, blocks of a foreign block size, and
messages that do not decode are counted and dropped; each instance holds at most
``max_blocks`` hashes (the oldest forgotten first, counted), so a flood of unique prompts costs
hits, never memory. An instance that fails or drains is :meth:`KvIndex.forget`-ten at once: a
request sent there for its cache would wait for nothing. A publisher that restarts (sequence
back to 0) starts with an empty cache, so its entries go too.

An instance that has published no event (a server without them, or one whose subscription
failed: :meth:`KvIndex.lost_stream`) is indexed from the balancer's own routing history instead
(:meth:`KvIndex.note_routed`: the blocks of every prompt sent there, in an LRU as large as its
KV cache, standing in for its evictions), and :meth:`KvIndex.mode` says which it is; its first
event replaces the estimate with the real thing. Silence alone is not taken for a dead stream:
a server whose cache does not change has nothing to publish.

Pure: no clock (callers pass ``now``), no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from regional_lb.balancing.kv_blocks import DEFAULT_BLOCK_SIZE, cacheable_hit_blocks
from regional_lb.balancing.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
)

# A 64-bit hash (a Python int) and its OrderedDict entry: 141 bytes a block measured with
# tracemalloc (CPython 3.11, 200,000 random hashes), so the default bound is ~28 MB per
# instance, enough for a 80 GB GPU's whole cache at 16-token blocks of a 7-13B model (~200k).
DEFAULT_MAX_BLOCKS = 200_000


@dataclass(slots=True)
class KvIndexCounts:
    """What the index did with what it was sent (exported as metrics by the caller)."""

    batches: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    malformed: int = 0  # messages that did not decode
    out_of_order: int = 0  # batches at or below the last sequence number seen
    gaps: int = 0  # batches missed (sequence jumped): entries may be stale
    unknown_instance: int = 0  # batches for an instance the index does not hold
    foreign_block_size: int = 0  # BlockStored with another block size than the index's
    overflow: int = 0  # hashes forgotten to stay within the bound
    restarts: int = 0  # a publisher's sequence went back to 0: its cache is new
    fallbacks: int = 0  # instances switched to routing-history estimates (no live events)


@dataclass(slots=True)
class _Held:
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)
    last_seq: int | None = None
    last_event_at: float | None = None
    estimated: bool = False  # blocks come from routing history, not events


class KvIndex:
    def __init__(
        self,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        estimate_blocks: int | None = None,
    ) -> None:
        if max_blocks < 1 or block_size < 1:
            raise ValueError("max_blocks and block_size must be at least 1")
        self.max_blocks = max_blocks
        self.block_size = block_size
        # The routing-history estimate's LRU size: the instance's KV cache in blocks.
        self.estimate_blocks = min(estimate_blocks or max_blocks, max_blocks)
        self.counts = KvIndexCounts()
        self._held: dict[str, _Held] = {}

    # -- membership -------------------------------------------------------------------------

    def track(self, instance_id: str) -> None:
        """Accept events for ``instance_id`` from now on."""
        self._held.setdefault(instance_id, _Held())

    def forget(self, instance_id: str) -> None:
        """Drop every entry of an instance that failed or drains; it stays tracked, empty,
        until it publishes again."""
        held = self._held.get(instance_id)
        if held is not None:
            held.blocks.clear()

    def untrack(self, instance_id: str) -> None:
        self._held.pop(instance_id, None)

    def blocks_held(self, instance_id: str) -> int:
        held = self._held.get(instance_id)
        return len(held.blocks) if held else 0

    def last_event_at(self, instance_id: str) -> float | None:
        held = self._held.get(instance_id)
        return held.last_event_at if held else None

    # -- events -----------------------------------------------------------------------------

    def malformed(self) -> None:
        self.counts.malformed += 1

    def apply(self, instance_id: str, seq: int, batch: KvEventBatch, now: float) -> None:
        """One batch from ``instance_id``'s publisher, sequence number ``seq``."""
        held = self._held.get(instance_id)
        if held is None:
            self.counts.unknown_instance += 1
            return
        if held.last_seq is not None:
            if seq == 0 and held.last_seq > 0:
                self.counts.restarts += 1
                held.blocks.clear()
            elif seq <= held.last_seq:
                self.counts.out_of_order += 1
                return
            elif seq > held.last_seq + 1:
                self.counts.gaps += 1
        if held.estimated:  # real events again: they replace the estimate
            held.blocks.clear()
            held.estimated = False
        held.last_seq, held.last_event_at = seq, now
        self.counts.batches += 1
        blocks = held.blocks
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.block_size != self.block_size:
                    self.counts.foreign_block_size += 1
                    continue
                for h in event.block_hashes:
                    blocks[h] = None
                    blocks.move_to_end(h)
                self.counts.stored += len(event.block_hashes)
                while len(blocks) > self.max_blocks:
                    blocks.popitem(last=False)
                    self.counts.overflow += 1
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    if blocks.pop(h, 0) is None:
                        self.counts.removed += 1
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()
                self.counts.cleared += 1

    # -- routing history ----------------------------------------------------------------------

    def mode(self, instance_id: str) -> str:
        """``events`` (indexed from the instance's KV events), ``history`` (estimated from
        what was routed there), or ``none`` (not tracked)."""
        held = self._held.get(instance_id)
        if held is None:
            return "none"
        return "history" if held.estimated else "events"

    def lost_stream(self, instance_id: str) -> None:
        """The instance's event stream failed: estimate it from routing history from now on
        (what the index held may already be wrong, so it goes)."""
        held = self._held.get(instance_id)
        if held is not None:
            held.blocks.clear()
            held.last_event_at = held.last_seq = None
            held.estimated = False

    def note_routed(self, instance_id: str, hashes: Sequence[int]) -> None:
        """A prompt with these blocks was sent to the instance: nothing more when its events
        say what it holds, its blocks enter the estimate when it has published none."""
        held = self._held.get(instance_id)
        if held is None or held.last_event_at is not None:
            return
        if not held.estimated:
            held.blocks.clear()
            held.estimated = True
            self.counts.fallbacks += 1
        blocks = held.blocks
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.estimate_blocks:
            blocks.popitem(last=False)

    # -- queries ----------------------------------------------------------------------------

    def matched_blocks(self, instance_id: str, hashes: Sequence[int]) -> int:
        """How many of ``hashes``' leading blocks the instance holds (a lookup: no change)."""
        held = self._held.get(instance_id)
        if held is None:
            return 0
        n = 0
        for h in hashes:
            if h not in held.blocks:
                break
            n += 1
        return n


def prefill_saved(
    index: KvIndex,
    instance_ids: Iterable[str],
    hashes: Sequence[int],
    prompt_tokens: int,
    prefill_per_token: float,
) -> dict[str, float]:
    """Reference seconds of prefill each instance would skip for a prompt of
    ``prompt_tokens`` whose full blocks are ``hashes``: the blocks it holds, never the whole
    prompt (vLLM recomputes the last token). Instances with nothing to skip are left out
    (:attr:`regional_lb.balancing.pick.PickRequest.prefill_saved` says how pick() uses it)."""
    out: dict[str, float] = {}
    if not hashes:
        return out
    for iid in instance_ids:
        matched = index.matched_blocks(iid, hashes)
        hit = cacheable_hit_blocks(prompt_tokens, matched, index.block_size)
        if hit:
            out[iid] = hit * index.block_size * prefill_per_token
    return out
