"""Session affinity in proxy mode, through the real front on loopback with real regional servers:
a conversation stays in the region that served it while that region is allowed, healthy and has
headroom (signed capacity reports pushed to the front's intake), and moves when one of those
stops holding; residency beats stickiness; cookies the front did not issue choose nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.edns
import dns.message
import httpx
import pytest
import yaml

from gtm.admin.replay import replay
from gtm.audit import query
from gtm.audit.database import make_async_engine
from gtm.cli.audit import explain_row
from gtm.decision.model import Decision
from gtm.decision.policy import load_policy
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.decision.snapshot import HealthState, RegionHealth, Snapshot
from gtm.errors import ConfigError
from gtm.front.affinity import COOKIE, Affinity, AffinitySettings, Session, Verdict, load_key
from gtm.front.server import FrontServer
from gtm.geodns.responder import Responder
from gtm.geodns.server import DnsServer
from gtm.geodns.stats import DnsStats
from regional_lb.capacity_report import SIGNATURE_HEADER, CapacityReport, region_secret, sign
from tests.conftest import POLICIES
from tests.gtm.front.conftest import Front, FrontFactory
from tests.gtm.front.test_proxy import CHAT_EU, FRANKFURT, Region, proxy_topology, regions
from tests.support.waiting import eventually

DUBLIN = "100.68.0.9"  # nearest: eu-west
SECRET = b"affinity-report-secret"
SETTINGS = AffinitySettings(b"k" * 32, ttl_s=600.0, min_spare=0.2)


class Client:
    """A client that keeps its affinity cookie itself (so a test can tamper with it)."""

    def __init__(self, front: Front, address: str = FRANKFURT) -> None:
        self.front = front
        self.address = address
        self.cookie: str | None = None
        self.http = httpx.AsyncClient(base_url=front.url, trust_env=False, timeout=10)
        self._seq: dict[str, int] = {}

    async def ask(self, **extra: str) -> httpx.Response:
        """One proxied request, with the cookie the client holds; keeps the one it is given."""
        self.http.cookies.clear()
        headers = [
            (b"host", CHAT_EU.encode()),
            (b"x-forwarded-for", self.address.encode()),
            *((k.encode(), v.encode()) for k, v in extra.items()),
        ]
        if self.cookie is not None:
            # As bytes: a test sends cookies with bytes no client library would.
            headers.append((b"cookie", f"theme=dark; {COOKIE}={self.cookie}".encode("latin-1")))
        r = await self.http.post("/v1/chat", content=b"q", headers=headers)
        assert r.status_code == 200, r.text
        given = r.headers.get("set-cookie")
        if given is not None:
            assert given.startswith(f"{COOKIE}=")
            assert "HttpOnly" in given and "Max-Age=600" in given
            self.cookie = given.split(";")[0].split("=", 1)[1]
        return r

    async def report(self, region: str, utilisation: float) -> None:
        """A signed capacity report from ``region``'s balancer, pushed to the front's intake."""
        seq = self._seq[region] = self._seq.get(region, 0) + 1
        body = (
            CapacityReport(
                region=region,
                seq=seq,
                ts=time.time(),
                instances_healthy=2,
                instances_total=2,
                capacity=10.0,
                outstanding=10 * utilisation,
                utilisation=utilisation,
            )
            .model_dump_json()
            .encode()
        )
        signature = sign(body, region_secret(SECRET, region))
        r = await self.http.post(
            "/v1/capacity",
            content=body,
            headers={SIGNATURE_HEADER: signature, "host": "127.0.0.1"},
        )
        assert r.status_code == 204, r.text

    async def aclose(self) -> None:
        await self.http.aclose()


def set_health(front: Front, **states: HealthState) -> None:
    """Region health as the test says (no probes run; conftest.start_front)."""
    now = time.time()
    front.runtime.swap(
        health={r.replace("_", "-"): RegionHealth(s, now) for r, s in states.items()}
    )


@contextlib.asynccontextmanager
async def proxied(
    start_front: FrontFactory, affinity: AffinitySettings = SETTINGS
) -> AsyncIterator[tuple[Front, dict[str, Region], Client]]:
    async with regions(eu_central="ok", eu_west="ok", us_east="ok") as up:
        topo = proxy_topology({r: up[r].port for r in up})
        async with start_front(topo, affinity=affinity) as front:
            front.runtime.intake.secret = SECRET
            client = Client(front)
            try:
                yield front, up, client
            finally:
                await client.aclose()


async def in_eu_west(front: Front, client: Client) -> None:
    """Give ``client`` a session in eu-west: its nearest region, eu-central, is down for its
    first request; then eu-central is back and eu-west reports headroom."""
    set_health(front, eu_central=HealthState.DOWN)
    r = await client.ask()
    assert r.headers["x-gtm-region"] == "eu-west"
    assert client.cookie is not None and ".eu-west." in client.cookie
    set_health(front)
    await client.report("eu-west", 0.3)


async def rows_of(front: Front) -> list[dict[str, Any]]:
    """The audit rows, read back after the front and its runtime stopped (every count flushed)."""
    engine = make_async_engine(front.runtime.settings.database_url)
    try:
        return await query.tail(engine, limit=1000)
    finally:
        await engine.dispose()


async def test_a_follow_up_stays_in_the_region_that_served_it(start_front: FrontFactory) -> None:
    async with proxied(start_front) as (front, up, client):
        await in_eu_west(front, client)
        kept = await client.ask()
        # GeoIP alone picks eu-central for this client (a client without a session shows it).
        stranger = Client(front)
        try:
            fresh = await stranger.ask()
        finally:
            await stranger.aclose()
        assert fresh.headers["x-gtm-region"] == "eu-central"
        assert kept.headers["x-gtm-region"] == "eu-west"
        assert kept.text.startswith("data: eu-west 0 q")
        assert len(up["eu-west"].requests) == 2
        assert ".eu-west." in (client.cookie or "")  # renewed for the same region
        assert front.app.affinity is not None
        counts = front.app.affinity.counts
        assert counts[Verdict.KEPT] == 1 and counts[Verdict.NEW] == 2

        # Explained as what it was: the audit row behind the response's decision id.
        # The front counts a proxied answer when its stream ends on the server's side, which
        # may come after the client read the last chunk: flush until the row is there.
        engine = make_async_engine(front.runtime.settings.database_url)
        found: list[dict[str, Any]] = []

        async def stored() -> bool:
            nonlocal found
            await front.runtime.writer.flush()
            found = await query.find_decision(engine, kept.headers["x-gtm-decision-id"])
            return bool(found)

        try:
            await eventually(stored, 30.0, "the kept decision's audit row")
        finally:
            await engine.dispose()
        assert [row["region"] for row in found] == ["eu-west"]
        verdicts = {c["region"]: c for c in found[0]["candidates"]}
        assert verdicts["eu-west"]["status"] == "chosen"
        assert verdicts["eu-west"]["reason"] == "session-affinity"
        assert verdicts["eu-central"]["status"] == "eligible"
        assert "fresh choice" in verdicts["eu-central"]["detail"]
        assert verdicts["us-east"]["reason"] == "residency"  # still outside the allowed set
        explained = explain_row(found[0])
        assert "session-affinity (kept for session affinity; fresh choice eu-central)" in explained
        # A replay decides afresh (the session is not recorded), and says so.
        replayed = replay(found[0], front.runtime.store.current, time.time())
        assert replayed.replayed["region"] == "eu-central"
        assert any("session region" in note for note in replayed.notes)

        metrics = await client.http.get("/metrics", headers={"host": "127.0.0.1"})
        assert 'gtm_front_affinity_total{outcome="kept"}' in metrics.text


@pytest.mark.parametrize("why", ["busy", "spilling", "stale"])
async def test_the_session_moves_when_its_region_loses_headroom(
    start_front: FrontFactory, why: str
) -> None:
    async with proxied(start_front) as (front, _up, client):
        await in_eu_west(front, client)
        if why == "busy":
            await client.report("eu-west", 0.81)  # 19% spare, under the 20% asked for
        elif why == "spilling":
            await client.report("eu-west", 0.9)
            assert front.runtime.store.current.capacity["eu-west"].spilling
        else:
            # Its last report is past the staleness limit (10 s): it proves nothing.
            now = time.time() + 11
            front.app.clock = lambda: now
        moved = await client.ask()
        assert moved.headers["x-gtm-region"] == "eu-central"
        assert ".eu-central." in (client.cookie or "")  # issued again where it now is
        again = await client.ask()
        assert again.headers["x-gtm-region"] == "eu-central"
        assert front.app.affinity is not None
        counts = front.app.affinity.counts
        assert counts[Verdict.NO_HEADROOM] == 1 and counts[Verdict.SAME] == 1
        assert Verdict.KEPT not in counts
    rows = await rows_of(front)
    noted = [r for r in rows if "affinity: left eu-west (no_headroom)" in (r["response"] or "")]
    assert [r["region"] for r in noted] == ["eu-central"]


@pytest.mark.parametrize("state", [HealthState.DOWN, HealthState.DRAINING])
async def test_the_session_moves_when_its_region_turns_unhealthy(
    start_front: FrontFactory, state: HealthState
) -> None:
    async with proxied(start_front) as (front, up, client):
        await in_eu_west(front, client)
        set_health(front, eu_west=state)
        await client.report("eu-west", 0.1)  # headroom does not make it healthy
        moved = await client.ask()
        assert moved.headers["x-gtm-region"] == "eu-central"
        assert len(up["eu-west"].requests) == 1  # only the first request
        assert front.app.affinity is not None
        assert front.app.affinity.counts[Verdict.UNHEALTHY] == 1


async def test_residency_beats_stickiness(start_front: FrontFactory, tmp_path: Path) -> None:
    """A policy activated after the session began no longer allows its region for this class:
    the next request leaves it, although the region is healthy and has headroom."""
    async with proxied(start_front) as (front, up, client):
        await in_eu_west(front, client)
        policies = tmp_path / "policies"
        policies.mkdir()
        for name in ("default.yaml", "country-localisation.yaml"):
            (policies / name).write_text((POLICIES / name).read_text())
        doc = yaml.safe_load((POLICIES / "eu-personal.yaml").read_text())
        doc["version"] = "2026-11-27.1"
        doc["rules"][0]["allow"] = {"regions": ["eu-central"]}
        (policies / "eu-personal.yaml").write_text(yaml.safe_dump(doc))
        front.runtime.swap(policy=load_policy([policies], front.runtime.store.current.topology))
        await client.report("eu-west", 0.1)

        moved = await client.ask()
        assert moved.headers["x-gtm-region"] == "eu-central"
        assert len(up["eu-west"].requests) == 1
        assert front.app.affinity is not None
        assert front.app.affinity.counts[Verdict.DISALLOWED] == 1
        # And it stays out: the cookie issued now names the allowed region.
        assert ".eu-central." in (client.cookie or "")
        again = await client.ask()
        assert again.headers["x-gtm-region"] == "eu-central"
    rows = await rows_of(front)
    noted = [r for r in rows if "affinity: left eu-west (disallowed)" in (r["response"] or "")]
    assert len(noted) == 1
    verdicts = {c["region"]: c for c in noted[0]["candidates"]}
    assert verdicts["eu-west"]["reason"] == "residency"


def _tampered(cookie: str) -> str:
    return cookie.replace(".eu-central.", ".eu-west.")


@pytest.mark.parametrize(
    "kind", ["tampered", "other-key", "made-up", "garbage", "not-ascii", "expired"]
)
async def test_a_cookie_the_front_did_not_issue_or_that_lapsed_chooses_nothing(
    start_front: FrontFactory, kind: str
) -> None:
    async with proxied(start_front) as (front, _up, client):
        await client.report("eu-west", 0.1)  # eu-west could take the session
        if kind == "expired":
            await in_eu_west(front, client)
            now = time.time() + SETTINGS.ttl_s + 1
            front.app.clock = lambda: now
            expected = Verdict.EXPIRED
        else:
            expected = Verdict.FORGED
            first = await client.ask()
            assert first.headers["x-gtm-region"] == "eu-central"
            assert client.cookie is not None
            if kind == "tampered":
                client.cookie = _tampered(client.cookie)
            elif kind == "other-key":
                # Genuine, for this very binding and eu-west, from a front with another key.
                outsider = Affinity(AffinitySettings(b"x" * 32, ttl_s=600.0))
                decision = _decision(front)
                session = Session(Verdict.NEW, None, outsider.tag(decision, None), False)
                issued = outsider.issue("eu-west", session, time.time()).decode()
                client.cookie = issued.split(";")[0].split("=", 1)[1]
            elif kind == "made-up":
                client.cookie = f"1.eu-west.{int(time.time())}.AAAAAAAAAAA.{'B' * 22}"
            elif kind == "not-ascii":
                client.cookie = f"1.eu-west.{int(time.time())}.AAAAAAAAAAA.{chr(0xE9) * 22}"
            else:
                client.cookie = "eu-west"
        r = await client.ask()
        assert r.headers["x-gtm-region"] == "eu-central"
        assert ".eu-central." in (client.cookie or "")  # a genuine one is issued instead
        assert front.app.affinity is not None
        assert front.app.affinity.counts[expected] == 1
        assert Verdict.KEPT not in front.app.affinity.counts


def _decision(front: Front) -> Decision:
    """A fresh decision for the Frankfurt client on chat-eu (the binding a cookie is tagged
    with)."""
    return _decide(front.runtime.store.current)


def _decide(snapshot: Snapshot) -> Decision:
    request = DecisionRequest(
        Channel.HTTP,
        ip_address(FRANKFURT),
        "chat-eu",
        CHAT_EU,
        None,
        frozenset({"eu-personal"}),
    )
    return decide(request, snapshot, time.time())


async def test_a_genuine_cookie_from_another_client_place_is_not_honoured(
    start_front: FrontFactory,
) -> None:
    """The cookie is bound to the country it was issued for: carried from Frankfurt to Dublin
    (whose nearest region is eu-west) it does not keep Dublin's requests in eu-central."""
    async with proxied(start_front) as (front, _up, client):
        await client.ask()
        assert client.cookie is not None and ".eu-central." in client.cookie
        await client.report("eu-central", 0.1)
        client.address = DUBLIN
        r = await client.ask()
        assert r.headers["x-gtm-region"] == "eu-west"
        assert front.app.affinity is not None
        assert front.app.affinity.counts[Verdict.MISMATCH] == 1


async def test_any_front_with_the_same_key_file_honours_the_cookie(
    start_front: FrontFactory, tmp_path: Path
) -> None:
    """Nothing is shared but the key: a second front (another node or worker) keeps the session
    a first one issued; a front with another key ignores it."""
    key_file = tmp_path / "affinity.key"
    key_file.write_bytes(os.urandom(48))
    key_file.chmod(0o600)
    shared = AffinitySettings(load_key(key_file), ttl_s=600.0)
    async with proxied(start_front, shared) as (front, _up, client):
        await in_eu_west(front, client)
        for key in (load_key(key_file), load_key(None)):
            second = FrontServer(
                front.runtime, "127.0.0.1:0", affinity=AffinitySettings(key, ttl_s=600.0)
            )
            second.bind()
            async with _serving(second) as other:
                other.cookie = client.cookie
                r = await other.ask()
                expected = "eu-west" if key == shared.key else "eu-central"
                assert r.headers["x-gtm-region"] == expected


@contextlib.asynccontextmanager
async def _serving(server: FrontServer) -> AsyncIterator[Client]:
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(server.run(stop, ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        assert server.app is not None
        front = Front(server.url, server.runtime, server.app, server, stop, task)
        client = Client(front)
        try:
            yield client
        finally:
            await client.aclose()
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


def test_a_key_file_others_can_read_or_too_short_is_refused(tmp_path: Path) -> None:
    loose = tmp_path / "loose.key"
    loose.write_bytes(os.urandom(48))
    loose.chmod(0o644)
    with pytest.raises(ConfigError, match="0600"):
        load_key(loose)
    short = tmp_path / "short.key"
    short.write_bytes(b"x" * 16)
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="32 bytes"):
        load_key(short)


async def test_dns_answers_are_unaffected(start_front: FrontFactory) -> None:
    """A session kept in eu-west on the front changes nothing of what DNS answers the same
    client's network: DNS has no session, and decides by place and load as before."""
    async with proxied(start_front) as (front, _up, client):
        await in_eu_west(front, client)
        assert (await client.ask()).headers["x-gtm-region"] == "eu-west"
        server = DnsServer(Responder(front.runtime, DnsStats()), ("127.0.0.1:0",))
        await server.start()
        try:
            port = server.bound[0][1]
            q = dns.message.make_query("chat.eu.gtm.example.", "A", use_edns=0)
            q.use_edns(0, options=[dns.edns.ECSOption("198.51.100.0", 24)])
            answer = await dns.asyncquery.udp(q, "127.0.0.1", port=port, timeout=3)
        finally:
            await server.stop()
        addresses = {str(rr) for rrset in answer.answer for rr in rrset}
        assert addresses == set(front.runtime.store.current.regions["eu-central"].ipv4)


async def test_redirects_are_unaffected(start_front: FrontFactory) -> None:
    """A redirected client talks to its region itself after the first request: no cookie is
    issued or read for a redirect-mode service."""
    async with start_front() as front:
        outsider = Affinity(SETTINGS)
        session = Session(Verdict.NEW, None, outsider.tag(_decision(front), None), False)
        cookie = outsider.issue("eu-west", session, time.time()).decode().split(";")[0]
        async with httpx.AsyncClient(base_url=front.url, trust_env=False) as http:
            r = await http.get(
                "/v1/models",
                headers={"host": CHAT_EU, "x-forwarded-for": FRANKFURT, "cookie": cookie},
            )
        assert r.status_code == 307
        assert r.headers["x-gtm-region"] == "eu-central"
        assert "set-cookie" not in r.headers
        assert front.app.affinity is not None
        assert not front.app.affinity.counts


def test_the_cookie_is_secure_over_tls_and_found_among_others(snapshot: Snapshot) -> None:
    affinity = Affinity(SETTINGS)
    decision = _decide(snapshot)
    session = Session(Verdict.NEW, None, affinity.tag(decision, None), True)
    issued = affinity.issue("eu-west", session, 1000.0).decode()
    assert issued.endswith("; SameSite=Lax; Secure")
    value = issued.split(";")[0].split("=", 1)[1]
    headers = [(b"cookie", b"a=1"), (b"cookie", f"b=2; {COOKIE}={value}; c=3".encode())]
    read = affinity.read(headers, decision, None, 1000.0, True)
    assert (read.verdict, read.region) == (Verdict.SAME, "eu-west")
    # Another tenant's request: the same cookie is genuine but not its own.
    assert affinity.read(headers, decision, "acme", 1000.0, True).verdict is Verdict.MISMATCH
