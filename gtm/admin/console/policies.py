"""Policy pages: versions and proposals, a readable diff, the proposal lifecycle (propose,
approve, schedule, roll back) with four-eyes enforced by the API, and the impact of a draft."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from gtm.admin import impact as replay
from gtm.admin.console.api import Reply
from gtm.admin.console.web import Posted, SignedIn, View

router = APIRouter(prefix="/console")


def documents_of(form: Mapping[str, str]) -> dict[str, Any]:
    """The proposal's documents from a form: ``topology`` and one ``policy:<file>`` per file."""
    policies = {
        key.removeprefix("policy:"): text.replace("\r\n", "\n")
        for key, text in form.items()
        if key.startswith("policy:") and key.removeprefix("policy:")
    }
    extra_name = form.get("new_policy_name", "").strip()
    if extra_name:
        policies[extra_name] = form.get("new_policy_text", "").replace("\r\n", "\n")
    return {"topology": form.get("topology", "").replace("\r\n", "\n"), "policies": policies}


def parse_at(text: str) -> float | None:
    """A ``datetime-local`` value, read as UTC (the page says so); empty: now."""
    text = text.strip()
    if not text:
        return None
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def bars(values: Mapping[str, int], bad: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A horizontal bar chart's geometry (the template draws it; the table beside it has the
    same numbers, so the chart is never the only place a figure is)."""
    items = sorted(values.items(), key=lambda kv: -kv[1])[:15]
    top = max((v for _, v in items), default=0) or 1
    rows = [
        {"label": k, "value": v, "width": round(340 * v / top, 1), "y": 22 * i, "bad": k in bad}
        for i, (k, v) in enumerate(items)
    ]
    return {"rows": rows, "height": 22 * len(rows) + 4}


def diff_lines(diff: str) -> list[tuple[str, str]]:
    out = []
    for line in diff.splitlines():
        kind = ""
        if line.startswith("@@"):
            kind = "hunk"
        elif line.startswith("+") and not line.startswith("+++"):
            kind = "add"
        elif line.startswith("-") and not line.startswith("---"):
            kind = "del"
        out.append((kind, line))
    return out


async def _policies_page(
    view: View,
    draft: Mapping[str, Any] | None = None,
    refusal: Reply | None = None,
    reason: str = "",
) -> Response:
    """The policies page; with ``draft``, its form holds what was typed (a refused draft loses
    nothing) and the refusal is shown above it."""
    active = await view.api.get("/v1/versions/active")
    proposals = await view.api.get("/v1/proposals")
    if not proposals.ok:
        return view.refused(proposals)
    current = None
    if view.may("create_proposal"):
        reply = await view.api.get("/v1/documents/current")
        current = reply.body if reply.ok else None
        if draft is not None and current is not None:
            current = dict(current) | dict(draft)
    return view.render(
        "policies.html",
        status=refusal.status if refusal is not None else 200,
        active=active.body if active.ok else None,
        proposals=sorted(proposals.body, key=lambda p: -p["id"]),
        current=current,
        refusal=refusal,
        reason=reason,
    )


@router.get("/policies")
async def policies(view: SignedIn) -> Response:
    return await _policies_page(view)


@router.get("/policies/new")
async def new_form(view: SignedIn) -> Response:
    """The form has no page of its own: the policies page holds it (a bookmark, a reload after
    a refused draft, or a link typed by hand land there)."""
    return view.redirect("/console/policies#new")


@router.post("/policies/new")
async def create(posted: Posted) -> Response:
    view, form = posted
    draft = documents_of(form)
    reply = await view.api.post("/v1/proposals", draft | {"reason": form.get("reason", "")})
    if not reply.ok:
        if reply.status in (401, 403):
            return view.refused(reply)
        return await _policies_page(view, draft, reply, form.get("reason", ""))
    return view.redirect(f"/console/policies/{reply.body['id']}")


# The traffic an activation's leak check replays: the same day the API replays.
LEAK_WINDOW_S = replay.LEAK_WINDOW_S


def leak_key(leaks: list[Mapping[str, Any]]) -> str:
    """What an acknowledgement names: each (class, from, to) that would leave, not the counts,
    which grow while the page is open; a new kind of leak asks again."""
    return replay.leak_key(
        (x["residency_class"], x["from_jurisdiction"], x["to_jurisdiction"]) for x in leaks
    )


async def _proposal_page(
    view: View,
    proposal_id: int,
    impact: Any = None,
    status: int = 200,
    confirm: Mapping[str, Any] | None = None,
) -> Response:
    proposal = await view.api.get(f"/v1/proposals/{proposal_id}")
    if not proposal.ok:
        return view.refused(proposal)
    diff = await view.api.get(f"/v1/proposals/{proposal_id}/diff")
    version = await view.api.get(f"/v1/versions/{proposal.body['version']}")
    rollout = None
    if proposal.body["state"] == "active":
        reply = await view.api.get(f"/v1/proposals/{proposal_id}/rollout")
        rollout = reply.body if reply.ok else None
    p = proposal.body
    is_author = p["author"] == view.principal.get("name")
    approved_by_me = any(a["approver"] == view.principal.get("name") for a in p["approvals"])
    charts = None
    if impact is not None:
        moves = impact["by_move"]
        left = frozenset(
            f"{e['before']} -> {e['after']}" for e in impact["examples"] if e["left_jurisdiction"]
        )
        charts = {"moves": bars(moves, left), "left": left}
    return view.render(
        "proposal.html",
        status=status,
        p=p,
        diff=diff.body if diff.ok else None,
        diff_error=None if diff.ok else diff.message,
        diff_lines=diff_lines,
        version=version.body if version.ok else None,
        rollout=rollout,
        is_author=is_author,
        approved_by_me=approved_by_me,
        impact=impact,
        charts=charts,
        confirm=confirm,
    )


def _refused_for_a_leak(reply: Reply) -> bool:
    return isinstance(reply.body, dict) and reply.body.get("error") == "leak_not_acknowledged"


async def _ask_about_leaks(
    view: View, proposal_id: int, form: Mapping[str, str], window_s: float
) -> tuple[Response | None, str]:
    """(the confirmation page, "") when the last ``window_s`` of traffic shows answers leaving
    their jurisdiction that the form has not acknowledged; else (None, the acknowledgement to
    send with the activation)."""
    check = await view.api.post(f"/v1/proposals/{proposal_id}/impact", {"since_s": window_s})
    if not check.ok:
        return view.refused(check), ""
    leaks = check.body.get("leaks") or []
    key = leak_key(leaks) if leaks else ""
    acknowledged = form.get("acknowledge") == key and form.get("understood") == "on"
    if leaks and not acknowledged:
        confirm = {"leaks": leaks, "key": key, "at": form.get("at", "")}
        confirm["total"] = sum(int(x["answers"]) for x in leaks)
        return await _proposal_page(view, proposal_id, confirm=confirm, status=409), ""
    return None, key


@router.get("/policies/{proposal_id}")
async def proposal(view: SignedIn, proposal_id: int) -> Response:
    return await _proposal_page(view, proposal_id)


@router.post("/policies/{proposal_id}/{action}")
async def act(proposal_id: int, action: str, posted: Posted) -> Response:
    view, form = posted
    path = f"/v1/proposals/{proposal_id}"
    if action == "edit":
        reply = await view.api.put(path, documents_of(form))
    elif action in ("submit", "withdraw"):
        reply = await view.api.post(f"{path}/{action}")
    elif action == "approve":
        body = {"version": form.get("version", ""), "comment": form.get("comment", "")}
        reply = await view.api.post(f"{path}/approve", body)
    elif action == "activate":
        try:
            at = parse_at(form.get("at", ""))
        except ValueError:
            return view.render("error.html", status=422, message="not a date and time")
        # Answers that would leave their jurisdiction are named, and acknowledged, first.
        asked, ack = await _ask_about_leaks(view, proposal_id, form, LEAK_WINDOW_S)
        if asked is not None:
            return asked
        reply = await view.api.post(f"{path}/activate", {"at": at, "acknowledge": ack})
        if reply.status == 409 and _refused_for_a_leak(reply):
            # Traffic moved between the check and the activation: the API found a leak this
            # page did not name. Asked again, with the API's own window.
            asked, _ = await _ask_about_leaks(view, proposal_id, form, replay.LEAK_WINDOW_S)
            if asked is not None:
                return asked
    elif action == "impact":
        try:
            hours = float(form.get("since_h", "24"))
        except ValueError:
            hours = math.nan
        if not math.isfinite(hours):
            return view.render("error.html", status=422, message="not a number of hours")
        reply = await view.api.post(f"{path}/impact", {"since_s": hours * 3600})
        if reply.ok:
            return await _proposal_page(view, proposal_id, impact=reply.body)
    elif action == "rollback":
        # A rollback is a new proposal of an earlier version's documents: it needs the same
        # approvals as any change, so a rollback is never a way around four-eyes.
        version = await view.api.get(f"/v1/versions/{form.get('version', '')}")
        if not version.ok:
            return view.refused(version)
        v = version.body
        reason = form.get("reason") or f"roll back to version {v['id']}"
        body = {"topology": v["topology"], "policies": v["policies"], "reason": reason}
        reply = await view.api.post("/v1/proposals", body)
        if reply.ok:
            return view.redirect(f"/console/policies/{reply.body['id']}")
    else:
        return view.render("error.html", status=404, message=f"no proposal action {action!r}")
    if not reply.ok:
        return view.refused(reply)
    return view.redirect(f"/console/policies/{proposal_id}")


__all__ = ["bars", "diff_lines", "documents_of", "parse_at", "router"]
