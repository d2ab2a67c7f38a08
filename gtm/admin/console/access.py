"""Access (admins): principals and their roles, binding an identity provider's subject, role
grants (power roles wait for a second admin's approval), API tokens issued to oneself (shown
once), listed and revoked."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from gtm.admin.console.web import Posted, SignedIn
from gtm.admin.permissions import Role

router = APIRouter(prefix="/console")


@router.get("/access")
async def access(view: SignedIn) -> Response:
    people = await view.api.get("/v1/principals")
    if not people.ok:
        return view.refused(people)
    tokens = await view.api.get("/v1/tokens")
    grants = await view.api.get("/v1/grants")
    return view.render(
        "access.html",
        people=people.body,
        tokens=tokens.body if tokens.ok else [],
        grants=grants.body if grants.ok else [],
        roles=[r.value for r in Role],
        issued=None,
    )


@router.post("/access/grants/{grant_id}/approve")
async def approve_grant(grant_id: int, posted: Posted) -> Response:
    view, _ = posted
    reply = await view.api.post(f"/v1/grants/{grant_id}/approve", {})
    if not reply.ok:
        return view.refused(reply)
    return view.redirect("/console/access")


@router.post("/access/principals")
async def create_principal(posted: Posted) -> Response:
    view, form = posted
    body = {
        "name": form.get("name", "").strip(),
        "roles": [r.value for r in Role if form.get(f"role:{r.value}") == "on"],
        "oidc_subject": form.get("oidc_subject", "").strip() or None,
    }
    reply = await view.api.post("/v1/principals", body)
    if not reply.ok:
        return view.refused(reply)
    return view.redirect("/console/access")


@router.post("/access/tokens")
async def create_token(posted: Posted) -> Response:
    view, form = posted
    name = form.get("principal", "")
    expires = form.get("expires_in", "").strip() or None
    reply = await view.api.post(f"/v1/principals/{name}/tokens", {"expires_in": expires})
    if not reply.ok:
        return view.refused(reply)
    people = await view.api.get("/v1/principals")
    tokens = await view.api.get("/v1/tokens")
    grants = await view.api.get("/v1/grants")
    # Rendered, not redirected: the token is shown this once and never kept by the console.
    return view.render(
        "access.html",
        status=201,
        people=people.body if people.ok else [],
        tokens=tokens.body if tokens.ok else [],
        grants=grants.body if grants.ok else [],
        roles=[r.value for r in Role],
        issued=reply.body,
    )


@router.post("/access/tokens/{token_id}/revoke")
async def revoke_token(token_id: str, posted: Posted) -> Response:
    view, _ = posted
    reply = await view.api.delete(f"/v1/tokens/{token_id}")
    if not reply.ok:
        return view.refused(reply)
    return view.redirect("/console/access")


__all__ = ["router"]
