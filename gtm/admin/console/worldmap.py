"""The fleet map's geometry: the projection of the shipped Natural Earth outline
(``static/world.svg``, built by ``tools/build_world_map.py``), where each region sits, where
each client country's flows start, and how thick a flow is drawn."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from functools import cache

from gtm.admin.console.web import HERE

WIDTH, HEIGHT = 1000.0, 500.0
# What the page shows of it: from the Arctic coasts to Tierra del Fuego (no Antarctica).
VIEW_BOX = "0 12 1000 400"


def project(lat: float, lon: float) -> tuple[float, float]:
    """Equirectangular, as the outline was drawn: x from longitude, y from latitude."""
    return round((lon + 180) * WIDTH / 360, 1), round((90 - lat) * HEIGHT / 180, 1)


@cache
def country_points() -> Mapping[str, tuple[float, float]]:
    """ISO alpha-2 -> (x, y) of the country's centroid on the map."""
    raw: dict[str, list[float]] = json.loads((HERE / "static" / "countries.json").read_text())
    return {code: project(lat, lon) for code, (lon, lat) in raw.items()}


def stroke(per_s: float) -> float:
    """A flow's width: visible at one answer a second, never wider than a region's dot."""
    return round(min(9.0, 1.0 + 1.6 * math.log10(1 + per_s)), 2)


__all__ = ["HEIGHT", "VIEW_BOX", "WIDTH", "country_points", "project", "stroke"]
