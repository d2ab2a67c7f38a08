"""The fleet map's geometry: the projection of the shipped Natural Earth outline
(``static/world.svg``, built by ``tools/build_world_map.py``), where each region sits, where
each client country's flows start, how a flow is drawn (the shorter way around the globe, with
its direction and its share of the traffic) and where each region's label goes so that no label
hides another label or a region's dot."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from gtm.admin.console.web import HERE

WIDTH, HEIGHT = 1000.0, 500.0
# What the page shows of it: from the Arctic coasts to Tierra del Fuego (no Antarctica).
TOP, BOTTOM = 12.0, 412.0
VIEW_BOX = f"0 {TOP:g} {WIDTH:g} {BOTTOM - TOP:g}"
DOT_R = 9.0  # a region's dot (the template draws it with this radius)
# A label's box in map units: the template's 13px semibold text with its white halo.
CHAR_W, LABEL_H, LABEL_PAD = 8.0, 16.0, 3.0


def project(lat: float, lon: float) -> tuple[float, float]:
    """Equirectangular, as the outline was drawn: x from longitude, y from latitude."""
    return round((lon + 180) * WIDTH / 360, 1), round((90 - lat) * HEIGHT / 180, 1)


@cache
def country_points() -> Mapping[str, tuple[float, float]]:
    """ISO alpha-2 -> (x, y) of the country's centroid on the map."""
    raw: dict[str, list[float]] = json.loads((HERE / "static" / "countries.json").read_text())
    return {code: project(lat, lon) for code, (lon, lat) in raw.items()}


def stroke(share: float) -> float:
    """A flow's width from its share of all answers (0..1): area grows with the share, so a
    flow of a quarter of the traffic reads as half as wide as one of all of it; never thinner
    than a hairline that can still be seen, never wider than a region's dot."""
    return round(1.2 + 7.0 * math.sqrt(max(0.0, min(1.0, share))), 2)


@dataclass(frozen=True)
class FlowShape:
    """How a flow is drawn: its arc's SVG path data (two copies when it crosses the
    antimeridian) and the points of the arrowhead at the region's dot; or, for clients too
    near their region for a line (Germany to Frankfurt), a ring around the dot (cx, cy, r)."""

    paths: tuple[str, ...]
    arrow: str
    ring: tuple[float, float, float] | None = None


def flow_shape(start: tuple[float, float], end: tuple[float, float], width: float) -> FlowShape:
    """A flow from ``start`` to a region's dot at ``end``, ``width`` wide: a gentle arc the
    shorter way around the globe, ending in an arrowhead at the dot's edge.

    A flow whose shorter way crosses the antimeridian (Tokyo to Oregon: east over the Pacific,
    not west over Eurasia) is one arc drawn twice, a map's width apart: each copy leaves the
    map at one edge and the view box clips the part outside, so it reads as one line leaving at
    the right and coming back at the left.
    """
    (x1, y1), (x2, y2) = start, end
    dx = x2 - x1
    if dx > WIDTH / 2:
        dx -= WIDTH
    elif dx < -WIDTH / 2:
        dx += WIDTH
    dy = y2 - y1
    length = math.hypot(dx, dy)
    size = max(7.0, 2.2 * width)  # the arrowhead's length
    if length < 2 * DOT_R + 2 * size:  # no room for a line and its arrow: a ring
        return FlowShape((), "", (x2, y2, round(DOT_R + 1.5 + width / 2, 1)))
    # Bowed to the left of the direction of travel, so A -> B and B -> A are two arcs.
    bow = min(0.18 * length, 60.0)
    cx, cy = x1 + dx / 2 + dy / length * bow, y1 + dy / 2 - dx / length * bow
    # The arrow's tip at the dot's edge, along the arc's last tangent (control point -> end).
    tx, ty = x1 + dx - cx, y1 + dy - cy
    t = math.hypot(tx, ty) or 1.0
    ux, uy = tx / t, ty / t
    back = DOT_R + 1.0
    tip_x, tip_y = x1 + dx - ux * back, y1 + dy - uy * back
    base_x, base_y = tip_x - ux * size, tip_y - uy * size
    # The line stops inside the arrowhead, so its round cap never shows past the tip.
    ex, ey = tip_x - ux * size * 0.6, tip_y - uy * size * 0.6
    shift = x2 - (x1 + dx)  # 0, or a map's width when the flow crosses the antimeridian
    path = "M{:.1f},{:.1f} Q{:.1f},{:.1f} {:.1f},{:.1f}"
    paths = [path.format(x1 + shift, y1, cx + shift, cy, ex + shift, ey)]
    if shift:
        paths.insert(0, path.format(x1, y1, cx, cy, ex, ey))
    half = size * 0.55
    arrow = " ".join(
        f"{px + shift:.1f},{py:.1f}"
        for px, py in (
            (tip_x, tip_y),
            (base_x - uy * half, base_y + ux * half),
            (base_x + uy * half, base_y - ux * half),
        )
    )
    return FlowShape(tuple(paths), arrow)


@dataclass(frozen=True)
class Box:
    x: float
    y: float
    w: float
    h: float

    def overlaps(self, other: Box) -> bool:
        return (
            self.x < other.x + other.w
            and other.x < self.x + self.w
            and self.y < other.y + other.h
            and other.y < self.y + self.h
        )

    def covers(self, cx: float, cy: float, r: float) -> bool:
        """Whether the box touches the disc of radius ``r`` at (cx, cy)."""
        nx = min(max(cx, self.x), self.x + self.w)
        ny = min(max(cy, self.y), self.y + self.h)
        return (nx - cx) ** 2 + (ny - cy) ** 2 < r * r

    def inside(self, left: float, top: float, right: float, bottom: float) -> bool:
        return (
            self.x >= left
            and self.y >= top
            and self.x + self.w <= right
            and (self.y + self.h <= bottom)
        )


@dataclass(frozen=True)
class Label:
    """Where a region's name is drawn: its box, the text's baseline, and a leader line from
    the dot when the label had to move away from it."""

    region: str
    box: Box
    text_x: float
    text_y: float
    leader: tuple[float, float, float, float] | None


def label_box(text: str) -> tuple[float, float]:
    return len(text) * CHAR_W + 2 * LABEL_PAD, LABEL_H


# Where a label may go around its dot, in order of preference: right, left, above, below, then
# the diagonals (unit directions; the box's near side or corner sits at the given distance).
DIRECTIONS = ((1, 0), (-1, 0), (0, -1), (0, 1), (1, -1), (-1, -1), (1, 1), (-1, 1))
ANGLES = 24  # positions tried on each ring further out


def _candidates(x: float, y: float, w: float, h: float) -> Iterable[tuple[Box, bool]]:
    """Boxes for a label of size (w, h) around a dot at (x, y), nearest first; the flag says
    whether the box is far enough from the dot to need a leader line."""
    gap = DOT_R + 2.0
    for ux, uy in DIRECTIONS:
        bx = x + gap if ux > 0 else (x - gap - w if ux < 0 else x - w / 2)
        by = y + gap if uy > 0 else (y - gap - h if uy < 0 else y - h / 2)
        yield Box(bx, by, w, h), False
    for ring in range(1, 40):
        distance = gap + ring * 12.0
        for step in range(ANGLES):
            angle = 2 * math.pi * step / ANGLES
            cx, cy = (
                x + math.cos(angle) * (distance + w / 2),
                y + math.sin(angle) * (distance + h / 2),
            )
            yield Box(cx - w / 2, cy - h / 2, w, h), True


def place_labels(
    dots: Sequence[tuple[str, float, float]],
    bounds: tuple[float, float, float, float] = (0.0, TOP, WIDTH, BOTTOM),
) -> dict[str, Label]:
    """A label for each region ``(id, x, y)``: no two labels overlap, no label covers a dot,
    every label is inside ``bounds`` (left, top, right, bottom) when there is room for it.

    Greedy and deterministic: the most crowded dots (most neighbours within a label's reach)
    are placed first, ties by id, each at the first free place among positions tried nearest
    first; the same regions give the same map whatever order they come in.
    """
    reach = 4 * DOT_R + max((label_box(r)[0] for r, _, _ in dots), default=0.0)
    crowd = {
        r: sum(1 for o, ox, oy in dots if o != r and math.hypot(ox - x, oy - y) < reach)
        for r, x, y in dots
    }
    placed: dict[str, Label] = {}
    boxes: list[Box] = []
    for region, x, y in sorted(dots, key=lambda d: (-crowd[d[0]], d[0])):
        w, h = label_box(region)
        chosen: tuple[Box, bool] | None = None
        for box, far in _candidates(x, y, w, h):
            if not box.inside(*bounds):
                continue
            if any(box.overlaps(b) for b in boxes):
                continue
            if any(box.covers(ox, oy, DOT_R + 1.0) for _, ox, oy in dots):
                continue
            chosen = (box, far)
            break
        if chosen is None:  # no room anywhere on the map: beside the dot, overlapping
            chosen = (next(iter(_candidates(x, y, w, h)))[0], False)
        box, far = chosen
        leader = None
        if far:
            # From the dot's edge towards the box's nearest point.
            nx = min(max(x, box.x), box.x + box.w)
            ny = min(max(y, box.y), box.y + box.h)
            d = math.hypot(nx - x, ny - y) or 1.0
            leader = (
                round(x + (nx - x) / d * DOT_R, 1),
                round(y + (ny - y) / d * DOT_R, 1),
                round(nx, 1),
                round(ny, 1),
            )
        boxes.append(box)
        placed[region] = Label(
            region,
            Box(round(box.x, 1), round(box.y, 1), round(box.w, 1), round(box.h, 1)),
            round(box.x + LABEL_PAD, 1),
            round(box.y + box.h - 4.0, 1),
            leader,
        )
    return placed


__all__ = [
    "DOT_R",
    "HEIGHT",
    "VIEW_BOX",
    "WIDTH",
    "Box",
    "FlowShape",
    "Label",
    "country_points",
    "flow_shape",
    "label_box",
    "place_labels",
    "project",
    "stroke",
]
