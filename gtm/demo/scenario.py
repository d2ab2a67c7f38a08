"""The live part of ``make demo`` that a person watches in the console: the demo's principals
and their sign-in tokens, client traffic from around the world, and a scenario that plays on
the map (a region fails and its clients move, a region fills and spills, a policy proposal waits
for approval), always ending with the fleet whole again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import dns.asyncquery
import dns.edns
import dns.message
import httpx
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.admin import principals, signer
from gtm.admin.permissions import Role
from gtm.control.entry import BOOTSTRAP
from gtm.control.log import ControlLog
from gtm.demo.local_fleet import MODEL, Fleet
from gtm.fleet import operator

# Who the demo signs in as. The author holds the approver role too, so the refusal to approve
# their own proposal is four-eyes at work, not a missing role; a separate approver approves,
# and an admin opens Access.
PEOPLE: dict[str, tuple[Role, ...]] = {
    "demo-operator": (Role.OPERATOR, Role.VIEWER),
    "demo-author": (Role.POLICY_AUTHOR, Role.POLICY_APPROVER, Role.VIEWER),
    "demo-approver": (Role.POLICY_APPROVER, Role.VIEWER),
    "demo-auditor": (Role.AUDITOR, Role.VIEWER),
    "demo-admin": (Role.ADMIN, Role.VIEWER),
}

# Client networks as the bundled 2018 GeoLite2 places them, and how often each asks.
CLIENTS: list[tuple[str, str, int]] = [
    ("8.8.8.0/24", "US", 6),
    ("24.48.0.0/24", "CA", 2),
    ("200.160.0.0/24", "BR", 2),
    ("81.2.69.0/24", "GB", 3),
    ("85.214.0.0/24", "DE", 4),
    ("217.70.184.0/24", "FR", 2),
    ("130.237.1.0/24", "SE", 1),
    ("41.203.64.0/24", "NG", 1),
    ("196.25.1.0/24", "ZA", 1),
    ("49.36.0.0/24", "IN", 3),
    ("133.11.0.0/24", "JP", 3),
    ("1.1.1.0/24", "AU", 2),
]
NAMES = ("chat.gtm.example.", "chat.gtm.example.", "chat.eu.gtm.example.")


def signing_keys(directory: Path) -> tuple[Path, Path]:
    """The demo admin service's document signing pair (made once, mode 0600)."""
    private, public = directory / signer.PRIVATE_NAME, directory / signer.PUBLIC_NAME
    if not private.exists():
        signer.generate(directory)
    return private, public


def key_holder(private_key: Path) -> ControlLog:
    """The demo holds the admin service's key file: it writes the control log as the bootstrap
    command does (``gtm token create``)."""
    key = signer.load_signer(private_key)
    return ControlLog({}, key, public=key.public_key())


async def issue_tokens(
    engine: AsyncEngine, private_key: Path, now: float
) -> dict[str, tuple[tuple[Role, ...], str]]:
    """A fresh token for each demo person (made once, like ``gtm token create``)."""
    control = key_holder(private_key)
    await control.refresh(engine)
    out = {}
    async with engine.begin() as conn:
        for name, roles in PEOPLE.items():
            person = await principals.by_name(conn, name, control)
            if person is None:
                person = await principals.create(
                    conn, name, roles, created_by="demo", now=now, node="demo", control=control
                )
            token = await principals.issue_token(
                conn, person, created_by="demo", now=now, expires_at=now + 86400,
                node="demo", control=control,
            )  # fmt: skip
            # The roles it holds (a store from an earlier demo keeps that run's people).
            held = tuple(r for r in Role if r in person.roles)
            out[name] = (held, token.text)
    return out


def write_tokens(path: Path, tokens: dict[str, tuple[tuple[Role, ...], str]]) -> None:
    """The tokens in a file only its owner reads (the terminal shows them too: demo tokens)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        for name, (_, token) in tokens.items():
            out.write(f"{name} {token}\n")
    path.chmod(0o600)


async def client_traffic(dns_port: int, stop: asyncio.Event, per_s: float = 40.0) -> int:
    """DNS questions from the clients above, as their resolvers would send them (ECS), until
    ``stop``; returns how many were answered. Paced, so the map shows steady flows."""
    rng = random.Random(7)
    weighted = [c for c in CLIENTS for _ in range(c[2])]
    answered = 0
    interval = 1.0 / per_s
    while not stop.is_set():
        subnet, _, _ = rng.choice(weighted)
        query = dns.message.make_query(rng.choice(NAMES), "A", use_edns=0)
        query.use_edns(0, options=[dns.edns.ECSOption.from_text(subnet)])
        with contextlib.suppress(Exception):  # a lost datagram is no reason to stop
            await dns.asyncquery.udp(query, "127.0.0.1", port=dns_port, timeout=1)
            answered += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
    return answered


async def fill(base_url: str, stop: asyncio.Event, workers: int = 48) -> None:
    """Keep a region's balancer busy with long completions until ``stop``: its utilisation
    climbs past the high watermark and GTM spills part of its clients to the next region."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 2000,
    }

    async def worker(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                await client.post("/v1/chat/completions", json=body)

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        tasks = [asyncio.create_task(worker(client)) for _ in range(workers)]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# Inference traffic kept up through each region's balancer while the demo serves: streams in
# flight per region, so the map's utilisation sits between idle and the watermark and differs
# by region, instead of 0% everywhere but a filled region.
STEADY: dict[str, int] = {
    "us-east": 6,
    "us-west": 3,
    "eu-west": 5,
    "eu-central": 4,
    "ap-south": 2,
    "ap-northeast": 3,
}


async def steady_load(balancers: Mapping[str, str], stop: asyncio.Event) -> None:
    """Completions through every balancer until ``stop``, :data:`STEADY` streams per region
    (a region the demo has killed just refuses them until it is back)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "summarise the news"}],
        "max_tokens": 400,
    }

    async def worker(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            try:
                await client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError:
                # The balancer is down (the scenario killed it): wait rather than spin.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)

    clients = [httpx.AsyncClient(base_url=url, timeout=60) for url in balancers.values()]
    try:
        tasks = [
            asyncio.create_task(worker(client))
            for region, client in zip(balancers, clients, strict=True)
            for _ in range(STEADY.get(region, 4))
        ]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for client in clients:
            await client.aclose()


Say = Callable[[str], None]


async def scenario(
    fleet: Fleet,
    engine: AsyncEngine,
    state_of: Callable[[str], str],
    stop: asyncio.Event,
    say: Say,
    step_s: float = 20.0,
) -> None:
    """Round and round until ``stop``: ap-south's balancer fails (its clients move to the
    nearest allowed region) and comes back; us-east fills and spills; a pause between each."""

    async def pause(seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)
        return stop.is_set()

    async def until(check: Callable[[], bool], within: float) -> float | None:
        started = time.monotonic()
        while time.monotonic() - started < within and not stop.is_set():
            if check():
                return time.monotonic() - started
            await asyncio.sleep(0.2)
        return None

    while not await pause(step_s):
        say("scenario: ap-south's balancer is killed (watch India's clients move)")
        fleet.kill("ap-south-lb")
        took = await until(lambda: state_of("ap-south") == "down", 20)
        say(f"scenario: ap-south is down ({took:.1f} s)" if took else "scenario: ap-south?")
        if await pause(step_s):
            break
        fleet.restart("ap-south-lb")
        took = await until(lambda: state_of("ap-south") == "up", 30)
        say(f"scenario: ap-south is back ({took:.1f} s)" if took else "scenario: ap-south?")
        if await pause(step_s):
            break
        say("scenario: us-east fills up (long completions; watch part of it spill)")
        done = asyncio.Event()
        load = asyncio.create_task(fill(fleet.balancers["us-east"], done))
        await pause(step_s * 1.5)
        done.set()
        await load
        say("scenario: us-east's load ends")


async def restore(
    fleet: Fleet, engine: AsyncEngine, regions: list[str], control: ControlLog
) -> None:
    """The whole fleet back: every balancer running and no operator override left by the demo."""
    for name, proc in list(fleet.processes.items()):
        if proc.poll() is not None:
            fleet.restart(name)
    await control.refresh(engine)
    for region in regions:
        await operator.clear(
            engine, region, control=control, by=BOOTSTRAP, actor="demo",
            reason="the demo leaves the fleet whole", now=time.time(),
        )  # fmt: skip


async def propose(admin_url: str, author_token: str) -> int | None:
    """A proposal by the demo's author, submitted, waiting for the approver in the console: one
    an approver should refuse, since its impact shows EU personal data answered from the US."""
    headers = {"authorization": f"Bearer {author_token}"}
    async with httpx.AsyncClient(base_url=admin_url, headers=headers, timeout=30) as api:
        current = await api.get("/v1/documents/current")
        if current.status_code != 200:
            return None
        docs = current.json()
        policies = dict(docs["policies"])
        eu = policies.get("eu-personal.yaml", "")
        policies["eu-personal.yaml"] = eu.replace("jurisdictions: [EU]", "jurisdictions: [EU, US]")
        created = await api.post(
            "/v1/proposals",
            json={
                "topology": docs["topology"],
                "policies": policies,
                "reason": "let EU personal data be served from the US when that is closer",
            },
        )
        if created.status_code != 201:
            return None
        proposal_id: int = created.json()["id"]
        await api.post(f"/v1/proposals/{proposal_id}/submit")
        return proposal_id


async def approve_own(admin_url: str, author_token: str, proposal_id: int) -> str:
    """The author, who holds the approver role too, approves their own proposal: what the API
    answers (four-eyes refuses it, whatever the roles)."""
    headers = {"authorization": f"Bearer {author_token}"}
    async with httpx.AsyncClient(base_url=admin_url, headers=headers, timeout=30) as api:
        proposal = await api.get(f"/v1/proposals/{proposal_id}")
        if proposal.status_code != 200:
            return f"HTTP {proposal.status_code}"
        reply = await api.post(
            f"/v1/proposals/{proposal_id}/approve", json={"version": proposal.json()["version"]}
        )
    if reply.status_code == 200:
        return "approved (four-eyes did not hold!)"
    message = reply.json().get("message", "") if reply.content else ""
    return f"refused, HTTP {reply.status_code}: {message}"


__all__ = [
    "CLIENTS",
    "PEOPLE",
    "approve_own",
    "client_traffic",
    "fill",
    "issue_tokens",
    "key_holder",
    "propose",
    "restore",
    "scenario",
    "signing_keys",
    "steady_load",
    "write_tokens",
]
