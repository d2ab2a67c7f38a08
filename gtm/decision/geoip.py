"""GeoIP: where a client is, from a MaxMind-format City database (GeoIP2/GeoLite2 City).

Lookups go through ``maxminddb``, the reader the ``geoip2`` package itself wraps: it returns the
record as a dict with the network's prefix length, where ``geoip2``'s model objects would cost
about ten times as much per lookup to build, on the answering path.

:class:`GeoDatabase` wraps one opened file and memoises lookups by the database's own network,
so the answering path pays for the reader once per network, not once per query.
:class:`GeoIPSource` owns the file path and swaps in a new :class:`GeoDatabase` when the file
changes; a new file that cannot be opened is refused and the last good database stays in use.

An address that the database does not know is located at :data:`UNKNOWN`: never an exception.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from pathlib import Path

import maxminddb
import structlog

from gtm.decision import memos
from gtm.decision.mmdb_offsets import open_offsets
from gtm.errors import GeoIPError

log = structlog.get_logger(__name__)

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

SETTING = "GTM_GEOIP_PATH"


@dataclass(frozen=True, slots=True)
class Location:
    country: str | None  # ISO 3166-1 alpha-2
    continent: str | None  # two-letter continent code
    lat: float | None
    lon: float | None
    # The database network this location holds for (the ECS scope of a location-based answer);
    # None when the address was not looked up in any database.
    network: IPNetwork | None

    @property
    def known(self) -> bool:
        return self.lat is not None and self.lon is not None


UNKNOWN = Location(None, None, None, None, None)

# Buckets of the first-level cache: a database network at least this wide covers the whole
# bucket, so every address in it shares the entry; narrower networks go to a per-address cache.
_V4_BUCKET = 24
_V6_BUCKET = 48
_SPLIT = Location(None, None, None, None, None)  # marker: this bucket holds several networks


# The decoded records by offset (about 250 bytes each: a 200k-subnet flood reads some 38,000
# records over 200,000 /24s) hold at most ``memo_entries``, a share of the DNS path's budget
# (gtm.geodns.budget counts GEO_SHARE among its tables').
MEMO_ENTRY_BYTES = 250
GEO_SHARE = 0.10


def memo_entries(budget_mb: float) -> int:
    """``memo_entries`` for a DNS budget of ``budget_mb`` MiB (DESIGN.md rule 8)."""
    return max(1024, int(memos.tables_mb(budget_mb) * (1 << 20) * GEO_SHARE / MEMO_ENTRY_BYTES))


DEFAULT_MEMO_ENTRIES = memo_entries(memos.DEFAULT_BUDGET_MB)


class GeoDatabase:
    """One opened City database. Thread-safe for lookups; close() when swapped out."""

    def __init__(self, path: Path, memo_entries: int = DEFAULT_MEMO_ENTRIES) -> None:
        try:
            self._reader = maxminddb.open_database(str(path))
        except FileNotFoundError as exc:
            raise GeoIPError(f"GeoIP database {path} does not exist (set {SETTING})") from exc
        except (OSError, ValueError, maxminddb.InvalidDatabaseError) as exc:
            raise GeoIPError(f"GeoIP database {path} cannot be read: {exc}") from exc
        meta = self._reader.metadata()
        if "City" not in meta.database_type:
            self._reader.close()
            raise GeoIPError(
                f"GeoIP database {path} is a {meta.database_type!r} database; a City database"
                " (GeoIP2-City, GeoLite2-City or compatible) is needed for coordinates"
            )
        self.path = path
        self.database_type: str = meta.database_type
        self.build_epoch: int = meta.build_epoch
        built = datetime.fromtimestamp(meta.build_epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.build = f"{meta.database_type}@{built}"
        self._buckets4: dict[int, Location] = {}
        self._buckets6: dict[int, Location] = {}
        self._exact: dict[IPAddress, Location] = {}
        self.lookups = 0  # reader calls (cache misses), for metrics and the benchmark
        # The tree walk without the decoding (gtm.decision.mmdb_offsets), and the decoded
        # records by their offset: each distinct record is decoded once.
        self._offsets = open_offsets(path, meta.ip_version == 6)
        self._places: dict[int, _Place] = {}
        self.memo_entries = memo_entries  # decoded records at most

    def close(self) -> None:
        if self._offsets is not None:
            self._offsets.close()
        self._reader.close()

    def locate(self, address: IPAddress) -> Location:
        """The client's location; :data:`UNKNOWN` (with its network) if not in the database."""
        return self.locate_int(address.version, int(address), address)

    def locate_int(self, version: int, value: int, address: IPAddress | None = None) -> Location:
        """:meth:`locate` for the address given as its version and integer (the DNS path's ECS
        addresses come as octets: no address object is made unless the database is read)."""
        if version == 4:
            buckets, key = self._buckets4, value >> (32 - _V4_BUCKET)
            bucket_len = _V4_BUCKET
        else:
            buckets, key = self._buckets6, value >> (128 - _V6_BUCKET)
            bucket_len = _V6_BUCKET
        hit = buckets.get(key)
        if hit is not None and hit is not _SPLIT:
            return hit
        if address is None:
            address = IPv4Address(value) if version == 4 else IPv6Address(value)
        if hit is _SPLIT:
            exact = self._exact.get(address)
            if exact is not None:
                return exact
        loc = self._lookup(address, value)
        # Bounded (DESIGN.md rule 8): about 450 bytes an entry, the bucket tables and the
        # per-address one together at most a share of the memory budget (gtm.decision.memos);
        # + 1: a split bucket adds two entries. A flood of random client subnets clears them
        # often, which costs lookups, never memory.
        held = len(self._buckets4) + len(self._buckets6) + len(self._exact)
        if held + 1 >= memos.LIMITS.locations:
            # A full clear is cheap and keeps memory bounded; the working set refills quickly.
            self._buckets4.clear()
            self._buckets6.clear()
            self._exact.clear()
        if loc.network is not None and loc.network.prefixlen <= bucket_len:
            buckets[key] = loc
        else:
            buckets[key] = _SPLIT
            self._exact[address] = loc
        return loc

    def where(self, version: int, value: int) -> tuple[_Place, int]:
        """(country, continent, latitude, longitude) of an address given as its version and
        integer, and the prefix length of its database network: what the DNS path's ECS answers
        depend on (gtm.geodns.shapes), without the network and location objects
        :meth:`locate` makes. Not memoised per address: the ECS path keeps what it found per
        client subnet (its memo holds the answer too); records are decoded once each."""
        offsets = self._offsets
        if offsets is None:
            loc = self.locate_int(version, value)
            net = loc.network
            return (loc.country, loc.continent, loc.lat, loc.lon), net.prefixlen if net else 0
        self.lookups += 1
        try:
            offset, prefix_len = offsets.lookup(version, value)
        except ValueError:
            loc = self.locate_int(version, value)  # says so in the log, gives UNKNOWN
            return (None, None, None, None), loc.network.prefixlen if loc.network else 0
        return self._place_at(offset, version, value), prefix_len

    def _place_at(self, offset: int, version: int, value: int) -> _Place:
        """The place of the record at ``offset`` (the address's, given as its version and
        integer; -1: none), each record decoded once. (Reading the four fields through
        libmaxminddb instead saved 8% of a lookup: not worth guessing its struct layout.)"""
        if offset < 0:
            return _NOWHERE
        place = self._places.get(offset)
        if place is None:
            if len(self._places) >= self.memo_entries:
                self._places.clear()
            address = IPv4Address(value) if version == 4 else IPv6Address(value)
            place = self._places[offset] = _place(self._reader.get(address))
        return place

    def _lookup(self, address: IPAddress, value: int) -> Location:
        self.lookups += 1
        offsets = self._offsets
        try:
            if offsets is not None:
                offset, prefix_len = offsets.lookup(address.version, value)
                place = self._place_at(offset, address.version, value)
                return Location(*place, _network(address.version, value, prefix_len))
            record, prefix_len = self._reader.get_with_prefix_len(address)
        except (ValueError, maxminddb.InvalidDatabaseError) as exc:
            # A database corrupt past its metadata: this address is unknown, nothing crashes.
            log.warning("geoip.lookup_failed", address=str(address), error=str(exc))
            return UNKNOWN
        return Location(*_place(record), _network(address.version, value, prefix_len))


_Place = tuple[str | None, str | None, float | None, float | None]
_NOWHERE: _Place = (None, None, None, None)


def _place(record: object) -> _Place:
    """(country, continent, latitude, longitude) of a decoded City record."""
    if not isinstance(record, dict):
        return (None, None, None, None)
    get = record.get
    country = _field(get("country"), "iso_code") or _field(get("registered_country"), "iso_code")
    where = get("location")
    lat, lon = _field(where, "latitude"), _field(where, "longitude")
    return (
        _text(country),
        _text(_field(get("continent"), "code")),
        float(lat) if isinstance(lat, int | float) else None,
        float(lon) if isinstance(lon, int | float) else None,
    )


_NETWORKS: dict[tuple[int, int, int], IPNetwork] = {}


def _network(version: int, value: int, prefix_len: int) -> IPNetwork:
    """The database network holding an address. Memoised: a network is read for each /24
    looked up in it (a random-subnet flood reads about two per network), and making one costs
    more than the dictionary lookup; integer masking beats ip_network((addr, len), False)."""
    shift = (32 if version == 4 else 128) - prefix_len
    key = (version, value >> shift, prefix_len)
    network = _NETWORKS.get(key)
    if network is None:
        if len(_NETWORKS) >= memos.LIMITS.networks:  # a share of the budget
            _NETWORKS.clear()
        network = _NETWORKS[key] = (
            IPv4Network((key[1] << shift, prefix_len))
            if version == 4
            else IPv6Network((key[1] << shift, prefix_len))
        )
    return network


def _field(part: object, key: str) -> object:
    return part.get(key) if isinstance(part, dict) else None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def default_database_path() -> Path:
    """The GeoLite2-City file shipped by the optional ``maxminddb-geolite2`` package."""
    try:
        from _maxminddb_geolite2 import geolite2_database
    except ImportError as exc:
        raise GeoIPError(
            f"no GeoIP database configured: set {SETTING} (or --geoip-path) to a GeoIP2/GeoLite2"
            " City file, or install the 'geolite' extra for the bundled 2018 GeoLite2-City"
        ) from exc
    return Path(geolite2_database())


@dataclass(frozen=True, slots=True)
class _FileStamp:
    mtime_ns: int
    size: int
    inode: int


def _stamp(path: Path) -> _FileStamp | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _FileStamp(st.st_mtime_ns, st.st_size, st.st_ino)


class GeoIPSource:
    """The configured GeoIP file and the database currently in force.

    ``poll()`` is called beside the answering path (from a thread: it reads the file). It
    compares the file's stamp with the one loaded; a changed file is opened and returned for
    the caller to swap into a new snapshot, while a file that fails to open is reported once
    and the last good database stays current. Polling the stamp, rather than watching inotify
    events, also catches files replaced by rename on bind mounts and network filesystems.
    """

    def __init__(self, path: Path, memo_entries: int = DEFAULT_MEMO_ENTRIES) -> None:
        self.path = path
        self.memo_entries = memo_entries
        self.current = GeoDatabase(path, memo_entries)
        self._stamp = _stamp(path)
        self._rejected: _FileStamp | None = None
        self.last_error: str | None = None

    def poll(self) -> GeoDatabase | None:
        stamp = _stamp(self.path)
        if stamp is None:
            if self.last_error is None:
                self.last_error = f"{self.path} disappeared; keeping {self.current.build}"
                log.error("geoip.missing", path=str(self.path), keeping=self.current.build)
            return None
        if stamp == self._stamp or stamp == self._rejected:
            return None
        try:
            fresh = GeoDatabase(self.path, self.memo_entries)
        except GeoIPError as exc:
            self._rejected = stamp
            self.last_error = f"{exc}; keeping {self.current.build}"
            log.error("geoip.reload_rejected", error=str(exc), keeping=self.current.build)
            return None
        previous = self.current
        self.current, self._stamp, self._rejected, self.last_error = fresh, stamp, None, None
        log.info("geoip.reloaded", build=fresh.build, previous=previous.build)
        return fresh
