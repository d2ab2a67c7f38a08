"""Distances on the Earth's surface."""

from __future__ import annotations

import math

EARTH_RADIUS_KM = 6371.0088


def great_circle_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    """Haversine distance; accurate to ~0.5% (the Earth is not a sphere), ample for ranking."""
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    a = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(a)))


UnitVector = tuple[float, float, float]


def unit_vector(lat: float, lon: float) -> UnitVector:
    """The point on the unit sphere; precomputed per region so ranking needs no trigonometry
    per region and query."""
    p, lam = math.radians(lat), math.radians(lon)
    return (math.cos(p) * math.cos(lam), math.cos(p) * math.sin(lam), math.sin(p))


def chord_km(a: UnitVector, b: UnitVector) -> float:
    """Great-circle distance between two unit vectors (same result as :func:`great_circle_km`)."""
    dx, dy, dz = a[0] - b[0], a[1] - b[1], a[2] - b[2]
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(dx * dx + dy * dy + dz * dz) / 2))
