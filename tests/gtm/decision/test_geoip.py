from __future__ import annotations

import os
import shutil
from ipaddress import ip_address
from pathlib import Path

import pytest

from gtm.decision.geoip import GeoDatabase, GeoIPSource
from gtm.errors import GeoIPError
from tests.support.geoip import UNKNOWN_V4, build_city_db


def test_locates_known_addresses_with_their_network(geoip_path: Path) -> None:
    db = GeoDatabase(geoip_path)
    loc = db.locate(ip_address("198.51.100.77"))
    assert (loc.country, loc.continent, loc.lat, loc.lon) == ("DE", "EU", 50.11, 8.68)
    assert str(loc.network) == "198.51.100.0/24"
    v6 = db.locate(ip_address("2001:db8:aaaa:1::9"))
    assert v6.country == "FR"
    assert str(v6.network) == "2001:db8:aaaa::/48"


def test_unknown_address_is_located_nowhere_without_error(geoip_path: Path) -> None:
    loc = GeoDatabase(geoip_path).locate(ip_address(UNKNOWN_V4))
    assert not loc.known
    assert loc.country is None
    assert loc.network is not None
    assert ip_address(UNKNOWN_V4) in loc.network


def test_cache_reads_each_network_once_and_keeps_narrow_networks_apart(geoip_path: Path) -> None:
    db = GeoDatabase(geoip_path)
    for host in range(1, 200):
        assert db.locate(ip_address(f"198.51.100.{host}")).country == "DE"
    assert db.lookups == 1
    # 100.70.0.0/28 and 100.70.0.16/28 share a /24 bucket but not a location.
    assert db.locate(ip_address("100.70.0.3")).country == "DE"
    assert db.locate(ip_address("100.70.0.20")).country == "US"
    assert db.locate(ip_address("100.70.0.3")).country == "DE"
    assert db.locate(ip_address("100.70.0.20")).country == "US"


def test_missing_file_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(GeoIPError, match="GTM_GEOIP_PATH"):
        GeoDatabase(tmp_path / "nope.mmdb")


def test_corrupt_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.mmdb"
    bad.write_bytes(b"\x00garbage" * 1000)
    with pytest.raises(GeoIPError, match="cannot be read"):
        GeoDatabase(bad)


def test_reload_swaps_a_good_file_and_keeps_the_last_good_on_a_bad_one(tmp_path: Path) -> None:
    live = tmp_path / "live.mmdb"
    build_city_db(live, {"198.51.100.0/24": ("DE", "EU", 50.0, 8.0)}, description="v1")
    source = GeoIPSource(live)
    assert source.poll() is None  # unchanged
    first = source.current

    # A new database replaces the file atomically (rename), as production updaters do.
    staged = tmp_path / "staged.mmdb"
    build_city_db(staged, {"198.51.100.0/24": ("AT", "EU", 48.2, 16.4)}, description="v2")
    os.replace(staged, live)
    fresh = source.poll()
    assert fresh is not None
    assert fresh is source.current
    assert fresh is not first
    assert fresh.locate(ip_address("198.51.100.1")).country == "AT"

    # A truncated copy: refused, reported, the last good database stays in force.
    truncated = tmp_path / "trunc.mmdb"
    truncated.write_bytes(live.read_bytes()[:100])
    os.replace(truncated, live)
    assert source.poll() is None
    assert source.current is fresh
    assert source.last_error is not None
    assert "keeping" in source.last_error
    assert source.poll() is None  # the same bad file is not retried every poll

    # The file disappears: still the last good one.
    live.unlink()
    assert source.poll() is None
    assert source.current is fresh

    staged = tmp_path / "staged.mmdb"
    build_city_db(staged, {"198.51.100.0/24": ("CH", "EU", 46.9, 7.4)}, description="v3")
    shutil.move(staged, live)
    again = source.poll()
    assert again is not None
    assert again.locate(ip_address("198.51.100.1")).country == "CH"
    assert source.last_error is None


def test_a_non_city_database_is_refused(tmp_path: Path) -> None:
    from mmdb_writer import MMDBWriter
    from netaddr import IPSet

    w = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoIP2-ASN")
    w.insert_network(IPSet(["198.51.100.0/24"]), {"autonomous_system_number": 64500})
    path = tmp_path / "asn.mmdb"
    w.to_db_file(str(path))
    with pytest.raises(GeoIPError, match="City database"):
        GeoDatabase(path)
