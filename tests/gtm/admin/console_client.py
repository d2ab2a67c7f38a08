"""A console user over plain HTTP: signs in through the form, keeps the cookies, posts forms with
the session's CSRF token (read off the page, as a browser would submit it)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def csrf_of(html: str) -> str:
    found = CSRF.search(html)
    assert found, "the page has no form with a CSRF token"
    return found.group(1)


@contextlib.asynccontextmanager
async def sign_in(url: str, token: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        form = await client.get("/console/signin")
        assert form.status_code == 200
        reply = await client.post(
            "/console/signin",
            data={"token": token, "csrf": csrf_of(form.text), "next": "/console/"},
        )
        assert reply.status_code == 303, reply.text
        assert reply.headers["location"] == "/console/"
        yield client


async def post_form(
    client: httpx.AsyncClient, page: str, action: str, fields: dict[str, Any]
) -> httpx.Response:
    """Post ``fields`` to ``action`` with the CSRF token of the form on ``page``."""
    html = (await client.get(page)).text
    return await client.post(action, data=fields | {"csrf": csrf_of(html)})
