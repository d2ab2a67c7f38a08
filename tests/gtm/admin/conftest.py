"""A node with the admin API on a loopback socket, a signing key pair, and principals made the
way the first one is made in production (directly in the database, as ``gtm token create``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from gtm.admin import principals, signer
from gtm.admin.permissions import Role
from gtm.admin.server import bind, serve_admin
from gtm.control.log import ControlLog
from gtm.runtime import Runtime
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES, ROOT
from tests.support.axe import axe_script  # noqa: F401 (the walkthrough's fixture)
from tests.support.browser import browser  # noqa: F401 (the console tests' fixture)
from tests.support.postgres import postgres_database
from tests.support.tcp_proxy import TcpProxy


@dataclass
class Admin:
    url: str
    runtime: Runtime
    keys: Path  # the key pair's directory

    @property
    def control(self) -> ControlLog:
        """The key file's holder's writer (as ``gtm token create``): a fresh read of the log."""
        key = signer.load_signer(self.keys / signer.PRIVATE_NAME)
        return ControlLog({}, key, public=key.public_key())

    async def token(self, name: str, *roles: Role) -> str:
        """A principal NAME with ROLES (made once) and a new token for it."""
        control = self.control
        await control.refresh(self.runtime.engine)
        async with self.runtime.engine.begin() as conn:
            principal = await principals.by_name(conn, name, control)
            if principal is None:
                principal = await principals.create(
                    conn, name, roles, created_by="test", now=time.time(), node="test",
                    control=control,
                )  # fmt: skip
            token = await principals.issue_token(
                conn, principal, created_by="test", now=time.time(), expires_at=None,
                node="test", control=control,
            )  # fmt: skip
        return token.text

    def client(self, token: str | None) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=20)


def capacity_report(**extra: Any) -> dict[str, Any]:
    """A fresh capacity report from eu-west (42% used), as its balancer pushes it; ``extra``
    changes or adds fields."""
    return {
        "region": "eu-west",
        "seq": 1,
        "ts": time.time(),
        "instances_healthy": 2,
        "instances_total": 2,
        "capacity": 100.0,
        "outstanding": 42.0,
        "utilisation": 0.42,
        **extra,
    }


def run_gtm(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``gtm ARGS`` in a process of its own with ``env`` over this one's. stdin is no
    terminal: the CLI must not wait on a question nobody can answer."""
    return subprocess.run(
        [sys.executable, "-m", "gtm", *args],
        env=os.environ | env,
        capture_output=True,
        stdin=subprocess.DEVNULL,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def documents(edit: Callable[[str, str], str] | None = None) -> dict[str, Any]:
    """The demo topology and policies as an API body; ``edit(file name, text)`` changes them."""
    texts = {p.name: p.read_text() for p in sorted(POLICIES.glob("*.yaml"))}
    if edit is not None:
        texts = {name: edit(name, text) for name, text in texts.items()}
    return {"topology": DEMO.read_text(), "policies": texts}


def loosen_eu(name: str, text: str) -> str:
    """The change a compliance team must never make alone: EU personal data allowed in the US."""
    if name == "eu-personal.yaml":
        return text.replace("jurisdictions: [EU]", "jurisdictions: [EU, US]")
    return text


AdminFactory = Callable[..., contextlib.AbstractAsyncContextManager[Admin]]


@pytest.fixture
def postgres() -> Iterator[str]:
    """A database of its own on the test PostgreSQL (tests marked ``postgres``)."""
    with postgres_database() as url:
        yield url


def through(url: str, proxy: TcpProxy) -> str:
    """``url`` with its server reached through ``proxy``."""
    return make_url(url).set(host="127.0.0.1", port=proxy.port).render_as_string(False)


@pytest.fixture
def start_admin(tmp_path: Path, geoip_path: Path) -> AdminFactory:
    @contextlib.asynccontextmanager
    async def start(
        *,
        approvals: int = 1,
        signing: bool = True,
        trusted_keys: Iterable[Path] | None = None,
        database_url: str | None = None,
        oidc: tuple[str, str, str] | None = None,  # issuer, audience, JWKS URL
        console_key_file: Path | None = None,
        **extra: Any,  # any other setting
    ) -> AsyncIterator[Admin]:
        keys = tmp_path / "keys"
        if not (keys / signer.PRIVATE_NAME).exists():
            signer.generate(keys)
        settings = Settings(
            config=DEMO,
            policies=(POLICIES,),
            geoip_path=geoip_path,
            database_url=database_url or f"sqlite:///{tmp_path / 'gtm.sqlite3'}",
            spool_dir=tmp_path / "spool",
            node_id="admin-test",
            probes=False,
            audit_flush_interval_s=0.05,
            state_sync_interval_s=0.1,
            policy_approvals=approvals,
            document_keys=tuple(
                trusted_keys if trusted_keys is not None else [keys / signer.PUBLIC_NAME]
            ),
            document_signing_key=(keys / signer.PRIVATE_NAME) if signing else None,
            admin_oidc_issuer=oidc and oidc[0],
            admin_oidc_audience=oidc and oidc[1],
            admin_oidc_jwks_url=oidc and oidc[2],
            console_session_key_file=console_key_file,
            **extra,
        )
        runtime = Runtime(settings)
        await runtime.start()
        sock = bind("127.0.0.1:0")
        port = sock.getsockname()[1]
        stop, ready = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(serve_admin(runtime, sock, stop, ready))
        await asyncio.wait(
            [task, asyncio.ensure_future(ready.wait())], return_when=asyncio.FIRST_COMPLETED
        )
        if task.done():
            task.result()
        try:
            yield Admin(f"http://127.0.0.1:{port}", runtime, keys)
        finally:
            stop.set()
            await task
            await runtime.stop()

    return start
