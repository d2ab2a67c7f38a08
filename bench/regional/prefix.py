"""KV-cache-aware routing benchmark: prefix-sharing workloads, every policy in one run.

    python bench/regional/prefix.py [--workload mooncake|mooncake_synthetic|system_prompt|rag|
                                     conversation|chat_mix|all] [--load 0.8] [--sustained]
                                    [--instances 8] [--n 0] [--trace PATH]

Each instance is a step-level model of a vLLM server: continuous batching of up to
``max_seqs`` sequences, chunked prefill under a per-step token budget (a step takes the decode
time of its batch plus the time of the prompt tokens it prefills, so a prefill stalls every
sequence in the batch; a request waits, counted as waiting, until its first chunk is
scheduled), and the prefix cache of :mod:`regional_lb.sim.prefix_cache` (the same model the
simulated server runs): blocks hit are not prefilled, memory is the KV cache's blocks. The
cache's KV events feed the balancer's :class:`regional_lb.balancing.kv_index.KvIndex` as the
subscriber would feed it from a real server.

Policies, all on the same requests: ``round_robin``; ``least_connections``; ``ours``, today's
balancer, :func:`regional_lb.balancing.pick.pick` (least outstanding work); ``ours_prefix``,
the same with today's character-prefix affinity (a key of the first 1,024 characters, which
lies in a prompt's first block); ``llmd_weighted`` and ``llmd_minmax``, llm-d's
precise-prefix-cache profile (see ``llmd`` below); ``cache_aware``, ours with each instance's
cached prefill from the KV-event index and queued prompts priced at the single-sequence speed;
``cache_batched``, the same index with every queued second at the full-batch speed (the first
pricing, kept to show the difference); ``cache_history``, ``cache_aware`` with no KV events
(the index estimated from what was routed where, an LRU as large as the KV cache);
``oracle``, which sees every instance's cache and queue exactly and picks the least time to
the request's first token (greedy: the best single choice with perfect information, not a
bound; :mod:`bench.regional.prefix_report` computes a bound).

Printed: per workload, a table (:func:`bench.regional.prefix_report.table`) and the issue's
targets with their figures.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.regional.prefix_report import (
    SATURATE,
    Row,
    WorkOf,
    floor_p90,
    nominal,
    prefix_free_targets,
    prefix_targets,
    sustained,
    table,
)
from bench.regional.prefix_workloads import (
    BLOCK,
    SYNTHETIC,
    Request,
    chat_mix,
    conversation,
    mooncake,
    rag,
    system_prompt,
)
from regional_lb.balancing.affinity import key_of
from regional_lb.balancing.gpus import batch_throughput
from regional_lb.balancing.instance import InstanceState, SpeedLearner
from regional_lb.balancing.kv_events import KvEventBatch
from regional_lb.balancing.kv_index import KvIndex, prefill_saved
from regional_lb.balancing.pick import PickParams, PickRequest, pick
from regional_lb.sim.prefix_cache import Admission, PrefixCache

WARMUP_SHARE = 0.05
POLICY_NAMES = (
    "round_robin",
    "least_connections",
    "ours",
    "ours_prefix",
    "llmd_weighted",
    "llmd_minmax",
    "cache_batched",
    "cache_history",
    "cache_aware",
    "oracle",
)


@dataclass(frozen=True, slots=True)
class Gpu:
    """An A100 serving an 8B model (llama-3-8B: 128 KiB of KV per token, ~60 GB for KV)."""

    decode_s: float = 0.015  # one decode step with one sequence
    penalty: float = 0.02  # each more sequence in the batch slows the step by this share
    prefill_s: float = 1.0e-4  # per prompt token (10k tokens/s)
    budget: int = 8192  # tokens per step (vLLM's max_num_batched_tokens)
    max_seqs: int = 64
    kv_blocks: int = 900  # 460k tokens of KV at BLOCK tokens a block

    def work(self, prompt: int, output: int) -> float:
        """GPU seconds a request takes when nothing is cached, decode amortised over a
        full batch (for calibrating the load)."""
        return prompt * self.prefill_s + output * self.decode_s / batch_throughput(
            self.max_seqs, self.penalty
        )


@dataclass(slots=True)
class Seq:
    id: int
    req: Request
    est_cost: float
    server: int = -1
    prefill_left: int = 0
    produced: int = 0
    hit_tokens: int = 0
    ttft: float = math.nan
    done_at: float = math.nan
    adm: Admission | None = None
    chunk: int = 0  # prompt tokens being prefilled in the current step
    admitted: float = math.nan  # when it joined the batch (the end of its queue wait)


@dataclass(slots=True)
class Server:
    gpu: Gpu
    cache: PrefixCache
    waiting: deque[Seq] = field(default_factory=deque)
    running: list[Seq] = field(default_factory=list)
    step_end: float | None = None  # None: idle
    decoding: list[Seq] = field(default_factory=list)
    seq: int = 0  # KV-event batch sequence number

    def exact_time_to_first_token(self, req: Request) -> float:
        """What the oracle sees: every prompt token queued ahead of the request here and its
        own that are not cached (prefill goes first come, first served, in chunks of the step
        budget, each step also carrying the batch's decode), plus the wait for a free slot
        when the batch is full."""
        g = self.gpu
        queued = [*self.running, *self.waiting]
        prefill = sum(s.prefill_left for s in self.running)
        prefill += sum(s.req.prompt - self._hit(s.req) for s in self.waiting)
        prefill += req.prompt - self._hit(req)
        decoding = sum(1 for s in self.running if s.prefill_left == 0)
        step = g.decode_s * (1 + g.penalty * max(decoding - 1, 0))
        steps = math.ceil(prefill / max(g.budget - decoding, 1))
        t = prefill * g.prefill_s + steps * step
        over = len(queued) + 1 - g.max_seqs
        if over > 0:  # it starts when the over-th shortest remaining decode ends
            left = sorted(s.req.output - s.produced for s in self.running)
            t += left[min(over, len(left)) - 1] * step if left else 0.0
        return t

    def _hit(self, req: Request) -> int:
        matched = self.cache.matched_blocks(req.blocks)
        return min(matched * BLOCK, max(req.prompt - 1, 0) // BLOCK * BLOCK)

    def start_step(self, now: float) -> None:
        """Plan one step as vLLM's scheduler does: decode every running sequence, give the
        running prompts their next chunks, then take waiting requests, oldest first, while
        the step's token budget and the batch have room (a request stays waiting, and counts
        in ``vllm:num_requests_waiting``, until its first chunk is scheduled; its cache hit is
        looked up then). Sets when the step ends."""
        g = self.gpu
        self.decoding = [s for s in self.running if s.prefill_left == 0]
        budget = g.budget - len(self.decoding)
        prefill = 0
        for s in self.running:
            s.chunk = 0
            if s.prefill_left > 0 and budget > 0:
                s.chunk = min(s.prefill_left, budget)
                budget -= s.chunk
                prefill += s.chunk
        while self.waiting and len(self.running) < g.max_seqs and budget > 0:
            s = self.waiting[0]
            adm = self.cache.admit_blocks(
                s.req.blocks, s.req.prompt, s.req.output, force=not self.running
            )
            if adm is None:
                break
            self.waiting.popleft()
            s.adm, s.hit_tokens, s.admitted = adm, adm.hit_tokens, now
            s.prefill_left = max(1, adm.prefill_tokens)
            s.chunk = min(s.prefill_left, budget)
            budget -= s.chunk
            prefill += s.chunk
            self.running.append(s)
        n = len(self.decoding)
        dt = (g.decode_s * (1 + g.penalty * (n - 1)) if n else 0.0) + prefill * g.prefill_s
        self.step_end = now + max(dt, 1e-6) if self.running else None

    def finish_step(self, now: float) -> tuple[list[Seq], list[Seq]]:
        """The step ended: tokens out; returns (first tokens, finished)."""
        first, done = [], []
        for s in self.decoding:
            s.produced += 1
        for s in self.running:
            if s.chunk:
                s.prefill_left -= s.chunk
                s.chunk = 0
                if s.prefill_left == 0:
                    s.ttft, s.produced = now, 1
                    first.append(s)
        keep = []
        for s in self.running:
            if s.prefill_left == 0 and s.produced >= s.req.output:
                s.done_at = now
                assert s.adm is not None
                self.cache.release(s.adm)
                done.append(s)
            else:
                keep.append(s)
        self.running = keep
        self.step_end = None
        return first, done


@dataclass(slots=True)
class Fleet:
    servers: list[Server]
    states: list[InstanceState]
    index: KvIndex
    gpu: Gpu
    mean_cost: float = 1.0


# -> (instance, work it adds, the part of that work that is prefill, when the policy splits it)
Policy = Callable[[Seq, float, Fleet], tuple[int, float, float]]


def _argmin(values: list[float], start: int) -> int:
    n = len(values)
    best = start % n
    for k in range(1, n):
        i = (start + k) % n
        if values[i] < values[best]:
            best = i
    return best


def make_policy(name: str) -> Policy:
    turn = [0]
    params = PickParams(slow_start_s=0.0)

    def rr(s: Seq, now: float, f: Fleet) -> tuple[int, float, float]:
        turn[0] += 1
        return turn[0] % len(f.servers), s.est_cost, 0.0

    def lc(s: Seq, now: float, f: Fleet) -> tuple[int, float, float]:
        turn[0] += 1
        return _argmin([float(st.in_flight) for st in f.states], turn[0]), s.est_cost, 0.0

    def ours(s: Seq, now: float, f: Fleet) -> tuple[int, float, float]:
        turn[0] += 1
        saved = prefill = None
        if name in ("cache_aware", "cache_history", "cache_batched"):
            ids = [st.id for st in f.states]
            saved = prefill_saved(f.index, ids, s.req.blocks, s.req.prompt, f.gpu.prefill_s)
            # cache_batched: the same index without the split (the first pricing).
            prefill = None if name == "cache_batched" else s.req.prompt * f.gpu.prefill_s
        req = PickRequest(
            model="m",
            cost=s.est_cost,
            mean_cost=f.mean_cost,
            tiebreak=turn[0],
            affinity=key_of(str(s.req.first)) if name == "ours_prefix" else None,
            prefill_saved=saved,
            prefill=prefill,
        )
        choice = pick(f.states, req, now, params)
        assert choice is not None
        i = f.states.index(choice.instance)
        # The work it adds there: what it will still have to prefill.
        skipped = (saved or {}).get(choice.instance.id, 0.0)
        return i, s.est_cost - skipped, max((prefill or 0.0) - skipped, 0.0)

    def llmd(s: Seq, now: float, f: Fleet) -> tuple[int, float, float]:
        """llm-d's precise-prefix-cache profile (its guide's EndpointPickerConfig): weights
        3 precise-prefix-cache-scorer, 2 kv-cache-utilization-scorer, 2 queue-scorer, highest
        wins. Prefix: the longest run of the prompt's leading blocks each pod holds (from the
        KV-event index) as a share of the prompt's blocks; ``llmd_minmax`` normalises it
        min-max over the pods holding any (the others 0, all 1 when equal), as llm-d's scorer
        does, which on a trace where every prompt shares its first block turns one block's
        difference into the whole weight (P90 2.6x worse on the Mooncake sample); the
        targets take the better of the two. KV: 1 - cache use. Queue: requests waiting for
        their first prefill chunk (vLLM's num_requests_waiting), min-max normalised (all 1
        when equal). The servers' gauges are read exactly (llm-d scrapes them every few tens
        of milliseconds)."""
        turn[0] += 1
        queues = [len(v.waiting) for v in f.servers]
        lo, hi = min(queues), max(queues)
        matched = [f.index.matched_blocks(st.id, s.req.blocks) for st in f.states]
        held = [m for m in matched if m > 0]
        mlo, mhi = (min(held), max(held)) if held else (0, 0)
        n_blocks = max(len(s.req.blocks), 1)
        scores = []
        for m, v, q in zip(matched, f.servers, queues, strict=True):
            if name == "llmd_minmax":
                prefix = 0.0 if m == 0 else 1.0 if mhi == mlo else (m - mlo) / (mhi - mlo)
            else:
                prefix = m / n_blocks
            kv = v.cache.used_blocks / max(v.cache.capacity_blocks, 1)
            queue = 1.0 if hi == lo else (hi - q) / (hi - lo)
            scores.append(-(3.0 * prefix + 2.0 * (1.0 - kv) + 2.0 * queue))
        return _argmin(scores, turn[0]), s.est_cost, 0.0

    def oracle(s: Seq, now: float, f: Fleet) -> tuple[int, float, float]:
        turn[0] += 1
        ttft = [v.exact_time_to_first_token(s.req) for v in f.servers]
        return _argmin(ttft, turn[0]), s.est_cost, 0.0

    named: dict[str, Policy] = {
        "round_robin": rr,
        "least_connections": lc,
        "llmd_weighted": llmd,
        "llmd_minmax": llmd,
        "oracle": oracle,
    }
    return named.get(name, ours)


@dataclass(slots=True)
class Result:
    ttft: list[float]
    output_tps: float
    hit_rate: float
    outputs: list[int] = field(default_factory=list)  # per measured request, as ttft
    span: float = 1.0
    # Per measured request, as ttft: time queued at the instance before joining its batch,
    # and from then to the first token (its prefill, sharing steps with other prompts').
    waits: list[float] = field(default_factory=list)
    prefills: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # arrival to the last token
    done_at: list[float] = field(default_factory=list)  # every request, in order

    def goodput(self, slo: float) -> float:
        """Output tokens per second of the requests whose first token came within ``slo``."""
        good = sum(o for t, o in zip(self.ttft, self.outputs, strict=True) if t <= slo)
        return good / self.span


def simulate(requests: list[Request], policy_name: str, instances: int, gpu: Gpu) -> Result:
    servers = [Server(gpu, PrefixCache(gpu.kv_blocks, BLOCK)) for _ in range(instances)]
    states = [
        InstanceState(
            id=f"i{k}",
            speed=SpeedLearner(unit_speed=1.0, slots=gpu.max_seqs, penalty=gpu.penalty),
            max_concurrency=1 << 30,
        )
        for k in range(instances)
    ]
    index = KvIndex(block_size=BLOCK, estimate_blocks=gpu.kv_blocks)
    events = policy_name != "cache_history"  # that one sees no KV events: history only
    for st in states:
        index.track(st.id)
    fleet = Fleet(servers, states, index, gpu)
    policy = make_policy(policy_name)

    def cost(prompt: int, output: int) -> float:  # the balancer's estimate, reference seconds
        return prompt * gpu.prefill_s + output * gpu.decode_s

    seqs = [Seq(k, r, cost(r.prompt, r.output)) for k, r in enumerate(requests)]
    fleet.mean_cost = statistics.fmean(s.est_cost for s in seqs) if seqs else 1.0

    def publish(i: int, now: float) -> None:
        batch = servers[i].cache.take_events()
        if batch and events:
            index.apply(states[i].id, servers[i].seq, KvEventBatch(now, tuple(batch)), now)
            servers[i].seq += 1

    k = 0
    while True:
        ends = [(v.step_end, i) for i, v in enumerate(servers) if v.step_end is not None]
        next_end = min(ends) if ends else None
        if k < len(seqs) and (next_end is None or seqs[k].req.arrival <= next_end[0]):
            s = seqs[k]
            k += 1
            now = s.req.arrival
            i, work, prefill = policy(s, now, fleet)
            s.server = i
            states[i].add(s.id, max(work, 1e-6), now, prefill=prefill)
            index.note_routed(states[i].id, s.req.blocks)
            servers[i].waiting.append(s)
            if servers[i].step_end is None:
                servers[i].start_step(now)
                publish(i, now)
            continue
        if next_end is None:
            break
        now, i = next_end
        srv, st = servers[i], states[i]
        first, done = srv.finish_step(now)
        for s in first:
            st.first_token(s.id, now)
        for s in done:
            st.release(s.id, now, actual_cost=cost(s.req.prompt - s.hit_tokens, s.req.output))
        # The balancer re-estimates what is left from the tokens it has seen stream.
        for s in srv.running:
            if s.prefill_left == 0:
                st.update_remaining(s.id, (s.req.output - s.produced) * gpu.decode_s, s.produced)
        publish(i, now)
        if srv.running or srv.waiting:
            srv.start_step(now)
            publish(i, now)

    measured = seqs[int(len(seqs) * WARMUP_SHARE) :]
    span = max(s.done_at for s in measured) - measured[0].req.arrival if measured else 1.0
    prompt = sum(s.req.prompt for s in seqs) or 1
    return Result(
        ttft=[s.ttft - s.req.arrival for s in measured],
        output_tps=sum(s.req.output for s in measured) / max(span, 1e-9),
        hit_rate=sum(s.hit_tokens for s in seqs) / prompt,
        outputs=[s.req.output for s in measured],
        span=max(span, 1e-9),
        waits=[s.admitted - s.req.arrival for s in measured],
        prefills=[s.ttft - s.admitted for s in measured],
        latencies=[s.done_at - s.req.arrival for s in measured],
        done_at=[s.done_at for s in seqs],
    )


def at_load(requests: list[Request], load: float, instances: int, gpu: Gpu) -> list[Request]:
    """The requests with arrival times scaled so that their uncached work is ``load`` times
    what ``instances`` GPUs can do at full batches in the same span (nominal capacity)."""
    return nominal(requests, load, instances, _work_of(gpu))


def _work_of(gpu: Gpu) -> WorkOf:
    return WorkOf(gpu.prefill_s, gpu.decode_s / batch_throughput(gpu.max_seqs, gpu.penalty))


def capacity(requests: list[Request], instances: int, gpu: Gpu) -> float:
    """What today's balancer sustains on these requests, in nominal capacities
    (:mod:`bench.regional.prefix_report`)."""
    flood = at_load(requests, SATURATE, instances, gpu)
    r = simulate(flood, "ours", instances, gpu)
    return sustained(flood, r.done_at, instances, _work_of(gpu))


def run(
    requests: list[Request], instances: int, gpu: Gpu, slo: float, names: tuple[str, ...]
) -> dict[str, Row]:
    rows = {}
    for name in names:
        t0 = time.perf_counter()
        r = simulate(requests, name, instances, gpu)
        rows[name] = Row(
            r.ttft,
            r.latencies,
            r.waits,
            r.prefills,
            r.output_tps,
            r.goodput(slo),
            r.hit_rate,
            time.perf_counter() - t0,
        )
    return rows


PREFIX_FREE = ("chat_mix",)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", default="all")
    ap.add_argument("--load", type=float, default=0.8, help="share of nominal capacity")
    ap.add_argument(
        "--sustained",
        action="store_true",
        help="--load as a share of what today's balancer sustains on the workload instead",
    )
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--n", type=int, default=0, help="requests per workload (0: whole trace)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trace", type=Path, default=None, help="a Mooncake trace .jsonl[.gz|.xz]")
    ap.add_argument("--slo", type=float, default=2.0, help="TTFT SLO (s) for the goodput column")
    args = ap.parse_args()
    gpu = Gpu()
    n = args.n or 2000
    loaders: dict[str, Callable[[], list[Request]]] = {
        "mooncake": lambda: mooncake(args.trace, args.n),
        "mooncake_synthetic": lambda: mooncake(args.trace or SYNTHETIC, args.n),
        "system_prompt": lambda: system_prompt(n, args.seed),
        "rag": lambda: rag(n, args.seed),
        "conversation": lambda: conversation(n, args.seed),
        "chat_mix": lambda: chat_mix(n, args.seed),
    }
    if args.trace is not None:
        loaders["toolagent"] = lambda: mooncake(args.trace, args.n)
    names = [k for k in loaders if k != "toolagent"] if args.workload == "all" else [args.workload]
    unknown = [k for k in names if k not in loaders]
    if unknown:
        ap.error(f"unknown workload {unknown[0]!r} (toolagent needs --trace PATH)")
    started = time.perf_counter()
    for wl in names:
        base = loaders[wl]()
        cap = capacity(base, args.instances, gpu) if args.sustained else 1.0
        reqs = at_load(base, args.load * cap, args.instances, gpu)
        of = f"what today's sustains ({cap:.3f} nominal)" if args.sustained else "nominal capacity"
        print(
            f"\n{wl}: {len(reqs)} requests, {args.instances} instances, "
            f"load {args.load:.2f} of {of}, blocks of {BLOCK} tokens"
        )
        rows = run(reqs, args.instances, gpu, args.slo, POLICY_NAMES)
        print("\n".join(table(rows)))
        if wl in PREFIX_FREE:
            print("\n".join(prefix_free_targets(rows)))
        else:
            floor = floor_p90(reqs, int(len(reqs) * WARMUP_SHARE), gpu.prefill_s)
            print("\n".join(prefix_targets(rows, floor)))
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
