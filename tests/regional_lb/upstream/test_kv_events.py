"""vLLM's KV-cache events: the codec, the balancer's block index, and the stream end to end
(the simulated server publishing over ZMQ on loopback, the balancer's subscriber indexing)."""

from __future__ import annotations

import asyncio

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from regional_lb.balancing.kv_blocks import block_hashes, tokens_of
from regional_lb.balancing.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvEventError,
    decode_batch,
    encode_batch,
)
from regional_lb.balancing.kv_index import KvIndex, prefill_saved
from regional_lb.upstream.kv_subscriber import KvEventSubscriber
from tests.regional_lb.conftest import eventually, sim

STORED = BlockStored((11, 12), None, tuple(range(32)), 16)


def batch(*events: BlockStored | BlockRemoved | AllBlocksCleared) -> KvEventBatch:
    return KvEventBatch(1.5, tuple(events))


# -- the codec --------------------------------------------------------------------------------


def test_array_layout_is_what_vllm_msgspec_writes() -> None:
    # msgspec's array_like, tagged structs: [ts, [[tag, field, ...], ...]], bin type for bytes.
    payload = encode_batch(batch(STORED, BlockRemoved((12,)), AllBlocksCleared()))
    assert msgpack.unpackb(payload) == [
        1.5,
        [
            ["BlockStored", [11, 12], None, list(range(32)), 16, None, "GPU", None],
            ["BlockRemoved", [12], "GPU"],
            ["AllBlocksCleared"],
        ],
    ]
    assert decode_batch(payload) == batch(STORED, BlockRemoved((12,)), AllBlocksCleared())


def test_map_layout_and_bytes_hashes_decode() -> None:
    # Later vLLM: events as tagged maps, block hashes as bytes, fields at defaults left out.
    h = (7).to_bytes(32, "big")
    payload = msgpack.packb(
        {
            "ts": 2.0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [h],
                    "parent_block_hash": None,
                    "token_ids": [1, 2],
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                },
                {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"},
            ],
            "data_parallel_rank": 1,
        }
    )
    got = decode_batch(payload)
    assert got.events == (BlockStored((7,), None, (1, 2), 16), BlockRemoved((7,)))
    assert got.data_parallel_rank == 1


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb(7), "not an event batch"),
        (msgpack.packb([float("nan"), []]), "finite"),
        (msgpack.packb([1.0, [["Bogus"]]]), "unknown tag"),
        (msgpack.packb([1.0, [["BlockStored", [1]]]]), "fields"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1], 0]]]), "block_size"),
        (msgpack.packb([1.0, [["BlockStored", ["x"], None, [1], 16]]]), "not a block hash"),
        (msgpack.packb([1.0, [["BlockRemoved", 5]]]), "not a list"),
        (msgpack.packb([1.0, [{"type": "BlockRemoved"}]]), "lacks block_hashes"),
        (msgpack.packb([1.0, [42]]), "not a tagged event"),
    ],
)
def test_bad_messages_are_refused_with_a_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(KvEventError, match=reason):
        decode_batch(payload)


# -- the index --------------------------------------------------------------------------------


def test_index_follows_stores_removals_and_clears() -> None:
    index = KvIndex(block_size=16)
    index.track("a")
    index.apply("a", 0, batch(STORED), now=1.0)
    assert index.matched_blocks("a", [11, 12, 13]) == 2
    index.apply("a", 1, batch(BlockRemoved((12, 99))), now=2.0)
    assert index.matched_blocks("a", [11, 12]) == 1 and index.counts.removed == 1
    index.apply("a", 2, batch(AllBlocksCleared()), now=3.0)
    assert index.blocks_held("a") == 0 and index.last_event_at("a") == 3.0


def test_index_counts_bad_order_unknown_instances_and_stays_bounded() -> None:
    index = KvIndex(max_blocks=3, block_size=16)
    index.track("a")
    index.apply("ghost", 0, batch(STORED), now=0.0)
    assert index.counts.unknown_instance == 1 and index.blocks_held("ghost") == 0
    index.apply("a", 5, batch(STORED), now=0.0)
    index.apply("a", 5, batch(BlockRemoved((11,))), now=0.0)  # a repeat: ignored
    index.apply("a", 4, batch(BlockRemoved((11,))), now=0.0)  # from the past: ignored
    assert index.counts.out_of_order == 2 and index.matched_blocks("a", [11, 12]) == 2
    index.apply("a", 9, batch(BlockStored((1, 2, 3), 12, (), 16)), now=0.0)  # 6..8 lost
    assert index.counts.gaps == 1
    # A flood of blocks: the oldest go, the bound holds.
    assert index.blocks_held("a") == 3 and index.counts.overflow == 2
    assert index.matched_blocks("a", [1, 2, 3]) == 3
    index.apply("a", 10, batch(BlockStored((4,), None, (), 32)), now=0.0)
    assert index.counts.foreign_block_size == 1 and index.blocks_held("a") == 3
    # The publisher restarted: its sequence is back at 0 and its cache is empty.
    index.apply("a", 0, batch(BlockStored((5,), None, (), 16)), now=0.0)
    assert index.counts.restarts == 1 and index.blocks_held("a") == 1


def test_a_failed_or_draining_instance_loses_its_entries_at_once() -> None:
    index = KvIndex(block_size=16)
    for iid in ("a", "b"):
        index.track(iid)
        index.apply(iid, 0, batch(STORED), now=0.0)
    prompt = 40  # two full blocks and a partial one
    saved = prefill_saved(index, ["a", "b"], [11, 12], prompt, prefill_per_token=0.001)
    assert saved == pytest.approx({"a": 0.032, "b": 0.032})
    index.forget("a")
    assert prefill_saved(index, ["a", "b"], [11, 12], prompt, 0.001) == pytest.approx({"b": 0.032})
    # A prompt that is exactly its cached blocks still computes its last block.
    assert prefill_saved(index, ["b"], [11, 12], 32, 0.001) == pytest.approx({"b": 0.016})


# -- end to end on loopback ---------------------------------------------------------------------


def _body(system: str, question: str) -> dict[str, object]:
    return {
        "model": "m1",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 2,
        "ignore_eos": True,
    }


async def test_the_sim_publishes_and_the_balancer_indexes_on_loopback() -> None:
    system = "Answer in the voice of a ship's log. " * 30
    index = KvIndex(block_size=16)
    subscriber = KvEventSubscriber(index)
    try:
        async with (
            sim(speedup=50.0, kv_events_endpoint="tcp://127.0.0.1:*") as (url, engine),
            httpx.AsyncClient(base_url=url, timeout=30) as c,
        ):
            pub = engine.kv_publisher
            assert pub is not None
            subscriber.add("i0", pub.endpoint)
            await eventually(lambda: pub.subscribers() > 0)
            r = await c.post("/v1/chat/completions", json=_body(system, "hi?"))
            assert r.status_code == 200
            hashes = block_hashes(tokens_of(f"system\x00{system}\x00user\x00hi?\x00"))
            await eventually(lambda: index.matched_blocks("i0", hashes) == len(hashes))
            assert all(h in engine.cache for h in hashes)
            assert index.counts.malformed == 0 and index.counts.gaps == 0
    finally:
        await subscriber.close()


async def test_garbage_on_the_wire_is_counted_and_the_stream_goes_on() -> None:
    index = KvIndex(block_size=16)
    subscriber = KvEventSubscriber(index)
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    try:
        subscriber.add("i0", pub.getsockopt_string(zmq.LAST_ENDPOINT))
        assert (await asyncio.wait_for(pub.recv(), 30))[:1] == b"\x01"  # subscribed
        await pub.send_multipart([b"", b"\x00" * 8])  # two frames, not three
        await pub.send_multipart([b"", b"\x00" * 3, encode_batch(batch(STORED))])
        await pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1garbage"])
        await pub.send_multipart([b"", (1).to_bytes(8, "big"), encode_batch(batch(STORED))])
        await eventually(lambda: index.matched_blocks("i0", [11, 12]) == 2)
        assert index.counts.malformed == 3
    finally:
        pub.close(linger=0)
        ctx.term()
        await subscriber.close()


def test_without_events_the_index_estimates_from_routing_history_and_says_so() -> None:
    index = KvIndex(block_size=16, estimate_blocks=3)
    index.track("a")
    index.note_routed("a", [1, 2])
    assert index.mode("a") == "history" and index.counts.fallbacks == 1
    assert index.matched_blocks("a", [1, 2]) == 2
    index.note_routed("a", [3, 4])  # the estimate's LRU is the instance's KV cache: 3 blocks
    assert index.blocks_held("a") == 3 and index.matched_blocks("a", [1]) == 0
    # Its first event: the real cache replaces the estimate, and routing no longer adds to it.
    index.apply("a", 0, batch(STORED), now=1.0)
    assert index.mode("a") == "events" and index.matched_blocks("a", [2, 3, 4]) == 0
    index.note_routed("a", [7])
    assert index.matched_blocks("a", [11, 12]) == 2 and index.matched_blocks("a", [7]) == 0
    # The stream failed: back to estimates, starting empty.
    index.lost_stream("a")
    index.note_routed("a", [7])
    assert index.mode("a") == "history" and index.counts.fallbacks == 2
    assert index.matched_blocks("a", [11]) == 0 and index.matched_blocks("a", [7]) == 1
    assert index.mode("ghost") == "none"
