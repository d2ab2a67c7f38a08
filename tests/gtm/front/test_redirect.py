"""The redirect front on a real server on loopback, asked by httpx and curl."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from gtm.decision.snapshot import HealthState, RegionHealth
from gtm.front.server import FrontServer, HeadLimits, serve_front
from tests.gtm.front.conftest import Front, FrontFactory, audit_rows, audited, demo_topology

FRANKFURT = "198.51.100.7"
WASHINGTON = "203.0.113.8"
TOKYO = "192.0.2.9"
EU_BASES = ("http://127.0.0.1:8103", "http://127.0.0.1:8104")
CHAT = "chat.gtm.example"
CHAT_EU = "chat.eu.gtm.example"


def ask(front: Front) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=front.url, follow_redirects=False, trust_env=False)


def hdrs(host: str, client: str | None = None, **extra: str) -> dict[str, str]:
    headers = {"host": host, **{k.replace("_", "-"): v for k, v in extra.items()}}
    if client is not None:
        headers["x-forwarded-for"] = client
    return headers


async def test_redirect_keeps_path_query_method_and_names_region(start_front: FrontFactory) -> None:
    async with start_front() as front, ask(front) as http:
        r = await http.get(
            "/v1/chat/completions?stream=true&q=a%2Fb", headers=hdrs(CHAT, FRANKFURT)
        )
        assert r.status_code == 307
        assert (
            r.headers["location"] == "http://127.0.0.1:8104/v1/chat/completions?stream=true&q=a%2Fb"
        )
        assert r.headers["cache-control"] == "no-store"
        assert r.headers["x-gtm-region"] == "eu-central"
        first_id = r.headers["x-gtm-decision-id"]
        r = await http.post("/v1/x", content=b'{"a":1}', headers=hdrs(CHAT, WASHINGTON))
        assert r.status_code == 307  # keeps method and body, never 302
        assert r.headers["location"] == "http://127.0.0.1:8101/v1/x"
        assert r.headers["x-gtm-region"] == "us-east"
        assert r.headers["x-gtm-decision-id"] != first_id
        r = await http.head("/", headers=hdrs(CHAT, TOKYO))
        assert r.status_code == 307
        assert r.headers["x-gtm-region"] == "ap-northeast"
    assert await audited(front.runtime) == 3


async def test_redirect_status_is_per_service(start_front: FrontFactory) -> None:
    topo = demo_topology()
    topo["services"][0]["http"] = {"redirect_status": 308}
    async with start_front(topo) as front, ask(front) as http:
        r = await http.put("/v1/files/1", content=b"x", headers=hdrs(CHAT, FRANKFURT))
        assert r.status_code == 308
        r = await http.put("/v1/files/1", content=b"x", headers=hdrs(CHAT_EU, FRANKFURT))
        assert r.status_code == 307


async def test_restricted_service_and_header_stay_in_the_allowed_set(
    start_front: FrontFactory,
) -> None:
    async with start_front() as front, ask(front) as http:
        r = await http.get("/", headers=hdrs(CHAT, WASHINGTON))
        assert r.headers["x-gtm-region"] == "us-east"
        for headers in (
            hdrs(CHAT_EU, WASHINGTON),
            hdrs(CHAT_EU, TOKYO),
            hdrs(CHAT, WASHINGTON, x_data_residency="eu-personal"),
            hdrs(CHAT, TOKYO, x_data_residency="EU-Personal ,"),
        ):
            r = await http.get("/v1/x", headers=headers)
            assert r.status_code == 307, headers
            assert r.headers["location"].startswith(EU_BASES), headers


def _tenants_topology() -> dict[str, Any]:
    topo = demo_topology()
    topo["tenants"] = [
        {"id": "usgov", "api_key_prefixes": ["sk-usgov-"]},
        {"id": "acme", "api_key_prefixes": ["sk-acme-"], "residency_classes": ["eu-personal"]},
    ]
    return topo


async def test_tenant_by_api_key_or_header_and_the_strictest_applies(
    start_front: FrontFactory,
) -> None:
    async with start_front(_tenants_topology()) as front, ask(front) as http:
        r = await http.get("/", headers=hdrs(CHAT, FRANKFURT, authorization="Bearer sk-usgov-1"))
        assert r.headers["x-gtm-region"] in ("us-east", "us-west")
        r = await http.get("/", headers=hdrs(CHAT, FRANKFURT, x_gtm_tenant="usgov"))
        assert r.headers["x-gtm-region"] in ("us-east", "us-west")
        r = await http.get("/", headers=hdrs(CHAT, WASHINGTON, x_api_key="sk-acme-9"))
        assert r.headers["location"].startswith(EU_BASES)
        # US-only tenant on EU personal data: the sets intersect to nothing.
        r = await http.get("/", headers=hdrs(CHAT_EU, WASHINGTON, x_gtm_tenant="usgov"))
        assert r.status_code == 451
        assert set(r.json()["rules"]) == {"eu-personal-stays-in-eu", "tenant-usgov-us-only"}
        assert "location" not in r.headers
        r = await http.get(
            "/", headers=hdrs(CHAT, WASHINGTON, x_gtm_tenant="acme", x_api_key="sk-usgov-1")
        )
        assert r.status_code == 400
        assert "another tenant" in r.json()["message"]
        r = await http.get("/", headers=hdrs(CHAT, WASHINGTON, x_gtm_tenant="nobody"))
        assert r.status_code == 400
    rows = await audit_rows(front.runtime)
    assert {row["tenant"] for row in rows} == {"usgov", "acme", None}


async def test_class_allowed_nowhere_is_451_naming_the_rule(start_front: FrontFactory) -> None:
    async with start_front() as front, ask(front) as http:
        r = await http.post("/", headers=hdrs(CHAT, FRANKFURT, x_data_residency="kr-personal"))
        assert r.status_code == 451
        body = r.json()
        assert body["error"] == "residency_denied"
        assert body["residency_classes"] == ["kr-personal"]
        assert any("kr-personal" in reason for reason in body["reasons"])
        assert "location" not in r.headers


async def test_allowed_regions_down_is_503_with_retry_after(start_front: FrontFactory) -> None:
    async with start_front() as front, ask(front) as http:
        down = RegionHealth(HealthState.DOWN, 0.0, "probe failed")
        front.runtime.swap(health={"eu-west": down, "eu-central": down})
        r = await http.get("/v1/x", headers=hdrs(CHAT_EU, FRANKFURT))
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) >= 1
        assert "location" not in r.headers
        body = r.json()
        assert body["rules"] == ["eu-personal-stays-in-eu"]
        assert {c["region"] for c in body["regions"]} >= {"eu-west", "us-east"}
        # Unrestricted traffic still goes to the nearest healthy region...
        r = await http.get("/v1/x", headers=hdrs(CHAT, FRANKFURT))
        assert r.status_code == 307
        assert not r.headers["location"].startswith(EU_BASES)
        # ...and with every region down it follows its policy (fail static): still a redirect.
        everything = {rid: down for rid in front.runtime.store.current.regions}
        front.runtime.swap(health=everything)
        r = await http.get("/v1/x", headers=hdrs(CHAT, FRANKFURT))
        assert r.status_code == 307
        r = await http.get("/v1/x", headers=hdrs(CHAT_EU, FRANKFURT))
        assert r.status_code == 503
    assert await audited(front.runtime) == 4


async def test_forwarding_headers_only_from_trusted_peers(start_front: FrontFactory) -> None:
    async with start_front(trusted=()) as front, ask(front) as http:
        plain = await http.get("/", headers=hdrs(CHAT))
        for spoof in (
            hdrs(CHAT, TOKYO),
            hdrs(CHAT, forwarded=f"for={TOKYO}"),
            hdrs(CHAT, "not an address"),  # ignored, not even parsed: the peer is not trusted
        ):
            r = await http.get("/", headers=spoof)
            assert r.status_code == 307
            assert r.headers["x-gtm-region"] == plain.headers["x-gtm-region"] != "ap-northeast"
    async with start_front(trusted=("127.0.0.0/8", "10.0.0.0/8")) as front, ask(front) as http:
        r = await http.get("/", headers=hdrs(CHAT, TOKYO))
        assert r.headers["x-gtm-region"] == "ap-northeast"
        # The leftmost entry is the client's own claim; the rightmost untrusted hop wins.
        r = await http.get("/", headers=hdrs(CHAT, f"{TOKYO}, {FRANKFURT}, 10.1.2.3"))
        assert r.headers["x-gtm-region"] == "eu-central"
        r = await http.get(
            "/", headers=hdrs(CHAT, forwarded=f'for={TOKYO}, for="[2001:db8:bbbb::1]:443"')
        )
        assert r.headers["x-gtm-region"] == "us-west"  # San Francisco
        r = await http.get("/", headers=hdrs(CHAT, forwarded="for=unknown"))
        assert r.headers["x-gtm-region"] == plain.headers["x-gtm-region"]
        for bad in (
            hdrs(CHAT, "999.1.1.1"),
            hdrs(CHAT, forwarded="for"),
            hdrs(CHAT, forwarded='for="[2001:db8::1'),
        ):
            r = await http.get("/", headers=bad)
            assert r.status_code == 400, bad
            assert r.json()["error"] == "bad_forwarding_header"


def _raw(front: Front, payload: bytes) -> bytes:
    host, port = front.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(payload)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


async def test_bad_input_gets_a_clear_4xx_and_changes_nothing(start_front: FrontFactory) -> None:
    limits = HeadLimits(max_head_bytes=8192, max_target_bytes=2048, max_headers=40)
    async with start_front(head_limits=limits) as front, ask(front) as http:
        version = front.runtime.store.current.version
        r = await http.get("/v1/x", headers=hdrs("nowhere.example"))
        assert r.status_code == 404
        assert "nowhere.example" in r.json()["message"]
        r = await http.request("TRACE", "/", headers=hdrs(CHAT))
        assert r.status_code == 405
        assert "GET" in r.headers["allow"]
        r = await http.get("/", headers=hdrs(CHAT, x_data_residency="eu personal;drop"))
        assert r.status_code == 400
        assert r.json()["error"] == "bad_residency_or_tenant"
        r = await http.get("/", headers=hdrs("bad host!"))
        assert r.status_code == 400
        r = await http.get("/", headers=hdrs(CHAT, x_padding="a" * 10_000))
        assert r.status_code == 431
        r = await http.get("/", headers={"host": CHAT, **{f"x-h{i}": "1" for i in range(50)}})
        assert r.status_code == 431
        r = await http.get("/" + "a" * 3000, headers=hdrs(CHAT))
        assert r.status_code == 414
        raw = await asyncio.to_thread(_raw, front, b"GET / HTTP/1.0\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 400")
        raw = await asyncio.to_thread(_raw, front, b"GARBAGE\x00\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 400")
        # Asterisk-form names no path to redirect to: refused, never a Location built from it.
        for method in (b"OPTIONS", b"GET"):
            raw = await asyncio.to_thread(
                _raw,
                front,
                method + b" * HTTP/1.1\r\nHost: chat.gtm.example\r\nConnection: close\r\n\r\n",
            )
            assert raw.startswith(b"HTTP/1.1 400") and b"bad_request_target" in raw
            assert b"location" not in raw.lower()
        # A head that never ends is cut off at the limit, not buffered.
        endless = b"GET / HTTP/1.1\r\nHost: chat.gtm.example\r\nX-A: " + b"a" * 200_000
        raw = await asyncio.to_thread(_raw, front, endless)
        assert raw.startswith(b"HTTP/1.1 431")
        # The head limit is per request: a keep-alive connection carrying many times the limit
        # in small requests is fine.
        for _ in range(120):
            r = await http.get("/v1/chat/completions", headers=hdrs(CHAT, FRANKFURT))
            assert r.status_code == 307
        assert front.runtime.store.current.version == version
    rows = await audit_rows(front.runtime)
    statuses = sorted(int(row["response"]) for row in rows for _ in range(row["count"]))
    assert statuses == [307] * 120 + [400] * 6 + [404, 405, 414, 431, 431, 431]


async def test_audit_counts_equal_responses_under_concurrency(start_front: FrontFactory) -> None:
    kinds = [
        hdrs(CHAT, FRANKFURT),
        hdrs(CHAT_EU, WASHINGTON),
        hdrs(CHAT, TOKYO, x_data_residency="nowhere-class"),
        hdrs("unknown.example"),
        hdrs(CHAT, "bad-address"),
    ]
    async with (
        start_front() as front,
        httpx.AsyncClient(
            base_url=front.url,
            trust_env=False,
            limits=httpx.Limits(max_connections=16),
            timeout=httpx.Timeout(30),
        ) as http,
    ):
        responses = await asyncio.gather(
            *(http.get(f"/r/{i}", headers=kinds[i % len(kinds)]) for i in range(400))
        )
        ops = [await http.get(p, headers={"host": "localhost"}) for p in ("/livez", "/readyz")]
    by_status: dict[int, int] = {}
    for r in responses:
        by_status[r.status_code] = by_status.get(r.status_code, 0) + 1
    assert by_status == {307: 160, 451: 80, 404: 80, 400: 80}
    assert [r.status_code for r in ops] == [200, 200]
    assert await audited(front.runtime) == 400  # the operational endpoints are not decisions


async def test_operational_endpoints(start_front: FrontFactory) -> None:
    async with start_front() as front, ask(front) as http:
        await http.get("/", headers=hdrs(CHAT, FRANKFURT))
        assert (await http.get("/livez")).json() == {"status": "live"}
        ready = await http.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["status"] == "ready"
        metrics = await http.get("/metrics")
        assert 'gtm_front_responses_total{status="307"}' in metrics.text
        # On a service host every path is traffic, even one named like an endpoint.
        r = await http.get("/metrics", headers=hdrs(CHAT, FRANKFURT))
        assert r.status_code == 307


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    text = f"{scope['method']} {scope['path']}?{scope['query_string'].decode()} {body.decode()}"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": text.encode()})


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_follows_the_redirect_to_the_region_with_method_and_body(
    start_front: FrontFactory,
) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    upstream = uvicorn.Server(
        uvicorn.Config(_echo, lifespan="off", log_config=None, access_log=False)
    )
    serving = asyncio.create_task(upstream.serve(sockets=[sock]))
    topo = demo_topology()
    for region in topo["regions"]:
        region["base_url"] = f"http://127.0.0.1:{port}"
    try:
        async with start_front(topo) as front:
            front_port = front.url.rsplit(":", 1)[1]
            proc = await asyncio.create_subprocess_exec(
                "curl", "-sS", "-L", "-i",
                "--resolve", f"{CHAT_EU}:{front_port}:127.0.0.1",
                "-H", f"X-Forwarded-For: {WASHINGTON}",
                "--data-binary", '{"prompt":"hi"}',
                f"http://{CHAT_EU}:{front_port}/v1/completions?n=1",
                stdout=subprocess.PIPE,
            )  # fmt: skip
            out, _ = await proc.communicate()
        text = out.decode()
        assert "HTTP/1.1 307" in text
        assert "x-gtm-region: eu-west" in text
        assert text.rstrip().endswith('POST /v1/completions?n=1 {"prompt":"hi"}')
    finally:
        upstream.should_exit = True
        await serving
        sock.close()


async def test_serve_front_on_ipv6_loopback_until_stopped(
    start_front: FrontFactory, tmp_path: Path
) -> None:
    async with start_front() as front:
        probe = FrontServer(front.runtime, "[::1]:0")
        port = probe.bind().getsockname()[1]
        probe.sock.close() if probe.sock else None  # free the port for serve_front
        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(serve_front(front.runtime, f"[::1]:{port}", stop, ready=ready))
        await asyncio.wait_for(ready.wait(), 10)
        async with httpx.AsyncClient(base_url=f"http://[::1]:{port}", trust_env=False) as http:
            r = await http.get("/", headers={"host": CHAT, "x-forwarded-for": FRANKFURT})
            assert r.status_code == 307
            assert r.headers["x-gtm-region"] == "eu-central"
        stop.set()
        await asyncio.wait_for(task, 10)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("::1", port), timeout=1).close()
    assert await audited(front.runtime) == 1
