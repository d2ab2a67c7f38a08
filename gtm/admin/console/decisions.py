"""Decision pages: the audit search with the API's filters, one decision explained (inputs,
every candidate region with its reason, the versions in force) and replayed, and export."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from gtm.admin.console.policies import parse_at
from gtm.admin.console.web import SECURITY_HEADERS, Posted, SignedIn, View
from gtm.audit.decision_id import make_id
from gtm.decision.model import Outcome

router = APIRouter(prefix="/console")

FILTERS = (
    "service",
    "name",
    "client_network",
    "region",
    "outcome",
    "residency_class",
    "rule",
    "node",
)


def api_filters(args: Mapping[str, str]) -> tuple[dict[str, Any], str | None]:
    """The API's query parameters from the form's (times are datetime-local, in UTC)."""
    out: dict[str, Any] = {k: args[k].strip() for k in FILTERS if args.get(k, "").strip()}
    for key in ("since", "until"):
        try:
            at = parse_at(args.get(key, ""))
        except ValueError:
            return out, f"{key}: not a date and time"
        if at is not None:
            out[key] = at
    return out, None


def decision_link(row: Mapping[str, Any]) -> str:
    """An id that finds ``row`` again (any response it counted has one like it)."""
    return make_id(
        row["node"], row["first_at_us"] / 1e6, row["client_network"], row["name"], serial=0
    )


@router.get("/decisions")
async def search(request: Request, view: SignedIn) -> Response:
    args = dict(request.query_params)
    params, error = api_filters(args)
    rows: list[dict[str, Any]] = []
    next_after = None
    reply = None
    if error is None:
        page_params = params | {"after": args.get("after") or None, "limit": 50, "order": "newest"}
        reply = await view.api.get("/v1/decisions", page_params)
        if reply.ok:
            rows, next_after = reply.body["rows"], reply.body["next"]
        elif reply.status in (401, 403):
            return view.refused(reply)
        else:
            error = reply.message
    keep = {k: v for k, v in args.items() if k != "after" and v}
    return view.render(
        "decisions.html",
        args=args,
        rows=rows,
        next_after=next_after,
        error=error,
        link=decision_link,
        keep=keep,
        outcomes=[o.value for o in Outcome],
    )


@router.get("/decisions/export")
async def export(request: Request, view: SignedIn) -> Response:
    params, error = api_filters(dict(request.query_params))
    if error is not None:
        return view.render("error.html", status=422, message=error)
    fmt = "csv" if request.query_params.get("format") == "csv" else "jsonl"
    upstream = await view.api.stream("/v1/decisions/export", params | {"format": fmt})
    if upstream.status != 200:
        text = b"".join([chunk async for chunk in upstream.body]).decode(errors="replace")
        return view.render("error.html", status=upstream.status, message=text)
    filename = f"decisions.{fmt}"
    headers = SECURITY_HEADERS | {"content-disposition": f'attachment; filename="{filename}"'}
    return StreamingResponse(
        upstream.body, media_type=upstream.headers.get("content-type"), headers=headers
    )


def replay_table(recorded: Mapping[str, Any], replayed: Mapping[str, Any]) -> list[Any]:
    """A replay as rows a person reads: (what, recorded, replayed, same?) for the outcome, the
    region and each region's verdict, instead of the API's nested dicts."""
    rows = [
        ("Outcome", recorded.get("outcome"), replayed.get("outcome")),
        ("Region", recorded.get("region") or "—", replayed.get("region") or "—"),
    ]
    before, after = recorded.get("verdicts") or {}, replayed.get("verdicts") or {}
    for region in sorted(set(before) | set(after)):
        rows.append((f"Verdict for {region}", before.get(region, "—"), after.get(region, "—")))
    return [(what, old, new, old == new) for what, old, new in rows]


async def _decision_page(view: View, decision_id: str, replayed: Any = None) -> Response:
    reply = await view.api.get(f"/v1/decisions/{decision_id}")
    if not reply.ok:
        return view.refused(reply)
    # The row names its documents by hash; the API says which stored version that is, and
    # the proposals say which of them carried it, so the page links the two.
    proposals_of: dict[str, list[Mapping[str, Any]]] = {}
    if any(r.get("document_version") for r in reply.body):
        listed = await view.api.get("/v1/proposals")
        for p in listed.body if listed.ok else []:
            proposals_of.setdefault(p["version"], []).append(p)
    return view.render(
        "decision.html",
        decision_id=decision_id,
        rows=reply.body,
        replayed=replayed,
        replay_table=replay_table,
        proposals_of=proposals_of,
    )


@router.get("/decisions/{decision_id}")
async def decision(view: SignedIn, decision_id: str) -> Response:
    return await _decision_page(view, decision_id)


@router.post("/decisions/{decision_id}/replay")
async def replay(decision_id: str, posted: Posted) -> Response:
    view, _ = posted
    reply = await view.api.post(f"/v1/decisions/{decision_id}/replay")
    if not reply.ok:
        return view.refused(reply)
    return await _decision_page(view, decision_id, replayed=reply.body)


__all__ = ["api_filters", "decision_link", "replay_table", "router"]
