"""A decision id in an HTTP response leads back to the audit row that counted that response:
cached redirects, refusals and proxied exchanges, through the query and the ``gtm`` command."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gtm.audit import query
from gtm.audit.database import make_async_engine
from gtm.audit.decision_id import DecisionIdError, make_id, mark_of, parse_id
from gtm.decision.snapshot import HealthState, RegionHealth
from gtm.runtime import Runtime
from tests.conftest import ROOT
from tests.gtm.front.conftest import FrontFactory
from tests.gtm.front.test_proxy import HEADERS, client, proxy_topology, regions
from tests.gtm.front.test_redirect import CHAT, CHAT_EU, FRANKFURT, TOKYO, WASHINGTON, ask, hdrs


async def _rows(runtime: Runtime, decision_id: str) -> list[dict[str, Any]]:
    await runtime.writer.flush()
    engine = make_async_engine(runtime.settings.database_url)
    try:
        return await query.find_decision(engine, decision_id)
    finally:
        await engine.dispose()


def test_ids_round_trip_and_malformed_ones_are_refused() -> None:
    i = make_id("edge-1.example/w3", 1_700_000_000.9876, "198.51.100.0/24", CHAT, 255)
    parsed = parse_id(i)
    assert parsed.node == "edge-1.example/w3"  # dots and slashes in a node name survive
    assert parsed.at_ms == 1_700_000_000_987
    assert parsed.mark == mark_of("198.51.100.0/24", CHAT)
    assert parsed.serial == 255
    assert mark_of("198.51.100.0/24", CHAT) != mark_of("198.51.100.0/24", CHAT_EU)
    for bad in ("", "nonsense", "a~b~c~d", "~1~00000000~1", "n~1~0000000~1", "n~zz~00000000~1"):
        with pytest.raises(DecisionIdError):
            parse_id(bad)


async def test_each_redirect_finds_its_own_row(start_front: FrontFactory) -> None:
    async with start_front() as front, ask(front) as http:
        answers = {}
        for client_ip in (FRANKFURT, WASHINGTON, TOKYO):
            for _ in range(3):  # repeats: the cached answer path
                r = await http.get("/v1/x", headers=hdrs(CHAT, client_ip))
                assert r.status_code == 307
                answers.setdefault(client_ip, []).append(r)
        ids = [r.headers["x-gtm-decision-id"] for rs in answers.values() for r in rs]
        assert len(set(ids)) == len(ids)  # unique per response
        for client_ip, responses in answers.items():
            for r in responses:
                rows = await _rows(front.runtime, r.headers["x-gtm-decision-id"])
                assert len(rows) == 1, rows
                row = rows[0]
                assert row["node"] == "front-test"
                assert row["region"] == r.headers["x-gtm-region"]
                assert row["response"] == "307" and row["name"] == CHAT
                prefix = client_ip.rsplit(".", 1)[0]
                assert row["client_network"] == f"{prefix}.0/24"
                at_us = parse_id(r.headers["x-gtm-decision-id"]).at_ms * 1000
                assert row["first_at_us"] <= at_us + 999 and row["last_at_us"] >= at_us


async def test_refusals_name_a_findable_decision(start_front: FrontFactory) -> None:
    async with start_front() as front, ask(front) as http:
        r = await http.get("/", headers=hdrs(CHAT, FRANKFURT, x_data_residency="kr-personal"))
        assert r.status_code == 451
        (row,) = await _rows(front.runtime, r.json()["decision_id"])
        assert (row["response"], row["outcome"], row["region"]) == ("451", "denied", None)
        down = RegionHealth(HealthState.DOWN, 0.0, "probe failed")
        front.runtime.swap(health={"eu-west": down, "eu-central": down})
        r = await http.get("/", headers=hdrs(CHAT_EU, FRANKFURT))
        assert r.status_code == 503
        (row,) = await _rows(front.runtime, r.json()["decision_id"])
        assert row["response"] == "503"
        assert {c["region"]: c["reason"] for c in row["candidates"]}["eu-west"] != "ok"


async def test_a_proxied_exchange_is_found_with_the_region_that_served_it(
    start_front: FrontFactory,
) -> None:
    async with regions(eu_west="ok") as up:  # eu-central refuses: the retry serves it
        topo = proxy_topology({r: up[r].port for r in up})
        async with start_front(topo) as front, client(front.url) as http:
            r = await http.post("/v1/chat", content=b"q", headers=HEADERS)
            assert r.status_code == 200
            decision_id = r.headers["x-gtm-decision-id"]
            # The region got the same id: both tiers' logs join on it.
            assert up["eu-west"].requests[0][1]["x-gtm-decision-id"] == decision_id
            (row,) = await _rows(front.runtime, decision_id)
            assert row["region"] == "eu-west" and row["response"].startswith("200")


async def test_gtm_audit_show_explains_the_decision(start_front: FrontFactory) -> None:
    async with start_front() as front, ask(front) as http:
        r = await http.get("/", headers=hdrs(CHAT_EU, WASHINGTON))
        decision_id = r.headers["x-gtm-decision-id"]
        await front.runtime.writer.flush()
        url = front.runtime.settings.database_url

        def show(*args: str) -> subprocess.CompletedProcess[str]:
            cmd = [sys.executable, "-m", "gtm", "audit", "show", *args, "--database-url", url]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)

        out = show(decision_id)
        assert out.returncode == 0, out.stderr
        assert r.headers["x-gtm-region"] in out.stdout
        assert "eu-personal" in out.stdout  # the class that constrained it
        assert "us-east" in out.stdout and "dropped" in out.stdout  # and why not the US
        unknown = decision_id.rsplit("~", 3)
        unknown[1] = "1"  # 1970: no row
        out = show("~".join(unknown))
        assert out.returncode == 1 and "no audit row" in out.stderr
        out = show("not-an-id")
        assert out.returncode == 2 and "not a decision id" in out.stderr


async def test_the_asgi_path_names_its_row_too(start_front: FrontFactory) -> None:
    """Cached redirects are written by the HTTP protocol itself unless the connection is
    busy (pipelining, a paused writer); then the ASGI call answers them. Called directly."""
    async with start_front() as front:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        headers = [(b"host", CHAT.encode()), (b"x-forwarded-for", TOKYO.encode())]
        scope = {
            "type": "http",
            "method": "GET",
            "path": "/v1/x",
            "raw_path": b"/v1/x",
            "query_string": b"",
            "headers": headers,
            "client": ("127.0.0.1", 40000),
        }
        ids = []
        for _ in range(2):
            sent.clear()
            await front.app(scope, receive, send)
            start = dict(sent[0]["headers"])
            assert sent[0]["status"] == 307 and start[b"x-gtm-region"] == b"ap-northeast"
            ids.append(start[b"x-gtm-decision-id"].decode())
        assert ids[0] != ids[1]
        for i in ids:
            (row,) = await _rows(front.runtime, i)
            assert row["region"] == "ap-northeast" and row["client_network"] == "192.0.2.0/24"


async def test_exchanges_ending_out_of_order_share_a_row_both_ids_find(
    start_front: FrontFactory,
) -> None:
    """A proxied exchange is counted when it ends, at its decision's time. One decided first
    but ending last (its client sends the body slowly) lands in the same tally as a quicker
    one decided after it: the row must span both decision times."""
    async with regions(eu_central="ok") as up:
        topo = proxy_topology({r: up[r].port for r in up})
        async with start_front(topo) as front, client(front.url) as http:
            front.runtime.writer.flush_interval = 60.0  # one window for both exchanges
            await front.runtime.writer.flush()

            sent, release = asyncio.Event(), asyncio.Event()

            async def slow_body() -> AsyncIterator[bytes]:
                yield b"first half, "
                sent.set()  # asked for more: its head and first half are on the wire
                await release.wait()  # the second half only once the quick one has ended
                yield b"second half"

            slow = asyncio.create_task(http.post("/v1/chat", content=slow_body(), headers=HEADERS))
            await sent.wait()
            # A few milliseconds so the two decision times differ (ids carry milliseconds):
            # not readiness, which the event above gives.
            await asyncio.sleep(0.01)
            quick = await http.post("/v1/chat", content=b"q", headers=HEADERS)
            assert not slow.done()
            release.set()
            first = await slow
            assert first.status_code == quick.status_code == 200
            ids = [first.headers["x-gtm-decision-id"], quick.headers["x-gtm-decision-id"]]
            assert parse_id(ids[0]).at_ms < parse_id(ids[1]).at_ms
            rows = [await _rows(front.runtime, i) for i in ids]
            assert len(rows[0]) == len(rows[1]) == 1
            assert rows[0][0]["id"] == rows[1][0]["id"] and rows[0][0]["count"] == 2
