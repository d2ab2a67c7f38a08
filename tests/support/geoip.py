"""Small GeoIP City databases written with mmdb-writer, so tests do not depend on the bundled
GeoLite2 file and can state exactly where each address is."""

from __future__ import annotations

from pathlib import Path

from mmdb_writer import MMDBWriter
from netaddr import IPSet

# network -> (country, continent, lat, lon)
Place = tuple[str, str, float, float]

WORLD: dict[str, Place] = {
    "198.51.100.0/24": ("DE", "EU", 50.11, 8.68),  # Frankfurt
    "203.0.113.0/24": ("US", "NA", 38.90, -77.04),  # Washington
    "192.0.2.0/25": ("JP", "AS", 35.68, 139.69),  # Tokyo
    "100.64.0.0/16": ("IN", "AS", 19.08, 72.88),  # Mumbai
    "100.65.0.0/16": ("GB", "EU", 51.51, -0.13),  # London
    "100.66.0.0/16": ("BR", "SA", -23.55, -46.63),  # Sao Paulo
    "100.67.0.0/16": ("US", "NA", 47.61, -122.33),  # Seattle
    "100.68.0.0/16": ("IE", "EU", 53.35, -6.26),  # Dublin
    # Two narrow networks inside one /24: the lookup cache must keep them apart.
    "100.70.0.0/28": ("DE", "EU", 52.52, 13.40),  # Berlin
    "100.70.0.16/28": ("US", "NA", 40.71, -74.01),  # New York
    # A wide network: thousands of distinct client /24s in one place (spillover tests).
    "100.72.0.0/13": ("DE", "EU", 50.11, 8.68),  # Frankfurt
    "2001:db8:aaaa::/48": ("FR", "EU", 48.86, 2.35),  # Paris
    "2001:db8:bbbb::/48": ("US", "NA", 37.77, -122.42),  # San Francisco
}
UNKNOWN_V4 = "100.99.1.1"  # in no network above


def build_city_db(
    path: Path, world: dict[str, Place] | None = None, description: str = "test"
) -> Path:
    writer = MMDBWriter(
        ip_version=6, ipv4_compatible=True, database_type="GeoIP2-City", description=description
    )
    for network, (country, continent, lat, lon) in (world or WORLD).items():
        writer.insert_network(
            IPSet([network]),
            {
                "country": {"iso_code": country, "names": {"en": country}},
                "continent": {"code": continent},
                "location": {"latitude": lat, "longitude": lon},
            },
        )
    writer.to_db_file(str(path))
    return path
