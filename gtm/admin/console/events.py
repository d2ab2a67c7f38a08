"""Events and evidence: the chained event log (region state changes and admin actions, newest
first), the live nodes and what each has in force, and the audit chains' verification status."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from gtm.admin.console.policies import parse_at
from gtm.admin.console.web import SECURITY_HEADERS, SignedIn, templates

router = APIRouter(prefix="/console")


@router.get("/events")
async def events(view: SignedIn, region: str | None = None) -> Response:
    params = {"region": region, "limit": 200}
    log = await view.api.get("/v1/events", params)
    if not log.ok:
        return view.refused(log)
    nodes = await view.api.get("/v1/nodes")
    chains = await view.api.get("/v1/audit/chains")
    return view.render(
        "events.html",
        events=log.body,
        region=region,
        nodes=nodes.body if nodes.ok else [],
        chains=chains.body if chains.ok else None,
        chains_error=None if chains.ok else chains.message,
    )


# The report is one self-contained page with its own inline style and no script.
REPORT_HEADERS = SECURITY_HEADERS | {
    "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
    "frame-ancestors 'none'; form-action 'none'; base-uri 'none'"
}


@router.get("/reports/compliance")
async def compliance(view: SignedIn, since: str = "", until: str = "") -> Response:
    try:
        start, end = parse_at(since), parse_at(until)
    except ValueError:
        return view.render("error.html", status=422, message="not a date and time")
    now = time.time()
    params = {
        "from": start if start is not None else now - 86400,
        "to": end if end is not None else now,
        "format": "html",
    }
    reply = await view.api.raw("/v1/reports/compliance", params)
    if reply.status_code != 200:
        return view.render("error.html", status=reply.status_code, message=reply.text)
    # The console's sections above the report (links only: the report's page takes no form).
    nav = templates.get_template("report_nav.html").render(me=view.principal, may=view.may)
    response = HTMLResponse(reply.text.replace("<body>", "<body>" + nav, 1), headers=REPORT_HEADERS)
    view.keep(response)
    return response


__all__ = ["router"]
