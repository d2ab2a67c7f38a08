"""libmaxminddb's own lookup, for the network and the data offset of an address's record.

A MaxMind database stores each distinct record once; every network of one city points at the
same record, at one offset in the data section. The ``maxminddb`` reader decodes that record
into dictionaries on every lookup (a City record is some fifty objects: names in eight
languages), which is most of what a lookup costs. libmaxminddb's ``MMDB_lookup_sockaddr`` walks
the search tree alone and returns the record's offset, so :class:`gtm.decision.geoip.GeoDatabase`
decodes each record once and knows it again by its offset: under a flood of random client
subnets (hundreds of thousands of /24s over some 23,000 places) a lookup costs the tree walk.

The functions are called through :mod:`ctypes` from the library the ``maxminddb`` package
already loaded (its C extension carries libmaxminddb), else from the system's
``libmaxminddb.so``. When neither offers them, :func:`open_offsets` returns None and every
lookup decodes, as before: slower, never different (``tests/gtm/decision/test_mmdb_offsets.py``
checks both agree on random addresses).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import struct
import sys
import weakref
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

_MMDB_MODE_MMAP = 1
_MMDB_SUCCESS = 0
# sizeof(MMDB_s) is about 400 bytes in libmaxminddb 1.x; the library fills what we give it.
_MMDB_S_SIZE = 4096


class _Entry(ctypes.Structure):
    _fields_ = (("mmdb", ctypes.c_void_p), ("offset", ctypes.c_uint32))


class _Result(ctypes.Structure):
    # MMDB_lookup_result_s: returned by value (found_entry, entry, netmask).
    _fields_ = (("found_entry", ctypes.c_bool), ("entry", _Entry), ("netmask", ctypes.c_uint16))


def _library() -> ctypes.CDLL | None:
    """The loaded libmaxminddb: the ``maxminddb`` extension's copy, else the system's. Linux
    only: the socket addresses below are laid out as Linux lays them out."""
    if sys.platform != "linux":
        return None
    candidates: list[str] = []
    try:
        import maxminddb.extension

        candidates.append(str(maxminddb.extension.__file__))
    except ImportError:
        pass
    system = ctypes.util.find_library("maxminddb")
    if system:
        candidates.append(system)
    for name in candidates:
        try:
            # PyDLL: calls keep the GIL. A lookup takes about a microsecond; releasing and
            # taking back the GIL around it would cost as much, and while another thread is
            # busy (the audit spool's, under a flood) each taking back could wait a switch
            # interval.
            lib = ctypes.PyDLL(name)
            lookup, opener, closer = lib.MMDB_lookup_sockaddr, lib.MMDB_open, lib.MMDB_close
        except (OSError, AttributeError):
            continue
        lookup.restype = _Result
        lookup.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int))
        opener.restype = ctypes.c_int
        opener.argtypes = (ctypes.c_char_p, ctypes.c_uint32, ctypes.c_void_p)
        closer.restype = None
        closer.argtypes = (ctypes.c_void_p,)
        return lib
    return None


_LIB = _library()
# struct sockaddr_in and sockaddr_in6 around an address: family in host order, port 0. The
# families are Linux's AF_INET and AF_INET6 (this package is pure: no socket module here).
_AF_INET, _AF_INET6 = 2, 10
_V4_HEAD = struct.pack("=HH", _AF_INET, 0)
_V4_TAIL = bytes(8)
_V6_HEAD = struct.pack("=HHI", _AF_INET6, 0, 0)
_V6_TAIL = bytes(4)


class OffsetReader:
    """One database opened by libmaxminddb, for :meth:`lookup` only (close() when done)."""

    def __init__(self, lib: ctypes.CDLL, path: Path, ipv6_tree: bool) -> None:
        self._mmdb = ctypes.create_string_buffer(_MMDB_S_SIZE)
        status = lib.MMDB_open(str(path).encode(), _MMDB_MODE_MMAP, self._mmdb)
        if status != _MMDB_SUCCESS:
            raise OSError(f"libmaxminddb could not open {path} (status {status})")
        self._lookup = lib.MMDB_lookup_sockaddr
        self._error = ctypes.c_int(0)
        self._error_ref = ctypes.byref(self._error)
        # An IPv4 address in an IPv6 tree sits under ::/96: its netmask counts those 96 bits.
        self._v4_base = 96 if ipv6_tree else 0
        # MMDB_close unmaps the file: when close() is not called (a reloaded database), the
        # finaliser does it once the reader goes.
        self._closer = weakref.finalize(self, lib.MMDB_close, self._mmdb)

    def lookup(self, version: int, value: int) -> tuple[int, int]:
        """(offset of the address's record, or -1 when it has none; prefix length of its
        network), for the address given as its version and integer. Raises ValueError when
        the database is corrupt where the walk went."""
        if not self._closer.alive:
            raise ValueError("the GeoIP database was closed")
        if version == 4:
            sockaddr = _V4_HEAD + value.to_bytes(4, "big") + _V4_TAIL
        else:
            sockaddr = _V6_HEAD + value.to_bytes(16, "big") + _V6_TAIL
        result = self._lookup(self._mmdb, sockaddr, self._error_ref)
        if self._error.value != _MMDB_SUCCESS:
            raise ValueError(f"libmaxminddb lookup failed (error {self._error.value})")
        netmask = result.netmask
        if version == 4:
            # As the maxminddb reader does: an IPv6 tree without an IPv4 subtree stops above it.
            netmask = netmask - self._v4_base if netmask >= self._v4_base else 0
        return (result.entry.offset if result.found_entry else -1), netmask

    def close(self) -> None:
        self._closer()  # once only, whoever calls it first


def open_offsets(path: Path, ipv6_tree: bool) -> OffsetReader | None:
    """An :class:`OffsetReader` on ``path``, or None when libmaxminddb is not at hand or will
    not open it (lookups then decode every record; the caller has opened the file already)."""
    if _LIB is None:
        return None
    try:
        return OffsetReader(_LIB, path, ipv6_tree)
    except OSError as exc:
        log.warning("geoip.offsets_unavailable", path=str(path), error=str(exc))
        return None
