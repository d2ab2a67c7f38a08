"""Process settings: one object, built once at start-up from ``GTM_*`` variables and CLI flags.

Documents (topology, policies) hold what the fleet looks like; settings hold how this process
runs (where it listens, which database, which GeoIP file, how it logs).
"""

from __future__ import annotations

import socket
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gtm.decision.documents import problems_from_validation
from gtm.decision.memos import DEFAULT_BUDGET_MB
from gtm.errors import ConfigError


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GTM_", extra="forbid", frozen=True)

    config: Path = Field(default=Path("examples/demo.yaml"), description="topology file")
    policies: tuple[Path, ...] = Field(
        default=(Path("policies"),), description="policy files or directories"
    )
    # The SQL store of the audit log, the control log and the fleet's shared state:
    # sqlite:///PATH (one machine) or postgresql://... (several nodes); brought to the current
    # schema at start unless migrate_on_start is off (then `gtm db upgrade` does it).
    database_url: str = "sqlite:///var/gtm.sqlite3"
    migrate_on_start: bool = True
    # The GeoIP database, and how often its file is checked for a new build (hot reload; a
    # missing or corrupt file keeps the last good one and says so).
    geoip_path: Path | None = Field(
        default=None, description="GeoIP2/GeoLite2 City file; unset: the bundled GeoLite2-City"
    )
    geoip_poll_interval_s: float = Field(default=2.0, gt=0)
    # DNS listeners, "HOST:PORT" or "[V6]:PORT", each served over UDP and TCP.
    dns_listen: tuple[str, ...] = ()
    # Response rate limiting per client /24 (/56) over UDP: responses per second, 0 = off. On by
    # default at a rate no real resolver network reaches against one authority for long (their
    # caches hold our answers for a TTL) and that caps what a spoofed victim is sent. Networks
    # in the exempt list are never limited: loopback cannot be spoofed from outside the host.
    dns_rate_limit: float = Field(default=1000.0, ge=0)
    dns_rate_slip: int = Field(default=2, ge=0)
    dns_rate_limit_exempt: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
    # Memory for the DNS path's caches and per-client tables, per worker process, in MiB: a
    # reserve for what no table holds (gtm.decision.memos.RESERVE_MB), then shares for the answer
    # caches, the rate limiter's buckets, the audit backlog and the slow path's memos
    # (gtm.geodns.budget). Under about 5.3 MiB the reserve is not covered.
    dns_cache_budget_mb: float = Field(default=DEFAULT_BUDGET_MB, gt=0)
    dns_tcp_idle_s: float = Field(default=10.0, gt=0)
    # The server's identity (gtm.geodns.identity): in class CHAOS, id.server. and hostname.bind.
    # answer the first, version.bind. and version.server. the second; the first is also the
    # NSID option's (RFC 5001) for queries that ask. Unset (the default): REFUSED, as for any
    # name outside the zone, and no NSID.
    dns_server_id: str | None = Field(default=None, min_length=1, max_length=1000)
    dns_server_version: str | None = Field(default=None, min_length=1, max_length=1000)
    dns_tcp_max_connections: int = Field(default=1000, gt=0)
    # Fair admission of the UDP slow path (gtm.geodns.admission): queries no cache holds wait
    # in queues per sender /24 (/56), at most this many per network and in all (per listener;
    # each a datagram and an address, some 200 bytes), and a loop turn answers at most
    # dns_slow_batch of them, one per network in turn, after every cached answer waiting.
    # Off: every datagram is answered in the order read, one per loop turn.
    dns_fair_admission: bool = True
    dns_slow_queue_per_network: int = Field(default=256, gt=0)
    dns_slow_queue_total: int = Field(default=4096, gt=0)
    dns_slow_batch: int = Field(default=32, gt=0)
    # With fair admission, UDP sockets per listen address, each sender network steered by the
    # kernel to one of them (gtm.geodns.steering): a flood fills and overflows only its own
    # socket's receive buffer, not the one every client shares. 1: one socket, as before.
    dns_udp_sockets: int = Field(default=8, ge=1, le=64)
    # Sender networks kept as established (gtm.geodns.established): read steadily while nothing
    # was dropped, they get the first half of those sockets to themselves, so a flood from
    # networks never seen before cannot overflow their buffers. The kernel map's size; 0: off.
    # Needs CAP_BPF (else a warning, and the hash alone); with workers, the first process binds
    # every worker's sockets (gtm.geodns.groups).
    dns_established_networks: int = Field(default=16384, ge=0, le=1_000_000)
    # gtm_dns_udp_queue_age_seconds (gtm.geodns.udp): the kernel stamps every datagram the UDP
    # listeners receive, which costs 3-4% of their capacity at full load; false: not measured.
    dns_queue_age: bool = True
    # DNS cookies (RFC 7873; server cookies as RFC 9018 makes them, gtm.geodns.cookies): a
    # query's COOKIE option is checked and its response given one. The secret: a file of 32
    # hex digits (mode 0600; a second line, the previous secret, is still accepted during a
    # rollover; `gtm dns cookie-secret` makes one) or GTM_DNS_COOKIE_SECRET, shared by every
    # node of an anycast set; neither: a random one per start, shared by the workers.
    # dns_require_cookie: a UDP query with a client cookie but no valid server cookie gets
    # BADCOOKIE and a new cookie instead of the answer (BIND's require-server-cookie).
    dns_cookies: bool = True
    dns_cookie_secret_file: Path | None = None
    dns_cookie_secret: SecretStr | None = None
    dns_require_cookie: bool = False
    # Established networks (above) only once a query from the network brought a valid server
    # cookie, or came over TCP, within the hour: proof its address receives what is sent to
    # it, which forged senders cannot give, so a flood's spoofed networks are never
    # established, even on a calm day; but a network whose resolvers speak neither never is.
    dns_establish_with_cookie: bool = False
    # DNSSEC online signing (gtm.geodns.dnssec): off unless a key file is given. The key file
    # signs (ECDSA P-256 PEM, mode 0600, `gtm dnssec keygen`); the publish-only ones are listed
    # in the DNSKEY RRset for a rollover. A configured file that is missing, loose or malformed
    # stops the start: a signed zone is never served unsigned.
    dnssec_key_file: Path | None = None
    dnssec_publish_key_files: tuple[Path, ...] = ()
    dnssec_signature_validity_s: int = Field(default=7 * 86400, ge=86400, le=90 * 86400)
    # Worker processes sharing the DNS and HTTP ports (SO_REUSEPORT), each with its own caches
    # and audit chain ("NODE/wN"); 1 answers in the main process.
    workers: int = Field(default=1, ge=1, le=64)
    http_listen: str | None = None
    admin_listen: str | None = None
    # Prometheus metrics on their own port (the HTTP front and admin API also serve /metrics).
    metrics_listen: str | None = None
    node_id: str = Field(default_factory=socket.gethostname, max_length=64)
    # The name this node's health observations carry in the quorum; worker processes of one
    # node share it (they are one vote, not several). Unset: the node id.
    observer_id: str | None = Field(default=None, max_length=64)
    spool_dir: Path = Path("var/spool")
    audit_flush_interval_s: float = Field(default=1.0, gt=0)
    # The tally journal (gtm.audit.journal): between seals, the answers counted are appended
    # to a file in the spool directory this often, so a kill -9 loses about this long of
    # answers instead of a flush interval's (0: off; a journal left behind is still replayed).
    audit_journal_interval_s: float = Field(default=0.1, ge=0)
    # Evidence outside the database (gtm.audit.checkpoints): each chain's Ed25519 key (made on
    # first start, 0600; unset: audit-signing.key in the spool directory), the sink its signed
    # checkpoints go to (a directory; in production the write-once bucket below),
    # and how often a chain that moved is checkpointed (also at start and shutdown).
    audit_signing_key: Path | None = None
    audit_checkpoint_dir: Path | None = None  # unset: "checkpoints" beside the spool directory
    # The production sink (gtm.audit.checkpoint_bucket): "s3://BUCKET/PREFIX" of an
    # S3-compatible bucket with Object Lock; when set it replaces the directory. Each checkpoint
    # is kept in COMPLIANCE mode for the retention days. Credentials only from the environment
    # (AWS_ACCESS_KEY_ID, ..., or a role) or a credentials file of mode 0600, never from here.
    audit_checkpoint_url: str | None = Field(default=None, pattern=r"^s3://[^/\s]+(/\S*)?$")
    audit_checkpoint_endpoint_url: str | None = Field(default=None, pattern=r"^https?://")
    audit_checkpoint_region: str | None = None
    audit_checkpoint_retention_days: int = Field(default=2555, ge=1, le=36_500)
    audit_checkpoint_credentials_file: Path | None = None
    audit_checkpoint_interval_s: float = Field(default=10.0, gt=0)
    audit_max_pending: int = Field(default=10_000, gt=0)
    # Scheduled verification on nodes serving the admin API (gtm.audit.watch); 0: off.
    audit_verify_interval_s: float = Field(default=60.0, ge=0)
    # ...and one of its passes reads every chain from the start this often (0: every pass),
    # so an edit behind where the passes resume is found within this period.
    audit_verify_full_every_s: float = Field(default=6 * 3600.0, ge=0)
    # Above this the spool raises gtm_audit_spool_over_cap (and logs an error at every flush):
    # rows are never dropped, so this is the alarm before the disk fills.
    audit_spool_max_bytes: int = Field(default=1 << 30, gt=0)
    # gtm.heap: freeze what survives young collections this often (0: leave the collector to
    # its defaults), and run a full collection this often to reclaim frozen cycles.
    gc_freeze_interval_s: float = Field(default=1.0, ge=0)
    gc_full_interval_s: float = Field(default=600.0, gt=0)
    # HTTP front: when given, /v1/capacity and /metrics answer only peers (the connection's
    # address, never a forwarded header) in these networks, others get 403; empty: any peer on
    # a non-service Host. (/livez and /readyz stay open for load balancers' health checks; the
    # metrics can also have their own listener, metrics_listen.)
    ops_allow: tuple[IPv4Network | IPv6Network, ...] = ()
    # HTTP front: peers whose Forwarded / X-Forwarded-For headers are believed.
    trusted_proxies: tuple[IPv4Network | IPv6Network, ...] = ()
    # HTTP front connections (gtm.front.connections), per worker: open at most, and per client
    # address (trusted proxies exempt; 0: no per-client cap); a request head (and a TLS
    # handshake) must arrive whole within the timeout, else 408 and the connection is closed.
    http_max_connections: int = Field(default=10_000, gt=0)
    http_max_connections_per_client: int = Field(default=512, ge=0)
    http_header_timeout_s: float = Field(default=10.0, gt=0)
    # A request body must keep coming: cut after this long without a byte of it, or when it
    # averages less than http_body_min_rate bytes/s after this long (0: whole within it); the
    # application answers 408, or the connection is closed if the request was answered.
    http_body_timeout_s: float = Field(default=10.0, gt=0)
    http_body_min_rate: float = Field(default=1024.0, ge=0)
    # An idle kept-alive connection (between requests) is closed after this long.
    http_keep_alive_s: float = Field(default=5.0, gt=0)
    # HTTP front over TLS: a PEM certificate chain and its key (mode 0600 or stricter), both or
    # neither; reloaded when either file changes (gtm.front.tls).
    http_tls_cert: Path | None = None
    http_tls_key: Path | None = None
    # HTTP front, proxy mode: session affinity (gtm.front.affinity). A signed gtm_affinity
    # cookie keeps a client's requests in the region that served it (its KV cache holds the
    # conversation) while that region stays allowed by the policy in force, healthy, and proves
    # headroom: a fresh capacity report with at least this share of capacity spare. The cookie
    # lapses after the TTL without a request (each response renews it). Its MAC key is derived
    # from the key file (mode 0600, 32+ random bytes, the same on every node and worker behind
    # one name); unset: a key per process, so only the process that issued a cookie honours it.
    http_affinity: bool = True
    http_affinity_key_file: Path | None = None
    http_affinity_ttl_s: float = Field(default=1800.0, gt=0)
    http_affinity_min_spare: float = Field(default=0.2, ge=0, le=1)
    # Region probing (each region's probe_url) and capacity reports.
    probes: bool = True
    probe_interval_s: float = Field(default=1.0, gt=0)
    probe_timeout_s: float = Field(default=0.8, gt=0)
    probe_jitter: float = Field(default=0.1, ge=0, lt=1)
    health_rise: int = Field(default=2, ge=1)
    health_fall: int = Field(default=3, ge=1)
    # Several nodes on one database: a region's state needs this many fresh observations
    # agreeing (fewer when fewer nodes are alive: a node alone decides by itself).
    health_quorum: int = Field(default=1, ge=1)
    # A node that has not heard from the shared database for this long fences itself: it may
    # hold a residency policy or a drain the fleet has since changed, so restricted traffic
    # fails closed ("fail_closed") or gets the degraded TTL ("short_ttl") until it hears again;
    # unrestricted traffic keeps being served. 0: never.
    fence_after_s: float = Field(default=60.0, ge=0)
    # Every database call has a deadline (gtm.audit.database, gtm.audit.deadline): a
    # connection silent this long is given up (TCP keepalives and user timeout; the audit
    # writer's drain, which shuts the socket itself) and discarded; a statement runs at most
    # database_statement_timeout_s on the server. 0: no such deadline (not recommended).
    database_silence_s: float = Field(default=10.0, ge=0)
    database_statement_timeout_s: float = Field(default=300.0, ge=0)
    fence_action: Literal["fail_closed", "short_ttl"] = "fail_closed"
    # The admin service counts a node live while its last status report is younger than this
    # (rollouts, /v1/nodes). Unset: four sync intervals, at least 5 s.
    node_live_within_s: float | None = Field(default=None, gt=0)
    # Anycast (gtm.anycast): BIRD's control socket; unset, the node announces nothing. The node
    # withdraws the prefix while the drain file exists, after anycast_fall failed queries to
    # its own DNS listener, after this long without the shared database, and when stopping.
    anycast_bird_socket: Path | None = None
    anycast_protocol: str = "gtm_anycast"
    anycast_drain_file: Path | None = None
    anycast_max_db_loss_s: float = Field(default=30.0, ge=0)
    anycast_fall: int = Field(default=2, ge=1)
    anycast_check_interval_s: float = Field(default=1.0, gt=0)
    # The fleet's configured observers (observer ids), used only when the topology has no
    # fleet.members (which wins): only their observations count and a region's state needs a
    # majority of them (or health_quorum, if higher), whoever is alive. An entry "ID=KEY" gives
    # the member's observation key (64 hex digits); a member without a key cannot vote (said at
    # start). Neither: this node counts its own observations only (gtm.fleet.observation_seal).
    health_members: tuple[str, ...] = ()
    # Several nodes on one database need a membership (the topology's fleet.members, or
    # health_members): without one each node decides region health from its own probes alone,
    # so one node with a broken probe path moves its answers. A node that finds another node
    # reporting live to its database refuses to start without a membership, unless this is set
    # (each node deciding alone, on purpose).
    fleet_standalone_health: bool = False
    # A node's observation counts while it is younger than this.
    health_observation_max_age_s: float = Field(default=3.0, gt=0)
    # ...and only if it is dated at most this far ahead of this node's clock (clock skew).
    health_max_future_s: float = Field(default=2.0, ge=0)
    # This node's observation signing key (Ed25519, mode 0600, made on first start; one per
    # node, shared by its worker processes); unset: health-signing.key in the spool directory.
    health_signing_key: Path | None = None
    # How often a node exchanges observations, overrides and published documents with the
    # shared database (the bound on how late another node's change takes effect here).
    state_sync_interval_s: float = Field(default=0.5, gt=0)
    # The fleet's capacity-report secret: each region's balancer signs with its own key derived
    # from it (`gtm report-key REGION`), and GTM verifies a report with the key of the region it
    # names. Unset: every report is refused, unless insecure_unsigned_reports (a closed
    # development network only; a loud warning at start) accepts them unsigned.
    report_secret: SecretStr | None = None
    insecure_unsigned_reports: bool = False
    # Public keys (PEM, Ed25519) whose signatures on published documents this node trusts:
    # a published topology or policy comes into force only signed by one of them, with its
    # approval record (gtm.fleet.signed_documents). None configured: none comes into force.
    document_keys: tuple[Path, ...] = ()
    # Where this node keeps the signed version it last accepted (gtm.fleet.local_documents),
    # on its own disk: after a restart it answers from it, verified again, never from its files
    # or an older version the database offers. Unset: <spool dir's parent>/state/<spool dir
    # name>-documents.json, beside the spool (one per node).
    document_state_file: Path | None = None
    # The admin service's private signing key (PEM, Ed25519, mode 0600): only nodes serving
    # the admin API need it, to sign activated versions. `gtm admin keygen` makes a pair.
    document_signing_key: Path | None = None
    # Approvals a proposal needs, each from a policy-approver other than its author.
    policy_approvals: int = Field(default=1, ge=1, le=10)
    # OIDC/JWT access tokens for the admin API (gtm.admin.oidc): all three, or none (API tokens
    # only). Roles come from the principal an admin bound the token's subject to, never from it.
    admin_oidc_issuer: str | None = None
    admin_oidc_audience: str | None = None
    admin_oidc_jwks_url: str | None = None
    # The console's session cookies are encrypted with a key derived from this file (mode 0600,
    # 32+ random bytes, the same on every admin node behind one name); unset: a key per process,
    # so sessions end when it restarts. Idle sessions end after the timeout.
    console_session_key_file: Path | None = None
    console_idle_timeout_s: float = Field(default=900.0, gt=0)
    # Console sign-in through the identity provider (authorization code flow with PKCE). The
    # access tokens it returns must be ones the admin API accepts (GTM_ADMIN_OIDC_* above).
    console_oidc_client_id: str | None = None
    console_oidc_client_secret: SecretStr | None = None  # confidential clients only
    console_oidc_authorize_url: str | None = None
    console_oidc_token_url: str | None = None
    console_oidc_scope: str = "openid"
    # Where the CLI's control-plane commands (gtm proposal ...) find the admin API, and the
    # bearer token they send (from the environment or a 0600 file, never a flag or YAML).
    admin_url: str | None = None
    admin_token: SecretStr | None = None
    # How this process logs: "console" for people, "json" (one object a line) for collectors.
    log_format: Literal["console", "json"] = "console"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Exceptions on an answering path (DNS, the HTTP front) are counted every one, and logged
    # at most once per path in this many seconds, with a sampled stack (gtm.failures).
    answer_failure_log_interval_s: float = Field(default=10.0, gt=0)
    # OpenTelemetry traces (gtm.tracing): off unless a collector's OTLP/HTTP base URL is given
    # here or in the standard OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT. Unset name and ratio: the
    # standard OTEL_SERVICE_NAME (else "gtm") and OTEL_TRACES_SAMPLER (else every request).
    otel_endpoint: str | None = Field(default=None, pattern=r"^https?://")
    otel_service_name: str | None = Field(default=None, min_length=1)
    otel_sample_ratio: float | None = Field(default=None, ge=0, le=1)

    @property
    def document_state_path(self) -> Path:
        if self.document_state_file is not None:
            return self.document_state_file
        return self.spool_dir.parent / "state" / f"{self.spool_dir.name}-documents.json"

    @property
    def health_key_path(self) -> Path:
        if self.health_signing_key is not None:
            return self.health_signing_key
        return self.spool_dir / "health-signing.key"

    @property
    def checkpoint_dir(self) -> Path:
        if self.audit_checkpoint_dir is not None:
            return self.audit_checkpoint_dir
        return self.spool_dir.parent / "checkpoints"

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.http_tls_cert is None) != (self.http_tls_key is None):
            raise ValueError("http_tls_cert and http_tls_key go together: set both or neither")
        return self

    @model_validator(mode="after")
    def _cookies_on(self) -> Settings:
        for needs in ("dns_require_cookie", "dns_establish_with_cookie"):
            if getattr(self, needs) and not self.dns_cookies:
                raise ValueError(f"{needs} needs dns_cookies: no cookie is checked")
        return self

    @model_validator(mode="after")
    def _dnssec_active_key(self) -> Settings:
        if self.dnssec_publish_key_files and self.dnssec_key_file is None:
            raise ValueError(
                "dnssec_publish_key_files needs dnssec_key_file: a published key does not sign"
            )
        return self

    @model_validator(mode="after")
    def _quorum_reachable(self) -> Settings:
        if self.health_members and self.health_quorum > len(self.health_members):
            raise ValueError(
                f"health_quorum {self.health_quorum} can never be reached by the "
                f"{len(self.health_members)} health_members"
            )
        return self


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment, with CLI flags (non-None ``overrides``) on top."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        raise ConfigError(problems_from_validation(exc, "settings")) from exc
