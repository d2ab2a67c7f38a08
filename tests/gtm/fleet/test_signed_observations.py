"""Health from known nodes only (DESIGN.md rule 6; issue 31): a row of ``health_observations``
moves traffic only when a member of the signed topology's membership signed all of it, with the
key the membership names, dated within a bound of the reader's clock.

The attacker here holds the database (every row of every table) but no key file. Nodes run on
a real SQLite file; the sync is driven by hand (``sync_once``) where one step is the point, and
two nodes run their own probes and syncs where the whole loop is.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY
from sqlalchemy import insert, select, update

from gtm.audit.schema import health_observations
from gtm.decision.model import Channel, DecisionRequest
from gtm.decision.routing import decide
from gtm.decision.snapshot import HealthState
from gtm.decision.topology import load_topology, parse_topology
from gtm.errors import ConfigError
from gtm.fleet import observation_seal, shared_state
from gtm.fleet.observation_seal import (
    FROM_SETTINGS,
    FROM_TOPOLOGY,
    SELF_ONLY,
    NodeKey,
    load_or_create_node_key,
    membership,
)
from gtm.fleet.region_state import Observation
from gtm.runtime import Runtime
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES
from tests.support.balancer import SECRET, FakeBalancer
from tests.support.ports import free_tcp_udp_port

TEN_YEARS_S = 10 * 365 * 86_400
PEM_BEGIN = "-----BEGIN PUBLIC KEY-----"
FRANKFURT = ip_address("198.51.100.7")  # an EU client: chat.eu answers it from eu-central


def chat_eu(node: Runtime) -> str | None:
    """The region ``chat.eu`` answers a Frankfurt client with, from the node's snapshot."""
    request = DecisionRequest(Channel.DNS, FRANKFURT, "chat-eu", "chat.eu.gtm.example.")
    return decide(request, node.store.current, time.time()).region


def refused(reason: str) -> float:
    labels = {"reason": reason}
    return REGISTRY.get_sample_value("gtm_health_observations_refused_total", labels) or 0.0


def topology_file(tmp_path: Path, members: dict[str, str] | None, **probe_urls: str) -> Path:
    """The demo topology with ``members`` (id -> public key) as its fleet membership."""
    data: dict[str, Any] = yaml.safe_load(DEMO.read_text())
    data.setdefault("routing", {})["readmit_window_s"] = 0
    for region in data["regions"]:
        region.pop("probe_url", None)  # only the regions given are probed
        if region["id"] in probe_urls:
            region["probe_url"] = probe_urls[region["id"]]
    if members is not None:
        data["fleet"] = {"members": [{"id": n, "public_key": k} for n, k in members.items()]}
    path = tmp_path / f"topology-{len(list(tmp_path.glob('topology-*')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def node_settings(
    tmp_path: Path, node: str, config: Path, geoip_path: Path, **extra: Any
) -> Settings:
    values: dict[str, Any] = {
        "config": config,
        "policies": (POLICIES,),
        "database_url": f"sqlite:///{tmp_path / 'gtm.sqlite3'}",
        "spool_dir": tmp_path / f"spool-{node}",
        "node_id": node,
        "geoip_path": geoip_path,
        "probes": False,
        # The tests below sync by hand; the loop's own syncs do not matter to them.
        "state_sync_interval_s": 60.0,
        "health_observation_max_age_s": 60.0,
        "audit_flush_interval_s": 0.2,
        "fence_after_s": 0,
    }
    return Settings(**(values | extra))


def peer_key(tmp_path: Path, name: str) -> NodeKey:
    """A member's key as that member's node makes it (its own 0600 file)."""
    return load_or_create_node_key(tmp_path / "peers" / name / observation_seal.KEY_NAME)


def own_key_hex(tmp_path: Path, node: str) -> str:
    """A node's public key, made before it first starts (as an operator would, to list it)."""
    path = tmp_path / f"spool-{node}" / observation_seal.KEY_NAME
    return load_or_create_node_key(path).public_hex


@pytest.fixture
async def started() -> AsyncIterator[Callable[[Settings], Any]]:
    runtimes: list[Runtime] = []

    async def start(settings: Settings) -> Runtime:
        runtime = Runtime(settings)
        await runtime.start()
        runtimes.append(runtime)
        return runtime

    yield start
    for runtime in reversed(runtimes):
        await runtime.stop()


@pytest.fixture
def peers(tmp_path: Path) -> dict[str, NodeKey]:
    return {name: peer_key(tmp_path, name) for name in ("peer-b", "peer-c")}


@pytest.fixture
async def member_node(
    tmp_path: Path, geoip_path: Path, peers: dict[str, NodeKey], started: Any
) -> Runtime:
    """node-a, probes off, in a membership of three (node-a, peer-b, peer-c; the keys of the
    last two held by the test): a region's state needs two members' verified words."""
    members = {"node-a": own_key_hex(tmp_path, "node-a")}
    members |= {name: key.public_hex for name, key in peers.items()}
    # One key as PEM, the others as raw hex: the topology takes either.
    members["peer-c"] = peers["peer-c"].public_pem
    node: Runtime = await started(
        node_settings(tmp_path, "node-a", topology_file(tmp_path, members), geoip_path)
    )
    assert node.book.gate is not None and node.book.gate.membership.source == FROM_TOPOLOGY
    assert chat_eu(node) == "eu-central"
    return node


def signed(
    key: NodeKey, node: str, region: str, state: HealthState, at: float | None = None
) -> Observation:
    at = time.time() if at is None else at
    return key.seal(Observation(node, region, state, at - 30, at, "probe says so"))


async def write(node: Runtime, *observations: Observation) -> None:
    await shared_state.write_observations(node.engine, observations)


async def synced(node: Runtime) -> None:
    assert await node.sync.sync_once()


# The named attack ---------------------------------------------------------------------------


@pytest.mark.parametrize("configured", ["nothing configured", "a membership in the topology"])
async def test_forged_rows_from_unknown_nodes_dated_ten_years_ahead_do_not_move_traffic(
    tmp_path: Path, geoip_path: Path, started: Any, configured: str
) -> None:
    """Issue 31, "Regions taken down by made-up observers": two rows inserted in SQL, from
    nodes that do not exist, dated ten years ahead, with probes off. Before, they took
    eu-central down and chat.eu moved to eu-west, until a restart."""
    members = None
    if configured != "nothing configured":
        members = {"node-a": own_key_hex(tmp_path, "node-a")}
    config = topology_file(tmp_path, members)
    node: Runtime = await started(node_settings(tmp_path, "node-a", config, geoip_path))
    assert chat_eu(node) == "eu-central"
    before = refused("not a member")
    later = int((time.time() + TEN_YEARS_S) * 1_000_000)
    async with node.engine.begin() as conn:
        await conn.execute(
            insert(health_observations),
            [
                {
                    "node": ghost,
                    "region": "eu-central",
                    "state": "down",
                    "since_us": later,
                    "observed_at_us": later,
                    "detail": "connect timeout",
                }
                for ghost in ("gtm-ghost-1", "gtm-ghost-2")
            ],
        )
    for _ in range(3):
        await synced(node)
        assert chat_eu(node) == "eu-central"
        assert node.store.current.health["eu-central"].state is not HealthState.DOWN
    assert refused("not a member") - before == 6


# A member's word counts; anything else of it does not ---------------------------------------


async def test_a_members_signed_observations_count_toward_the_quorum(
    member_node: Runtime, peers: dict[str, NodeKey]
) -> None:
    node = member_node
    await write(node, signed(peers["peer-b"], "peer-b", "eu-central", HealthState.DOWN))
    await synced(node)
    assert chat_eu(node) == "eu-central", "one member of three is not a majority"
    await write(node, signed(peers["peer-c"], "peer-c", "eu-central", HealthState.DOWN))
    await synced(node)
    assert node.store.current.health["eu-central"].state is HealthState.DOWN
    assert chat_eu(node) == "eu-west"
    assert node.book.gate is not None and not node.book.gate.refused


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("state", "up"),
        ("detail", "all good"),
        ("since_us", 1),
        ("observed_at_us", None),  # moved a second later: fresher than it was signed
    ],
)
async def test_a_members_row_edited_in_sql_is_refused(
    member_node: Runtime, peers: dict[str, NodeKey], column: str, value: object
) -> None:
    node = member_node
    for name, key in peers.items():
        await write(node, signed(key, name, "eu-central", HealthState.DOWN))
    await synced(node)
    assert chat_eu(node) == "eu-west"
    # Both rows edited: peer-b's and peer-c's signatures no longer cover what the rows say.
    before = refused("bad signature")
    change = (
        {column: health_observations.c.observed_at_us + 1_000_000}
        if value is None
        else {column: value}
    )
    async with node.engine.begin() as conn:
        await conn.execute(update(health_observations).values(**change))
    await synced(node)
    # Nothing of theirs counts now: no quorum for anything, the state stays as it was, and
    # nothing an edit says (up, another detail, other times) is taken.
    assert refused("bad signature") - before == 2
    health = node.store.current.health["eu-central"]
    assert health.state is HealthState.DOWN
    assert "all good" not in health.detail


async def test_a_row_copied_to_another_region_or_node_is_refused(
    member_node: Runtime, peers: dict[str, NodeKey]
) -> None:
    node = member_node
    # Each member truly says eu-west is down (not a region chat.eu answers this client from).
    for name, key in peers.items():
        await write(node, signed(key, name, "eu-west", HealthState.DOWN))
    await synced(node)
    assert node.store.current.health["eu-west"].state is HealthState.DOWN
    before = refused("bad signature")
    # Their signed rows copied, signature and all, to eu-central.
    async with node.engine.begin() as conn:
        rows = (await conn.execute(select(health_observations))).mappings().all()
        await conn.execute(
            insert(health_observations), [dict(r) | {"region": "eu-central"} for r in rows]
        )
    await synced(node)
    assert chat_eu(node) == "eu-central"
    assert refused("bad signature") - before == 2
    # peer-b's true word on eu-central, and a copy of it under peer-c's name: one vote.
    await write(node, signed(peers["peer-b"], "peer-b", "eu-central", HealthState.DOWN))
    async with node.engine.begin() as conn:
        row = (
            (
                await conn.execute(
                    select(health_observations).where(
                        health_observations.c.node == "peer-b",
                        health_observations.c.region == "eu-central",
                    )
                )
            )
            .mappings()
            .one()
        )
        await conn.execute(
            update(health_observations)
            .where(
                health_observations.c.node == "peer-c",
                health_observations.c.region == "eu-central",
            )
            .values({k: v for k, v in row.items() if k not in ("node", "region")})
        )
    await synced(node)
    assert chat_eu(node) == "eu-central"
    assert node.store.current.health["eu-central"].state is not HealthState.DOWN


async def test_a_far_future_row_is_refused_even_when_signed(
    member_node: Runtime, peers: dict[str, NodeKey]
) -> None:
    """A member's own key cannot make a row that stays fresh for an hour (or ten years): the
    reader bounds the date by its own clock (GTM_HEALTH_MAX_FUTURE_S)."""
    node = member_node
    before = refused("dated in the future")
    ahead = time.time() + 3600
    for name, key in peers.items():
        await write(node, signed(key, name, "eu-central", HealthState.DOWN, at=ahead))
    await synced(node)
    assert chat_eu(node) == "eu-central"
    assert refused("dated in the future") - before == 2


async def test_an_older_row_put_back_is_refused(
    member_node: Runtime, peers: dict[str, NodeKey]
) -> None:
    node = member_node
    now = time.time()
    older = [signed(k, n, "eu-central", HealthState.UP, at=now - 1) for n, k in peers.items()]
    await write(node, *older)
    await synced(node)
    for name, key in peers.items():
        await write(node, signed(key, name, "eu-central", HealthState.DOWN, at=now))
    await synced(node)
    assert chat_eu(node) == "eu-west"
    before = refused("older than one accepted")
    await write(node, *older)  # the attacker kept the older rows and puts them back
    await synced(node)
    assert chat_eu(node) == "eu-west"
    assert refused("older than one accepted") - before == 2


async def test_hostile_rows_never_stop_a_sync_and_the_rest_is_used(
    member_node: Runtime, peers: dict[str, NodeKey]
) -> None:
    node = member_node
    before = refused("malformed")
    for name, key in peers.items():
        await write(node, signed(key, name, "eu-central", HealthState.DOWN))
    now_us = int(time.time() * 1_000_000)
    async with node.engine.begin() as conn:
        await conn.execute(
            insert(health_observations),
            [
                {"node": "peer-b", "region": "us-east", "state": "exploded",
                 "since_us": now_us, "observed_at_us": now_us, "detail": "",
                 "signature": None, "key_id": None},
                {"node": "peer-c", "region": "us-east", "state": "down",
                 "since_us": now_us, "observed_at_us": now_us, "detail": "x" * 10_000,
                 "signature": "zz", "key_id": "k"},
                {"node": "x" * 64, "region": "us-west", "state": "down",
                 "since_us": now_us, "observed_at_us": now_us, "detail": "",
                 "signature": "00" * 64, "key_id": None},
            ],
        )  # fmt: skip
    await synced(node)
    assert chat_eu(node) == "eu-west"  # the members' true words still count
    assert refused("malformed") - before == 2
    assert node.store.current.health["us-east"].state is not HealthState.DOWN


# Two nodes, their own probes -----------------------------------------------------------------


async def until(check: Callable[[], bool], within: float) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within} s")
        await asyncio.sleep(0.02)


async def test_two_nodes_on_one_sqlite_file_count_each_others_signed_observations(
    tmp_path: Path, geoip_path: Path, started: Any
) -> None:
    """A membership of two: every state needs both nodes' words, so each node's region state
    moves only through its peer's signed, verified observations read from the shared file."""
    balancer = FakeBalancer("eu-central")
    await balancer.start()
    try:
        members = {n: own_key_hex(tmp_path, n) for n in ("node-a", "node-b")}
        url = f"http://127.0.0.1:{balancer.port}/gtm/capacity"
        config = topology_file(tmp_path, members, **{"eu-central": url})
        extra = {
            "probes": True,
            "probe_interval_s": 0.2,
            "probe_timeout_s": 0.15,
            "health_rise": 2,
            "health_fall": 3,
            "report_secret": SECRET,
            "state_sync_interval_s": 0.2,
            "health_observation_max_age_s": 5.0,
        }
        nodes: list[Runtime] = [
            await started(node_settings(tmp_path, n, config, geoip_path, **extra))
            for n in ("node-a", "node-b")
        ]

        def everywhere(state: HealthState) -> Callable[[], bool]:
            return lambda: all(n.store.current.health["eu-central"].state is state for n in nodes)

        # Up needs both words: each node took its peer's.
        await until(everywhere(HealthState.UP), 15)
        await balancer.stop()
        await until(everywhere(HealthState.DOWN), 15)
        assert all(chat_eu(n) == "eu-west" for n in nodes)
        for n in nodes:
            gate = n.book.gate
            assert gate is not None
            assert not gate.refused, gate.refused
            assert "2/2 nodes" in n.store.current.health["eu-central"].detail
    finally:
        await balancer.stop()


async def test_a_node_alone_decides_from_its_own_probes_out_of_the_box(
    tmp_path: Path, geoip_path: Path, started: Any
) -> None:
    balancer = FakeBalancer("eu-central")
    await balancer.start()
    try:
        url = f"http://127.0.0.1:{balancer.port}/gtm/capacity"
        config = topology_file(tmp_path, None, **{"eu-central": url})
        node: Runtime = await started(
            node_settings(
                tmp_path, "solo", config, geoip_path,
                probes=True, probe_interval_s=0.2, probe_timeout_s=0.15,
                report_secret=SECRET, state_sync_interval_s=0.2,
            )
        )  # fmt: skip
        assert node.book.gate is not None and node.book.gate.membership.source == SELF_ONLY
        key = tmp_path / "spool-solo" / observation_seal.KEY_NAME
        assert key.stat().st_mode & 0o777 == 0o600
        await until(lambda: node.store.current.health["eu-central"].state is HealthState.UP, 15)
        await balancer.stop()
        await until(lambda: chat_eu(node) == "eu-west", 15)
        # Its own rows in the database are signed with its key.
        async with node.engine.connect() as conn:
            rows = (await conn.execute(select(health_observations))).mappings().all()
        assert rows and all(r["signature"] and r["node"] == "solo" for r in rows)
    finally:
        await balancer.stop()


async def test_a_second_node_without_a_membership_refuses_to_start_saying_why(
    tmp_path: Path, geoip_path: Path, started: Any
) -> None:
    """Several nodes on one database and no membership: each would decide region health from
    its own probes alone, so one with a broken probe path (a restarting one first of all)
    fails its regions over (issue 33: a Berlin client sent to six regions in turn). The old
    node started all the same; now the second one refuses, naming the first and the fix."""
    config = topology_file(tmp_path, None)
    quick = {"state_sync_interval_s": 0.2}
    await started(node_settings(tmp_path, "node-a", config, geoip_path, **quick))
    with pytest.raises(ConfigError) as refusal:
        await started(node_settings(tmp_path, "node-b", config, geoip_path, **quick))
    said = str(refusal.value)
    assert "node-a" in said and "fleet.members" in said and "GTM_HEALTH_MEMBERS" in said
    # Alone on purpose: said so, and it starts.
    alone = node_settings(
        tmp_path, "node-b", config, geoip_path, fleet_standalone_health=True, **quick
    )
    assert (await started(alone)).book.gate is not None


async def test_a_member_restarting_with_broken_probes_is_outvoted_from_its_first_answer(
    tmp_path: Path, geoip_path: Path, peers: dict[str, NodeKey], started: Any
) -> None:
    """The safe configuration: a membership of three. node-b restarts with a probe path that
    reaches nothing; before its own probes can say anything it has read its peers' signed
    words (the first sync comes before the first probe), and once they say the region is down
    it is outvoted: it keeps answering from eu-central."""
    balancer = FakeBalancer("eu-central")
    await balancer.start()
    try:
        members = {n: own_key_hex(tmp_path, n) for n in ("node-a", "node-b")}
        members["peer-c"] = peers["peer-c"].public_hex
        good = f"http://127.0.0.1:{balancer.port}/gtm/capacity"
        probing = {
            "probes": True, "probe_interval_s": 0.2, "probe_timeout_s": 0.15,
            "health_rise": 2, "health_fall": 3, "report_secret": SECRET,
            "state_sync_interval_s": 0.2, "health_observation_max_age_s": 60.0,
        }  # fmt: skip
        a_config = topology_file(tmp_path, members, **{"eu-central": good})
        node_a: Runtime = await started(
            node_settings(tmp_path, "node-a", a_config, geoip_path, **probing)
        )
        await write(node_a, signed(peers["peer-c"], "peer-c", "eu-central", HealthState.UP))
        a_prober = node_a.prober
        assert a_prober is not None
        await until(lambda: a_prober.health["eu-central"].state is HealthState.UP, 15)
        await node_a.sync.sync_once()  # its word is in the database
        assert node_a.store.current.health["eu-central"].state is HealthState.UP
        # node-b's probe path is broken: its probes reach a port nobody listens on.
        dead = f"http://127.0.0.1:{free_tcp_udp_port()}/gtm/capacity"
        b_config = topology_file(tmp_path, members, **{"eu-central": dead})
        node_b: Runtime = await started(
            node_settings(tmp_path, "node-b", b_config, geoip_path, **probing)
        )
        assert node_b.store.current.health["eu-central"].state is HealthState.UP
        assert chat_eu(node_b) == "eu-central"
        prober = node_b.prober
        assert prober is not None
        await until(lambda: prober.health["eu-central"].state is HealthState.DOWN, 15)
        await node_b.sync.sync_once()
        assert node_b.store.current.health["eu-central"].state is HealthState.UP
        assert chat_eu(node_b) == "eu-central"
    finally:
        await balancer.stop()


# Membership configuration --------------------------------------------------------------------


def test_bad_membership_yaml_lists_every_problem(tmp_path: Path) -> None:
    good = peer_key(tmp_path, "ok").public_hex
    data: dict[str, Any] = yaml.safe_load(DEMO.read_text())
    data["fleet"] = {
        "members": [
            {"id": "gtm-1", "public_key": "not-a-key"},
            {"id": "gtm-2", "public_key": good[:-2]},  # 31 bytes
            {"id": "gtm-3", "public_key": f"{PEM_BEGIN}\nAAAA\n-----END PUBLIC KEY-----"},
            {"id": "gtm 4", "public_key": good},
            {"id": "gtm-5"},
        ]
    }  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        parse_topology(data, "topology.yaml")
    where = {p.location: p.message for p in caught.value.problems}
    assert set(where) == {
        "fleet.members[0].public_key",
        "fleet.members[1].public_key",
        "fleet.members[2].public_key",
        "fleet.members[3].id",
        "fleet.members[4].public_key",
    }, where
    assert "64 hex digits" in where["fleet.members[0].public_key"]
    assert "32 bytes" in where["fleet.members[1].public_key"]
    assert "PEM" in where["fleet.members[2].public_key"]
    # Whole-document checks: an id twice, a key shared by two members (one node, two votes).
    data["fleet"] = {
        "members": [
            {"id": "gtm-1", "public_key": good},
            {"id": "gtm-1", "public_key": peer_key(tmp_path, "other").public_hex},
            {"id": "gtm-2", "public_key": good},
        ]
    }
    with pytest.raises(ConfigError) as caught:
        parse_topology(data, "topology.yaml")
    messages = [f"{p.location}: {p.message}" for p in caught.value.problems]
    assert any("'gtm-1' is listed more than once" in m for m in messages), messages
    assert any("same key" in m and m.startswith("fleet.members[2]") for m in messages), messages


def test_health_members_setting_folds_in_under_the_topology(tmp_path: Path) -> None:
    own = peer_key(tmp_path, "gtm-1")
    b = peer_key(tmp_path, "gtm-2")
    # No topology membership: the setting, "ID=KEY"; a bare id other than this node's has no
    # key, so it is a member that cannot vote (and the start says so).
    m = membership((), ["gtm-1", f"gtm-2={b.public_hex}", "gtm-3"], "gtm-1", own)
    assert m.source == FROM_SETTINGS
    assert m.voters == {"gtm-1", "gtm-2", "gtm-3"} and set(m.keys) == {"gtm-1", "gtm-2"}
    assert m.keyless == ("gtm-3",)
    problems = observation_seal.membership_problems(m, "gtm-1", own, quorum=1)
    assert any("gtm-3" in p and "cannot vote" in p for p in problems)
    # A topology membership wins over the setting.
    topo = load_topology(topology_file(tmp_path, {"gtm-1": own.public_hex}))
    m = membership(topo.fleet.members, ["gtm-9"], "gtm-1", own)
    assert m.source == FROM_TOPOLOGY and m.voters == {"gtm-1"}
    # Neither: the node alone.
    assert membership((), (), "gtm-1", own).source == SELF_ONLY
    # A malformed entry is a start-up error naming it.
    with pytest.raises(ConfigError) as caught:
        membership((), ["gtm-2=abc", "=x", "gtm-1", "gtm-1"], "gtm-1", own)
    assert [p.location for p in caught.value.problems] == [
        "health_members[0]",
        "health_members[1]",
        "health_members[3]",
    ]


def test_a_node_key_is_made_once_owner_only_and_a_loose_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "k" / observation_seal.KEY_NAME
    first = load_or_create_node_key(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_or_create_node_key(path).public_hex == first.public_hex
    assert not [p for p in path.parent.iterdir() if p != path], "no temporary file left"
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="0600"):
        load_or_create_node_key(path)


def test_refusals_are_logged_at_most_once_an_interval() -> None:
    from structlog.testing import capture_logs

    t = [1000.0]
    refusals = observation_seal._RefusalLog(clock=lambda: t[0])
    with capture_logs() as logs:
        for i in range(1000):
            refusals.refuse("not a member", f"ghost-{i}", "eu-central")
        t[0] += observation_seal.LOG_EVERY_S
        refusals.refuse("bad signature", "peer-b", "eu-central")
    lines = [e for e in logs if e["event"] == "health.observations_refused"]
    assert [line["refused"] for line in lines] == [
        {"not a member": 1},
        {"not a member": 999, "bad signature": 1},
    ]


def test_a_nodes_worker_processes_sign_with_one_key(tmp_path: Path) -> None:
    from gtm.node import worker_settings

    base = Settings(node_id="gtm-1", spool_dir=tmp_path / "spool")
    workers = [worker_settings(base, i) for i in range(3)]
    # Each worker has a spool (and audit chain key) of its own, one observation key for all.
    assert len({w.spool_dir for w in workers}) == 3
    assert {w.health_key_path for w in workers} == {tmp_path / "spool" / "health-signing.key"}
