"""The fleet map's geometry: labels that never hide one another or a region's dot (the demo's
regions, and dense random sets), flows drawn the shorter way around the globe with an arrowhead
at the region, and widths that grow with a flow's share of the traffic."""

from __future__ import annotations

import itertools
import math
import random
import re

import pytest

from gtm.admin.console.fleet import fleet_model
from gtm.admin.console.worldmap import (
    BOTTOM,
    DOT_R,
    TOP,
    WIDTH,
    Label,
    flow_shape,
    place_labels,
    project,
    stroke,
)
from gtm.decision.topology import Topology


def demo_dots(topology: Topology) -> list[tuple[str, float, float]]:
    return [(r.id, *project(r.lat, r.lon)) for r in topology.regions]


def assert_readable(dots: list[tuple[str, float, float]], labels: dict[str, Label]) -> None:
    assert set(labels) == {d[0] for d in dots}
    for a, b in itertools.combinations(labels.values(), 2):
        assert not a.box.overlaps(b.box), (a, b)
    for label in labels.values():
        assert label.box.inside(0.0, TOP, WIDTH, BOTTOM), label
        for region, x, y in dots:
            assert not label.box.covers(x, y, DOT_R), (label, region)


def test_the_demo_regions_labels_hide_no_label_and_no_dot(topology: Topology) -> None:
    dots = demo_dots(topology)
    labels = place_labels(dots)
    assert_readable(dots, labels)
    # eu-west's label used to sit on eu-central's dot: it is clear of it now, and next to its
    # own dot (no leader line needed).
    eu_central = next(d for d in dots if d[0] == "eu-central")
    assert not labels["eu-west"].box.covers(eu_central[1], eu_central[2], DOT_R + 1)
    assert labels["eu-west"].leader is None


def test_placement_is_deterministic_whatever_the_order(topology: Topology) -> None:
    dots = demo_dots(topology)
    shuffled = dots[:]
    random.Random(3).shuffle(shuffled)
    assert place_labels(dots) == place_labels(shuffled) == place_labels(list(reversed(dots)))


@pytest.mark.parametrize("seed", range(8))
def test_dense_random_regions_get_readable_labels(seed: int) -> None:
    """Twenty regions crowded into western Europe's few hundred square units, and thirty more
    around the world: every label finds a place (further out, with a leader line)."""
    rng = random.Random(seed)
    names = [f"r{i}-{rng.choice(['eu', 'us-west', 'ap-northeast'])}" for i in range(50)]
    dots = []
    for i, name in enumerate(names):
        if i < 20:
            x, y = rng.uniform(470, 560), rng.uniform(90, 140)
        else:
            x, y = rng.uniform(20, 980), rng.uniform(40, 380)
        # Dots themselves do not overlap (two regions on one spot are one spot on a map).
        if any(math.hypot(x - ox, y - oy) < 2 * DOT_R + 2 for _, ox, oy in dots):
            continue
        dots.append((name, round(x, 1), round(y, 1)))
    labels = place_labels(dots)
    assert_readable(dots, labels)
    for label in labels.values():
        if label.leader is not None:  # a leader runs from its dot's edge to its own box
            x1, y1, x2, y2 = label.leader
            region = next(d for d in dots if d[0] == label.region)
            assert math.isclose(math.hypot(x1 - region[1], y1 - region[2]), DOT_R, abs_tol=0.2)
            assert label.box.x - 0.2 <= x2 <= label.box.x + label.box.w + 0.2
            assert label.box.y - 0.2 <= y2 <= label.box.y + label.box.h + 0.2


def _points(path: str) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in re.findall(r"(-?[\d.]+),(-?[\d.]+)", path)]


def test_tokyo_to_oregon_goes_east_over_the_pacific(topology: Topology) -> None:
    tokyo = project(35.68, 139.69)
    oregon = next(project(r.lat, r.lon) for r in topology.regions if r.id == "us-west")
    shape = flow_shape(tokyo, oregon, 3.0)
    leaving, arriving = shape.paths  # one arc, drawn on both sides of the antimeridian
    start, _, end = _points(leaving)
    assert start == tokyo and end[0] > WIDTH  # leaves at the right edge, eastward
    start, _, end = _points(arriving)
    assert start[0] < 0 and 0 < end[0] < oregon[0]  # comes back at the left edge
    # The arrowhead is on the map, at Oregon's dot, pointing into it.
    tip, *_ = _points(shape.arrow)
    assert math.isclose(math.dist(tip, oregon), DOT_R + 1, abs_tol=0.2)
    # A flow that needs no wrap is one arc, and ends short of the dot (the arrow covers it).
    london, frankfurt = project(51.5, -0.1), project(50.11, 8.68)
    washington = project(38.9, -77.0)
    (direct,) = flow_shape(washington, london, 3.0).paths
    *_, end = _points(direct)
    assert math.dist(end, london) > DOT_R
    # Too close for a line: a ring around the region.
    near = flow_shape(project(51.2, 10.4), frankfurt, 3.0)
    assert near.paths == () and near.ring is not None and near.ring[:2] == frankfurt


def test_a_flows_width_grows_with_its_share_and_stays_bounded() -> None:
    widths = [stroke(s) for s in (0.0, 0.01, 0.1, 0.25, 0.5, 1.0, 2.0)]
    assert widths == sorted(widths) and len(set(widths[:-1])) == 6
    assert widths[0] >= 1.0 and widths[-1] <= 2 * DOT_R


def test_the_map_model_weighs_flows_by_share_and_places_every_label(
    topology: Topology,
) -> None:
    regions = [
        {"region": r.id, "name": r.name, "jurisdiction": r.jurisdiction, "lat": r.lat,
         "lon": r.lon, "state": "up"}
        for r in topology.regions
    ]  # fmt: skip
    flows = [
        {"country": "US", "region": "us-east", "per_s": 30.0},
        {"country": "JP", "region": "us-west", "per_s": 10.0},
        {"country": "FR", "region": None, "per_s": 10.0},
    ]
    model = fleet_model(regions, flows)
    by_pair = {(f.country, f.region): f for f in model["lines"]}
    assert by_pair[("US", "us-east")].share == pytest.approx(0.6)
    assert by_pair[("US", "us-east")].width > by_pair[("JP", "us-west")].width
    assert len(by_pair[("JP", "us-west")].shape.paths) == 2  # across the Pacific
    labels = {d.id: d.label for d in model["dots"]}
    assert_readable(demo_dots(topology), labels)
