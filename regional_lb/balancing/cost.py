"""Request cost estimate, in *reference-GPU seconds*, corrected online.

A cost unit is one second of work on the reference GPU (speed 1.0, an A100 by convention) for a
request running alone; an instance's learned speed says how many units it finishes per busy
second. Costs are estimated before a request is routed from what the request itself says
(prompt size, ``max_tokens``, model, endpoint) and corrected from what completed requests
turned out to be:

* clients set ``max_tokens`` far above what they get back, so each model keeps an online
  ratio of tokens produced to tokens allowed;
* each model's coefficients (overhead, prefill and decode per token) start from the
  configuration and are refitted from the timing of completed streams
  (:class:`CoefficientFit`): the decode time per generated token, and the time to the first
  token against the prompt size. The proxy hands over timings already normalised to a
  reference GPU running the sequence alone
  (:meth:`regional_lb.balancing.instance.InstanceState.timing`), so a slow or busy instance does not
  make a model look expensive;
* the spread of ``log(actual / predicted)`` is tracked, because the picker blends in the
  request count when estimates are poor (pure cost routing loses once that spread is large).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
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


# -- online coefficients ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TimingSample:
    """What one completed stream showed about its model, in reference-GPU seconds of a
    sequence running alone: the proxy's wall-clock times multiplied by the instance's
    normalised speed, with the batch slowdown taken out of the decode time.

    ``first_token`` is the time from dispatch to the first token; it is meaningful only when
    the request did not wait at the instance (``queued`` False). ``first_token_steps`` is how
    many single-sequence decode steps that time contains besides overhead and prefill: the
    step that produced the first token, slowed by the batch it joined, plus on average half
    a step of waiting for the running step to end. ``decode`` is the reference time the
    ``output_tokens - 1`` tokens after the first took, already divided by the batch slowdown.
    """

    prompt_tokens: int
    output_tokens: int
    first_token: float | None
    first_token_steps: float
    decode: float | None
    queued: bool


@dataclass(frozen=True, slots=True)
class LearnParams:
    alpha: float = 0.02  # weight of one decode sample once warmed up: a memory of ~50
    line_alpha: float = 0.01  # the same for time-to-first-token samples, which are noisier
    min_samples: int = 16  # before that many, the configured value is used
    huber_k: float = 3.0  # residuals beyond k times the typical deviation are clipped
    max_factor: float = 50.0  # a learned value stays within configured / f .. configured * f
    min_decode_tokens: int = 4  # fewer tokens after the first teach no decode time
    damping: float = 0.5  # pseudo-samples holding the line fit at its last solution


def _finite_nonneg(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x >= 0.0


def _clamp(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


@dataclass(slots=True)
class CoefficientFit:
    """Online fit of one model's overhead, prefill and decode coefficients.

    * **decode per token**: an exponentially weighted mean of ``decode / (output_tokens - 1)``
      with Huber-clipped updates (a stream that stalled or was preempted moves it by at most
      ``huber_k`` typical deviations), weighted by stream length;
    * **overhead + prefill per prompt token**: a line through the time to first token (minus
      the decode steps it contains) against the prompt size, by exponentially forgetting
      least squares with Huber weights, fed only by requests that did not queue at the
      instance and only once the decode time is trusted. A little damping towards the last
      solution keeps the line defined when every prompt has the same size (the slope then
      stays where it was and the intercept takes the difference).

    Every value is clamped to ``[configured / max_factor, configured * max_factor]`` (with
    absolute floors for coefficients configured as zero), prefill never costs more per token
    than decode, and nothing is ever negative or NaN. Until ``min_samples`` samples have been
    seen, :meth:`current` returns the configured value for that part.
    """

    prior: ModelCoefficients
    params: LearnParams = field(default_factory=LearnParams)
    decode: float = math.nan
    overhead: float = math.nan
    prefill: float = math.nan
    decode_samples: int = 0
    line_samples: int = 0
    _decode_n: int = 0  # samples the decode mean counts as (see _observe_line)
    _decode_dev: float = 0.0
    _resid: float = 0.0
    _sn: float = 0.0
    _sw: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def __post_init__(self) -> None:
        p = self.prior
        self.decode = _clamp(p.decode_per_token, *self.decode_bounds())
        self.overhead = _clamp(p.overhead, *self.overhead_bounds())
        self.prefill = _clamp(p.prefill_per_token, *self.prefill_bounds(self.decode))
        # Generous at first, so a badly configured prior is not held back by the clipping.
        self._decode_dev = max(self.decode, 1e-9)
        self._resid = 1.0  # relative to the predicted time to first token

    # -- bounds -------------------------------------------------------------------------------

    def decode_bounds(self) -> tuple[float, float]:
        f, d = self.params.max_factor, self.prior.decode_per_token
        return d / f, max(d, 1e-3) * f

    def overhead_bounds(self) -> tuple[float, float]:
        return 0.0, max(self.prior.overhead, 0.02) * self.params.max_factor

    def prefill_bounds(self, decode: float) -> tuple[float, float]:
        # A prompt token is processed in parallel with the others: never dearer than a
        # generated token, which needs a forward pass of its own.
        hi = max(self.prior.prefill_per_token, 1e-5) * self.params.max_factor
        return 0.0, min(hi, decode)

    # -- results ------------------------------------------------------------------------------

    @property
    def decode_trusted(self) -> bool:
        return self.decode_samples >= self.params.min_samples

    @property
    def line_trusted(self) -> bool:
        return self.line_samples >= self.params.min_samples

    def current(self) -> ModelCoefficients:
        """The coefficients to estimate with: learned where trusted, configured elsewhere."""
        p = self.prior
        decode = self.decode if self.decode_trusted else p.decode_per_token
        if self.line_trusted:
            overhead, prefill = self.overhead, self.prefill
        else:
            overhead, prefill = p.overhead, p.prefill_per_token
        prefill = min(prefill, decode)  # also when a learned decode undercuts the configuration
        return replace(p, decode_per_token=decode, overhead=overhead, prefill_per_token=prefill)

    # -- learning -----------------------------------------------------------------------------

    def observe(self, s: TimingSample) -> None:
        if s.output_tokens - 1 >= self.params.min_decode_tokens and _finite_nonneg(s.decode):
            assert s.decode is not None
            per_token = s.decode / (s.output_tokens - 1)
            if math.isfinite(per_token):
                self._observe_decode(per_token, min(1.0, (s.output_tokens - 1) / 32.0))
        if (
            not s.queued
            and self.decode_trusted
            and _finite_nonneg(s.first_token)
            and math.isfinite(s.first_token_steps)
            and s.prompt_tokens >= 0
        ):
            assert s.first_token is not None
            steps = max(s.first_token_steps, 1.0)
            y = s.first_token - self.decode * steps
            self._observe_line(float(s.prompt_tokens), y, steps)

    def _observe_decode(self, x: float, weight: float) -> None:
        p = self.params
        # A running mean at first (the configured value is not counted as a sample: it may
        # be far off), an exponentially weighted one once past 1 / alpha samples.
        a = max(p.alpha, 1.0 / (self._decode_n + 1)) * weight
        dev = x - self.decode
        limit = p.huber_k * self._decode_dev
        clipped = _clamp(dev, -limit, limit)
        self.decode = _clamp(self.decode + a * clipped, *self.decode_bounds())
        self._decode_dev += a * (abs(clipped) - self._decode_dev)
        # A floor keeps a run of identical samples from freezing the estimate.
        self._decode_dev = max(self._decode_dev, 0.02 * self.decode, 1e-12)
        self.decode_samples += 1
        self._decode_n += 1

    def _observe_line(self, x: float, y: float, steps: float) -> None:
        """One point of the line. Timing noise is roughly proportional to the time itself
        (and joining a busy batch adds a wait of up to a step, slowed by the batch), so a
        point is judged and weighed relative to its predicted time to first token: residuals
        are relative, and weights ``1 / predicted**2`` (weighted least squares for
        multiplicative noise, the weights from the current fit)."""
        p = self.params
        if not (math.isfinite(x) and math.isfinite(y)):
            return
        predicted = self.overhead + self.prefill * x + self.decode * steps
        if not (math.isfinite(predicted) and predicted > 0):
            return
        residual = (y - (self.overhead + self.prefill * x)) / predicted
        limit = p.huber_k * self._resid
        w = (1.0 if abs(residual) <= limit else limit / abs(residual)) / (predicted * predicted)
        a = max(p.line_alpha, 1.0 / (self.line_samples + 1))
        self._resid += a * (min(abs(residual), limit) - self._resid)
        self._resid = max(self._resid, 0.01)  # a floor: identical samples must not freeze it
        keep = 1.0 - p.line_alpha
        self._sn = keep * self._sn + 1.0
        self._sw = keep * self._sw + w
        self._sx = keep * self._sx + w * x
        self._sy = keep * self._sy + w * y
        self._sxx = keep * self._sxx + w * x * x
        self._sxy = keep * self._sxy + w * x * y
        self.line_samples += 1
        self._solve()
        if self.line_samples == p.min_samples:
            # From now on the proxy knows how long other requests' prompts stall a batch and
            # takes that out of decode times (CostEstimator.prefill_stall); the decode samples
            # taken before carry those stalls, so the mean forgets them faster.
            self._decode_n = min(self._decode_n, max(1, p.min_samples // 4))

    def _solve(self) -> None:
        """Weighted least squares for ``y = overhead + prefill * x``, damped towards the last
        solution, then clamped (prefill first, the overhead refitted given it)."""
        sw, sx, sy, sxx, sxy = self._sw, self._sx, self._sy, self._sxx, self._sxy
        if sw <= 0:
            return
        scale = max(sx / sw, 1.0)
        la = self.params.damping * sw / max(self._sn, 1.0)  # in pseudo-samples of mean weight
        lb = la * scale * scale
        a11, a12, a22 = sw + la, sx, sxx + lb
        b1, b2 = sy + la * self.overhead, sxy + lb * self.prefill
        det = a11 * a22 - a12 * a12
        if not (math.isfinite(det) and det > 0):
            return
        prefill = (a11 * b2 - a12 * b1) / det
        if not math.isfinite(prefill):
            return
        prefill = _clamp(prefill, *self.prefill_bounds(self.decode))
        overhead = (b1 - a12 * prefill) / a11
        if not math.isfinite(overhead):
            return
        self.prefill = prefill
        self.overhead = _clamp(overhead, *self.overhead_bounds())


# -- the estimator ----------------------------------------------------------------------------


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
    learn_params: LearnParams = field(default_factory=LearnParams)
    learn_coefficients: bool = True
    _stats: dict[str, _ModelStats] = field(default_factory=dict)
    _fits: dict[str, CoefficientFit] = field(default_factory=dict)
    # What coeffs() answers for models with a fit: refreshed on each sample, so the hot path
    # (an estimate per request, a re-estimate per streamed chunk) is one dict lookup.
    _current: dict[str, ModelCoefficients] = field(default_factory=dict)

    def configured(self, model: str) -> ModelCoefficients:
        return self.coefficients.get(model, self.default)

    def coeffs(self, model: str) -> ModelCoefficients:
        current = self._current.get(model)
        return current if current is not None else self.coefficients.get(model, self.default)

    def fit(self, model: str) -> CoefficientFit | None:
        return self._fits.get(model)

    def learned(self) -> dict[str, ModelCoefficients]:
        """The coefficients in use for every model that has timing samples."""
        return dict(self._current)

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

    def prefill_stall(self, shape: RequestShape) -> float:
        """Reference seconds a running batch stalls while this request's prompt is prefilled,
        once the model's prefill coefficient has been learned (0 before: a configured value
        may be far off, and would distort the decode times the fit learns from)."""
        fit = self._fits.get(shape.model)
        if fit is None or not fit.line_trusted or shape.endpoint == "embedding":
            return 0.0
        return self.coeffs(shape.model).prefill_per_token * shape.prompt_tokens

    def learn(self, model: str, sample: TimingSample) -> None:
        """Refit ``model``'s coefficients from one completed stream's timing."""
        if not self.learn_coefficients:
            return
        fit = self._fits.get(model)
        if fit is None:
            fit = self._fits[model] = CoefficientFit(self.configured(model), self.learn_params)
        fit.observe(sample)
        self._current[model] = fit.current()

    def observe(
        self,
        shape: RequestShape,
        predicted: float,
        output_tokens: int,
        predicted_tokens: float | None = None,
    ) -> float:
        """Record a completed request; returns its actual cost (for the speed learner).

        With ``predicted_tokens`` (the output length the estimate assumed) the error spread
        compares like with like under the current coefficients, so a coefficient correction
        made while the request ran is not mistaken for a poor estimate."""
        actual = self.cost_of(shape, output_tokens)
        if predicted_tokens is not None:
            predicted = self.cost_of(shape, predicted_tokens)
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
