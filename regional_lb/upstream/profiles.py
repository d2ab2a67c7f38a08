"""Where each kind of model server keeps its readiness, model list and metrics, and the
credential the balancer presents to it.

| kind | readiness (no inference) | metrics |
|---|---|---|
| vllm | ``GET /health`` | ``/metrics`` on the API port |
| sglang | ``GET /health`` (``/health_generate`` would run the model) | ``/metrics`` |
| tgi | ``GET /health`` | ``/metrics`` |
| triton | ``GET /v2/health/ready`` | ``/metrics`` on its own port, 8002 by default |
| openai | ``GET /health`` where the server has it, else liveness (see below) | none |

An instance's ``health_url`` / ``metrics_url`` override these (Triton's OpenAI frontend runs on
another port than its KServe endpoints, so a Triton instance often names both).

Readiness is never the model list. llama-cpp-python's server ends every running stream when
``/v1/models`` is called (its ``interrupt_requests``, on by default) and otherwise queues the
call behind the running generation; a probe there cut one stream in six. A generic
``openai`` server is probed at ``/health`` (llama.cpp's ``llama-server``: 503 while it loads
the model, 200 when ready); a 404 there means the server has no readiness route (Ollama,
LM Studio, llama-cpp-python), and the answer itself shows the process is serving HTTP, which
is all such a server can say without touching the model. A configured ``health_url`` must
answer 2xx: a 404 there is a mistake in the configuration, not a server without the route.

The model list is fetched on its own, slower schedule (``health.models_interval_s``) and before
an instance without configured models takes work. On a kind whose listing can disturb work
(``openai``: the server is unknown), it is fetched only while none of this balancer's requests
runs there, and requests routed meanwhile wait for it (:class:`regional_lb.upstream.pool.Pool`).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from regional_lb.config import BalancerConfig, InstanceConfig, UpstreamAuth


@dataclass(frozen=True, slots=True)
class ServerProfile:
    readiness_path: str
    metrics_path: str | None = "/metrics"
    metrics_port: int | None = None  # None: the instance's own port
    # A 404 at the default readiness path: the server has no such route, and answering shows
    # it is alive (a generic OpenAI-compatible server).
    readiness_optional: bool = False
    # Listing the models may interrupt or queue behind running work (llama-cpp-python).
    listing_disturbs: bool = False


PROFILES: dict[str, ServerProfile] = {
    "vllm": ServerProfile("/health"),
    "sglang": ServerProfile("/health"),
    "tgi": ServerProfile("/health"),
    "triton": ServerProfile("/v2/health/ready", metrics_port=8002),
    "openai": ServerProfile(
        "/health", metrics_path=None, readiness_optional=True, listing_disturbs=True
    ),
}


@dataclass(frozen=True, slots=True)
class Upstream:
    """How the balancer talks to one instance outside the request body itself."""

    kind: str
    health_url: str
    models_url: str
    metrics_url: str | None
    task: str  # generate | embed
    # A 404 at health_url means "no readiness route" (the kind's default path only).
    readiness_optional: bool = False
    listing_disturbs: bool = False
    # The models the configuration names (empty: the instance's own list decides).
    models: frozenset[str] = frozenset()
    # The header the balancer authenticates with, already formatted; empty when none.
    auth: tuple[tuple[str, str], ...] = ()
    replace_client_auth: bool = True

    @property
    def auth_bytes(self) -> list[tuple[bytes, bytes]]:
        return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.auth]

    @property
    def auth_header_name(self) -> bytes | None:
        return self.auth[0][0].lower().encode("latin-1") if self.auth else None


def _with_port(url: str, port: int, path: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return urlunsplit((parts.scheme, netloc, path, "", ""))


def auth_headers(spec: UpstreamAuth | None) -> tuple[tuple[str, str], ...]:
    if spec is None:
        return ()
    token = spec.token.read()
    return ((spec.header, f"{spec.scheme} {token}" if spec.scheme else token),)


def upstream_for(ic: InstanceConfig, config: BalancerConfig) -> Upstream:
    kind = ic.kind or config.server_kind
    prof = PROFILES[kind]
    base = ic.url.rstrip("/")
    metrics: str | None = None
    if ic.metrics_url is not None:
        metrics = ic.metrics_url
    elif prof.metrics_path is not None:
        metrics = (
            _with_port(base, prof.metrics_port, prof.metrics_path)
            if prof.metrics_port is not None
            else base + prof.metrics_path
        )
    spec = ic.auth or config.upstream_auth
    return Upstream(
        kind=kind,
        health_url=ic.health_url or base + prof.readiness_path,
        models_url=base + "/v1/models",
        metrics_url=metrics if ic.metrics else None,
        task=ic.task,
        readiness_optional=prof.readiness_optional and ic.health_url is None,
        listing_disturbs=prof.listing_disturbs,
        models=frozenset(ic.models),
        auth=auth_headers(spec),
        replace_client_auth=spec is None or spec.client_authorization == "replace",
    )
