"""The balancer's configuration: a YAML file validated with pydantic, plus the report secret
from the environment (``REGIONAL_LB_REPORT_SECRET``), which is never stored in the YAML.

Every problem is reported at once with its location; the CLI exits with code 2 on any.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from regional_lb.balancing.gpus import GPUS
from regional_lb.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InstanceConfig(_Strict):
    id: str = Field(min_length=1, max_length=64)
    url: str = Field(pattern=r"^https?://")
    gpu: str = "A100"
    speed: float | None = Field(default=None, gt=0, description="prior; learned online")
    models: list[str] = Field(default_factory=list, description="servable models (empty: any)")
    max_concurrency: int | None = Field(default=None, gt=0)
    memory_gb: float | None = Field(default=None, gt=0)
    metrics: bool = True  # scrape /metrics for real load

    @model_validator(mode="after")
    def _known_gpu(self) -> InstanceConfig:
        if self.gpu.upper() not in GPUS and self.speed is None:
            raise ValueError(f"unknown gpu {self.gpu!r} needs an explicit speed")
        return self


class VersionShare(_Strict):
    name: str
    weight: float = Field(ge=0)


class ModelConfig(_Strict):
    prefill_per_token: float = Field(default=0.0002, ge=0)
    decode_per_token: float = Field(default=0.02, ge=0)
    overhead: float = Field(default=0.005, ge=0)
    load_time_s: float = Field(default=20.0, ge=0)
    memory_gb: float = Field(default=16.0, gt=0)
    # Canary or blue/green: the served model names a request for this model is split over.
    versions: list[VersionShare] = Field(default_factory=list)


class TierConfig(_Strict):
    name: str
    max_utilisation: float = Field(gt=0, le=1.0)
    queue_limit: int = Field(default=100, ge=0)
    queue_timeout_s: float = Field(default=10.0, gt=0)


class TenantConfig(_Strict):
    tier: str | None = None
    rate: float = Field(default=100.0, gt=0, description="requests per second")
    burst: float = Field(default=200.0, gt=0)


class Timeouts(_Strict):
    connect_s: float = Field(default=2.0, gt=0)
    first_byte_s: float = Field(default=60.0, gt=0)
    # Writes to instances and the balancer's own calls (probes, scrapes use their own).
    read_s: float = Field(default=30.0, gt=0, description="write and default read timeout")
    pool_s: float = Field(default=5.0, gt=0)


class HealthConfig(_Strict):
    probe_interval_s: float = Field(default=2.0, gt=0)
    probe_timeout_s: float = Field(default=2.0, gt=0)
    probe_model: bool = True  # ask the model for one token, not just the port
    # Rise/fall: consecutive probes that must agree before the state flips. One probe lost to
    # a busy host or a dropped packet does not take an instance out of service.
    unhealthy_after: int = Field(default=2, ge=1)
    healthy_after: int = Field(default=1, ge=1)
    consecutive_failures: int = Field(default=5, ge=1)
    ejection_base_s: float = Field(default=10.0, gt=0)
    ejection_max_s: float = Field(default=300.0, gt=0)
    max_ejected_share: float = Field(default=0.5, ge=0, le=1)
    slow_start_s: float = Field(default=30.0, ge=0)
    stall_timeout_s: float = Field(default=20.0, gt=0)


class AffinityConfig(_Strict):
    """Session or prompt-prefix affinity (regional_lb.balancing.affinity): off by default."""

    mode: Literal["none", "session", "prefix"] = "none"
    # session: the header naming the conversation (else the body's OpenAI "user" field).
    session_header: str = "X-Session-Id"
    # prefix: how many characters of the prompt make the key (a system prompt's length).
    prefix_chars: int = Field(default=1024, gt=0)
    # Affinity holds while the instance's score is within this many times the mean.
    load_bound: float = Field(default=1.25, ge=1.0)


class ScrapeConfig(_Strict):
    interval_s: float = Field(default=1.0, gt=0)
    stale_after_s: float = Field(default=3.0, gt=0)


def _default_tiers() -> list[TierConfig]:
    return [
        TierConfig(name="realtime", max_utilisation=1.0, queue_limit=100, queue_timeout_s=5),
        TierConfig(name="standard", max_utilisation=0.85, queue_limit=200, queue_timeout_s=15),
        TierConfig(name="batch", max_utilisation=0.6, queue_limit=500, queue_timeout_s=60),
    ]


class BalancerConfig(_Strict):
    region: str = Field(min_length=1, max_length=64)
    listen: str = "127.0.0.1:8600"
    instances: list[InstanceConfig] = Field(min_length=1)
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    tiers: list[TierConfig] = Field(default_factory=_default_tiers, min_length=1)
    default_tier: str = "standard"
    tier_header: str = "X-Priority"
    tenant_header: str = "X-Tenant"
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    default_tenant: TenantConfig | None = None  # unset: unknown tenants are not rate-limited
    gtm_urls: list[str] = Field(default_factory=list)
    report_interval_s: float = Field(default=1.0, gt=0)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    health: HealthConfig = Field(default_factory=HealthConfig)
    scrape: ScrapeConfig = Field(default_factory=ScrapeConfig)
    affinity: AffinityConfig = Field(default_factory=AffinityConfig)
    max_body_bytes: int = Field(default=1 << 20, gt=0)
    kv_limit: float = Field(default=0.95, gt=0, le=1)

    @model_validator(mode="after")
    def _consistent(self) -> BalancerConfig:
        problems: list[str] = []
        ids = [i.id for i in self.instances]
        if len(set(ids)) != len(ids):
            problems.append("instances: ids must be unique")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            problems.append("tiers: names must be unique")
        if self.default_tier not in names:
            problems.append(f"default_tier: {self.default_tier!r} is not a tier")
        for tenant, spec in self.tenants.items():
            if spec.tier is not None and spec.tier not in names:
                problems.append(f"tenants.{tenant}.tier: {spec.tier!r} is not a tier")
        if ":" not in self.listen:
            problems.append("listen: expected HOST:PORT")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class ReportSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REGIONAL_LB_", extra="ignore")

    report_secret: SecretStr | None = None


def _problems(exc: ValidationError, source: str) -> list[str]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        out.append(f"{source}: {loc}: {err['msg']}" if loc else f"{source}: {err['msg']}")
    return out


def parse_config(data: Any, source: str = "<string>") -> BalancerConfig:
    try:
        return BalancerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_problems(exc, source)) from exc


def load_config(path: Path) -> BalancerConfig:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from exc
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from exc
    return parse_config(data, str(path))


def split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)
