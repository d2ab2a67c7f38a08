"""A real ``gtm serve`` process, asked by dig and kdig: the RFC 8906 set and the basics."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DEMO, POLICIES, ROOT
from tests.support.geoip import build_city_db
from tests.support.ports import free_tcp_udp_port

TOOLS = ("dig", "kdig")


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        reason = f"{tool} is not installed (Debian: bind9-dnsutils / knot-dnsutils)"
        if os.environ.get("GTM_TEST_REQUIRE_TOOLS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


METRICS_PORT: list[int] = []


def serve_env(tmp: Path) -> dict[str, str]:
    """The environment of a ``gtm serve`` on the demo topology with files under ``tmp``."""
    return os.environ | {
        "GTM_CONFIG": str(DEMO),
        "GTM_POLICIES": f'["{POLICIES}"]',
        "GTM_GEOIP_PATH": str(build_city_db(tmp / "city.mmdb")),
        "GTM_DATABASE_URL": f"sqlite:///{tmp / 'g.sqlite3'}",
        "GTM_SPOOL_DIR": str(tmp / "spool"),
        "GTM_PROBES": "false",
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    tmp = tmp_path_factory.mktemp("serve")
    port = free_tcp_udp_port()
    METRICS_PORT.append(free_tcp_udp_port())
    env = serve_env(tmp)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gtm",
            "serve",
            "--dns",
            f"127.0.0.1:{port}",
            "--metrics",
            f"127.0.0.1:{METRICS_PORT[-1]}",
        ],
        env=env,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    seen = ""
    deadline = time.monotonic() + 30
    while "gtm.ready" not in seen and time.monotonic() < deadline and proc.poll() is None:
        seen += proc.stderr.readline()
    assert "gtm.ready" in seen, seen
    yield port
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    proc.stderr.close()


def ask(tool: str, port: int, *args: str) -> str:
    retries = "+tries=1" if tool == "dig" else "+retry=0"
    out = subprocess.run(
        [require(tool), "@127.0.0.1", "-p", str(port), "+time=2", retries, *args],
        capture_output=True,
        text=True,
        timeout=15,
    )
    return out.stdout


def status(output: str) -> str:
    for line in output.splitlines():
        if "status:" in line:
            # dig: "status: NXDOMAIN, id: 1"; kdig: "status: NXDOMAIN; id: 1"
            return line.split("status:")[1].replace(";", ",").split(",")[0].strip()
    raise AssertionError(output)


def flags(output: str) -> set[str]:
    for line in output.splitlines():
        if line.startswith(";; flags:") or line.startswith(";; Flags:"):
            return set(line.split(":")[1].split(";")[0].split())
    raise AssertionError(output)


def test_dig_rfc8906_set(server: int) -> None:
    soa = ask("dig", server, "gtm.example", "SOA", "+norec", "+noedns")
    assert status(soa) == "NOERROR" and "aa" in flags(soa) and "OPT PSEUDOSECTION" not in soa
    assert "2026112201" in soa
    unknown = ask("dig", server, "gtm.example", "TYPE1000", "+norec")
    assert status(unknown) == "NOERROR" and "ANSWER: 0" in unknown
    bits = ask(
        "dig",
        server,
        "chat.gtm.example",
        "A",
        "+cdflag",
        "+adflag",
        "+zflag",
        "+norec",
        "+subnet=198.51.100.0/24",
    )
    assert status(bits) == "NOERROR" and "192.0.2.40" in bits
    assert flags(bits) >= {"qr", "aa", "cd"} and not flags(bits) & {"ad", "ra", "z"}
    assert "MBZ" not in bits  # dig reports a set Z bit as "MBZ: ..."
    opcode = ask("dig", server, "gtm.example", "SOA", "+opcode=15", "+norec")
    assert status(opcode) == "NOTIMP"
    over_tcp = ask("dig", server, "gtm.example", "SOA", "+tcp", "+norec")
    assert status(over_tcp) == "NOERROR" and "(TCP)" in over_tcp
    v0 = ask("dig", server, "gtm.example", "SOA", "+edns=0", "+norec")
    assert status(v0) == "NOERROR" and "EDNS: version: 0" in v0
    v1 = ask("dig", server, "gtm.example", "SOA", "+edns=1", "+noednsneg", "+norec")
    assert status(v1) == "BADVERS" and "EDNS: version: 0" in v1
    option = ask("dig", server, "gtm.example", "SOA", "+ednsopt=100:abcd", "+norec")
    assert status(option) == "NOERROR" and "OPT=100" not in option
    flag = ask("dig", server, "gtm.example", "SOA", "+ednsflags=0x80", "+norec")
    assert status(flag) == "NOERROR" and "flags:; udp" in flag  # unknown flag not echoed
    do = ask("dig", server, "gtm.example", "SOA", "+dnssec", "+norec")
    assert "flags: do;" in do


def test_dig_and_kdig_answers(server: int) -> None:
    eu = ask("dig", server, "chat.eu.gtm.example", "A", "+short", "+subnet=203.0.113.0/24")
    assert eu.split() == ["192.0.2.30"]  # a US client's EU data is served in Dublin
    nx = ask("kdig", server, "nope.gtm.example", "A")
    assert status(nx) == "NXDOMAIN"
    refused = ask("kdig", server, "example.com", "A")
    assert status(refused) == "REFUSED"
    ecs = ask("kdig", server, "chat.gtm.example", "A", "+subnet=192.0.2.0/25")
    assert "192.0.2.60" in ecs and "192.0.2.0/25/25" in ecs.replace(" ", "")
    tcp = ask("kdig", server, "chat.gtm.example", "AAAA", "+tcp", "+subnet=203.0.113.0/24")
    assert "2001:db8:10::1" in tcp


def test_worker_processes_share_the_port(tmp_path: Path) -> None:
    import sqlite3

    import dns.message
    import dns.query
    import httpx

    port, http_port = free_tcp_udp_port(), free_tcp_udp_port()
    db = tmp_path / "g.sqlite3"
    env = serve_env(tmp_path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gtm",
            "serve",
            "--dns",
            f"127.0.0.1:{port}",
            "--http",
            f"127.0.0.1:{http_port}",
            "--workers",
            "2",
            "--node-id",
            "pair",
        ],
        env=env,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    try:
        ready = 0
        deadline = time.monotonic() + 60
        while ready < 2 and time.monotonic() < deadline:
            ready += "gtm.ready" in proc.stderr.readline()
        assert ready == 2
        answered = 0
        for _ in range(200):  # a new source port each time: the kernel spreads them
            reply = dns.query.udp(
                dns.message.make_query("chat.gtm.example.", "A"), "127.0.0.1", port=port, timeout=2
            )
            answered += bool(reply.answer)
        assert answered == 200
        redirected = 0
        for _ in range(40):  # a new connection each time: spread like the datagrams
            with httpx.Client() as client:
                response = client.get(
                    f"http://127.0.0.1:{http_port}/v1/models", headers={"Host": "chat.gtm.example"}
                )
            redirected += response.status_code == 307
        assert redirected == 40
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        proc.stderr.close()
    with sqlite3.connect(db) as conn:
        by_node = dict(conn.execute("SELECT node, SUM(count) FROM decisions GROUP BY node"))
        by_channel = dict(
            conn.execute("SELECT channel, SUM(count) FROM decisions GROUP BY channel")
        )
    assert set(by_node) == {"pair/w0", "pair/w1"}  # both answered, each its own chain
    assert by_channel == {"dns": 200, "http": 40}


def test_metrics_count_what_was_answered(server: int) -> None:
    import httpx

    ask("dig", server, "chat.gtm.example", "A", "+tcp")
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT[-1]}/metrics", timeout=5).text
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples['gtm_dns_responses_total{qtype="A",rcode="NOERROR",transport="tcp"}'] >= 1
    assert samples['gtm_dns_responses_total{qtype="-",rcode="NOTIMP",transport="udp"}'] >= 1
    assert samples["gtm_dns_cache_misses_total"] >= 1
    assert samples['gtm_audit_decisions_counted_total{channel="dns"}'] >= 5
