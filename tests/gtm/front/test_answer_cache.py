"""The front's answer cache and the redirects the protocol answers itself: every response still
a real decision for its own inputs, and every one counted in the audit store.

Real servers on loopback, asked by httpx and by raw sockets (pipelining, HTTP/1.0, bodies)."""

from __future__ import annotations

import asyncio
import collections
import re
import socket
import time
from typing import Any

import httpx

from gtm.decision.snapshot import HealthState, RegionCapacity, RegionHealth
from tests.gtm.front.conftest import Front, FrontFactory, audit_rows, audited, demo_topology

FRANKFURT = "198.51.100.7"
WASHINGTON = "203.0.113.8"
TOKYO = "192.0.2.9"
BERLIN = "100.70.0.5"  # 100.70.0.0/28: the same /24 as NEW_YORK, a different GeoIP network
NEW_YORK = "100.70.0.20"  # 100.70.0.16/28
CHAT = "chat.gtm.example"
CHAT_EU = "chat.eu.gtm.example"
EU_BASES = ("http://127.0.0.1:8103", "http://127.0.0.1:8104")


def ask(front: Front, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=front.url, follow_redirects=False, trust_env=False, **kwargs)


def hdrs(host: str, client: str | None = None, **extra: str) -> dict[str, str]:
    headers = {"host": host, **{k.replace("_", "-"): v for k, v in extra.items()}}
    if client is not None:
        headers["x-forwarded-for"] = client
    return headers


def _exchange(front: Front, payload: bytes, responses: int) -> list[bytes]:
    """Send ``payload`` on one connection and read ``responses`` responses (or until closed)."""
    host, port = front.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(payload)
        data = b""
        out: list[bytes] = []
        while len(out) < responses:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            while True:
                end = data.find(b"\r\n\r\n")
                if end < 0:
                    break
                head = data[: end + 4]
                length = re.search(rb"(?i)\r\ncontent-length: (\d+)", head)
                size = end + 4 + (int(length.group(1)) if length else 0)
                if len(data) < size:
                    break
                out.append(data[:size])
                data = data[size:]
        return out


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def _header(response: bytes, name: str) -> str | None:
    found = re.search(rb"(?im)^" + name.encode() + rb": ([^\r]*)\r$", response)
    return found.group(1).decode() if found else None


def _request(
    host: str, client: str, target: str = "/v1/x", method: str = "GET", extra: str = ""
) -> bytes:
    return (
        f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nX-Forwarded-For: {client}\r\n{extra}\r\n"
    ).encode()


async def test_repeated_answers_are_each_counted(start_front: FrontFactory) -> None:
    """Thousands of responses from a few cached answers, over many flushes of the audit
    writer (every 50 ms here): the audit store counts each one, per client network and
    method."""
    clients = [FRANKFURT, WASHINGTON, TOKYO, BERLIN, NEW_YORK]
    sent: collections.Counter[tuple[str, str]] = collections.Counter()
    async with (
        start_front() as front,
        ask(front, limits=httpx.Limits(max_connections=8), timeout=httpx.Timeout(30)) as http,
    ):
        for round_ in range(6):
            batch = []
            for i in range(300):
                client = clients[i % len(clients)]
                method = "POST" if i % 3 == 0 else "GET"
                sent[client, method] += 1
                batch.append(
                    http.request(method, f"/v1/r{round_}/{i}?n={i}", headers=hdrs(CHAT, client))
                )
            responses = await asyncio.gather(*batch)
            assert {r.status_code for r in responses} == {307}
            for r in responses:
                assert r.headers["location"].endswith(r.request.url.raw_path.decode())
            await asyncio.sleep(0.06)  # let a flush of the audit writer run in between
        assert front.app.ledger.responses == 1800
    assert await audited(front.runtime) == 1800
    counted: collections.Counter[tuple[str, str]] = collections.Counter()
    networks = {c: ".".join(c.split(".")[:3]) + ".0/24" for c in clients}
    for row in await audit_rows(front.runtime):
        assert row["response"] == "307"
        client = [c for c in clients if networks[c] == row["client_network"]]
        assert client, row["client_network"]
        # BERLIN and NEW_YORK share a /24: tell them apart by where they were sent.
        who = client[0]
        if len(client) > 1:
            who = BERLIN if row["region"] == "eu-central" else NEW_YORK
        counted[who, row["query_type"]] += row["count"]
    assert counted == sent


async def test_decision_ids_are_unique_and_paths_are_per_request(
    start_front: FrontFactory,
) -> None:
    async with start_front() as front, ask(front) as http:
        seen = set()
        for i in range(50):
            r = await http.get(f"/v1/p/{i}?q={i}", headers=hdrs(CHAT, FRANKFURT))
            assert r.headers["location"] == f"http://127.0.0.1:8104/v1/p/{i}?q={i}"
            assert r.headers["x-gtm-region"] == "eu-central"
            seen.add(r.headers["x-gtm-decision-id"])
        assert len(seen) == 50
        r = await http.get("/v1/p?", headers=hdrs(CHAT, FRANKFURT))
        assert r.headers["location"] == "http://127.0.0.1:8104/v1/p"
        assert "date" in r.headers
        # Absolute-form and fragment targets are read as uvicorn reads them.
        raw = await asyncio.to_thread(
            _exchange,
            front,
            _request(CHAT, FRANKFURT, target=f"http://{CHAT}/v1/abs?x=1")
            + _request(CHAT, FRANKFURT, target="/v1/frag#part?no"),
            2,
        )
        assert [_header(r, "location") for r in raw] == [
            "http://127.0.0.1:8104/v1/abs?x=1",
            "http://127.0.0.1:8104/v1/frag",
        ]


async def test_a_new_snapshot_replaces_cached_answers(start_front: FrontFactory) -> None:
    async with start_front() as front, ask(front) as http:
        for _ in range(3):
            r = await http.get("/", headers=hdrs(CHAT_EU, FRANKFURT))
            assert r.headers["x-gtm-region"] == "eu-central"
        before = front.runtime.store.current.version
        down = RegionHealth(HealthState.DOWN, time.time(), "probe failed")
        front.runtime.swap(health={"eu-central": down})
        for _ in range(3):
            r = await http.get("/", headers=hdrs(CHAT_EU, FRANKFURT))
            assert r.headers["x-gtm-region"] == "eu-west"  # failover, inside the EU
        front.runtime.swap(health={"eu-central": down, "eu-west": down})
        r = await http.get("/", headers=hdrs(CHAT_EU, FRANKFURT))
        assert r.status_code == 503  # restricted traffic fails closed; no stale redirect
        assert "location" not in r.headers
        front.runtime.swap(health={})
        r = await http.get("/", headers=hdrs(CHAT_EU, FRANKFURT))
        assert r.headers["x-gtm-region"] == "eu-central"
    rows = await audit_rows(front.runtime)
    by_version: collections.Counter[tuple[int, str | None]] = collections.Counter()
    for row in rows:
        by_version[row["snapshot_version"], row["region"]] += row["count"]
    assert by_version[before, "eu-central"] == 3
    assert by_version[before + 1, "eu-west"] == 3
    assert sum(n for (v, _), n in by_version.items() if v == before + 2) == 1
    assert by_version[before + 3, "eu-central"] == 1
    assert await audited(front.runtime) == 8


async def test_routine_capacity_reports_keep_cached_answers(start_front: FrontFactory) -> None:
    """Healthy regions' reports (a new snapshot each, in the same decision epoch) leave the
    cached redirects in place; a region going over its high watermark has them decided again."""
    clients = [f"100.72.{i}.1" for i in range(20)]  # Frankfurt: nearest eu-central
    async with start_front() as front, ask(front) as http:

        def report(eu_central: float, spilling: bool = False) -> None:
            now = time.time()
            front.runtime.swap(
                capacity={
                    "eu-central": RegionCapacity(eu_central, now, spilling),
                    "eu-west": RegionCapacity(0.3, now, False),
                }
            )

        async def regions() -> set[str]:
            rs = await asyncio.gather(*(http.get("/", headers=hdrs(CHAT, c)) for c in clients))
            return {r.headers["x-gtm-region"] for r in rs}

        report(0.4)
        epoch = front.runtime.store.current.epoch
        assert await regions() == {"eu-central"}
        decided = front.app.stats.decided
        assert decided == len(clients)
        for u in (0.5, 0.2, 0.6):
            report(u)
            assert await regions() == {"eu-central"}
        assert front.app.stats.decided == decided  # every answer came from the cache
        report(0.97, spilling=True)  # sheds (0.97 - 0.7) / 0.97 of its clients to eu-west
        assert await regions() <= {"eu-central", "eu-west"}
        assert front.app.stats.decided == 2 * decided
        metrics = (await http.get("/metrics", headers={"host": "localhost"})).text
        # The metric sums every front in the process (earlier tests' too).
        exported = re.search(r"^gtm_front_redirect_decisions_total (\S+)$", metrics, re.M)
        assert exported is not None and float(exported.group(1)) >= 2 * decided
    rows = await audit_rows(front.runtime)
    assert sum(r["count"] for r in rows if r["snapshot_version"] == epoch) == 4 * len(clients)


async def test_answers_change_when_a_capacity_report_turns_stale(
    start_front: FrontFactory,
) -> None:
    """Spillover reads a fresh report only: once it is older than the staleness limit the
    decision changes without a new snapshot, and so must the cached answers."""
    # Client networks in 100.72.0.0/13 are all in Frankfurt (nearest: eu-central).
    clients = [f"100.72.{i}.1" for i in range(200)]
    async with start_front() as front, ask(front) as http:
        now = time.time()
        # The front's time stands still until the test moves it: 400 requests on a loaded
        # machine once took longer than the staleness limit, and the report turned stale early.
        front.app.clock = lambda: now
        front.runtime.swap(
            capacity={
                "eu-central": RegionCapacity(0.97, now, True),
                "eu-west": RegionCapacity(0.30, now, False),  # headroom, proven fresh
            }
        )

        async def regions() -> collections.Counter[str]:
            rs = await asyncio.gather(*(http.get("/", headers=hdrs(CHAT, c)) for c in clients))
            return collections.Counter(r.headers["x-gtm-region"] for r in rs)

        fresh = await regions()
        assert fresh["eu-central"] < 200 and fresh["eu-west"] > 0  # a share spills
        assert await regions() == fresh  # stable while the report is fresh
        stale_after = front.runtime.store.current.topology.routing.spillover.stale_after_s
        front.app.clock = lambda: now + stale_after + 1
        assert await regions() == {"eu-central": 200}  # the stale report is ignored


async def test_inputs_that_change_the_decision_do_not_share_an_answer(
    start_front: FrontFactory,
) -> None:
    topo = demo_topology()
    topo["tenants"] = [
        {"id": "usgov", "api_key_prefixes": ["sk-usgov-"]},
        {"id": "acme", "api_key_prefixes": ["sk-acme-"], "residency_classes": ["eu-personal"]},
    ]
    async with start_front(topo) as front, ask(front) as http:

        async def region(*args: Any, **kwargs: str) -> str:
            r = await http.get("/v1/x", headers=hdrs(*args, **kwargs))
            assert r.status_code == 307, r.text
            return str(r.headers["x-gtm-region"])

        for _ in range(2):  # the second time from the cache
            # Client networks, and two GeoIP networks inside one /24.
            assert await region(CHAT, FRANKFURT) == "eu-central"
            assert await region(CHAT, WASHINGTON) == "us-east"
            assert await region(CHAT, BERLIN) == "eu-central"
            assert await region(CHAT, NEW_YORK) == "us-east"
            # Residency header: the same client, narrowed to the EU.
            assert (await region(CHAT, WASHINGTON, x_data_residency="eu-personal")) in (
                "eu-west",
                "eu-central",
            )
            # Tenants by API key (different keys of one tenant alike) and by header.
            assert await region(CHAT, FRANKFURT, authorization="Bearer sk-usgov-1") in (
                "us-east",
                "us-west",
            )
            assert await region(CHAT, FRANKFURT, x_api_key="sk-usgov-2") in ("us-east", "us-west")
            assert await region(CHAT, FRANKFURT, x_gtm_tenant="usgov") in ("us-east", "us-west")
            assert await region(CHAT, WASHINGTON, authorization="Bearer sk-acme-7") in (
                "eu-west",
                "eu-central",
            )
            # A key of no tenant is no tenant.
            assert await region(CHAT, FRANKFURT, authorization="Bearer sk-other-1") == "eu-central"
            # Hosts of different services.
            assert await region(CHAT_EU, WASHINGTON) == "eu-west"
        # Conflicts are still refused after the same inputs were answered from the cache.
        r = await http.get(
            "/", headers=hdrs(CHAT, WASHINGTON, x_gtm_tenant="acme", x_api_key="sk-usgov-1")
        )
        assert r.status_code == 400
        # The cache keeps no credentials.
        keys = repr(list(front.app.answers._exact)) + repr(list(front.app.answers._answers))
        assert "sk-usgov" not in keys and "sk-acme" not in keys
    rows = await audit_rows(front.runtime)
    assert {row["tenant"] for row in rows} == {"usgov", "acme", None}
    assert await audited(front.runtime) == 23


async def test_pipelined_requests_are_answered_in_order_and_counted(
    start_front: FrontFactory,
) -> None:
    """Redirects the protocol answers itself and requests the ASGI app answers, pipelined on
    one connection: answers come back in request order."""
    async with start_front() as front:
        payload = (
            _request(CHAT, FRANKFURT, "/1")
            + _request("unknown.example", FRANKFURT, "/2")  # 404, from the app
            + _request(CHAT, WASHINGTON, "/3")
            + _request(CHAT, TOKYO, "/4", extra="X-Data-Residency: kr-personal\r\n")  # 451
            + _request(CHAT, TOKYO, "/5")
            + _request(CHAT, FRANKFURT, "/6", method="POST", extra="Content-Length: 5\r\n")
            + b"hello"
            + _request(CHAT, WASHINGTON, "/7", method="HEAD")
        )
        raw = await asyncio.to_thread(_exchange, front, payload, 7)
        assert [_status(r) for r in raw] == [307, 404, 307, 451, 307, 307, 307]
        assert [_header(r, "location") for r in raw] == [
            "http://127.0.0.1:8104/1",
            None,
            "http://127.0.0.1:8101/3",
            None,
            "http://127.0.0.1:8106/5",
            "http://127.0.0.1:8104/6",
            "http://127.0.0.1:8101/7",
        ]
        # The same again, now that every answer is cached.
        raw = await asyncio.to_thread(_exchange, front, payload, 7)
        assert [_status(r) for r in raw] == [307, 404, 307, 451, 307, 307, 307]
    assert await audited(front.runtime) == 14


async def test_http_10_and_connection_close_end_the_connection(start_front: FrontFactory) -> None:
    async with start_front() as front:
        for payload in (
            f"GET /a HTTP/1.0\r\nHost: {CHAT}\r\nX-Forwarded-For: {FRANKFURT}\r\n\r\n".encode(),
            _request(CHAT, FRANKFURT, "/a", extra="Connection: close\r\n"),
        ):
            for _ in range(2):  # from a new answer, then from the cache
                # Asked for two responses, it gets one: the connection is closed after it.
                raw = await asyncio.to_thread(_exchange, front, payload + payload, 2)
                assert len(raw) == 1
                assert _status(raw[0]) == 307
                assert _header(raw[0], "connection") == "close"
                assert _header(raw[0], "location") == "http://127.0.0.1:8104/a"
    assert await audited(front.runtime) == 4


async def test_a_body_after_a_cached_redirect_is_skipped(start_front: FrontFactory) -> None:
    async with start_front() as front:
        body = b'{"prompt": "' + b"x" * 20_000 + b'"}'
        post = _request(CHAT, FRANKFURT, "/v1/post", "POST", f"Content-Length: {len(body)}\r\n")
        chunked = _request(CHAT, FRANKFURT, "/v1/chunked", "POST", "Transfer-Encoding: chunked\r\n")
        payload = (
            post
            + body
            + chunked
            + b"5\r\nhello\r\n0\r\n\r\n"
            + _request(CHAT, WASHINGTON, "/after")
            + post
            + body
        )
        raw = await asyncio.to_thread(_exchange, front, payload, 4)
        assert [_header(r, "location") for r in raw] == [
            "http://127.0.0.1:8104/v1/post",
            "http://127.0.0.1:8104/v1/chunked",
            "http://127.0.0.1:8101/after",
            "http://127.0.0.1:8104/v1/post",
        ]
    assert await audited(front.runtime) == 4


async def test_counts_survive_snapshot_swaps_under_load(start_front: FrontFactory) -> None:
    """Answers dropped with their snapshot while their tallies are still waiting for the audit
    writer: nothing is lost."""
    clients = [FRANKFURT, WASHINGTON, TOKYO] + [f"100.72.{i}.1" for i in range(20)]
    async with (
        start_front() as front,
        ask(front, limits=httpx.Limits(max_connections=8), timeout=httpx.Timeout(30)) as http,
    ):
        stop = asyncio.Event()

        async def swapper() -> None:
            flip = False
            while not stop.is_set():
                flip = not flip
                state = HealthState.DOWN if flip else HealthState.UP
                front.runtime.swap(health={"us-east": RegionHealth(state, time.time())})
                await asyncio.sleep(0.01)

        swapping = asyncio.create_task(swapper())
        responses = await asyncio.gather(
            *(http.get(f"/{i}", headers=hdrs(CHAT, clients[i % len(clients)])) for i in range(800))
        )
        stop.set()
        await swapping
        assert {r.status_code for r in responses} == {307}
    assert await audited(front.runtime) == 800


async def test_an_idle_connection_after_a_late_body_still_times_out(
    start_front: FrontFactory,
) -> None:
    """A redirect answered before its request's body arrived: the keep-alive timeout still
    closes the connection once it is idle."""

    def late_body(front: Front) -> tuple[bytes, bytes, float]:
        host, port = front.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=6) as sock:
            sock.sendall(_request(CHAT, FRANKFURT, "/v1/late", "POST", "Content-Length: 5\r\n"))
            head = b""
            while b"\r\n\r\n" not in head:
                head += sock.recv(65536)
            time.sleep(0.3)
            sock.sendall(b"hello")
            started = time.monotonic()
            rest = sock.recv(65536)  # b"": the server closed the connection
            return head, rest, time.monotonic() - started

    async with start_front(keep_alive_s=1) as front:
        head, rest, waited = await asyncio.to_thread(late_body, front)
    assert _status(head) == 307
    assert rest == b""
    assert waited < 4
    assert await audited(front.runtime) == 1
