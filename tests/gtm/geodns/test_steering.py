"""The kernel's steering of sender networks to sockets (gtm.geodns.steering), checked against
real datagrams: each lands on the socket :func:`socket_index` names, and one network's
addresses and ports all land on one socket.

IPv6 senders other than ::1 need addresses on a loopback: that part runs in its own network
namespace (``unshare -n``, as root), where 2001:db8::/32 addresses are put on the namespace's
own ``lo``."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gtm.geodns.steering import attach, program, socket_index

SOCKETS = 8


@contextmanager
def group(family: socket.AddressFamily, host: str) -> Iterator[tuple[list[socket.socket], int]]:
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
        assert attach(socks[0], SOCKETS)
        yield socks, port
    finally:
        for sock in socks:
            sock.close()


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


NAMESPACE_CHECK = textwrap.dedent(
    """
    import socket, subprocess, sys
    from gtm.geodns.steering import socket_index
    from tests.gtm.geodns.test_steering import SOCKETS, group, landed, send_from

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
    print("ok", len(hosts))
    """
)


def test_ipv6_slash_56s_land_where_the_hash_says_in_a_network_namespace() -> None:
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        reason = "IPv6 steering needs `unshare -n` as root (addresses on a namespace's loopback)"
        if os.environ.get("GTM_TEST_REQUIRE_TOOLS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
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
