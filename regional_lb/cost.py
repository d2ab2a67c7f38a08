"""Request cost estimate, in *reference-GPU seconds*, corrected online.

A cost unit is one second of work on the reference GPU (speed 1.0, an A100 by convention); an
instance's learned speed says how many units it finishes per busy second. Costs are estimated
before a request is routed from what the request itself says (prompt size, ``max_tokens``,
model, endpoint) and corrected from what completed requests turned out to be:

* clients set ``max_tokens`` far above what they get back, so each model keeps an online
  ratio of tokens produced to tokens allowed;
* the spread of ``log(actual / predicted)`` is tracked, because the picker blends in the
  request count when estimates are poor (pure cost routing loses once that spread is large).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

Endpoint = Literal["chat", "completion", "embedding"]

CHARS_PER_TOKEN = 4.0  # the usual rule of thumb for English text and BPE vocabularies


@dataclass(frozen=True, slots=True)
class ModelCoefficients:
    """Reference-GPU seconds per unit of work for one model."""

    prefill_per_token: float = 0.0002  # prompt tokens are processed in parallel: cheap
    decode_per_token: float = 0.02  # each generated token is one forward pass
    overhead: float = 0.005  # scheduling, tokenisation, first kernel launches
    load_time_s: float = 20.0  # time to load the weights onto an instance
    memory_gb: float = 16.0  # weights, for the "most free memory" choice


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What the balancer knows about a request before it runs."""

    model: str
    endpoint: Endpoint
    prompt_tokens: int
    max_tokens: int


def estimate_tokens(text_chars: int) -> int:
    """Token count from a character count, when the client did not give tokens."""
    return max(1, math.ceil(text_chars / CHARS_PER_TOKEN))


@dataclass(slots=True)
class _ModelStats:
    # Start by assuming half of max_tokens is used; the EWMA moves it within tens of requests.
    output_ratio: float = 0.5
    samples: int = 0


@dataclass(slots=True)
class ErrorTracker:
    """EWMA of the squared log error of cost estimates; ``sigma`` is its square root."""

    alpha: float = 0.02
    # A fresh balancer has seen nothing: assume a middling spread so it hedges with counts.
    mean_sq: float = 0.25
    samples: int = 0

    def observe(self, predicted: float, actual: float) -> None:
        if predicted <= 0 or actual <= 0:
            return
        err = math.log(actual / predicted)
        # Faster learning at first, so a few hundred requests are enough to trust the estimate.
        a = max(self.alpha, 1.0 / (self.samples + 2))
        self.mean_sq += a * (err * err - self.mean_sq)
        self.samples += 1

    @property
    def sigma(self) -> float:
        return math.sqrt(max(self.mean_sq, 0.0))


@dataclass(slots=True)
class CostEstimator:
    """Per-model coefficients plus the online corrections described in the module docstring."""

    coefficients: dict[str, ModelCoefficients] = field(default_factory=dict)
    default: ModelCoefficients = field(default_factory=ModelCoefficients)
    alpha: float = 0.05
    errors: ErrorTracker = field(default_factory=ErrorTracker)
    _stats: dict[str, _ModelStats] = field(default_factory=dict)

    def coeffs(self, model: str) -> ModelCoefficients:
        return self.coefficients.get(model, self.default)

    def expected_output_tokens(self, shape: RequestShape) -> float:
        if shape.endpoint == "embedding":
            return 0.0
        stats = self._stats.get(shape.model)
        ratio = stats.output_ratio if stats else _ModelStats().output_ratio
        return max(1.0, shape.max_tokens * ratio)

    def cost_of(self, shape: RequestShape, output_tokens: float) -> float:
        """Cost of a request that reads ``prompt_tokens`` and writes ``output_tokens``."""
        c = self.coeffs(shape.model)
        return (
            c.overhead
            + c.prefill_per_token * shape.prompt_tokens
            + (c.decode_per_token * output_tokens)
        )

    def estimate(self, shape: RequestShape) -> float:
        return self.cost_of(shape, self.expected_output_tokens(shape))

    def remaining(self, shape: RequestShape, produced: int) -> float:
        """Work left once ``produced`` tokens have streamed: the prompt is done, and the
        expected output is what is left of the prediction, or a tail proportional to what was
        already produced when the stream outruns the prediction."""
        c = self.coeffs(shape.model)
        expected = self.expected_output_tokens(shape)
        if produced < expected:
            left = expected - produced
        else:
            left = min(max(shape.max_tokens - produced, 0), 0.25 * produced + 1.0)
        return c.decode_per_token * left

    def observe(self, shape: RequestShape, predicted: float, output_tokens: int) -> float:
        """Record a completed request; returns its actual cost (for the speed learner)."""
        actual = self.cost_of(shape, output_tokens)
        self.errors.observe(predicted, actual)
        if shape.endpoint != "embedding" and shape.max_tokens > 0:
            stats = self._stats.setdefault(shape.model, _ModelStats())
            ratio = min(1.0, output_tokens / shape.max_tokens)
            a = max(self.alpha, 1.0 / (stats.samples + 2))
            stats.output_ratio += a * (ratio - stats.output_ratio)
            stats.samples += 1
        return actual

    @property
    def sigma(self) -> float:
        return self.errors.sigma
