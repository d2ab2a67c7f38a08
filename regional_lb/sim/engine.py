"""The simulated inference engine behind ``regional-lb sim-backend``.

It behaves like a continuous-batching server (vLLM-style) closely enough for the balancer to
be exercised for real: up to ``slots`` sequences decode together, each step taking longer the
fuller the batch; new sequences pay their prefill in the step that admits them; a sequence
needs KV-cache room for its prompt and output, and waits when there is none; asking for a
model that is not loaded pauses the engine for the model's load time and evicts the least
recently used model when too many are loaded. ``speedup`` divides every duration so tests run
a GPU's minute in a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from regional_lb.balancing.gpus import GpuProfile
from regional_lb.balancing.kv_blocks import DEFAULT_BLOCK_SIZE
from regional_lb.balancing.kv_events import KvEvent
from regional_lb.errors import RegionalError
from regional_lb.sim.prefix_cache import Admission, PrefixCache

if TYPE_CHECKING:
    from regional_lb.sim.kv_publisher import KvEventPublisher


class UnknownModel(RegionalError):
    """The engine neither has nor can load the requested model."""


@dataclass(slots=True)
class Sequence:
    id: int
    model: str
    prompt_tokens: int
    output_tokens: int  # how many it will produce (decided up front, like an EOS position)
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    produced: int = 0
    prefilled: bool = False
    aborted: bool = False
    # The prompt's token ids for the prefix cache (None: unique tokens nobody shares).
    token_ids: list[int] | None = None
    admission: Admission | None = None

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass
class EngineConfig:
    gpu: GpuProfile
    models: list[str]  # loaded at start
    loadable: list[str] = field(default_factory=list)  # may be loaded on demand
    max_loaded: int = 2
    load_time_s: float = 20.0
    kv_tokens: int = 0  # 0: derived from the GPU memory
    speedup: float = 1.0
    seed: int = 0
    kind: str = "vllm"  # the server it plays: health path and metric names (sim.metrics)
    api_key: str | None = None  # like `vllm serve --api-key`: /v1 routes need it
    max_model_len: int = 8192
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per KV block (vLLM's --block-size)
    # Where to publish KV-cache events (ZMQ, vLLM's format), e.g. "tcp://127.0.0.1:*"; None: off.
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""  # vLLM's kv_events_config "topic" (the first frame)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.gpu = config.gpu
        self.loaded: OrderedDict[str, float] = OrderedDict((m, 0.0) for m in config.models)
        self.catalog = list(dict.fromkeys(config.models + config.loadable))
        self.kv_capacity = config.kv_tokens or int(self.gpu.memory_gb * 4000)
        # The KV memory as blocks, shared prompt prefixes cached in it (vLLM's automatic
        # prefix caching, on by default since v1).
        self.cache = PrefixCache(self.kv_capacity // config.block_size, config.block_size)
        # Called with each run of KV events (the sim's ZMQ publisher, when configured).
        self.on_kv_events: Callable[[list[KvEvent]], None] | None = None
        self.kv_publisher: KvEventPublisher | None = None  # set by the server when publishing
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.stalled_until = 0.0
        self.fail_next = 0
        self.prompt_total = 0
        self.generation_total = 0
        self.loads = 0
        self._ids = itertools.count(1)
        self._rng = random.Random(config.seed)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for seq in [*self.running, *self.waiting]:
            seq.aborted = True  # streams end without [DONE]: the client sees a failure
            seq.tokens.put_nowait(None)

    # -- requests ---------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        if model not in self.catalog:
            raise UnknownModel(f"The model `{model}` does not exist.")

    def submit(
        self,
        model: str,
        prompt_tokens: int,
        max_tokens: int,
        exact: bool = False,
        token_ids: list[int] | None = None,
    ) -> Sequence:
        """Queue a generation; ``exact`` produces exactly ``max_tokens`` (like ignore_eos).
        ``token_ids`` are the prompt's tokens for the prefix cache."""
        self.check_model(model)
        out = max_tokens if exact else max(1, round(max_tokens * self._rng.uniform(0.2, 1.0)))
        seq = Sequence(next(self._ids), model, max(1, prompt_tokens), max(1, out))
        seq.token_ids = token_ids
        self.waiting.append(seq)
        self._wake.set()
        return seq

    def abort(self, seq: Sequence) -> None:
        """The client went away: free the slot and the KV cache now."""
        if seq.aborted:
            return
        seq.aborted = True
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    async def embed(self, model: str, prompt_tokens: int) -> None:
        """Embeddings are prefill only: time proportional to the input."""
        self.check_model(model)
        await self._ensure_loaded(model)
        await asyncio.sleep(prompt_tokens / self.gpu.prefill_tokens_per_s / self.config.speedup)
        self.prompt_total += prompt_tokens

    # -- metrics ----------------------------------------------------------------------------

    @property
    def kv_used(self) -> int:
        """Tokens of KV memory running sequences hold (whole blocks)."""
        return self.cache.used_blocks * self.cache.block_size

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.kv_capacity if self.kv_capacity else 0.0

    def _release(self, seq: Sequence) -> None:
        if seq.admission is not None:
            self.cache.release(seq.admission)
        self._flush_events()

    def _flush_events(self) -> None:
        events = self.cache.take_events()
        if events and self.on_kv_events is not None:
            self.on_kv_events(events)

    def _prompt(self, seq: Sequence) -> list[int]:
        if seq.token_ids is not None:
            return seq.token_ids
        # Unique to this sequence: shares no block with any other prompt.
        base = seq.id << 32
        return list(range(base, base + seq.prompt_tokens))

    # -- the loop ---------------------------------------------------------------------------

    async def _ensure_loaded(self, model: str) -> None:
        if model in self.loaded:
            self.loaded.move_to_end(model)
            return
        # Loading pauses the whole engine, as swapping weights does on one GPU.
        await asyncio.sleep(self.config.load_time_s / self.config.speedup)
        self.loads += 1
        busy = {s.model for s in self.running}
        while len(self.loaded) >= self.config.max_loaded:
            victim = next((m for m in self.loaded if m not in busy), None)
            if victim is None:
                break
            del self.loaded[victim]
        self.loaded[model] = time.monotonic()

    async def _admit(self) -> float:
        """Move waiting sequences into the batch; returns the prefill time they add."""
        prefill = 0.0
        while self.waiting and len(self.running) < self.gpu.batch_slots:
            seq = self.waiting[0]
            if seq.model not in self.loaded:
                self.waiting.popleft()
                await self._ensure_loaded(seq.model)
                if seq.aborted:
                    continue
                self.waiting.appendleft(seq)
            adm = self.cache.admit(self._prompt(seq), seq.output_tokens, force=not self.running)
            if adm is None:
                break  # no KV room: wait for a sequence to finish
            self.waiting.popleft()
            seq.admission = adm
            self.loaded.move_to_end(seq.model)
            self.running.append(seq)
            # Only the blocks not found in the cache are prefilled.
            uncached = max(1, seq.prompt_tokens - adm.hit_tokens)
            prefill += uncached / self.gpu.prefill_tokens_per_s
            self.prompt_total += seq.prompt_tokens
        self._flush_events()
        return prefill

    async def _run(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            pause = self.stalled_until - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
                continue
            prefill = await self._admit()
            n = len(self.running)
            if n == 0:
                await asyncio.sleep(0.001)
                continue
            step = self.gpu.decode_s_per_token * (1.0 + self.gpu.batch_penalty * (n - 1))
            await asyncio.sleep((step + prefill) / self.config.speedup)
            for seq in list(self.running):
                if seq.aborted:
                    continue
                seq.produced += 1
                self.generation_total += 1
                seq.tokens.put_nowait(seq.produced)
                if seq.produced >= seq.output_tokens:
                    self.running.remove(seq)
                    self._release(seq)
                    seq.tokens.put_nowait(None)
