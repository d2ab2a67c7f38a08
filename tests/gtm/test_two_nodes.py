"""Two ``gtm serve`` nodes on one PostgreSQL: one is killed (SIGKILL), the other keeps answering,
and the audit store still holds every answer the killed node gave before its last flush."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import dns.message
import dns.query
import dns.rcode
import pytest
from sqlalchemy import create_engine, func, select

from gtm.audit.database import sync_url
from gtm.audit.schema import decisions
from tests.conftest import DEMO, POLICIES, ROOT
from tests.support.ports import free_tcp_udp_port
from tests.support.postgres import postgres_database

pytestmark = pytest.mark.postgres

FLUSH_S = 0.2


@pytest.fixture
def database_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


def start_node(
    node: str, port: int, database_url: str, tmp_path: Path, geoip: Path
) -> subprocess.Popen[str]:
    env = os.environ | {
        "GTM_CONFIG": str(DEMO),
        "GTM_POLICIES": json.dumps([str(POLICIES)]),
        "GTM_GEOIP_PATH": str(geoip),
        "GTM_DATABASE_URL": database_url,
        "GTM_SPOOL_DIR": str(tmp_path / f"spool-{node}"),
        "GTM_PROBES": "false",
        "GTM_AUDIT_FLUSH_INTERVAL_S": str(FLUSH_S),
        "GTM_FLEET_STANDALONE_HEALTH": "true",  # two nodes, no membership: on purpose here
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "gtm", "serve", "--dns", f"127.0.0.1:{port}", "--node-id", node],
        env=env,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    seen, deadline = "", time.monotonic() + 30
    while "dns.listening" not in seen:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise AssertionError(f"{node} did not start: {seen}")
        seen += proc.stderr.readline()
    return proc


def ask(port: int, n: int) -> int:
    """Queries answered (NOERROR with an address) out of ``n``."""
    answered = 0
    for i in range(n):
        query = dns.message.make_query("chat.gtm.example.", "A")
        reply = dns.query.udp(query, "127.0.0.1", port=port, timeout=2)
        answered += reply.rcode() == dns.rcode.NOERROR and bool(reply.answer)
        del i
    return answered


def counted(database_url: str) -> dict[str, int]:
    engine = create_engine(sync_url(database_url))
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                select(decisions.c.node, func.sum(decisions.c.count)).group_by(decisions.c.node)
            ).all()
    finally:
        engine.dispose()
    return {node: int(total) for node, total in rows}


def test_one_of_two_nodes_killed(database_url: str, tmp_path: Path, geoip_path: Path) -> None:
    ports = {"node-a": free_tcp_udp_port(), "node-b": free_tcp_udp_port()}
    procs = {n: start_node(n, p, database_url, tmp_path, geoip_path) for n, p in ports.items()}
    try:
        assert ask(ports["node-a"], 150) == 150
        assert ask(ports["node-b"], 100) == 100
        # Answers older than one flush interval are in the spool (fsynced) and the database.
        time.sleep(5 * FLUSH_S)
        procs["node-a"].send_signal(signal.SIGKILL)
        procs["node-a"].wait(timeout=10)
        # The survivor answers as before.
        assert ask(ports["node-b"], 100) == 100
        procs["node-b"].send_signal(signal.SIGTERM)
        assert procs["node-b"].wait(timeout=20) == 0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
    assert counted(database_url) == {"node-a": 150, "node-b": 200}
