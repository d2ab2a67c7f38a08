"""The capacity report a regional balancer gives the global tier, and its HMAC signature.

The report is pushed to each configured GTM URL (``POST {url}/v1/capacity``) about once a
second and served at ``GET /gtm/capacity``; both carry the signature of the exact body bytes in
``X-GTM-Signature`` so GTM can reject reports that were not written by a balancer holding the
shared secret.
"""

from __future__ import annotations

import hashlib
import hmac

from pydantic import BaseModel, ConfigDict, Field

SIGNATURE_HEADER = "X-GTM-Signature"
_PREFIX = "sha256="


class ModelAvailability(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    versions: list[str] = Field(default_factory=list)


class CapacityReport(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    region: str
    seq: int = Field(ge=1, description="monotonic per balancer process, starts at 1")
    ts: float = Field(description="unix seconds")
    instances_healthy: int = Field(ge=0)
    instances_total: int = Field(ge=0)
    capacity: float = Field(ge=0, description="cost units per second the pool can do")
    outstanding: float = Field(ge=0, description="cost units in flight")
    utilisation: float = Field(
        ge=0,
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


def sign(body: bytes, secret: bytes) -> str:
    return _PREFIX + hmac.new(secret, body, hashlib.sha256).hexdigest()


def verify(body: bytes, signature: str, secret: bytes) -> bool:
    # compare_digest on the whole header value: constant time, and a missing prefix fails.
    return hmac.compare_digest(sign(body, secret), signature)
