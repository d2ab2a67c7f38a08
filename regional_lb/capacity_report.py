"""The capacity report a regional balancer gives the global tier, and its HMAC signature.

The report is pushed to each configured GTM URL (``POST {url}/v1/capacity``) about once a
second and served at ``GET /gtm/capacity``; both carry the signature of the exact body bytes in
``X-GTM-Signature``. Each region signs with its own secret (:func:`region_secret`, derived from
the fleet's report secret that only GTM holds): GTM verifies a report with the key of the region
it names, so one region's balancer cannot speak for another (a balancer holding eu-west's key
cannot drain us-east, nor the reverse).

Every number must be finite and in range: ``NaN`` compares false with everything, and would
otherwise slip past the freshness and order checks.
"""

from __future__ import annotations

import hashlib
import hmac

from pydantic import BaseModel, ConfigDict, Field

SIGNATURE_HEADER = "X-GTM-Signature"
_PREFIX = "sha256="


class ModelAvailability(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str
    versions: list[str] = Field(default_factory=list)


class CapacityReport(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    region: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=1, lt=2**63, description="monotonic per balancer process, starts at 1")
    ts: float = Field(gt=0, lt=1e11, description="unix seconds")
    instances_healthy: int = Field(ge=0, le=1_000_000)
    instances_total: int = Field(ge=0, le=1_000_000)
    capacity: float = Field(ge=0, description="cost units per second the pool can do")
    outstanding: float = Field(ge=0, description="cost units in flight")
    utilisation: float = Field(
        ge=0,
        le=1000,
        description=(
            "share of the region's throughput ceiling in use (batching, KV cache), above 1 by "
            "the work queued at the balancer and the instances; 0..2 "
            "(regional_lb.balancing.utilisation)"
        ),
    )
    queue_depth: dict[str, int] = Field(default_factory=dict)
    models: list[ModelAvailability] = Field(default_factory=list)
    draining: bool = False
    can_take_work: bool = True
    # Prefix caching (regional_lb.upstream.cache_stats); null: no instance in service says.
    prefix_cache_hit_rate: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="prompt tokens found in the instances' prefix caches over those looked up, "
        "over the last minute (vllm:prefix_cache_hits / vllm:prefix_cache_queries)",
    )
    kv_free_fraction: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="share of the instances' KV cache no running request holds (1 - KV usage)",
    )
    kv_free_blocks: int | None = Field(
        default=None, ge=0, le=2**53, description="KV blocks no running request holds"
    )


def region_secret(fleet_secret: bytes, region: str) -> bytes:
    """Region ``region``'s report key: HMAC-SHA256 of its name under the fleet's secret. GTM
    holds the fleet secret; each region's balancer is given only its own key
    (``gtm report-key REGION``), from which no other region's can be computed."""
    return (
        hmac.new(fleet_secret, b"gtm capacity report key\0" + region.encode(), hashlib.sha256)
        .hexdigest()
        .encode()
    )


def sign(body: bytes, secret: bytes) -> str:
    return _PREFIX + hmac.new(secret, body, hashlib.sha256).hexdigest()


def verify(body: bytes, signature: str, secret: bytes) -> bool:
    # compare_digest on the whole header value: constant time, and a missing prefix fails.
    return hmac.compare_digest(sign(body, secret), signature)
