"""The balancer's configuration: a YAML file validated with pydantic, plus the report secret
from the environment (``REGIONAL_LB_REPORT_SECRET``), which is never stored in the YAML.
Other secrets (upstream API keys, the admin token) are named by their environment variable or
file (:mod:`regional_lb.credentials`) and checked when the configuration is loaded.

Every problem is reported at once with its location; the CLI exits with code 2 on any.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from regional_lb.balancing.gpus import GPUS
from regional_lb.credentials import SecretUnavailable, read_secret
from regional_lb.errors import ConfigError

# What serves an instance decides where its readiness and metrics are and what they mean
# (regional_lb.upstream.profiles).
ServerKind = Literal["vllm", "tgi", "triton", "sglang", "openai"]

KiB, MiB = 1 << 10, 1 << 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SecretRef(_Strict):
    """Where a secret lives: exactly one of an environment variable or a file (mode 0600)."""

    env: str | None = Field(default=None, min_length=1)
    file: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _resolvable(self) -> SecretRef:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env or file (never the secret itself)")
        try:
            read_secret(self.env, self.file)
        except SecretUnavailable as exc:
            raise ValueError(str(exc)) from None
        return self

    def read(self) -> str:
        return read_secret(self.env, self.file)


class UpstreamAuth(_Strict):
    """The credential the balancer presents to instances: on probes, metrics scrapes and
    proxied requests alike (``vllm serve --api-key`` guards every /v1 route)."""

    token: SecretRef
    header: str = Field(default="Authorization", min_length=1)
    scheme: str = "Bearer"  # prefix of the header's value; "" sends the bare token
    # A client's own Authorization: replaced by ours, or passed through (when clients hold
    # per-user keys the instances check themselves; probes and scrapes still use ours).
    client_authorization: Literal["replace", "pass"] = "replace"


class KvEventsConfig(_Strict):
    """Where an instance publishes its KV-cache events: vLLM's ``--kv-events-config``
    ``endpoint`` as the balancer reaches it (vLLM binds ``tcp://*:5557``; connect to
    ``tcp://HOST:5557``), and its ``topic``. The simulator's ``--kv-events`` is the same."""

    endpoint: str = Field(description="tcp://HOST:PORT or ipc://PATH")
    topic: str = Field(default="", max_length=256, description="vLLM's topic; empty: all")

    @field_validator("endpoint")
    @classmethod
    def _connectable(cls, v: str) -> str:
        if re.fullmatch(r"ipc://\S+", v):
            return v
        m = re.fullmatch(r"tcp://(\[[0-9a-fA-F:.]+\]|[^\s/:*\[\]]+):(\d{1,5})", v)
        if m is None:
            raise ValueError(
                f"{v!r} is not a ZMQ endpoint the balancer can connect to: tcp://HOST:PORT "
                "or ipc://PATH (vLLM's bind address tcp://*:PORT is reached as tcp://HOST:PORT)"
            )
        if not 0 < int(m.group(2)) < 65536:
            raise ValueError(f"{v!r}: port {m.group(2)} is out of range")
        return v


class KvCacheConfig(_Strict):
    """The balancer's index of which instance holds which KV blocks
    (regional_lb.balancing.kv_index). Block size and hashing must be the servers': the
    regional tier's README says what has to match for vLLM."""

    # null: on when an instance has kv_events; true: also without (routing-history estimates).
    enabled: bool | None = None
    block_size: int = Field(default=16, ge=1, le=4096, description="tokens per block")
    max_blocks: int = Field(
        default=200_000, ge=1, le=10_000_000, description="per instance: the index's bound"
    )
    # A stream is silent when requests that stored new blocks there ended this long ago and
    # no event followed: its instance falls back to the routing-history estimate.
    silent_after_s: float = Field(default=10.0, gt=0)


class InstanceConfig(_Strict):
    id: str = Field(min_length=1, max_length=64)
    url: str = Field(pattern=r"^https?://")
    gpu: str = "A100"
    speed: float | None = Field(default=None, gt=0, description="prior; learned online")
    models: list[str] = Field(
        default_factory=list, description="servable models (empty: the ones the instance lists)"
    )
    max_concurrency: int | None = Field(default=None, gt=0)
    memory_gb: float | None = Field(default=None, gt=0)
    metrics: bool = True  # scrape the server's metrics for real load
    kind: ServerKind | None = None  # unset: the pool's server_kind
    # Overrides of the kind's defaults, e.g. Triton's metrics on their own port.
    health_url: str | None = Field(default=None, pattern=r"^https?://")
    metrics_url: str | None = Field(default=None, pattern=r"^https?://")
    # embed: an embedding/pooling server (its model probe asks for an embedding).
    task: Literal["generate", "embed"] = "generate"
    auth: UpstreamAuth | None = None  # unset: the pool's upstream_auth
    kv_events: KvEventsConfig | None = None  # unset: no events (routing-history estimates)

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
    tier: str | None = None  # the highest tier its callers get (X-Priority may only lower it)
    rate: float = Field(default=100.0, gt=0, description="requests per second")
    burst: float = Field(default=200.0, gt=0)
    # SHA-256 (hex) of the tenant's API keys; `regional-lb hash-key` prints one. A caller is
    # this tenant only when it presents one of these keys as a bearer token.
    key_sha256: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _digests(self) -> TenantConfig:
        for d in self.key_sha256:
            if len(d) != 64 or any(c not in "0123456789abcdef" for c in d):
                raise ValueError("key_sha256 entries are 64 lower-case hex digits")
        return self


class JwtConfig(_Strict):
    """Bearer JWTs from an identity provider, verified against its JWKS (public keys: a file,
    or a URL fetched at start and every ``refresh_s``). The tenant is a claim's value, and must
    be one of ``tenants`` (its tier and limits apply)."""

    jwks_file: str | None = None
    jwks_url: str | None = Field(default=None, pattern=r"^https?://")
    refresh_s: float = Field(default=300.0, gt=0)
    issuer: str = Field(min_length=1)
    audience: str = Field(min_length=1)
    tenant_claim: str = "tenant"
    algorithms: list[str] = Field(default_factory=lambda: ["RS256", "ES256", "EdDSA"])

    @model_validator(mode="after")
    def _one_source(self) -> JwtConfig:
        if (self.jwks_file is None) == (self.jwks_url is None):
            raise ValueError("give exactly one of jwks_file or jwks_url")
        if self.jwks_file is not None and not Path(self.jwks_file).is_file():
            raise ValueError(f"jwks_file {self.jwks_file} does not exist")
        if any(a.upper().startswith("HS") or a.lower() == "none" for a in self.algorithms):
            raise ValueError("algorithms: only public-key algorithms verify against a JWKS")
        return self


class ClientAuthConfig(_Strict):
    """How callers are identified. Identity comes only from a verified key, never a header."""

    # The header carrying the client's key (a bearer token in Authorization, like OpenAI's).
    header: str = "Authorization"
    # true: a caller without a valid key gets 401; false: it gets the default tenant.
    require_key: bool = False
    jwt: JwtConfig | None = None


class AdminConfig(_Strict):
    """/admin/*: with a token, every call must carry it as a bearer token; without one, only
    callers on the loopback interface are served (bind the balancer accordingly)."""

    token: SecretRef | None = None


class BodyLimits(_Strict):
    """Per route: chat requests carry images (base64) and long contexts."""

    chat: int = Field(default=64 * MiB, gt=0)
    completion: int = Field(default=16 * MiB, gt=0)
    embedding: int = Field(default=16 * MiB, gt=0)


class BackpressureConfig(_Strict):
    """What a 429 tells the client (regional_lb.balancing.admission)."""

    # Retry-After is spread by this share either way, so clients told the same thing at the
    # same moment do not come back together.
    jitter: float = Field(default=0.15, ge=0, lt=1)
    # Balancer-side retries (a connection refused, once) may add at most this share of
    # requests on top of the ones received, plus a small floor per second.
    retry_budget_ratio: float = Field(default=0.2, ge=0)
    retry_budget_min_per_s: float = Field(default=5.0, ge=0)


class Timeouts(_Strict):
    connect_s: float = Field(default=2.0, gt=0)
    first_byte_s: float = Field(default=60.0, gt=0)
    # Writes to instances and the balancer's own calls (probes, scrapes use their own).
    read_s: float = Field(default=30.0, gt=0, description="write and default read timeout")
    pool_s: float = Field(default=5.0, gt=0)


class HealthConfig(_Strict):
    probe_interval_s: float = Field(default=2.0, gt=0)
    probe_timeout_s: float = Field(default=2.0, gt=0)
    # Readiness probes cost no inference. The model check (one token, or one embedding) is
    # opt-in, and at most once per model_probe_interval_s per instance.
    probe_model: bool = False
    model_probe_interval_s: float = Field(default=30.0, gt=0)
    # The model list (/v1/models) is not a readiness probe: it is fetched before an instance
    # without configured models takes work, then on this slower schedule.
    models_interval_s: float = Field(default=60.0, gt=0)
    # Rise/fall: consecutive probes that must agree before the state flips. One probe lost to
    # a busy host or a dropped packet does not take an instance out of service.
    unhealthy_after: int = Field(default=2, ge=1)
    healthy_after: int = Field(default=1, ge=1)
    consecutive_failures: int = Field(default=5, ge=1)
    ejection_base_s: float = Field(default=10.0, gt=0)
    ejection_max_s: float = Field(default=300.0, gt=0)
    max_ejected_share: float = Field(default=0.5, ge=0, le=1)
    slow_start_s: float = Field(default=30.0, ge=0)
    # Between tokens, from the first one on. Before it the request may be queued at the
    # server (vLLM sends headers before the first token): first_token_timeout_s applies, and
    # running out of it while the server reports waiting requests is busy, not broken.
    stall_timeout_s: float = Field(default=20.0, gt=0)
    first_token_timeout_s: float = Field(default=120.0, gt=0)


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
    # A caller may ask for a lower tier than its tenant's with this header, never a higher one.
    tier_header: str = "X-Priority"
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    # Callers without a valid key: these limits, one bucket per client address.
    default_tenant: TenantConfig = Field(default_factory=TenantConfig)
    clients: ClientAuthConfig = Field(default_factory=ClientAuthConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    server_kind: ServerKind = "vllm"  # per instance: instances[].kind
    upstream_auth: UpstreamAuth | None = None  # per instance: instances[].auth
    gtm_urls: list[str] = Field(default_factory=list)
    report_interval_s: float = Field(default=1.0, gt=0)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    health: HealthConfig = Field(default_factory=HealthConfig)
    scrape: ScrapeConfig = Field(default_factory=ScrapeConfig)
    affinity: AffinityConfig = Field(default_factory=AffinityConfig)
    backpressure: BackpressureConfig = Field(default_factory=BackpressureConfig)
    body_limits: BodyLimits = Field(default_factory=BodyLimits)
    max_body_bytes: int | None = Field(default=None, gt=0, description="all routes, if set")
    kv_limit: float = Field(default=0.95, gt=0, le=1)
    kv_cache: KvCacheConfig = Field(default_factory=KvCacheConfig)

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
        owners: dict[str, str] = {}
        for tenant, spec in [*self.tenants.items(), ("default_tenant", self.default_tenant)]:
            if spec.tier is not None and spec.tier not in names:
                problems.append(f"tenants.{tenant}.tier: {spec.tier!r} is not a tier")
            for d in spec.key_sha256:
                if owners.setdefault(d, tenant) != tenant:
                    problems.append(f"tenants.{tenant}: a key is also {owners[d]}'s")
        if self.default_tenant.key_sha256:
            problems.append("default_tenant: has no keys (it is for callers without one)")
        endpoints = [i.kv_events.endpoint for i in self.instances if i.kv_events]
        if len(set(endpoints)) != len(endpoints):
            problems.append("instances: kv_events endpoints must be unique (one per instance)")
        if self.kv_cache.enabled is False and endpoints:
            problems.append("kv_cache.enabled is false, yet instances name kv_events")
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


def kv_index_on(config: BalancerConfig) -> bool:
    """Whether routing prices prefix-cache hits (:class:`KvCacheConfig`)."""
    if config.kv_cache.enabled is not None:
        return config.kv_cache.enabled
    return any(i.kv_events is not None for i in config.instances)


def body_limit(config: BalancerConfig, endpoint: str) -> int:
    if config.max_body_bytes is not None:
        return config.max_body_bytes
    return int(getattr(config.body_limits, endpoint))


def split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)
