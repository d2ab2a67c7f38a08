"""Build the console's world map from Natural Earth (run by hand; its output is committed).

Input: ``countries-110m.json`` from the npm package ``world-atlas`` 2.0.2, Natural Earth 4.1.0
1:110m admin-0 countries as TopoJSON (Natural Earth is public domain; world-atlas is ISC).
Output, into ``gtm/admin/console/static/``:

- ``world.svg``: one ``<path>`` per country in an equirectangular projection, 1000 x 500 user
  units (x = (lon + 180) * 1000/360, y = (90 - lat) * 500/180), so the console can place a
  region at its latitude and longitude with the same two lines of arithmetic;
- ``countries.json``: ISO 3166-1 alpha-2 -> [lon, lat] of each country's largest polygon's
  centroid, where the console draws a client area's flows from.

Usage: ``python tools/build_world_map.py countries-110m.json`` (needs ``pycountry`` for the
numeric -> alpha-2 codes). Nothing is fetched at run time: the outputs ship in the package.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pycountry  # type: ignore[import-not-found]

OUT = Path(__file__).resolve().parent.parent / "gtm" / "admin" / "console" / "static"
WIDTH, HEIGHT = 1000.0, 500.0


def decode_arcs(topo: dict[str, Any]) -> list[list[tuple[float, float]]]:
    (sx, sy), (tx, ty) = topo["transform"]["scale"], topo["transform"]["translate"]
    arcs = []
    for arc in topo["arcs"]:
        x = y = 0
        points = []
        for dx, dy in arc:  # quantized and delta-encoded
            x, y = x + dx, y + dy
            points.append((x * sx + tx, y * sy + ty))
        arcs.append(points)
    return arcs


def ring(arcs: list[list[tuple[float, float]]], refs: list[int]) -> list[tuple[float, float]]:
    points: list[tuple[float, float]] = []
    for ref in refs:
        arc = arcs[ref] if ref >= 0 else list(reversed(arcs[~ref]))
        points.extend(arc[1:] if points else arc)
    return points


def project(lon: float, lat: float) -> tuple[float, float]:
    return (lon + 180) * WIDTH / 360, (90 - lat) * HEIGHT / 180


def area_centroid(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    a = cx = cy = 0.0
    for (x0, y0), (x1, y1) in zip(points, points[1:] + points[:1], strict=True):
        cross = x0 * y1 - x1 * y0
        a += cross
        cx += (x0 + x1) * cross
        cy += (y0 + y1) * cross
    if a == 0:
        return 0.0, points[0][0], points[0][1]
    return abs(a / 2), cx / (3 * a), cy / (3 * a)


def subpath(points: list[tuple[float, float]]) -> str:
    """One ring as SVG path data; a ring crossing the antimeridian (Russia's and Fiji's do, at
    this scale) is cut there rather than drawn as a line across the whole map."""
    out, previous = [], None
    for lon, lat in points:
        x, y = project(lon, lat)
        jump = previous is not None and abs(lon - previous) > 180
        out.append(("M" if previous is None or jump else "L") + f"{x:.1f},{y:.1f}")
        previous = lon
    return "".join(out) + "Z"


def main(source: Path) -> None:
    topo = json.loads(source.read_text())
    arcs = decode_arcs(topo)
    paths, centres = [], {}
    for geometry in topo["objects"]["countries"]["geometries"]:
        polygons = geometry.get("arcs", [])
        if geometry["type"] == "Polygon":
            polygons = [polygons]
        rings = [[ring(arcs, r) for r in polygon] for polygon in polygons]
        code = None
        numeric = geometry.get("id")
        if numeric is not None and (found := pycountry.countries.get(numeric=numeric)):
            code = found.alpha_2
        name = geometry["properties"]["name"]
        if code is None and name == "Kosovo":
            code = "XK"  # user-assigned; GeoIP databases use it
        if code == "AQ":
            continue  # no clients there, and it would take a fifth of the map
        d = [subpath(points) for polygon in rings for points in polygon]
        if code and rings:
            _, lon, lat = max(area_centroid(polygon[0]) for polygon in rings)
            centres[code] = [round(lon, 2), round(lat, 2)]
        attrs = f' data-cc="{code}"' if code else ""
        paths.append(f'<path{attrs} d="{"".join(d)}"><title>{name}</title></path>')
    svg = (
        '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 1000 500">\n'
        "<!-- Natural Earth 4.1.0 1:110m countries (public domain), via world-atlas 2.0.2 -->\n"
        # Attributes, not a stylesheet: the file is shown as an image, styled by nothing else.
        '<g fill="#d5dbe3" stroke="#ffffff" stroke-width="0.5" stroke-linejoin="round">\n'
        + "\n".join(paths)
        + "\n</g>\n</svg>\n"
    )
    (OUT / "world.svg").write_text(svg)
    (OUT / "countries.json").write_text(json.dumps(dict(sorted(centres.items()))) + "\n")
    print(f"{len(paths)} countries, {len(centres)} with codes, {len(svg)} bytes of SVG")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
