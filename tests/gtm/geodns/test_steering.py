"""The kernel's steering of sender networks to sockets (gtm.geodns.steering), checked against
real datagrams: each lands on the socket :func:`socket_index` names, and one network's
addresses and ports all land on one socket.

IPv6 senders other than ::1 need addresses on a loopback: that part runs in its own network
namespace (``unshare -n``, as root), where 2001:db8::/32 addresses are put on the namespace's
own ``lo``."""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gtm.geodns.admission import sender_network
from gtm.geodns.groups import bind_worker_groups
from gtm.geodns.steering import (
    SplitGroup,
    attach,
    program,
    protected_index,
    socket_index,
    split_index,
    split_program,
    worker_index,
)
from tests.support.ports import free_tcp_udp_port

SOCKETS = 8


def bind_group(family: socket.AddressFamily, host: str) -> list[socket.socket]:
    socks: list[socket.socket] = []
    port = 0
    try:
        for _ in range(SOCKETS):
            sock = socket.socket(family, socket.SOCK_DGRAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            sock.setblocking(False)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


@contextmanager
def group(family: socket.AddressFamily, host: str) -> Iterator[tuple[list[socket.socket], int]]:
    socks = bind_group(family, host)
    try:
        assert attach(socks[0], SOCKETS)
        yield socks, socks[0].getsockname()[1]
    finally:
        for sock in socks:
            sock.close()


@contextmanager
def split_group(
    family: socket.AddressFamily, host: str
) -> Iterator[tuple[list[socket.socket], int, SplitGroup]]:
    """A group whose first half serves the networks in its map (gtm.geodns.established)."""
    socks = bind_group(family, host)
    split = None
    try:
        split = SplitGroup.open(socks[0], SOCKETS // 2, SOCKETS - SOCKETS // 2, 64)
        yield socks, socks[0].getsockname()[1], split
    finally:
        if split is not None:
            split.close()
        for sock in socks:
            sock.close()


def split_expected(host: str, members: set[object]) -> int:
    network = sender_network(host)
    if network in members:
        return protected_index(network, SOCKETS // 2)
    return split_index(host, SOCKETS - SOCKETS // 2, SOCKETS // 2)


def landed(socks: list[socket.socket]) -> list[int]:
    """The sockets that hold a datagram now (each read)."""
    found = []
    for i, sock in enumerate(socks):
        try:
            sock.recv(64)
        except BlockingIOError:
            continue
        found.append(i)
    return found


def send_from(family: socket.AddressFamily, source: str, target: tuple[str, int]) -> None:
    with socket.socket(family, socket.SOCK_DGRAM) as c:
        c.bind((source, 0))  # a new source port each time
        c.sendto(b"q", target)


def test_ipv4_networks_land_where_the_hash_says_whatever_the_address_and_port() -> None:
    with group(socket.AF_INET, "127.0.0.1") as (socks, port):
        seen = set()
        for net in range(60):
            expected = socket_index(f"127.0.{net}.1", SOCKETS)
            seen.add(expected)
            for host in (1, 77, 254):  # three hosts of the /24, each from a new port
                send_from(socket.AF_INET, f"127.0.{net}.{host}", ("127.0.0.1", port))
                assert landed(socks) == [expected], (net, host)
        assert seen == set(range(SOCKETS))  # the networks are spread over every socket


def test_ipv4_senders_on_a_dual_stack_socket_are_steered_by_their_own_slash_24() -> None:
    with group(socket.AF_INET6, "::") as (socks, port):
        for net in range(30):
            send_from(socket.AF_INET, f"127.0.{net}.9", ("127.0.0.1", port))
            assert landed(socks) == [socket_index(f"127.0.{net}.9", SOCKETS)]
            assert socket_index(f"::ffff:127.0.{net}.9", SOCKETS) == socket_index(
                f"127.0.{net}.9", SOCKETS
            )
        send_from(socket.AF_INET6, "::1", ("::1", port))
        assert landed(socks) == [socket_index("::1", SOCKETS)]


def test_a_split_group_puts_networks_in_its_map_on_their_protected_socket_and_others_after() -> (
    None
):
    """The split program (gtm.geodns.steering.split_program) against real datagrams: a network
    in the map lands on the protected socket the map names, whatever its host and port; every
    other network on one of the general sockets, by the hash; taken out of the map, a network
    is back on the general sockets."""
    with split_group(socket.AF_INET, "127.0.0.1") as (socks, port, split):
        members: set[object] = set()
        for net in range(0, 60, 3):
            network = sender_network(f"127.0.{net}.1")
            assert split.add(network) == protected_index(network, SOCKETS // 2)
            members.add(network)
        protected, general = set(), set()
        for net in range(60):
            for host in (1, 200):
                source = f"127.0.{net}.{host}"
                expected = split_expected(source, members)
                send_from(socket.AF_INET, source, ("127.0.0.1", port))
                assert landed(socks) == [expected], source
                (protected if sender_network(source) in members else general).add(expected)
        assert protected == set(range(SOCKETS // 2))  # members spread over the protected half
        assert general == set(range(SOCKETS // 2, SOCKETS))  # the rest over the general half
        for network in list(members)[:5]:
            split.remove(network)
            members.discard(network)
        for net in range(0, 60, 3):
            source = f"127.0.{net}.9"
            send_from(socket.AF_INET, source, ("127.0.0.1", port))
            assert landed(socks) == [split_expected(source, members)], source


def test_a_split_group_on_a_dual_stack_socket_keys_ipv4_senders_by_their_slash_24() -> None:
    with split_group(socket.AF_INET6, "::") as (socks, port, split):
        members: set[object] = {sender_network("127.0.7.1"), sender_network("::1")}
        for network in members:
            split.add(network)
        for source in ("127.0.7.1", "127.0.7.99", "127.0.8.1"):
            send_from(socket.AF_INET, source, ("127.0.0.1", port))
            assert landed(socks) == [split_expected(source, members)], source
        send_from(socket.AF_INET6, "::1", ("::1", port))
        assert landed(socks) == [split_expected("::1", members)]
        assert split_expected("::1", members) < SOCKETS // 2


def test_the_split_program_refuses_a_group_without_both_halves() -> None:
    with pytest.raises(ValueError, match="protected and general"):
        split_program(3, 0, 4)


NAMESPACE_CHECK = textwrap.dedent(
    """
    import select, socket, subprocess, sys
    from gtm.geodns.admission import sender_network
    from gtm.geodns.groups import bind_worker_groups
    from gtm.geodns.steering import socket_index, worker_index
    from tests.support.ports import free_tcp_udp_port
    from tests.gtm.geodns.test_steering import (
        SOCKETS, group, landed, send_from, split_expected, split_group
    )

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    # /56s that differ in each octet of the prefix, and hosts within one /56.
    prefixes = [f"2001:db8:{a:x}:{b:x}00" for a in range(4) for b in (0, 1, 2, 0xff)]
    hosts = [f"{p}::1" for p in prefixes] + [f"{p}::2" for p in prefixes[:4]]
    hosts += [f"{p[:-2]}7f::3" for p in prefixes[:4]]  # same /56, another /64
    for host in hosts:
        subprocess.run(["ip", "-6", "addr", "add", host + "/128", "dev", "lo", "nodad"], check=True)
    seen = set()
    with group(socket.AF_INET6, "::1") as (socks, port):
        for host in hosts:
            send_from(socket.AF_INET6, host, ("::1", port))
            got, expected = landed(socks), socket_index(host, SOCKETS)
            if got != [expected]:
                sys.exit(f"{host}: landed on {got}, the hash says {expected}")
            seen.add(expected)
    if len(seen) < SOCKETS // 2:
        sys.exit(f"16 /56s spread over only {sorted(seen)}")
    # Split: every other /56 in the map, on its protected socket; the rest on the general ones.
    members = {sender_network(h) for h in hosts[:16:2]}
    with split_group(socket.AF_INET6, "::1") as (socks, port, split):
        for network in members:
            split.add(network)
        for host in hosts:
            send_from(socket.AF_INET6, host, ("::1", port))
            got, expected = landed(socks), split_expected(host, members)
            if got != [expected]:
                sys.exit(f"split: {host}: landed on {got}, expected {expected}")
    # Two workers' TCP listeners (gtm.geodns.groups): a /56's connections go to the worker
    # whose general sockets its datagrams reach.
    shares = bind_worker_groups(("[::1]:" + str(free_tcp_udp_port()),), 2, 4, 64)
    listeners = [next(iter(share.values())).tcp for share in shares]
    port = listeners[0].getsockname()[1]
    for host in hosts:
        with socket.create_connection(("::1", port), timeout=5, source_address=(host, 0)):
            ready, _, _ = select.select(listeners, [], [], 5)
            got, expected = [listeners.index(s) for s in ready], worker_index(host, 2, 2)
            if got != [expected]:
                sys.exit(f"tcp: {host}: accepted by {got}, expected worker {expected}")
            ready[0].accept()[0].close()
    print("ok", len(hosts))
    """
)


def root_tool(tool: str, reason: str) -> str:
    """``tool``'s path when it is installed and this is root; else the test is skipped (failed
    where the tools are required, as in CI) with ``reason``."""
    path = shutil.which(tool)
    if path is None or os.geteuid() != 0:
        if os.environ.get("GTM_TEST_REQUIRE_TOOLS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def test_ipv6_slash_56s_land_where_the_hash_says_in_a_network_namespace() -> None:
    unshare = root_tool(
        "unshare", "IPv6 steering needs `unshare -n` as root (addresses on a namespace's loopback)"
    )
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [unshare, "-n", sys.executable, "-c", NAMESPACE_CHECK],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["ok", "24"]
    # Same /56 -> same socket, whatever the rest of the address.
    assert socket_index("2001:db8:1:100::1", 16) == socket_index("2001:db8:1:1ff:ab::9", 16)


def test_the_program_is_whole_instructions_and_refuses_an_empty_group() -> None:
    code = program(SOCKETS)
    assert len(code) % 8 == 0 and len(code) // 8 == 19
    with pytest.raises(ValueError, match="at least one"):
        program(0)


def test_a_group_bound_for_two_workers_gives_each_network_to_one_worker() -> None:
    """gtm.geodns.groups: the first process binds both workers' sockets in order, and the
    program hashes each network over every worker's general sockets; a network one worker
    establishes lands on that worker's own protected socket. Before, workers bound their own
    sockets in whatever order they started, and a split group was refused with workers."""
    port = free_tcp_udp_port()
    shares = bind_worker_groups((f"127.0.0.1:{port}",), workers=2, per_worker=4, capacity=64)
    assert shares is not None and len(shares) == 2
    (first,), (second,) = (list(share.values()) for share in shares)
    socks = first.socks + second.socks  # the group's order
    try:
        assert (first.split.base, second.split.base) == (0, 4)
        owner = {}
        for net in range(60):
            source = f"127.0.{net}.1"
            expected = split_index(source, 2, 2, workers=2)
            assert expected in (2, 3, 6, 7)  # a general socket, of either worker
            send_from(socket.AF_INET, source, ("127.0.0.1", port))
            assert landed(socks) == [expected], source
            owner[sender_network(source)] = 0 if expected < 4 else 1
        assert set(owner.values()) == {0, 1}  # the networks are spread over both workers
        for net in (5, 6, 7, 8):
            network = sender_network(f"127.0.{net}.1")
            share = (first, second)[owner[network]]
            index = share.split.add(network)  # its owner establishes it
            assert index == share.split.base + protected_index(network, 2)
            send_from(socket.AF_INET, f"127.0.{net}.77", ("127.0.0.1", port))
            assert landed(socks) == [index]
    finally:
        first.split.close()
        for sock in (*socks, first.tcp, second.tcp):
            if sock is not None:
                sock.close()


def test_a_group_bound_for_two_workers_gives_a_networks_connections_to_its_reader() -> None:
    """gtm.geodns.groups binds each worker's TCP listener too, in order, with a program that
    steers each network's connections to the worker whose general sockets its datagrams
    reach: a query over TCP then proves the network (GTM_DNS_ESTABLISH_WITH_COOKIE) to the
    one worker that may establish it. Before, each worker bound its own listener, and the
    kernel's hash of addresses and ports sent a connection there one time in two."""
    port = free_tcp_udp_port()
    shares = bind_worker_groups((f"127.0.0.1:{port}",), workers=2, per_worker=4, capacity=64)
    assert shares is not None
    (first,), (second,) = (list(share.values()) for share in shares)
    listeners = [first.tcp, second.tcp]
    try:
        assert first.tcp is not None and second.tcp is not None
        readers = set()
        for net in range(40):
            source = f"127.0.{net}.1"
            reader = 0 if split_index(source, 2, 2, workers=2) < 4 else 1
            assert worker_index(source, 2, 2) == reader
            readers.add(reader)
            for _ in range(2):  # a new source port each time: the same worker
                with socket.create_connection(
                    ("127.0.0.1", port), timeout=5, source_address=(source, 0)
                ):
                    ready, _, _ = select.select(listeners, [], [], 5)
                    assert [listeners.index(sock) for sock in ready] == [reader], source
                    ready[0].accept()[0].close()
        assert readers == {0, 1}
    finally:
        first.split.close()
        for sock in (*first.socks, *second.socks, *listeners):
            if sock is not None:
                sock.close()


def test_a_program_for_workers_divides_the_hash_among_them() -> None:
    # One more instruction a branch: the slot's worker.
    assert len(program(8, 4)) // 8 == len(program(8)) // 8 + 2
    with pytest.raises(ValueError, match="whole"):
        program(6, 4)
