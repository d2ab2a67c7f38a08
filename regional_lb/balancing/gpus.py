"""GPU profiles: relative speed, memory and batching, shared by the simulated inference server,
the discrete-event simulator and the balancer's speed priors.

Speeds are relative to the reference GPU (A100 = 1.0), which is what a cost unit is measured
on. The ratios are round figures for a 7-8B model in fp16: several-fold apart, which is the
point; an instance's real speed is learned online and the prior only matters at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuProfile:
    name: str
    speed: float  # relative to the A100
    memory_gb: float
    batch_slots: int  # concurrent sequences (continuous batching)
    # Extra time per step for each additional sequence in the batch, as a share of a
    # single-sequence step: 0 would be free batching, 1 no batching gain at all.
    batch_penalty: float = 0.15

    @property
    def decode_s_per_token(self) -> float:
        return REFERENCE_DECODE_S / self.speed

    @property
    def prefill_tokens_per_s(self) -> float:
        return REFERENCE_PREFILL_TOKENS_PER_S * self.speed


REFERENCE_DECODE_S = 0.02  # one sequence alone on an A100
REFERENCE_PREFILL_TOKENS_PER_S = 5000.0

GPUS: dict[str, GpuProfile] = {
    "T4": GpuProfile("T4", speed=0.2, memory_gb=16, batch_slots=8),
    "A10G": GpuProfile("A10G", speed=0.4, memory_gb=24, batch_slots=12),
    "L4": GpuProfile("L4", speed=0.35, memory_gb=24, batch_slots=12),
    "A100": GpuProfile("A100", speed=1.0, memory_gb=80, batch_slots=32),
    "H100": GpuProfile("H100", speed=2.0, memory_gb=80, batch_slots=48),
}


def profile(name: str) -> GpuProfile:
    try:
        return GPUS[name.upper()] if name.upper() in GPUS else GPUS[name]
    except KeyError:
        raise KeyError(f"unknown GPU type {name!r}; known: {', '.join(GPUS)}") from None


def batch_throughput(n: int, penalty: float) -> float:
    """Sequences' worth of progress per single-sequence step time with ``n`` in the batch."""
    if n <= 0:
        return 0.0
    return n / (1.0 + penalty * (n - 1))


def batch_slowdown(n: float, penalty: float) -> float:
    """How many times longer one sequence's step takes with ``n`` in the batch than alone."""
    return 1.0 + penalty * (max(n, 1.0) - 1.0)
