"""Several GTM nodes on one PostgreSQL: quorum, operator controls and published documents reach
every node through the shared database; a node that loses the database keeps answering."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import delete, func, select, update

from gtm.admin import lifecycle, principals
from gtm.admin.permissions import Role
from gtm.admin.signer import PRIVATE_NAME, PUBLIC_NAME, generate, load_signer
from gtm.audit.schema import control_head, control_log, region_events
from gtm.control.log import ControlLog
from gtm.decision.snapshot import HealthState
from gtm.fleet import shared_state
from gtm.fleet.observation_seal import KEY_NAME, NodeKey, load_or_create_node_key
from gtm.fleet.region_state import Force, Observation
from gtm.fleet.signed_documents import Manifest, content_digest
from gtm.runtime import Runtime
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES
from tests.support.balancer import SECRET, FakeBalancer
from tests.support.control import KeyHolder
from tests.support.postgres import postgres_database
from tests.support.tamper import triggers_off
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import eventually

# The nodes' probes and syncs run every 0.2 s and the tests hold them to seconds (controls in
# force everywhere within two): measured alone, not beside other tests' load (`make test`).
pytestmark = [pytest.mark.postgres, pytest.mark.timing]

SYNC_S = 0.2


@pytest.fixture
def database_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


@pytest.fixture
async def balancers(tmp_path: Path) -> AsyncIterator[tuple[Path, dict[str, FakeBalancer]]]:
    found: dict[str, FakeBalancer] = {}
    data: dict[str, Any] = yaml.safe_load(DEMO.read_text())
    data.setdefault("routing", {})["readmit_window_s"] = 0
    for region in data["regions"]:
        b = found[region["id"]] = FakeBalancer(region["id"])
        await b.start()
        region["probe_url"] = f"http://127.0.0.1:{b.port}/gtm/capacity"
    config = tmp_path / "topology.yaml"
    config.write_text(yaml.safe_dump(data))
    yield config, found
    for b in found.values():
        await b.stop()


def node_settings(tmp_path: Path, config: Path, url: str, node: str, **extra: Any) -> Settings:
    if not (tmp_path / "keys" / PRIVATE_NAME).exists():
        generate(tmp_path / "keys")  # the pair the tests' admin service signs with
    return Settings(
        config=config,
        policies=(POLICIES,),
        database_url=url,
        spool_dir=tmp_path / f"spool-{node}",
        node_id=node,
        probe_interval_s=0.2,
        probe_timeout_s=0.15,
        health_rise=2,
        health_fall=3,
        report_secret=SECRET,
        document_keys=(tmp_path / "keys" / PUBLIC_NAME,),
        state_sync_interval_s=SYNC_S,
        health_observation_max_age_s=1.0,
        audit_flush_interval_s=0.2,
        # Several nodes without a membership, each counting its own probes: on purpose here
        # (the membership's own tests are in test_signed_observations).
        **({"fleet_standalone_health": True} | extra),
    )


@pytest.fixture
async def nodes(
    tmp_path: Path,
    balancers: tuple[Path, dict[str, FakeBalancer]],
    database_url: str,
    geoip_path: Path,
) -> AsyncIterator[list[Runtime]]:
    config, _ = balancers
    runtimes = [
        Runtime(
            node_settings(tmp_path, config, database_url, n, geoip_path=geoip_path, health_quorum=2)
        )
        for n in ("node-a", "node-b")
    ]
    for r in runtimes:
        await r.start()
    yield runtimes
    for r in runtimes:
        await r.stop()


def state(runtime: Runtime, region: str) -> HealthState | None:
    health = runtime.store.current.health.get(region)
    return health.state if health is not None else None


async def until(check: Callable[[], bool], within: float) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > within:
            raise AssertionError(f"not within {within} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


@pytest.fixture
async def members(
    tmp_path: Path,
    balancers: tuple[Path, dict[str, FakeBalancer]],
    database_url: str,
    geoip_path: Path,
) -> AsyncIterator[tuple[list[Runtime], dict[str, NodeKey]]]:
    """Two running nodes in a membership of five (the signed topology's fleet.members): the
    other three members' keys are held by the test, which speaks for them."""
    config, _ = balancers
    keys = {
        n: load_or_create_node_key(tmp_path / f"spool-{n}" / KEY_NAME)
        for n in ("node-a", "node-b", "node-c", "node-d", "node-e")
    }
    data = yaml.safe_load(config.read_text())
    data["fleet"] = {"members": [{"id": n, "public_key": k.public_hex} for n, k in keys.items()]}
    config.write_text(yaml.safe_dump(data))
    runtimes = [
        Runtime(
            node_settings(tmp_path, config, database_url, n, geoip_path=geoip_path, health_quorum=2)
        )
        for n in ("node-a", "node-b")
    ]
    for r in runtimes:
        await r.start()
    yield runtimes, {n: k for n, k in keys.items() if n not in ("node-a", "node-b")}
    for r in runtimes:
        await r.stop()


async def test_a_majority_of_the_membership_decides(
    members: tuple[list[Runtime], dict[str, NodeKey]],
) -> None:
    """Only members' signed observations vote (gtm.fleet.observation_seal), and a state needs a
    majority of the five: the two running nodes' own probes are two votes of the three needed.
    (Before observations were signed, any row naming any node voted: see
    test_signed_observations.)"""
    nodes, peers = members
    a, b = nodes

    async def peers_say(state_: HealthState, *names: str) -> None:
        now = time.time()
        await shared_state.write_observations(
            a.engine,
            [peers[p].seal(Observation(p, "eu-central", state_, now, now)) for p in names],
        )

    async def say_until(state_: HealthState, names: tuple[str, ...], want: HealthState) -> None:
        deadline = time.monotonic() + 8
        while not (state(a, "eu-central") is want and state(b, "eu-central") is want):
            if time.monotonic() > deadline:
                raise AssertionError(f"not {want} within 8 s")
            await peers_say(state_, *names)
            await asyncio.sleep(SYNC_S)

    # The two nodes' probes and one more member say up: up on both.
    await say_until(HealthState.UP, ("node-c",), HealthState.UP)
    # One member says down against two: no majority for down.
    for _ in range(5):
        await peers_say(HealthState.DOWN, "node-c")
        await asyncio.sleep(SYNC_S)
    assert state(a, "eu-central") is HealthState.UP and state(b, "eu-central") is HealthState.UP
    # Three members say down against two: down on both nodes, though their own probes say up.
    await say_until(HealthState.DOWN, ("node-c", "node-d", "node-e"), HealthState.DOWN)
    # They see it up again: up again.
    await say_until(HealthState.UP, ("node-c", "node-d", "node-e"), HealthState.UP)

    async def recorded() -> dict[str, int]:
        async with a.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(region_events.c.node, func.count())
                    .where(
                        region_events.c.region == "eu-central",
                        region_events.c.kind == "in_force",
                    )
                    .group_by(region_events.c.node)
                )
            ).all()
        return {str(node): int(n) for node, n in rows}

    # unknown -> up -> down -> up, recorded by each node. Waited for in the database: an empty
    # queue is not yet a committed append (the sync takes events off it before appending).
    want = {"node-a": 3, "node-b": 3}
    seen: list[dict[str, int]] = []

    async def all_recorded() -> bool:
        seen.append(await recorded())
        return seen[-1] == want

    with contextlib.suppress(AssertionError):
        await eventually(all_recorded, 10, "every state change recorded")
    assert seen[-1] == want
    assert all(n.book.gate is not None and not n.book.gate.refused for n in nodes)


async def test_a_control_log_rolled_back_is_refused_by_every_node_which_keeps_its_state(
    nodes: list[Runtime], tmp_path: Path
) -> None:
    """Both nodes hold the drain they verified; the attacker deletes its entry and moves the
    head back; each node refuses the log (loudly) and keeps draining, and a node restarted on
    the same disk refuses it too, from its mark."""
    a, b = nodes
    holder = KeyHolder(tmp_path / "keys")
    await holder.amend(a.engine, "us-east", actor="ops", reason="upgrade", now=time.time(),
                       drain=True)  # fmt: skip
    for n in nodes:
        await until(lambda n=n: state(n, "us-east") is HealthState.DRAINING, 2)  # type: ignore[misc]
    async with a.engine.begin() as conn:
        newest = (await conn.execute(select(func.max(control_log.c.seq)))).scalar_one()
        previous = (
            await conn.execute(
                select(control_log.c.entry_hash).where(control_log.c.seq == newest - 1)
            )
        ).scalar_one_or_none() or "0" * 64  # the genesis hash when it was the first entry
        await triggers_off(conn)
        await conn.execute(delete(control_log).where(control_log.c.seq == newest))
        await conn.execute(update(control_head).values(seq=newest - 1, last_hash=previous))
    for n in nodes:
        await until(lambda n=n: n.sync.control.refusal is not None, 2)  # type: ignore[misc]
        assert "cut back" in (n.sync.control.refusal or "")
        assert state(n, "us-east") is HealthState.DRAINING
    again = Runtime(b.settings)
    await again.start()
    try:
        # From its own copy of the log, verified again: the drain it accepted stays in force.
        assert again.sync.control.refusal is not None and "cut back" in again.sync.control.refusal
        assert state(again, "us-east") is HealthState.DRAINING
    finally:
        await again.stop()


async def test_operator_controls_reach_every_node_within_two_seconds(
    nodes: list[Runtime], tmp_path: Path
) -> None:
    a, b = nodes
    for n in nodes:
        await until(lambda n=n: state(n, "us-east") is HealthState.UP, 5)  # type: ignore[misc]
    holder = KeyHolder(tmp_path / "keys")  # the nodes trust its public key (document_keys)
    await holder.amend(
        a.engine, "us-east", actor="ops", reason="GPU driver upgrade", now=time.time(), drain=True
    )
    for n in nodes:
        took = await until(lambda n=n: state(n, "us-east") is HealthState.DRAINING, 2)  # type: ignore[misc]
        assert took < 2
    await holder.amend(
        a.engine,
        "us-east",
        actor="ops",
        reason="probe false positive",
        now=time.time(),
        drain=False,
        force=Force.DOWN,
        force_for_s=1.0,
        weight=0.25,
    )
    await until(lambda: state(b, "us-east") is HealthState.DOWN, 2)
    assert b.store.current.regions["us-east"].weight == 0.25
    # The forced state lapses by itself; the weight stays until cleared.
    await until(lambda: state(b, "us-east") is HealthState.UP, 3)
    assert b.store.current.regions["us-east"].weight == 0.25
    await holder.clear(a.engine, "us-east", actor="ops", reason="done", now=time.time())
    await until(lambda: b.store.current.regions["us-east"].weight == 1.0, 2)
    events = await shared_state.read_events(a.engine, "us-east")
    operator_events = [
        (e.actor, e.reason, e.detail.split(":")[0]) for e in events if e.kind == "override"
    ]
    assert ("ops", "GPU driver upgrade", "set") in operator_events
    assert ("ops", "done", "cleared") in operator_events
    assert any(d == "lapsed" for _, _, d in operator_events)


async def test_an_approved_version_is_in_force_on_every_node_within_two_seconds(
    nodes: list[Runtime], balancers: tuple[Path, dict[str, FakeBalancer]], tmp_path: Path
) -> None:
    config, _ = balancers
    data = yaml.safe_load(config.read_text())
    data["routing"]["degraded_ttl"] = 7
    policies = {p.name: p.read_text() for p in sorted(POLICIES.glob("*.yaml"))}
    topology = yaml.safe_dump(data)
    before = [n.store.current.topology.fingerprint() for n in nodes]
    key = load_signer(tmp_path / "keys" / PRIVATE_NAME)
    seal = ControlLog({}, key, public=key.public_key())
    engine, now = nodes[0].engine, time.time()
    await seal.refresh(engine)
    async with engine.begin() as conn:
        alice = await principals.create(
            conn, "alice", [Role.POLICY_AUTHOR], created_by="t", now=now, node="t", control=seal
        )
        bob = await principals.create(
            conn, "bob", [Role.POLICY_APPROVER], created_by="t", now=now, node="t", control=seal
        )
        p = await lifecycle.create(
            conn, alice, topology, policies, "shorter TTL",
            required_approvals=1, now=now, node="t", control=seal,
        )  # fmt: skip
        await lifecycle.submit(conn, p.id, alice, now=now, node="t", control=seal)
        await lifecycle.approve(conn, p.id, bob, p.version, "", now=now, node="t", control=seal)
    started = time.monotonic()
    async with engine.begin() as conn:
        await lifecycle.activate(conn, p.id, bob, key, now=time.time(), node="t", control=seal)
    for n in nodes:
        await until(lambda n=n: n.store.current.topology.routing.degraded_ttl == 7, 2)  # type: ignore[misc]
    assert time.monotonic() - started < 2
    assert [n.store.current.topology.fingerprint() for n in nodes] != before
    assert all(n.document_sequence == 1 for n in nodes)
    # And both say so in the shared database: the rollout the admin API reports is complete.
    while time.monotonic() - started < 2:
        live = await shared_state.read_node_status(engine, time.time() - 5)
        if {s.node: s.document_sequence for s in live} == {"node-a": 1, "node-b": 1}:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError(f"not acknowledged by both nodes within 2 s: {live}")
    # A broken document, even one signed with the real key (an admin-service bug), is refused
    # by every node, which keeps what it has.
    broken = "zone: ["
    manifest, signature = key.sign(
        Manifest(
            content_digest(broken, policies), 2, p.id, "alice", ("bob",), 1, now, "bob", "", ""
        )
    )
    async with engine.begin() as conn:
        await shared_state.publish(
            conn, broken, policies, "e" * 32, "ops", "typo", time.time(),
            manifest=manifest, signature=signature,
        )  # fmt: skip
    await asyncio.sleep(3 * SYNC_S)
    assert all(n.store.current.topology.routing.degraded_ttl == 7 for n in nodes)
    assert all(n.document_sequence == 1 for n in nodes)


async def test_a_node_that_loses_the_database_keeps_answering_and_catches_up(
    tmp_path: Path,
    balancers: tuple[Path, dict[str, FakeBalancer]],
    database_url: str,
    geoip_path: Path,
) -> None:
    config, fake = balancers
    from sqlalchemy.engine import make_url

    real = make_url(database_url)
    proxy = TcpProxy(real.host or "127.0.0.1", real.port or 5432)
    await proxy.start()
    via_proxy = real.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    node = Runtime(node_settings(tmp_path, config, via_proxy, "node-a", geoip_path=geoip_path))
    await node.start()
    try:
        await until(lambda: state(node, "eu-west") is HealthState.UP, 5)
        assert node.sync.age_s < 1
        await proxy.stop()  # the database goes away (connections cut, new ones refused)
        await until(lambda: node.sync.age_s > 2, 6)
        # Its own probes still decide: a region failing now is routed around.
        await fake["eu-west"].stop()
        await until(lambda: state(node, "eu-west") is HealthState.DOWN, 3)
        assert node.sync.unsent, "the state change waits in memory for the database"
        await proxy.start()
        await until(lambda: node.sync.age_s < 1, 8)
        await until(lambda: not node.sync.unsent, 10)
    finally:
        await node.stop()
        await proxy.stop()
    events = await shared_state_events(database_url)
    assert ("node-a", "eu-west", "down") in events


async def shared_state_events(url: str) -> set[tuple[str, str, str | None]]:
    from gtm.audit.database import make_async_engine

    engine = make_async_engine(url)
    try:
        return {(e.node, e.region, e.state) for e in await shared_state.read_events(engine)}
    finally:
        await engine.dispose()


async def test_a_node_started_while_the_database_is_away_answers_and_migrates_when_it_is_back(
    tmp_path: Path,
    balancers: tuple[Path, dict[str, FakeBalancer]],
    database_url: str,
    geoip_path: Path,
) -> None:
    from ipaddress import ip_address

    from sqlalchemy.engine import make_url

    from gtm.audit import migrate, query
    from gtm.audit.database import make_async_engine
    from gtm.audit.record import record_of
    from gtm.decision.routing import Channel, DecisionRequest, decide

    config, _ = balancers
    real = make_url(database_url)
    proxy = TcpProxy(real.host or "127.0.0.1", real.port or 5432)
    await proxy.start()
    await proxy.stop()  # the address is known, nothing answers there yet
    via_proxy = real.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    node = Runtime(node_settings(tmp_path, config, via_proxy, "node-a", geoip_path=geoip_path))
    await node.start()  # does not fail: the node answers from its own files
    try:
        assert not node.migrated
        snapshot = node.store.current
        for i in range(20):
            req = DecisionRequest(Channel.DNS, ip_address(f"198.51.100.{i}"), "chat", "chat")
            node.count(record_of(decide(req, snapshot, 0.0), channel="dns", name="chat"))
        await asyncio.sleep(0.5)  # flushes fail meanwhile; the spool keeps the rows
        await proxy.start()
        await until(lambda: node.migrated, 6)
        assert migrate.current_revision(database_url) == migrate.head_revision(database_url)
    finally:
        await node.stop()
        await proxy.stop()
    engine = make_async_engine(database_url)
    try:
        assert await query.total_count(engine) == 20
    finally:
        await engine.dispose()
