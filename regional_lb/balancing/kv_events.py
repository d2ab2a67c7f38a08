"""vLLM's KV-cache events: the messages and their msgpack encoding (pure: bytes in, bytes out;
the ZMQ transport is in regional_lb.sim.kv_publisher and regional_lb.upstream.kv_subscriber).

vLLM (``vllm/distributed/kv_events.py``) publishes what its prefix cache does over a ZMQ PUB
socket as three frames: ``topic``, an 8-byte big-endian sequence number, and a msgpack payload,
a ``KVEventBatch`` of ``ts`` (seconds since the epoch) and ``events``. The events are msgspec
structs tagged with their class name:

* ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name)``: full blocks, in prefix order, entered the cache; ``parent_block_hash`` is the
  block before the first (None at a prompt's start);
* ``BlockRemoved(block_hashes, medium)``: blocks were evicted;
* ``AllBlocksCleared()``: the cache was reset.

vLLM has shipped two layouts of the same structs: ``array_like`` (a batch is ``[ts, events]``
and an event ``["BlockStored", hashes, parent, ...]``, trailing fields at their default left
out), which llm-d's indexer reads, and later map-shaped events (``{"type": "BlockStored",
"block_hashes": ...}``). :func:`encode_batch` writes the array layout; :func:`decode_batch`
reads both and raises :class:`KvEventError` for anything else, so a subscriber counts a bad
message and keeps going. Block hashes are integers (vLLM's ``ExternalBlockHash`` before 0.11)
or bytes (since); bytes are read as their last 8 bytes, big-endian.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from regional_lb.errors import RegionalError

MEDIUM_GPU = "GPU"
MAX_EVENTS_PER_BATCH = 100_000  # a batch claiming more is refused before it is walked


class KvEventError(RegionalError):
    """A KV-event message that is not one vLLM could have sent."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None


# -- encoding ---------------------------------------------------------------------------------


def _event_array(event: KvEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        out: list[Any] = [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
        ]
        return out
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    return ["AllBlocksCleared"]


def encode_batch(batch: KvEventBatch) -> bytes:
    """The msgpack payload of one batch, in vLLM's array layout."""
    body: list[Any] = [batch.ts, [_event_array(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:  # omit_defaults: left out when unset
        body.append(batch.data_parallel_rank)
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


# -- decoding ---------------------------------------------------------------------------------


def _hash(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise KvEventError(f"{what} is a boolean, not a block hash")
    if isinstance(value, int):
        return value & 0xFFFFFFFFFFFFFFFF
    if isinstance(value, bytes) and value:
        return int.from_bytes(value[-8:], "big")
    raise KvEventError(f"{what} is {type(value).__name__}, not a block hash")


def _hashes(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise KvEventError(f"{what} is {type(value).__name__}, not a list")
    return tuple(_hash(v, f"{what}[{i}]") for i, v in enumerate(value))


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise KvEventError(f"{what} is not a list of integers")
    return tuple(value)


def _opt_int(value: Any, what: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise KvEventError(f"{what} is {type(value).__name__}, not an integer or nil")


def _opt_str(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise KvEventError(f"{what} is {type(value).__name__}, not a string or nil")


_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size")
_STORED_OPT = ("lora_id", "medium", "lora_name")


def _fields(raw: Any, names: tuple[str, ...], optional: tuple[str, ...]) -> dict[str, Any]:
    """An event's fields by name from either layout (its tag already taken off)."""
    if isinstance(raw, list):
        if len(raw) < len(names):
            raise KvEventError(f"event has {len(raw)} fields, needs at least {len(names)}")
        return dict(zip(names + optional, raw, strict=False))
    if not isinstance(raw, dict):
        raise KvEventError("event is neither an array nor a map")
    missing = [n for n in names if n not in raw]
    if missing:
        raise KvEventError(f"event lacks {', '.join(missing)}")
    return {n: raw[n] for n in names + optional if n in raw}


def _event(raw: Any, at: str) -> KvEvent:
    body: Any
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, body = raw[0], raw[1:]
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag, body = raw["type"], raw
    else:
        raise KvEventError(f"{at} is not a tagged event")
    if tag == "BlockStored":
        f = _fields(body, _STORED, _STORED_OPT)
        size = f["block_size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise KvEventError(f"{at}.block_size is not a positive integer")
        parent = f["parent_block_hash"]
        return BlockStored(
            block_hashes=_hashes(f["block_hashes"], f"{at}.block_hashes"),
            parent_block_hash=None if parent is None else _hash(parent, f"{at}.parent"),
            token_ids=_ints(f["token_ids"], f"{at}.token_ids"),
            block_size=size,
            lora_id=_opt_int(f.get("lora_id"), f"{at}.lora_id"),
            medium=_opt_str(f.get("medium"), f"{at}.medium"),
            lora_name=_opt_str(f.get("lora_name"), f"{at}.lora_name"),
        )
    if tag == "BlockRemoved":
        f = _fields(body, ("block_hashes",), ("medium",))
        return BlockRemoved(
            _hashes(f["block_hashes"], f"{at}.block_hashes"),
            _opt_str(f.get("medium"), f"{at}.medium"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KvEventError(f"{at} has an unknown tag {tag[:40]!r}")


def decode_batch(payload: bytes) -> KvEventBatch:
    """One batch from its msgpack payload, in either of vLLM's layouts."""
    try:
        raw = msgpack.unpackb(
            payload, raw=False, strict_map_key=False, max_array_len=MAX_EVENTS_PER_BATCH * 8
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise KvEventError(f"not msgpack: {type(exc).__name__}") from exc
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "ts" in raw and "events" in raw:
        ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        raise KvEventError("not an event batch")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts):
        raise KvEventError("batch ts is not a finite number")
    if not isinstance(events, list) or len(events) > MAX_EVENTS_PER_BATCH:
        raise KvEventError("batch events is not a list of a sane length")
    return KvEventBatch(
        float(ts),
        tuple(_event(e, f"events[{i}]") for i, e in enumerate(events)),
        _opt_int(rank, "data_parallel_rank"),
    )


def encode_sequence(seq: int) -> bytes:
    """The sequence-number frame: 8 bytes, big-endian, as vLLM's publisher sends it."""
    return seq.to_bytes(8, "big", signed=True)


def decode_sequence(frame: bytes) -> int:
    if len(frame) != 8:
        raise KvEventError(f"sequence frame is {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)
