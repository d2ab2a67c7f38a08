"""libmaxminddb's tree walk (gtm.decision.mmdb_offsets) against the maxminddb reader: the same
network for every address, and through GeoDatabase the same location whichever is used."""

from __future__ import annotations

import contextlib
import random
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path

import maxminddb
import pytest

from gtm.decision import geoip
from gtm.decision.geoip import GeoDatabase, default_database_path
from gtm.decision.mmdb_offsets import open_offsets
from gtm.errors import GeoIPError


def _databases(test_db: Path) -> list[Path]:
    paths = [test_db]
    # The bundled GeoLite2-City too, when installed (optional: the test database suffices).
    with contextlib.suppress(GeoIPError):
        paths.append(default_database_path())
    return paths


def _addresses(seed: int, n: int) -> list[IPv4Address | IPv6Address]:
    rng = random.Random(seed)
    out: list[IPv4Address | IPv6Address] = [IPv4Address(rng.getrandbits(32)) for _ in range(n)]
    out += [IPv6Address(rng.getrandbits(128)) for _ in range(n // 10)]
    # Allocated IPv6 space, where the database has data.
    out += [IPv6Address((0x2A00 << 112) | rng.getrandbits(112)) for _ in range(n // 5)]
    out += [IPv4Address(s) for s in ("100.72.1.1", "100.70.0.9", "127.0.0.1", "0.0.0.0")]
    return out


def test_the_tree_walk_finds_the_readers_network_for_every_address(geoip_path: Path) -> None:
    for path in _databases(geoip_path):
        reader = maxminddb.open_database(str(path))
        offsets = open_offsets(path, reader.metadata().ip_version == 6)
        assert offsets is not None, "libmaxminddb is at hand wherever the tests run"
        records: dict[int, object] = {}
        for address in _addresses(seed=5, n=20_000):
            record, prefix_len = reader.get_with_prefix_len(address)
            offset, walked = offsets.lookup(address.version, int(address))
            assert walked == prefix_len, address
            assert (offset >= 0) == (record is not None), address
            if offset >= 0:
                # One offset, one record: what GeoDatabase memoises by.
                assert records.setdefault(offset, record) == record
        offsets.close()
        reader.close()


def test_locations_are_the_same_with_and_without_the_tree_walk(
    geoip_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for path in _databases(geoip_path):
        walked = GeoDatabase(path)
        assert walked._offsets is not None
        monkeypatch.setattr(geoip, "open_offsets", lambda *_: None)
        decoded = GeoDatabase(path)
        monkeypatch.undo()
        assert decoded._offsets is None
        for address in _addresses(seed=8, n=20_000):
            expected = decoded.locate(address)
            assert walked.locate(address) == expected, address
            place, prefix_len = walked.where(address.version, int(address))
            net = expected.network
            assert net is not None
            assert place == (expected.country, expected.continent, expected.lat, expected.lon)
            assert prefix_len == net.prefixlen
            assert address in net
        walked.close()
        decoded.close()


def test_a_database_libmaxminddb_will_not_open_falls_back_to_decoding(
    geoip_path: Path, tmp_path: Path
) -> None:
    assert open_offsets(tmp_path / "missing.mmdb", ipv6_tree=True) is None
    db = GeoDatabase(geoip_path)
    assert db.locate(IPv4Address("100.72.1.1")).country == "DE"


def test_a_closed_reader_refuses_lookups_instead_of_reading_unmapped_memory(
    geoip_path: Path,
) -> None:
    offsets = open_offsets(geoip_path, ipv6_tree=True)
    assert offsets is not None
    assert offsets.lookup(4, int(IPv4Address("100.72.1.1")))[1] == 13
    offsets.close()
    offsets.close()  # once only
    with pytest.raises(ValueError, match="closed"):
        offsets.lookup(4, int(IPv4Address("100.72.1.1")))
