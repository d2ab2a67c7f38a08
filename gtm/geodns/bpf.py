"""The few pieces of Linux's ``bpf()`` system call the DNS listener uses: an eBPF instruction
encoder, a hash map the process updates, and a program loaded for a reuseport group
(:mod:`gtm.geodns.steering`).

Written against the kernel's ABI (``<linux/bpf.h>``) with ctypes rather than through a library:
the libraries that load eBPF from Python compile C with clang at run time (bcc) or need
libbpf and its object files; the listener's program is some thirty instructions, assembled
here and checked against datagrams in the tests. Loading needs ``CAP_BPF`` (or root) where the
kernel disallows unprivileged eBPF, as Debian's default does: every call raises
:class:`BpfError` then, and the caller falls back to classic BPF.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform
import struct
from dataclasses import dataclass

# bpf() commands (enum bpf_cmd) and the types used.
_MAP_CREATE, _MAP_LOOKUP_ELEM, _MAP_UPDATE_ELEM, _MAP_DELETE_ELEM, _PROG_LOAD = 0, 1, 2, 3, 5
MAP_TYPE_HASH = 1
PROG_TYPE_SOCKET_FILTER = 1
F_NO_PREALLOC = 1  # map memory taken as entries are added, not all up front
_ATTR_SIZE = 128  # bytes of union bpf_attr passed: zero past the fields set, as the kernel wants

# System call numbers of bpf() (<asm/unistd.h>).
_SYSCALL = {"x86_64": 321, "aarch64": 280, "i686": 357, "armv7l": 386, "ppc64le": 361}

# Instruction classes, sizes, modes and operations (<linux/bpf_common.h>, <linux/bpf.h>).
LD, LDX, STX, ALU, JMP, ALU64 = 0x00, 0x01, 0x03, 0x04, 0x05, 0x07
W, H, B, DW = 0x00, 0x08, 0x10, 0x18
IMM, ABS, MEM = 0x00, 0x20, 0x60
K, X = 0x00, 0x08
ADD, MUL, DIV, OR, LSH, RSH, MOD, XOR, MOV = 0x00, 0x20, 0x30, 0x40, 0x60, 0x70, 0x90, 0xA0, 0xB0
JA, JEQ, JNE, CALL, EXIT = 0x00, 0x10, 0x50, 0x80, 0x90
PSEUDO_MAP_FD = 1  # src_reg of a 64-bit immediate load that names a map by its fd
FUNC_MAP_LOOKUP_ELEM = 1
R0, R1, R2, R6, R7, R8, R9, R10 = 0, 1, 2, 6, 7, 8, 9, 10


class BpfError(OSError):
    """The kernel refused a bpf() call (no privilege, an old kernel, a verifier error)."""


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    """One ``struct bpf_insn``: opcode, the two registers in a byte, offset, immediate."""
    return struct.pack("<BBhi", code, dst | (src << 4), off, _s32(imm))


def _s32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value & 0x80000000 else value


def load_map_fd(dst: int, fd: int) -> bytes:
    """The two-slot instruction that loads map ``fd`` into ``dst`` (the kernel swaps in the
    map's address)."""
    return insn(LD | IMM | DW, dst, PSEUDO_MAP_FD, 0, fd) + insn(0)


_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _bpf(cmd: int, attr: bytes) -> int:
    number = _SYSCALL.get(platform.machine())
    if number is None:
        raise BpfError(errno.ENOSYS, f"bpf() not wired for {platform.machine()}")
    buffer = ctypes.create_string_buffer(attr.ljust(_ATTR_SIZE, b"\0"), _ATTR_SIZE)
    result = int(_libc.syscall(number, cmd, buffer, _ATTR_SIZE))
    if result < 0:
        code = ctypes.get_errno()
        raise BpfError(code, os.strerror(code))
    return result


@dataclass
class HashMap:
    """A BPF hash map of fixed-size keys and values, owned by this process (closed with it)."""

    fd: int
    key_size: int
    value_size: int

    @classmethod
    def create(cls, key_size: int, value_size: int, max_entries: int, name: bytes) -> HashMap:
        attr = struct.pack(
            "=IIIIIII16s", MAP_TYPE_HASH, key_size, value_size, max_entries, F_NO_PREALLOC, 0, 0,
            name[:15],
        )  # fmt: skip
        return cls(_bpf(_MAP_CREATE, attr), key_size, value_size)

    def _elem(
        self, cmd: int, key: bytes, value: ctypes.Array[ctypes.c_char] | None, flags: int
    ) -> int:
        assert len(key) == self.key_size
        k = ctypes.create_string_buffer(key, len(key))
        v = ctypes.addressof(value) if value is not None else 0
        return _bpf(cmd, struct.pack("=IIQQQ", self.fd, 0, ctypes.addressof(k), v, flags))

    def put(self, key: bytes, value: bytes) -> None:
        """Add or replace; :class:`BpfError` (E2BIG) when the map is full."""
        assert len(value) == self.value_size
        self._elem(_MAP_UPDATE_ELEM, key, ctypes.create_string_buffer(value, len(value)), 0)

    def get(self, key: bytes) -> bytes | None:
        out = ctypes.create_string_buffer(self.value_size)
        try:
            self._elem(_MAP_LOOKUP_ELEM, key, out, 0)
        except BpfError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise
        return out.raw

    def delete(self, key: bytes) -> bool:
        """Remove; False when the key was not there."""
        try:
            self._elem(_MAP_DELETE_ELEM, key, None, 0)
        except BpfError as exc:
            if exc.errno == errno.ENOENT:
                return False
            raise
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def load_program(prog_type: int, code: bytes, name: bytes) -> int:
    """Load ``code`` (instructions); the program's fd. A verifier refusal raises
    :class:`BpfError` with the verifier's log in its message (the load is tried again with
    the log on, as libbpf does: a log costs the verifier time, and past its buffer fails the
    load by itself)."""
    program = ctypes.create_string_buffer(code, len(code))
    license_ = ctypes.create_string_buffer(b"GPL")

    def attempt(log: ctypes.Array[ctypes.c_char] | None) -> int:
        level, size, address = (
            (1, len(log), ctypes.addressof(log)) if log is not None else (0, 0, 0)
        )
        attr = struct.pack(
            "=IIQQIIQII16s", prog_type, len(code) // 8, ctypes.addressof(program),
            ctypes.addressof(license_), level, size, address, 0, 0, name[:15],
        )  # fmt: skip
        return _bpf(_PROG_LOAD, attr)

    try:
        return attempt(None)
    except BpfError as first:
        if first.errno not in (errno.EINVAL, errno.EACCES):
            raise  # no privilege, no memory: the log would say nothing more
    log = ctypes.create_string_buffer(1 << 16)
    try:
        return attempt(log)
    except BpfError as exc:
        detail = log.value.decode(errors="replace").strip()
        message = f"{exc.strerror}: {detail[-2000:]}" if detail else exc.strerror
        raise BpfError(exc.errno, message) from None
