"""Sender networks steered to their own UDP socket by the kernel (DESIGN.md rule 9).

One UDP socket has one receive buffer, a FIFO shared by every sender: when a flood arrives
faster than the process reads, the kernel drops whatever comes next, the flood's datagrams and
every other client's alike, before the process can tell them apart. So each UDP listen address
gets several sockets bound to the same address and port (``SO_REUSEPORT``), and a classic BPF
program attached to the group (``SO_ATTACH_REUSEPORT_CBPF``) picks the socket for each datagram
from a hash of its sender's network: an IPv4 /24, an IPv6 /56, the same networks the slow
path's queues use (:func:`gtm.geodns.admission.sender_network`). A flooding network then fills
only its own socket's buffer, and the kernel drops only from it; the listener reads every
socket in turn each loop turn, a bounded batch from each, so the others' datagrams wait behind
at most one batch of the flood's, not behind all of it.

What it does not do: many spoofed networks spread over every socket, as any hash spreads them;
a network that shares a socket with a flooding one (one in ``sockets``) shares its fate.

The program reads the sender's address at the network header (``SKF_NET_OFF``), so it works on
IPv4, IPv6 and dual-stack sockets alike. Where the kernel refuses it, the sockets still share
the port and the kernel spreads datagrams by its own hash of addresses and ports, so one
sender's source port still lands on one socket (:func:`attach` says whether it took).

:func:`socket_index` computes in Python what the program computes, for tests and for the docs.
"""

from __future__ import annotations

import ctypes
import socket
import struct
from ipaddress import IPv4Address, IPv6Address, ip_address

SO_ATTACH_REUSEPORT_CBPF = 51  # <asm-generic/socket.h>; not in Python's socket module
_NET = 0xFFF00000  # SKF_NET_OFF: loads relative to the network header
_GOLDEN = 0x9E3779B1  # Knuth's multiplicative hash constant (2^32 / phi)

# Classic BPF opcodes (<linux/filter.h>).
_LD_W_ABS = 0x20
_LD_B_ABS = 0x30
_RSH_K = 0x74
_MUL_K = 0x24
_MOD_K = 0x94
_XOR_X = 0xAC
_TAX = 0x07
_JEQ_K = 0x15
_RET_A = 0x16


def _ins(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def program(sockets: int) -> bytes:
    """The steering program for a group of ``sockets`` sockets, as ``struct sock_filter``s.

    IPv4: the /24 (source address >> 8), hashed. IPv6: the /56 (the first source word, mixed
    with the next three octets), hashed. The hash keeps the multiplication's high 16 bits,
    then takes them modulo the group's size."""
    if sockets < 1:
        raise ValueError("a group has at least one socket")
    ipv4 = [
        _ins(_LD_W_ABS, 0, 0, _NET + 12),  # A = source address
        _ins(_RSH_K, 0, 0, 8),  # its /24
        _ins(_MUL_K, 0, 0, _GOLDEN),
        _ins(_RSH_K, 0, 0, 16),
        _ins(_MOD_K, 0, 0, sockets),
        _ins(_RET_A, 0, 0, 0),
    ]
    ipv6 = [
        _ins(_LD_W_ABS, 0, 0, _NET + 12),  # source octets 4..7
        _ins(_RSH_K, 0, 0, 8),  # octets 4..6: with the first four, the /56
        _ins(_TAX, 0, 0, 0),
        _ins(_LD_W_ABS, 0, 0, _NET + 8),  # source octets 0..3
        _ins(_MUL_K, 0, 0, _GOLDEN),
        _ins(_XOR_X, 0, 0, 0),
        _ins(_MUL_K, 0, 0, _GOLDEN),
        _ins(_RSH_K, 0, 0, 16),
        _ins(_MOD_K, 0, 0, sockets),
        _ins(_RET_A, 0, 0, 0),
    ]
    head = [
        _ins(_LD_B_ABS, 0, 0, _NET + 0),  # version and header length
        _ins(_RSH_K, 0, 0, 4),
        _ins(_JEQ_K, 0, len(ipv6), 6),  # IPv6: fall through; else jump over it to IPv4
    ]
    return b"".join(head + ipv6 + ipv4)


def socket_index(host: str, sockets: int) -> int:
    """The socket of a group of ``sockets`` that the program picks for datagrams from ``host``
    (as the kernel sees it: an IPv4 sender on a dual-stack socket arrives as IPv4)."""
    address = ip_address(host.split("%", 1)[0])
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    raw = address.packed
    if isinstance(address, IPv4Address):
        a = (int.from_bytes(raw, "big") >> 8) * _GOLDEN & 0xFFFFFFFF
    else:
        x = int.from_bytes(raw[4:8], "big") >> 8
        a = int.from_bytes(raw[0:4], "big") * _GOLDEN & 0xFFFFFFFF
        a = ((a ^ x) * _GOLDEN) & 0xFFFFFFFF
    return (a >> 16) % sockets


def attach(sock: socket.socket, sockets: int) -> bool:
    """Attach the steering program for a group of ``sockets`` to ``sock``'s reuseport group
    (one socket attaches it for all). False, with nothing changed, where the kernel refuses."""
    code = program(sockets)
    buffer = ctypes.create_string_buffer(code, len(code))
    # struct sock_fprog { unsigned short len; struct sock_filter *filter; }: the kernel copies
    # the program during the call, so the buffer need only outlive it.
    fprog = struct.pack("HL", len(code) // 8, ctypes.addressof(buffer))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)
    except OSError:
        return False
    return True


SO_MEMINFO = 55  # <asm-generic/socket.h>
# Indexes in the u32 array SO_MEMINFO returns (SK_MEMINFO_RMEM_ALLOC, SK_MEMINFO_DROPS).
_RMEM_ALLOC, _DROPS = 0, 8


def _meminfo(sock: socket.socket, index: int) -> int:
    """One field of the kernel's SO_MEMINFO for ``sock``; 0 where the kernel does not say."""
    size = 4 * (_DROPS + 1)
    try:
        info = sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, size)
    except OSError:
        return 0
    if len(info) < size:
        return 0
    return int(struct.unpack_from("=I", info, 4 * index)[0])


def receive_drops(sock: socket.socket) -> int:
    """Datagrams the kernel dropped at this socket (its receive buffer full), since it opened;
    0 where the kernel does not say."""
    return _meminfo(sock, _DROPS)


def receive_queued(sock: socket.socket) -> int:
    """Bytes waiting in this socket's receive buffer now, as the kernel accounts them."""
    return _meminfo(sock, _RMEM_ALLOC)
