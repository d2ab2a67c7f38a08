"""Established sender networks (gtm.geodns.established): who gets the protected sockets, and
what that is worth when many networks flood at once, over real sockets on loopback.

The flood is sent whole before the server reads a datagram (the test runs in the node's own
loop and does not yield while sending), so what the kernel's buffers cannot hold is dropped
there, as under a flood faster than the node reads; nothing here measures time. The set's
ticks are run by the test (the timer is pushed out of the way): when a network becomes
established is then a matter of what was read, not of the clock."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import dns.asyncquery
import dns.edns
import dns.message
import dns.query
import pytest

from gtm.geodns.admission import TOTAL_FULL, sender_network
from gtm.geodns.established import (
    AGE_TICKS,
    BAR_TICKS,
    CALM_DROPS,
    DEMOTED,
    EXPIRED,
    IDLE_TICKS,
    PER_TICK,
    PROMOTED,
    EstablishedNetworks,
    is_calm,
)
from gtm.geodns.stats import SO_TIMESTAMPNS, DnsCollector
from gtm.geodns.steering import key_of_network, protected_index, receive_queued
from gtm.geodns.udp import GENERAL_BATCH, FairUdp
from gtm.node import Node
from tests.support.ports import free_tcp_udp_port
from tests.support.waiting import eventually

from .conftest import StartNode, port_of
from .test_dig import serve_env
from .test_fairness import (
    CACHED,
    _stamped,
    missing_name,
    prime,
    readable,
    receive,
    sender,
    stamped_answers,
    with_id,
)
from .test_steering import root_tool

FLOOD_NETWORKS = 256
# 81,920 datagrams: a general socket of the split group gets some 20,000, a socket of the
# hashed group some 9,000 (29 networks' worth for the legitimate one's): each is more than a
# buffer holds (some 5,000 at the 4 MiB the kernel allows here).
FLOOD_EACH = 320


def ticks(est: EstablishedNetworks, networks: list[str], n: int, *, calm: bool = True) -> list[str]:
    added: list[str] = []
    for _ in range(n):
        added += [str(x) for x in est.end_tick(networks, (), calm=calm).added]
    return added


def test_a_network_read_in_consecutive_calm_ticks_is_established() -> None:
    est = EstablishedNetworks(capacity=100)
    assert ticks(est, ["a"], AGE_TICKS - 1) == []
    assert ticks(est, ["a"], 1) == ["a"]
    assert "a" in est and len(est) == 1
    assert est.changes[PROMOTED] == 1


def test_with_proof_required_only_a_proven_network_is_established() -> None:
    proven: set[str] = set()
    est = EstablishedNetworks(capacity=100, proven=proven.__contains__)
    assert ticks(est, ["a", "b"], AGE_TICKS + 2) == []  # steady, calm, but never proven
    proven.add("b")
    assert ticks(est, ["a", "b"], 1) == ["b"]  # its streak went on meanwhile
    assert "a" not in est


def test_a_tick_that_lost_datagrams_or_a_tick_unseen_starts_the_streak_again() -> None:
    est = EstablishedNetworks(capacity=100)
    ticks(est, ["a", "b"], AGE_TICKS - 1)
    ticks(est, ["a", "b"], 1, calm=False)  # a flood: nobody is established, streaks reset
    assert ticks(est, ["a"], AGE_TICKS - 1) == []
    est.end_tick([], (), calm=True)  # "a" not read this tick
    assert ticks(est, ["a"], AGE_TICKS - 1) == []
    assert ticks(est, ["a"], 1) == ["a"]
    assert "b" not in est


def test_networks_seen_once_each_never_are_and_their_memory_stays_bounded() -> None:
    """A spoofed flood in calm ticks (below what the node drops): new networks every tick."""
    est = EstablishedNetworks(capacity=10)
    for t in range(20):
        est.end_tick([f"spoof-{t}-{i}" for i in range(100)], (), calm=True)
        assert len(est._candidates) <= 4 * est.capacity
    assert len(est) == 0


def test_the_set_is_bounded_by_its_capacity_and_a_ticks_promotions_by_per_tick() -> None:
    est = EstablishedNetworks(capacity=5)
    ticks(est, [f"n{i}" for i in range(8)], AGE_TICKS)
    assert len(est) == 5
    big = EstablishedNetworks(capacity=PER_TICK * 3)
    added = ticks(big, [f"n{i}" for i in range(PER_TICK + 10)], AGE_TICKS)
    assert len(added) == PER_TICK
    assert len(ticks(big, [f"n{i}" for i in range(PER_TICK + 10)], 1)) == 10  # the rest next


def test_a_member_idle_for_idle_ticks_expires() -> None:
    est = EstablishedNetworks(capacity=10)
    ticks(est, ["a", "b"], AGE_TICKS)
    removed: list[object] = []
    for _ in range(IDLE_TICKS):
        removed += est.end_tick([], ["b"], calm=True).removed  # "b" keeps asking
    assert removed == ["a"]
    assert "b" in est and est.changes[EXPIRED] == 1


def test_a_demoted_network_is_barred_then_may_come_back() -> None:
    est = EstablishedNetworks(capacity=10)
    ticks(est, ["a"], AGE_TICKS)
    assert est.demote("a") and not est.demote("a")
    assert est.changes[DEMOTED] == 1
    assert ticks(est, ["a"], BAR_TICKS - 1) == []  # read every tick, still barred
    assert ticks(est, ["a"], 1) == ["a"]


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        EstablishedNetworks(capacity=0)


# --- the listener --------------------------------------------------------------------------


def listener(node: Node) -> FairUdp:
    assert node.dns is not None
    return node.dns._fair[0]


async def establish(node: Node, source: str) -> None:
    """``source``'s network asks in AGE_TICKS calm ticks in a row."""
    fair = listener(node)
    assert fair.established is not None
    for _ in range(AGE_TICKS):
        await prime(node, source)
        fair.tick()
    assert sender_network(source) in fair.established


def sharing_a_protected_socket(fair: FairUdp, host: str) -> str:
    """A host of another network (127.0.x.1) given the same protected socket as ``host``'s."""
    assert fair.split is not None
    mine = protected_index(sender_network(host), fair.split.protected)
    return next(
        f"127.0.{third}.1"
        for third in range(6, 250)
        if protected_index(sender_network(f"127.0.{third}.1"), fair.split.protected) == mine
    )


@contextlib.contextmanager
def flood_senders() -> Iterator[list[socket.socket]]:
    """FLOOD_NETWORKS UDP senders, one in each /24 127.1.x (closed on the way out)."""
    floods = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(FLOOD_NETWORKS)]
    try:
        for i, f in enumerate(floods):
            f.bind((f"127.1.{i}.1", 0))
        yield floods
    finally:
        for f in floods:
            f.close()


async def flood_from_many_then(node: Node, legit_from: str) -> socket.socket:
    """FLOOD_NETWORKS networks send FLOOD_EACH cached queries each, then ``legit_from`` sends 50,
    all before the server reads one. Returns the legitimate sender (the caller closes it)."""
    target = ("127.0.0.1", port_of(node))
    legit = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    legit.setblocking(False)
    legit.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    legit.bind((legit_from, 0))
    with flood_senders() as floods:
        for k in range(FLOOD_EACH):
            for f in floods:
                f.sendto(with_id(CACHED, k), target)
        for i in range(50):
            legit.sendto(with_id(CACHED, 60_000 + i), target)
    return legit


@pytest.mark.usefixtures("manual_ticks")
async def test_a_flood_from_many_new_networks_drops_nothing_of_an_established_one(
    start_node: StartNode,
) -> None:
    """256 networks flood more than any socket holds, then an established network
    sends 50 queries: it has a protected socket to itself, and all 50 are answered. The flood
    lost datagrams (counted), and none of its networks became established: the tick after a
    flood is not calm."""
    node = await start_node(dns_listen=("127.0.0.1:0",))
    assert node.dns is not None and node.dns.split
    fair = listener(node)
    assert fair.split is not None and fair.established is not None
    await establish(node, "127.0.5.1")
    assert node.dns.socket_of("127.0.5.1") < fair.split.protected
    legit = await flood_from_many_then(node, "127.0.5.1")
    with legit:
        answers = await receive(legit, 50)
    assert sorted(int.from_bytes(a[:2], "big") for a in answers) == list(range(60_000, 60_050))
    assert node.dns.receive_drops() > 0
    # The flood's networks were read (some of their datagrams): still, none is established.
    await prime(node, "127.0.5.1")
    fair.tick()
    assert len(fair.established) == 1
    for _ in range(AGE_TICKS):
        fair.tick()  # nobody read: nobody new
    assert len(fair.established) == 1
    metrics = {
        (m.name, tuple(s.labels.values())): s.value
        for m in DnsCollector(node.dns_stats).collect()
        for s in m.samples
    }
    assert metrics[("gtm_dns_established_networks", ())] == 1
    assert metrics[("gtm_dns_established_changes", ("established",))] == 1


@pytest.mark.usefixtures("manual_ticks")
async def test_without_established_networks_the_same_flood_drops_the_legitimate_queries(
    start_node: StartNode,
) -> None:
    """The same flood and the same 50 with the split off (GTM_DNS_ESTABLISHED_NETWORKS=0, the
    listener before): the legitimate network hashes to a socket 29 of the flood's networks
    share, whose buffer is full when its queries come (dropped unread), and whose batches it
    shares with them (past its share of one, dropped as read)."""
    node = await start_node(dns_listen=("127.0.0.1:0",), dns_established_networks=0)
    assert node.dns is not None and not node.dns.split and node.dns.steered
    await prime(node, "127.0.5.1")
    legit = await flood_from_many_then(node, "127.0.5.1")
    with legit:
        got = await answered(node, legit)
    assert len(got) < 50


async def answered(node: Node, legit: socket.socket) -> set[int]:
    """The ids of ``legit``'s answers once every datagram that reached a buffer was read: a
    marker from ``legit`` is answered after them (the server reads a socket in order; the
    loop yields until the buffers are empty, as no event marks one empty)."""
    assert node.dns is not None
    for sock in node.dns.udp_sockets():
        while receive_queued(sock):  # noqa: ASYNC110
            await asyncio.sleep(0)
    legit.sendto(with_id(CACHED, 65_000), ("127.0.0.1", port_of(node)))
    ids = [int.from_bytes(a[:2], "big") for a in await receive(legit, 1)]
    while ids[-1] != 65_000:
        ids += [int.from_bytes(a[:2], "big") for a in await receive(legit, 1)]
    return set(ids[:-1])


@pytest.mark.usefixtures("manual_ticks")
async def test_an_established_network_that_floods_its_protected_socket_is_demoted(
    start_node: StartNode,
) -> None:
    """Two established networks share a protected socket; one sends 2,000 queries at once
    while the other asks 20: past its share of a batch, the first is dropped as read
    (OVER_SHARE) and, at the tick, demoted to the general sockets; the other keeps its place
    and all its answers."""
    node = await start_node(dns_listen=("127.0.0.1:0",))
    assert node.dns is not None and node.dns.split
    fair = listener(node)
    assert fair.split is not None and fair.established is not None
    flooder = "127.0.5.1"
    other = sharing_a_protected_socket(fair, flooder)
    for _ in range(AGE_TICKS):
        await prime(node, flooder)
        await prime(node, other)
        fair.tick()
    assert node.dns.socket_of(flooder) == node.dns.socket_of(other) < fair.split.protected
    port = port_of(node)
    with sender(flooder) as f, sender(other) as g:
        for i in range(2000):
            f.sendto(with_id(CACHED, i), ("127.0.0.1", port))
            if i % 100 == 0:  # the other network asks meanwhile: the batches are shared
                g.sendto(with_id(CACHED, 61_000 + i // 100), ("127.0.0.1", port))
        answers = await receive(g, 20)
    assert sorted(int.from_bytes(a[:2], "big") for a in answers) == list(range(61_000, 61_020))
    fair.tick()
    assert sender_network(flooder) not in fair.established
    assert sender_network(other) in fair.established
    assert node.dns.socket_of(flooder) >= fair.split.protected
    assert fair.established.changes[DEMOTED] == 1


@pytest.mark.usefixtures("manual_ticks")
async def test_while_the_general_sockets_are_flooded_an_established_query_waits_behind_little(
    start_node: StartNode,
) -> None:
    """One flooding network on each general socket, 8,000 cached queries each (more than a
    buffer holds); once the server is reading them, an established network sends 5. Between
    its sending and its last answer, by the kernel's timestamps, the flood got about two loop
    turns' worth of answers at GENERAL_BATCH per general socket (the turn under way and the
    next, before the protected socket's turn came), not at SOCKET_BATCH."""
    node = await start_node(dns_listen=("127.0.0.1:0",))
    assert node.dns is not None and node.dns.split
    fair = listener(node)
    assert fair.split is not None
    await establish(node, "127.0.5.1")
    general = range(fair.split.protected, len(fair.socks))
    flooders: dict[int, str] = {}
    for i in range(250):
        host = f"127.1.{i}.1"
        flooders.setdefault(node.dns.socket_of(host), host)
        if set(flooders) >= set(general):
            break
    assert set(flooders) == set(general)
    target = ("127.0.0.1", port_of(node))
    with contextlib.ExitStack() as stack:
        floods = [stack.enter_context(sender(host)) for host in flooders.values()]
        legit = stack.enter_context(sender("127.0.5.1"))
        for sock in (*floods, legit):
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        for k in range(8000):
            for f in floods:
                f.sendto(with_id(CACHED, k), target)
        await readable(floods[0])  # the server is answering the flood: its sockets are behind
        sent_at = time.time_ns()
        for i in range(5):
            legit.sendto(with_id(CACHED, 62_000 + i), target)
        got = await stamped_answers(legit, 5)
        last = max(stamp for stamp, _ in got)
        flood = [stamp for f in floods for stamp, _ in _stamped(f)]
    assert sorted(int.from_bytes(d[:2], "big") for _, d in got) == list(range(62_000, 62_005))
    between = sum(1 for stamp in flood if sent_at < stamp < last)
    # About two turns (65 here, every run); at SOCKET_BATCH a general socket, 513.
    assert between < 3 * len(general) * GENERAL_BATCH


async def misses_after_a_full_slow_lane(node: Node, legit_from: str) -> set[int]:
    """100 new networks send 300 queries each that no cache holds (new names): more than the
    slow path's queues hold, and more than the buffers hold. Once the queues are full,
    ``legit_from`` sends 20 queries no cache holds either. The ids of its answers."""
    assert node.dns is not None
    fair = listener(node)
    target = ("127.0.0.1", port_of(node))
    with contextlib.ExitStack() as stack:
        floods = [stack.enter_context(sender(f"127.1.{i}.1")) for i in range(100)]
        legit = stack.enter_context(sender(legit_from))
        for k in range(300):
            for i, f in enumerate(floods):
                f.sendto(with_id(missing_name(1000 * i + k), k), target)
        lane = fair.lane
        # Each sleep(0) is one loop turn: the legitimate queries go out in the turn after the
        # first one the full queues dropped, while the buffers still hold thousands.
        while not lane.counts.dropped[TOTAL_FULL]:  # noqa: ASYNC110
            await asyncio.sleep(0)
        for i in range(20):
            legit.sendto(with_id(missing_name(900_000 + i), 63_000 + i), target)
        # Every datagram read and every query taken (or dropped): nothing more will come.
        await eventually(lambda: lane.size == 0 and not fair._behind, 60.0, "the flood read")
        priority = fair.priority
        if priority is not None:
            await eventually(lambda: priority.size == 0, 60.0, "the priority lane drained")
        ids = set()
        while True:
            try:
                data = legit.recv(65535)
            except BlockingIOError:
                return ids
            ids.add(int.from_bytes(data[:2], "big"))


@pytest.mark.usefixtures("manual_ticks")
async def test_an_established_networks_misses_are_not_one_share_among_a_floods(
    start_node: StartNode,
) -> None:
    """An established network's queries that no cache holds wait in a lane of their own, which
    the slow path serves first (3 in 4): behind 100 flooding networks' full queues, all 20
    are answered."""
    node = await start_node(dns_listen=("127.0.0.1:0",))
    assert node.dns is not None and node.dns.split
    await establish(node, "127.0.5.1")
    answered = await misses_after_a_full_slow_lane(node, "127.0.5.1")
    assert answered == set(range(63_000, 63_020))


@pytest.mark.usefixtures("manual_ticks")
async def test_without_established_networks_the_same_misses_find_the_queues_full(
    start_node: StartNode,
) -> None:
    """The same with the split off: the network's 20 find every queue full and are dropped,
    bar the odd one that takes a place freed between two reads."""
    node = await start_node(dns_listen=("127.0.0.1:0",), dns_established_networks=0)
    assert node.dns is not None and not node.dns.split
    await prime(node, "127.0.5.1")
    answered = await misses_after_a_full_slow_lane(node, "127.0.5.1")
    assert len(answered) < 10


@pytest.mark.parametrize("workers", [1, 2])
def test_without_cap_bpf_the_node_says_so_and_steers_by_the_hash(
    tmp_path: Path, workers: int
) -> None:
    """``gtm serve`` with CAP_BPF (and CAP_SYS_ADMIN) out of its bounding set, as an unprivileged
    service runs where unprivileged eBPF is off: the kernel refuses the map, the node logs
    dns.established_refused once per address and serves on the hashed group (with workers,
    each binds its own sockets: gtm.geodns.groups)."""
    setpriv = root_tool("setpriv", "dropping CAP_BPF needs setpriv (util-linux) as root")
    port = free_tcp_udp_port()
    proc = subprocess.Popen(
        [
            setpriv,
            "--bounding-set=-bpf,-sys_admin",
            sys.executable,
            *("-m", "gtm", "serve", "--dns", f"127.0.0.1:{port}", "--workers", str(workers)),
        ],
        env=serve_env(tmp_path),
        cwd=Path(__file__).resolve().parents[3],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    try:
        seen = ""
        deadline = time.monotonic() + 60
        while seen.count("gtm.ready") < workers and time.monotonic() < deadline:
            assert proc.poll() is None, seen
            seen += proc.stderr.readline()
        assert seen.count("gtm.ready") == workers, seen
        assert seen.count("dns.established_refused") == 1
        assert "CAP_BPF" in seen and "dns.udp_steering_refused" not in seen
        query = dns.message.make_query("chat.gtm.example.", "A")
        reply = dns.query.udp(query, "127.0.0.1", port=port, timeout=10)
        assert reply.answer
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        proc.stderr.close()


def test_a_tick_with_a_few_stray_drops_is_calm_and_a_floods_is_not() -> None:
    """One bad checksum, one burst past a queue, must not stop anyone being established for
    good; a flood's thousands of drops must."""
    assert is_calm(0, 10)
    assert is_calm(CALM_DROPS, 0)
    assert not is_calm(CALM_DROPS + 1, 0)
    assert is_calm(CALM_DROPS + 100, 100_000)
    assert not is_calm(5_000, 100_000)


@pytest.mark.usefixtures("manual_ticks")
async def test_networks_the_map_could_not_take_are_not_members(start_node: StartNode) -> None:
    """The kernel map holds 2; the set would take 10. Four networks become established in one
    tick: the two the map took are members with a map entry, the two after the refused one are
    not members at all (a member without an entry would hold a place and steer nothing)."""
    node = await start_node(dns_listen=("127.0.0.1:0",), dns_established_networks=2)
    fair = listener(node)
    assert fair.split is not None
    fair.established = EstablishedNetworks(capacity=10)
    hosts = [f"127.0.{third}.1" for third in (11, 12, 13, 14)]
    for _ in range(AGE_TICKS):
        for host in hosts:
            await prime(node, host)
        fair.tick()
    members = [h for h in hosts if sender_network(h) in fair.established]
    assert len(members) == 2
    for host in hosts:
        key = struct.pack("=Q", key_of_network(sender_network(host)))
        assert (fair.split.table.get(key) is not None) == (host in members), host
