"""Discrete-event simulator: seeded Poisson arrivals routed by a policy to simulated
continuous-batching instances. Deterministic for a given (scenario, load, policy, seed).

The balancer's bookkeeping (:class:`regional_lb.balancing.instance.InstanceState`: add on dispatch,
re-estimate while running, release on completion) is the real code, kept for every policy, so
``ours`` runs exactly the function the proxy runs. Arrivals, true costs and estimation errors
depend only on the seed, so every policy sees the same requests.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from bench.regional.policies import Fleet, Policy
from bench.regional.scenarios import Scenario, ServerSpec
from regional_lb.balancing.admission import PoolLoad, TierSpec, predicted_wait, retry_after_for
from regional_lb.balancing.cost import ErrorTracker
from regional_lb.balancing.instance import InstanceState, SpeedLearner

WARMUP_SHARE = 0.05  # the first requests fill the pipes and teach the learners; not measured


@dataclass(slots=True)
class Job:
    id: int
    arrival: float
    true_cost: float
    est_cost: float
    remaining: float
    server: int = -1
    done_at: float = math.nan
    rejected: bool = False
    retry_after: float = math.nan
    predicted_wait: float = math.nan
    dispatched_at: float = math.nan
    behind: Job | None = None  # for a 429: the last request queued when it was refused


class SimServer:
    """Processor sharing among up to ``slots`` running jobs; a FIFO queue behind them."""

    __slots__ = (
        "busy_until_window",
        "last",
        "penalty",
        "queue",
        "running",
        "slots",
        "spec",
        "speed",
        "version",
        "window_end",
        "work_done",
    )

    def __init__(self, spec: ServerSpec, window_end: float) -> None:
        self.spec = spec
        self.speed, self.slots, self.penalty = spec.speed, spec.slots, spec.penalty
        self.running: list[Job] = []
        self.queue: deque[Job] = deque()
        self.last = 0.0
        self.version = 0
        self.work_done = 0.0  # within the measurement window, for utilisation
        self.window_end = window_end

    @property
    def capacity(self) -> float:
        return self.spec.capacity

    def rate(self) -> float:
        n = len(self.running)
        return self.speed / (1.0 + self.penalty * (n - 1)) if n else 0.0

    def advance(self, now: float) -> None:
        dt = now - self.last
        if dt > 0 and self.running:
            step = dt * self.rate()
            for job in self.running:
                job.remaining -= step
            lo, hi = self.last, min(now, self.window_end)
            if hi > lo:
                self.work_done += (hi - lo) * self.rate() * len(self.running)
        self.last = now

    def exact_work_left(self, now: float) -> float:
        self.advance(now)
        return sum(max(j.remaining, 0.0) for j in self.running) + sum(
            j.true_cost for j in self.queue
        )

    def admit(self, job: Job) -> None:
        if len(self.running) < self.slots:
            self.running.append(job)
        else:
            self.queue.append(job)

    def next_completion(self) -> float | None:
        if not self.running:
            return None
        return self.last + max(min(j.remaining for j in self.running), 0.0) / self.rate()

    def pop_finished(self) -> list[Job]:
        done = [j for j in self.running if j.remaining <= 1e-9]
        if done:
            self.running = [j for j in self.running if j.remaining > 1e-9]
            while self.queue and len(self.running) < self.slots:
                self.running.append(self.queue.popleft())
        return done


@dataclass(frozen=True, slots=True)
class AdmissionSpec:
    """A balancer queue in front of the pool: at most ``running_limit`` requests dispatched."""

    running_limit: int
    queue_limit: int = 1000
    queue_timeout_s: float = 30.0


@dataclass(slots=True)
class RunResult:
    latencies: list[float]
    utilisation: list[float]
    work_share: list[float]
    duration: float
    offered: int
    rejected: int
    # (predicted wait, actual wait) for 429s: when the last request queued at the time of the
    # refusal actually started, i.e. how long the refused one would have waited.
    drain: list[tuple[float, float]] = field(default_factory=list)
    retry_ok: int = 0  # 429s whose retry at Retry-After would have been admitted


def make_jobs(
    scenario: Scenario, load: float, seed: int, n: int, sigma: float, mean_cost: float
) -> list[Job]:
    rng = random.Random(seed)
    err = random.Random(seed * 7919 + 1)
    rate = load * scenario.capacity / mean_cost
    t, jobs = 0.0, []
    for k in range(n):
        t += rng.expovariate(rate)
        cost = scenario.sample_cost(rng)
        # The error draw is independent of the sizes so sigma changes nothing else.
        est = cost * math.exp(sigma * err.gauss(0.0, 1.0)) if sigma > 0 else cost
        jobs.append(Job(k, t, cost, est, cost))
    return jobs


def simulate(
    scenario: Scenario,
    policy: Policy,
    jobs: list[Job],
    seed: int,
    admission: AdmissionSpec | None = None,
) -> RunResult:
    jobs = [Job(j.id, j.arrival, j.true_cost, j.est_cost, j.true_cost) for j in jobs]
    window_end = jobs[-1].arrival if jobs else 0.0
    servers = [SimServer(s, window_end) for s in scenario.servers]
    states = [
        InstanceState(
            id=f"{s.name}-{i}",
            speed=SpeedLearner(unit_speed=s.speed, slots=s.slots, penalty=s.penalty),
            max_concurrency=1 << 30,
        )
        for i, s in enumerate(scenario.servers)
    ]
    fleet = Fleet(
        states,
        [s.capacity for s in scenario.servers],
        servers,
        ErrorTracker(),
        random.Random(seed * 31 + 7),
    )
    heap: list[tuple[float, int, int]] = []  # (time, version, server)
    waiting: deque[Job] = deque()
    running_total = 0
    decisions: list[tuple[float, bool]] = []  # (time, admitted) at each arrival
    est_sum, est_n = 0.0, 0
    tier = TierSpec(
        "standard",
        0,
        1.0,
        admission.queue_limit if admission else 0,
        admission.queue_timeout_s if admission else 0.0,
    )

    def reschedule(i: int) -> None:
        srv = servers[i]
        srv.version += 1
        t = srv.next_completion()
        if t is not None:
            heapq.heappush(heap, (t, srv.version, i))

    def refresh_estimates(now: float) -> None:
        # While a request runs the balancer re-estimates what is left from the tokens it has
        # seen (regional_lb.balancing.cost.CostEstimator.remaining); progress here is the true work
        # done.
        for i, srv in enumerate(servers):
            srv.advance(now)
            st = states[i]
            for job in srv.running:
                done = job.true_cost - job.remaining
                left = job.est_cost - done if done < job.est_cost else 0.25 * done
                st.update_remaining(job.id, left, 0)

    def dispatch(job: Job, now: float) -> None:
        nonlocal running_total
        if policy.name == "ours":
            refresh_estimates(now)
        i = policy.choose(now, job.est_cost, job.true_cost, fleet)
        job.server = i
        job.dispatched_at = now
        servers[i].advance(now)
        servers[i].admit(job)
        states[i].add(job.id, job.est_cost, now)
        running_total += 1
        reschedule(i)

    def pool_load() -> PoolLoad:
        return PoolLoad(
            slots=admission.running_limit if admission else 0,
            outstanding=sum(s.outstanding for s in states),
            capacity=sum(s.speed.speed for s in states),
        )

    k = 0
    while k < len(jobs) or heap:
        if heap and (k >= len(jobs) or heap[0][0] <= jobs[k].arrival):
            t, version, i = heapq.heappop(heap)
            srv = servers[i]
            if version != srv.version:
                continue
            srv.advance(t)
            for job in srv.pop_finished():
                job.done_at = t
                states[i].release(job.id, t, actual_cost=job.true_cost)
                fleet.errors.observe(job.est_cost, job.true_cost)
                running_total -= 1
            reschedule(i)
            while admission and waiting and running_total < admission.running_limit:
                nxt = waiting.popleft()
                if t - nxt.arrival > admission.queue_timeout_s:
                    nxt.rejected = True
                    continue
                dispatch(nxt, t)
            continue
        job = jobs[k]
        k += 1
        now = job.arrival
        est_sum += job.est_cost
        est_n += 1
        fleet.mean_cost = est_sum / est_n
        if admission is None or (not waiting and running_total < admission.running_limit):
            decisions.append((now, True))
            dispatch(job, now)
            continue
        ahead = sum(j.est_cost for j in waiting)
        wait = predicted_wait(tier, running_total, ahead, job.est_cost, pool_load())
        if len(waiting) >= admission.queue_limit or wait > admission.queue_timeout_s:
            job.rejected, job.retry_after = True, retry_after_for(wait, tier)
            job.predicted_wait, job.behind = wait, (waiting[-1] if waiting else None)
            decisions.append((now, False))
        else:
            decisions.append((now, True))
            waiting.append(job)

    start = int(len(jobs) * WARMUP_SHARE)
    measured = jobs[start:]
    duration = max(window_end - (measured[0].arrival if measured else 0.0), 1e-9)
    caps = [s.capacity for s in servers]
    total_work = sum(s.work_done for s in servers) or 1.0
    result = RunResult(
        latencies=[j.done_at - j.arrival for j in measured if not j.rejected],
        utilisation=[s.work_done / (c * window_end) for s, c in zip(servers, caps, strict=True)],
        work_share=[s.work_done / total_work for s in servers],
        duration=duration,
        offered=len(measured),
        rejected=sum(1 for j in measured if j.rejected),
    )
    _score_retry_after(measured, decisions, result)
    return result


def _score_retry_after(
    measured: list[Job], decisions: list[tuple[float, bool]], result: RunResult
) -> None:
    """For each 429: would a retry after Retry-After seconds have been admitted, and how close
    was the predicted wait (the drain time Retry-After is computed from) to the real one?"""
    times = [t for t, _ in decisions]
    for job in measured:
        if not job.rejected or math.isnan(job.retry_after):
            continue
        at = bisect.bisect_left(times, job.arrival + job.retry_after)
        if at < len(decisions) and decisions[at][1]:
            result.retry_ok += 1
        tail = job.behind
        if tail is not None and not math.isnan(tail.dispatched_at):
            result.drain.append((job.predicted_wait, tail.dispatched_at - job.arrival))
