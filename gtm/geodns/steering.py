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

What a hash cannot do: many spoofed networks spread over every socket, as any hash spreads
them; a network that shares a socket with a flooding one (one in ``sockets``) shares its fate.
So where the kernel allows eBPF (``CAP_BPF``), the group is split instead
(:func:`split_program`, :class:`SplitGroup`): the networks in a map the process fills
(:mod:`gtm.geodns.established`: steady clients) have the first half of the sockets to
themselves, and every other network hashes over the second half.

The program reads the sender's address at the network header (``SKF_NET_OFF``), so it works on
IPv4, IPv6 and dual-stack sockets alike. Where the kernel refuses it, the sockets still share
the port and the kernel spreads datagrams by its own hash of addresses and ports, so one
sender's source port still lands on one socket (:func:`attach` says whether it took).

:func:`socket_index` computes in Python what the program computes, for tests and for the docs.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
from collections.abc import Hashable
from ipaddress import IPv4Address, IPv6Address, ip_address

from gtm.geodns import bpf

SO_ATTACH_REUSEPORT_CBPF = 51  # <asm-generic/socket.h>; not in Python's socket module
_NET = 0xFFF00000  # SKF_NET_OFF: loads relative to the network header
_GOLDEN = 0x9E3779B1  # Knuth's multiplicative hash constant (2^32 / phi)

# Classic BPF opcodes (<linux/filter.h>).
_LD_W_ABS = 0x20
_LD_B_ABS = 0x30
_RSH_K = 0x74
_MUL_K = 0x24
_MOD_K = 0x94
_DIV_K = 0x34
_XOR_X = 0xAC
_TAX = 0x07
_JEQ_K = 0x15
_RET_A = 0x16


def _ins(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def program(sockets: int, per: int = 1) -> bytes:
    """The steering program for a group of ``sockets`` sockets, as ``struct sock_filter``s.

    IPv4: the /24 (source address >> 8), hashed. IPv6: the /56 (the first source word, mixed
    with the next three octets), hashed. The hash keeps the multiplication's high 16 bits,
    then takes them modulo the group's size. With ``per``, the group is ``sockets // per``
    sockets, each standing for ``per`` slots of the hash: the one of :func:`worker_index`."""
    if sockets < 1 or per < 1 or sockets % per:
        raise ValueError("a group has at least one socket, and whole ones")
    tail = [_ins(_DIV_K, 0, 0, per)] if per > 1 else []
    ipv4 = [
        _ins(_LD_W_ABS, 0, 0, _NET + 12),  # A = source address
        _ins(_RSH_K, 0, 0, 8),  # its /24
        _ins(_MUL_K, 0, 0, _GOLDEN),
        _ins(_RSH_K, 0, 0, 16),
        _ins(_MOD_K, 0, 0, sockets),
        *tail,
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
        *tail,
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
    return _hash(network_key(host)) % sockets


def _hash(key: int) -> int:
    """What both programs compute from a sender's network (its :func:`network_key`) before
    taking it modulo a count of sockets: IPv4, the /24 times the constant; IPv6, the first
    four octets times the constant, mixed with the next three, times the constant again; of
    the 32-bit product, the high 16 bits."""
    if key >> _FAMILY_SHIFT == 4:
        a = (key & 0xFFFFFF) * _GOLDEN & 0xFFFFFFFF
    else:
        first, rest = (key >> 24) & 0xFFFFFFFF, key & 0xFFFFFF
        a = ((first * _GOLDEN & 0xFFFFFFFF) ^ rest) * _GOLDEN & 0xFFFFFFFF
    return a >> 16


def worker_index(host: str, general: int, workers: int) -> int:
    """The worker whose general sockets :func:`split_index` picks for ``host``: the one a
    group of one socket a worker (its TCP listeners, :mod:`gtm.geodns.groups`) steers
    ``host`` to with ``program(general * workers, general)``."""
    return socket_index(host, general * workers) // general


def attach(sock: socket.socket, sockets: int, per: int = 1) -> bool:
    """Attach the steering program for a group of ``sockets`` (:func:`program`) to ``sock``'s
    reuseport group (one socket attaches it for all). False, with nothing changed, where the
    kernel refuses."""
    code = program(sockets, per)
    buffer = ctypes.create_string_buffer(code, len(code))
    # struct sock_fprog { unsigned short len; struct sock_filter *filter; }: the kernel copies
    # the program during the call, so the buffer need only outlive it.
    fprog = struct.pack("HL", len(code) // 8, ctypes.addressof(buffer))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)
    except OSError:
        return False
    return True


SO_ATTACH_REUSEPORT_EBPF = 52  # <asm-generic/socket.h>
_FAMILY_SHIFT = 56  # a network's key: its family (4, 6) above its 56 bits (/24 or /56)


def network_key(host: str) -> int:
    """The key of ``host``'s network in the map of established networks, as the eBPF program
    builds it from a datagram: the family (4 or 6) in the top byte, then the /24 or /56.

    >>> hex(network_key("192.0.2.77")), network_key("::ffff:192.0.2.1") == network_key("192.0.2.9")
    ('0x400000000c00002', True)
    """
    address = ip_address(host.split("%", 1)[0])
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if isinstance(address, IPv4Address):
        return (4 << _FAMILY_SHIFT) | (int(address) >> 8)
    return (6 << _FAMILY_SHIFT) | (int(address) >> 72)


def key_of_network(network: Hashable) -> int:
    """The map key of a sender network as the listener names it
    (:func:`gtm.geodns.admission.sender_network`: ``"a.b.c"`` or ``(6, /56)``)."""
    if isinstance(network, str):
        a, b, c = (int(octet) for octet in network.split("."))
        return (4 << _FAMILY_SHIFT) | (a << 16) | (b << 8) | c
    if isinstance(network, tuple) and len(network) == 2 and network[0] == 6:
        return (6 << _FAMILY_SHIFT) | int(network[1])
    raise ValueError(f"not a sender network: {network!r}")


def split_index(host: str, general: int, protected: int, workers: int = 1) -> int:
    """The socket the split program picks for ``host`` when its network is not in the map:
    one of the ``general`` sockets after the ``protected`` ones, of one of ``workers``
    processes, whose sockets lie one after the other (:func:`split_program`)."""
    slot = socket_index(host, general * workers)  # every worker's general sockets, in turn
    return slot + (slot // general + 1) * protected


def protected_index(network: Hashable, protected: int) -> int:
    """The protected socket an established network is given: spread by the same hash."""
    return _hash(key_of_network(network)) % protected


_CALLEE_SAVED = (bpf.R7, bpf.R8, bpf.R9)


def split_program(map_fd: int, protected: int, general: int, workers: int = 1) -> bytes:
    """The eBPF program of a group whose first ``protected`` sockets serve established
    networks: a datagram whose sender network is in the map (fd ``map_fd``, 8-byte keys from
    :func:`network_key`, 4-byte socket indexes) goes to the socket the map names; any other to
    one of the ``general`` sockets after them, by the classic program's hash of its network.
    With ``workers`` processes, the group is theirs one after the other, each ``protected``
    then ``general`` sockets (:mod:`gtm.geodns.groups`): the hash picks among every worker's
    general sockets, so each network's datagrams reach one worker, which alone establishes it
    on one of its own protected sockets.

    Loads use the legacy packet access (``BPF_LD | BPF_ABS``, relative to the network header
    like the classic program's), which needs the context in r6 and leaves r1-r5 clobbered."""
    if protected < 1 or general < 1 or workers < 1:
        raise ValueError("a split group has protected and general sockets, and a worker")
    i = bpf.insn
    alu32, alu64 = bpf.ALU, bpf.ALU64
    r0, r1, r2, r6, r7, r8, r9, r10 = bpf.R0, bpf.R1, bpf.R2, bpf.R6, *_CALLEE_SAVED, bpf.R10
    ld_w, ld_b = bpf.LD | bpf.ABS | bpf.W, bpf.LD | bpf.ABS | bpf.B
    net = _NET - (1 << 32)  # SKF_NET_OFF as the signed immediate

    def store_key(family: int) -> list[bytes]:
        """The map key (network_key's layout) on the stack at r10 - 8: r1, the network's
        bits, tagged with ``family`` above them."""
        return [
            i(alu64 | bpf.MOV | bpf.K, r2, imm=family),
            i(alu64 | bpf.LSH | bpf.K, r2, imm=_FAMILY_SHIFT),
            i(alu64 | bpf.OR | bpf.X, r1, r2),
            i(bpf.STX | bpf.MEM | bpf.DW, r10, r1, off=-8),
        ]

    ipv6 = [
        i(ld_w, imm=net + 8),  # r0 = source octets 0..3
        i(alu64 | bpf.MOV | bpf.X, r7, r0),
        i(ld_w, imm=net + 12),  # source octets 4..7
        i(alu32 | bpf.RSH | bpf.K, r0, imm=8),  # octets 4..6: with the first four, the /56
        i(alu64 | bpf.MOV | bpf.X, r8, r0),
        # key = 6 << 56 | octets 0..3 << 24 | octets 4..6
        i(alu64 | bpf.MOV | bpf.X, r1, r7),
        i(alu64 | bpf.LSH | bpf.K, r1, imm=24),
        i(alu64 | bpf.OR | bpf.X, r1, r8),
        *store_key(6),
        # the classic program's hash, in 32 bits: ((w0 * G) ^ x) * G >> 16
        i(alu32 | bpf.MOV | bpf.X, r9, r7),
        i(alu32 | bpf.MUL | bpf.K, r9, imm=_GOLDEN),
        i(alu32 | bpf.XOR | bpf.X, r9, r8),
        i(alu32 | bpf.MUL | bpf.K, r9, imm=_GOLDEN),
        i(alu32 | bpf.RSH | bpf.K, r9, imm=16),
    ]
    ipv4 = [
        i(ld_w, imm=net + 12),  # r0 = source address
        i(alu32 | bpf.RSH | bpf.K, r0, imm=8),  # its /24
        i(alu64 | bpf.MOV | bpf.X, r1, r0),
        *store_key(4),
        i(alu32 | bpf.MOV | bpf.X, r9, r0),
        i(alu32 | bpf.MUL | bpf.K, r9, imm=_GOLDEN),
        i(alu32 | bpf.RSH | bpf.K, r9, imm=16),
    ]
    lookup = [
        bpf.load_map_fd(r1, map_fd),
        i(alu64 | bpf.MOV | bpf.X, r2, r10),
        i(alu64 | bpf.ADD | bpf.K, r2, imm=-8),
        i(bpf.JMP | bpf.CALL, imm=bpf.FUNC_MAP_LOOKUP_ELEM),
        i(bpf.JMP | bpf.JEQ | bpf.K, r0, off=2, imm=0),  # not established: the general sockets
        i(bpf.LDX | bpf.MEM | bpf.W, r0, r0),  # the socket the map names
        i(bpf.JMP | bpf.EXIT),
        # slot = hash % (general * workers); index = slot + (slot / general + 1) * protected
        i(alu32 | bpf.MOV | bpf.X, r0, r9),
        i(alu32 | bpf.MOD | bpf.K, r0, imm=general * workers),
        i(alu32 | bpf.MOV | bpf.X, r1, r0),
        i(alu32 | bpf.DIV | bpf.K, r1, imm=general),
        i(alu32 | bpf.ADD | bpf.K, r1, imm=1),
        i(alu32 | bpf.MUL | bpf.K, r1, imm=protected),
        i(alu32 | bpf.ADD | bpf.X, r0, r1),
        i(bpf.JMP | bpf.EXIT),
    ]
    head = [
        i(alu64 | bpf.MOV | bpf.X, r6, r1),  # the context, where BPF_ABS loads look for it
        i(ld_b, imm=net + 0),  # version and header length
        i(alu32 | bpf.RSH | bpf.K, r0, imm=4),
        i(bpf.JMP | bpf.JNE | bpf.K, r0, off=len(ipv6) + 1, imm=6),  # IPv4: past the IPv6 part
    ]
    jump = [i(bpf.JMP | bpf.JA, off=len(ipv4))]  # IPv6 done: over the IPv4 part to the lookup
    return b"".join(head + ipv6 + jump + ipv4 + lookup)


class SplitGroup:
    """The map of established networks behind a split group's program, and the program.

    :meth:`open` loads both and attaches the program to a socket's group; where the kernel
    refuses (no ``CAP_BPF``), it raises :class:`~gtm.geodns.bpf.BpfError` and nothing is
    attached."""

    def __init__(
        self,
        table: bpf.HashMap,
        prog_fd: int,
        protected: int,
        general: int,
        *,
        base: int = 0,
        workers: int = 1,
    ) -> None:
        self.table = table
        self.prog_fd = prog_fd  # -1 in a worker that joined a group another process set up
        self.protected = protected  # this worker's protected sockets, then its general ones
        self.general = general
        # The index of this worker's first socket in the group, and how many workers share it
        # (gtm.geodns.groups): the map names sockets by their index in the whole group.
        self.base = base
        self.workers = workers

    @classmethod
    def open(
        cls, sock: socket.socket, protected: int, general: int, capacity: int, workers: int = 1
    ) -> SplitGroup:
        """Load the map and program, and attach the program to ``sock``'s group: of
        ``workers`` processes' sockets, this process's first (base 0)."""
        table = bpf.HashMap.create(8, 4, capacity, b"gtm_established")
        try:
            code = split_program(table.fd, protected, general, workers)
            prog_fd = bpf.load_program(bpf.PROG_TYPE_SOCKET_FILTER, code, b"gtm_steer")
            try:
                sock.setsockopt(
                    socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_EBPF, struct.pack("i", prog_fd)
                )
            except OSError as exc:
                os.close(prog_fd)
                raise bpf.BpfError(exc.errno, f"attach: {exc.strerror}") from None
        except BaseException:
            table.close()
            raise
        return cls(table, prog_fd, protected, general, workers=workers)

    def joined(self, worker: int) -> SplitGroup:
        """The same group as worker ``worker`` sees it: the same map (its descriptor, handed
        to that worker's process), its own sockets; no program of its own to close."""
        return SplitGroup(
            self.table,
            -1,
            self.protected,
            self.general,
            base=worker * (self.protected + self.general),
            workers=self.workers,
        )

    def add(self, network: Hashable) -> int:
        """Steer ``network`` to its protected socket, one of this worker's, from now on; the
        socket's index in the group."""
        index = self.base + protected_index(network, self.protected)
        self.table.put(struct.pack("=Q", key_of_network(network)), struct.pack("=I", index))
        return index

    def remove(self, network: Hashable) -> None:
        self.table.delete(struct.pack("=Q", key_of_network(network)))

    def close(self) -> None:
        """The map and program as this process holds them (the group keeps the program until
        its sockets close)."""
        self.table.close()
        if self.prog_fd >= 0:
            os.close(self.prog_fd)
            self.prog_fd = -1


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
