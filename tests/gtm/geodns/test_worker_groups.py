"""Established networks with worker processes (gtm.geodns.groups): ``gtm serve --workers 2``,
its sockets bound by the first process for both, an established network's queries answered
through a flood from 256 networks that overflows every other socket.

Before, each worker bound its own sockets and the split group was off with workers: every
network hashed over all sixteen sockets, the legitimate one's among the flood's."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dns.message
import dns.query
import httpx

from gtm.geodns.steering import split_index, worker_index
from tests.conftest import ROOT
from tests.support.dns_peers import require
from tests.support.ports import free_tcp_udp_port

from .test_dig import serve_env
from .test_established import flood_senders

PER_WORKER = 8  # GTM_DNS_UDP_SOCKETS: 4 protected, then 4 general, in each worker
# 163,840 datagrams: some 20,000 for each of the 8 general sockets (and, with the sockets
# hashed, some 10,000 for each of 16): every one more than its buffer holds (some 5,000).
FLOOD_EACH = 640
DEADLINE_S = 60.0
QUERY = dns.message.make_query("chat.gtm.example.", "A").to_wire()


def with_id(qid: int) -> bytes:
    return qid.to_bytes(2, "big") + QUERY[2:]


@contextmanager
def two_workers(
    tmp_path: Path, *, metrics: int | None = None, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], int, list[str]]]:
    """``gtm serve --workers 2`` until both workers are ready: the process, its DNS port and
    its log lines (read by a thread, so that the pipe never fills). Stopped on the way out if
    it still runs (SIGTERM); its exit status is then ``proc.returncode``."""
    port = free_tcp_udp_port()
    extra = ("--metrics", f"127.0.0.1:{metrics}") if metrics is not None else ()
    proc = subprocess.Popen(
        [
            sys.executable,
            *("-m", "gtm", "serve", "--dns", f"127.0.0.1:{port}", "--workers", "2", *extra),
        ],
        env=serve_env(tmp_path) | {"GTM_DNS_UDP_SOCKETS": str(PER_WORKER)} | (env or {}),
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + DEADLINE_S
        while sum("gtm.ready" in line for line in list(lines)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        yield proc, port, lines
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            reader.join(timeout=10)
            proc.stderr.close()


def metric(metrics: int, name: str) -> float:
    """A sample of the first worker's metrics (the second's are not served)."""
    text = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in the first worker's metrics")


def ask_until_established(metrics: int, port: int, source: str) -> None:
    """Ask over UDP from ``source`` (no cookie) until the first worker has a network
    established; each query answered meanwhile."""
    deadline = time.monotonic() + DEADLINE_S
    while metric(metrics, "gtm_dns_established_networks") < 1:
        assert time.monotonic() < deadline, f"{source}'s network never established"
        reply = dns.query.udp(
            dns.message.from_wire(QUERY), "127.0.0.1", port=port, source=source, timeout=5
        )
        assert reply.answer
        time.sleep(0.2)


def family_of(pid: int) -> list[int]:
    """``pid`` and its children (the spawned worker, multiprocessing's helpers)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *map(int, children)]


def test_two_workers_keep_an_established_networks_queries_through_a_flood(
    tmp_path: Path,
) -> None:
    # The legitimate network hashes to the first worker's general sockets (the second's
    # would do as well; the first serves the metrics that show it established).
    legit_host = next(
        f"127.0.{third}.1"
        for third in range(5, 250)
        if split_index(f"127.0.{third}.1", PER_WORKER // 2, PER_WORKER // 2, 2) < PER_WORKER
    )
    metrics = free_tcp_udp_port()
    with two_workers(tmp_path, metrics=metrics) as (proc, port, lines):
        assert not any("dns.established_refused" in line for line in lines), "".join(lines)
        # Asked steadily, the network is established within a few calm one-second ticks.
        ask_until_established(metrics, port, legit_host)
        target = ("127.0.0.1", port)
        processes = family_of(proc.pid)
        legit = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        legit.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        legit.bind((legit_host, 0))
        with legit, flood_senders() as floods:
            # Neither worker reads while the flood and the legitimate queries are sent: every
            # general socket overflows, whatever the machine's speed.
            for pid in processes:
                os.kill(pid, signal.SIGSTOP)
            try:
                for k in range(FLOOD_EACH):
                    for f in floods:
                        f.sendto(with_id(k), target)
                for i in range(50):
                    legit.sendto(with_id(60_000 + i), target)
            finally:
                for pid in processes:
                    os.kill(pid, signal.SIGCONT)
            legit.settimeout(DEADLINE_S)
            answered = sorted(int.from_bytes(legit.recv(512)[:2], "big") for _ in range(50))
        assert answered == list(range(60_000, 60_050))
        # The flood did overflow the first worker's general sockets.
        assert metric(metrics, "gtm_dns_receive_dropped_total") > 0
    assert proc.returncode == 0  # a clean stop


def spawned_worker(pid: int) -> int:
    """The worker the first process ``pid`` spawned (not multiprocessing's helpers)."""
    (worker,) = (
        child
        for child in family_of(pid)[1:]
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()
    )
    return worker


def connection_owners(port: int) -> dict[tuple[str, int], int]:
    """The process holding each established TCP connection to ``port``, by the client's
    address and port (``ss``)."""
    out = subprocess.run(
        [require("ss"), "-Htnp", "state", "established", f"( sport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    owners = {}
    for line in out.splitlines():
        fields = line.split()
        peer, users = fields[3], fields[-1]
        host, _, peer_port = peer.rpartition(":")
        owners[(host, int(peer_port))] = int(users.split("pid=")[1].split(",")[0])
    return owners


def test_with_proof_required_a_tcp_query_proves_its_network_to_the_worker_reading_it(
    tmp_path: Path,
) -> None:
    """With GTM_DNS_ESTABLISH_WITH_COOKIE, a query over TCP proves its network, but only to
    the worker that takes the connection, and only the worker reading the network's datagrams
    may establish it. The first process binds each worker's TCP listener with a program that
    steers a network's connections to that worker (gtm.geodns.groups). Before, each worker
    bound its own listener, and the kernel spread connections by addresses and ports: the
    proof reached the network's reader one time in two."""
    general = PER_WORKER // 2
    by_worker: dict[int, list[str]] = {0: [], 1: []}
    for third in range(5, 250):
        source = f"127.0.{third}.1"
        mine = by_worker[worker_index(source, general, 2)]
        if len(mine) < 4:
            mine.append(source)
    metrics = free_tcp_udp_port()
    env = {"GTM_DNS_ESTABLISH_WITH_COOKIE": "true"}
    with two_workers(tmp_path, metrics=metrics, env=env) as (proc, port, lines):
        assert not any("steering_refused" in line for line in lines), "".join(lines)
        pids = [proc.pid, spawned_worker(proc.pid)]
        connections = []
        try:
            for worker, sources in by_worker.items():
                for source in sources:
                    conn = socket.create_connection(
                        ("127.0.0.1", port), timeout=5, source_address=(source, 0)
                    )
                    connections.append((worker, conn))
                    reply = dns.query.tcp(
                        dns.message.from_wire(QUERY), "127.0.0.1", timeout=5, sock=conn
                    )
                    assert reply.answer
            owners = connection_owners(port)
            held = [(worker, owners.get(conn.getsockname())) for worker, conn in connections]
            assert held == [(worker, pids[worker]) for worker, _ in connections]
        finally:
            for _, conn in connections:
                conn.close()
        # The proof took: a network of the first worker (whose metrics are served), asking
        # over UDP without a cookie, is established.
        ask_until_established(metrics, port, by_worker[0][0])
    assert proc.returncode == 0


def test_a_worker_that_dies_stops_the_node_with_a_failure(tmp_path: Path) -> None:
    """A worker killed (SIGKILL, as the OOM killer would) leaves the port's socket group, and
    the kernel moves others' sockets into its places: the group's layout no longer holds.
    Before, the first process went on serving as if nothing had happened; now it stops, and
    exits 1, so that its supervisor (systemd's Restart=on-failure) starts the node again whole."""
    with two_workers(tmp_path) as (proc, _, lines):
        os.kill(spawned_worker(proc.pid), signal.SIGKILL)
        assert proc.wait(timeout=DEADLINE_S) == 1
    assert any("gtm.worker_exited" in line for line in lines), "".join(lines)
