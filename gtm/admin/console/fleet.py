"""The fleet page: the world map with every region coloured by its state and the live flows of
answers from client countries to regions, the regions' table, and the operators' controls."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter
from fastapi.responses import Response

from gtm.admin.console.web import Posted, SignedIn, View
from gtm.admin.console.worldmap import (
    DOT_R,
    HEIGHT,
    VIEW_BOX,
    WIDTH,
    FlowShape,
    Label,
    country_points,
    flow_shape,
    place_labels,
    project,
    stroke,
)

router = APIRouter(prefix="/console")

# The controls a form may ask for, and the API operation behind each.
ACTIONS = {
    "drain": "drain_region",
    "undrain": "undrain_region",
    "weight": "weight_region",
    "force": "force_region",
    "clear": "clear_region",
}


@dataclass(frozen=True)
class RegionDot:
    id: str
    name: str
    jurisdiction: str
    x: float
    y: float
    state: str  # what the map colours: up, down, draining, readmitting, spilling, unknown
    row: Mapping[str, Any]
    label: Label | None = None


@dataclass(frozen=True)
class FlowLine:
    country: str
    region: str | None
    per_s: float
    x1: float
    y1: float
    share: float  # of every answer on the map
    width: float
    shape: FlowShape | None = None  # None: answered with no region (drawn as a ring)


def shown_state(row: Mapping[str, Any]) -> str:
    """One word for the map: operator drains and health first, then slow readmission, then
    spilling (a healthy region shedding part of its clients)."""
    state = str(row.get("state", "unknown"))
    override = str(row.get("override") or "")
    if state == "down":
        return "down"
    if state == "draining" or override.startswith("drain") or row.get("out_of_service"):
        return "draining"
    if state == "up" and float(row.get("admitted", 1.0)) < 1.0:
        return "readmitting"
    if row.get("spilling"):
        return "spilling"
    return state if state in ("up", "unknown") else "unknown"


def fleet_model(
    regions: Sequence[Mapping[str, Any]], flows: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    dots = {}
    for row in regions:
        x, y = project(float(row["lat"]), float(row["lon"]))
        dots[row["region"]] = RegionDot(
            row["region"], row["name"], row["jurisdiction"], x, y, shown_state(row), row
        )
    labels = place_labels([(d.id, d.x, d.y) for d in dots.values()])
    dots = {r: replace(d, label=labels[r]) for r, d in dots.items()}
    points = country_points()
    total = sum(float(f["per_s"]) for f in flows) or 1.0
    lines, refused, unplaced = [], [], 0.0
    for flow in flows:
        per_s = float(flow["per_s"])
        start = points.get(flow.get("country") or "")
        if start is None:
            unplaced += per_s
            continue
        share = per_s / total
        dot = dots.get(flow.get("region") or "")
        if dot is None:
            refused.append(FlowLine(flow["country"], None, per_s, *start, share, stroke(share)))
            continue
        width = stroke(share)
        shape = flow_shape(start, (dot.x, dot.y), width)
        lines.append(FlowLine(flow["country"], dot.id, per_s, *start, share, width, shape))
    return {
        "width": WIDTH,
        "height": HEIGHT,
        "dot_r": DOT_R,
        "view_box": VIEW_BOX,
        "dots": list(dots.values()),
        "lines": sorted(lines, key=lambda f: -f.per_s),
        "refused": refused,
        "unplaced_per_s": round(unplaced, 2),
        "total_per_s": round(sum(float(f["per_s"]) for f in flows), 2),
    }


async def _model(view: View) -> tuple[dict[str, Any] | None, str | None]:
    regions = await view.api.get("/v1/regions")
    if not regions.ok:
        return None, regions.message
    traffic = await view.api.get("/v1/traffic", {"window_s": 5})
    flows = traffic.body["flows"] if traffic.ok else []
    model = fleet_model(regions.body, flows)
    nodes = await view.api.get("/v1/nodes")
    model["nodes"] = nodes.body if nodes.ok else []
    model["traffic_error"] = None if traffic.ok else traffic.message
    return model, None


@router.get("/")
async def fleet(view: SignedIn, done: str | None = None) -> Response:
    model, error = await _model(view)
    if model is None:
        return view.render("error.html", status=502, message=error)
    return view.render("fleet.html", done=done, **model)


@router.get("/fleet/live")
async def fleet_live(view: SignedIn) -> Response:
    """The map and the table alone, for the page's script to swap in every second."""
    model, error = await _model(view)
    if model is None:
        return view.render("error.html", status=502, message=error)
    return view.render("fleet_live.html", **model)


@router.post("/regions/{region}/{action}")
async def control(region: str, action: str, posted: Posted) -> Response:
    view, form = posted
    if action not in ACTIONS:
        return view.render("error.html", status=404, message=f"no region control {action!r}")
    body: dict[str, Any] = {
        "reason": form.get("reason", ""),
        "override_safety": form.get("override_safety") == "on",
    }
    if form.get("for"):
        body["for"] = form["for"]
    if action == "weight":
        weight = form.get("weight", "")
        try:
            body["weight"] = None if weight.strip() in ("", "default") else float(weight)
        except ValueError:
            return view.render("error.html", status=422, message=f"not a weight: {weight!r}")
    if action == "force":
        body["state"] = form.get("state", "")
    reply = await view.api.post(f"/v1/regions/{region}/{action}", body)
    if not reply.ok:
        return view.refused(reply)
    changed = reply.body
    note = f"{region}: {action} done"
    if changed.get("override"):
        note += f" ({changed['override']})"
    if changed.get("broke_safety_rules"):
        note += " — safety rules overridden: " + "; ".join(changed["broke_safety_rules"])
    return view.redirect(f"/console/?done={quote(note, safe='')}")


__all__ = ["fleet_model", "router", "shown_state"]
