"""Anycast announcements follow the node's own health, against real BIRD daemons on loopback:
the node's speaker (127.0.0.1) and a peer (127.0.0.2) standing in for the upstream router,
whose routing table is what the world would see."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gtm.anycast import Announcer, Bird, Health, Rules, wanted
from gtm.node import Node, run_node
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES
from tests.support.ports import free_tcp_udp_port
from tests.support.waiting import eventually

PREFIX = "192.0.2.53/32"
WITHIN_S = 60.0  # a condition polled for; BGP sessions take a few seconds to come up


def test_the_rules() -> None:
    rules = Rules(fall=2, max_db_loss_s=30)
    assert wanted(Health(False, 0, 0.0), rules) == (True, "healthy")
    assert wanted(Health(True, 0, 0.0), rules)[0] is False
    assert wanted(Health(False, 1, 0.0), rules)[0] is True  # one lost check is not enough
    assert wanted(Health(False, 2, 0.0), rules)[0] is False
    assert wanted(Health(False, 0, 31.0), rules)[0] is False
    assert wanted(Health(False, 0, 10_000.0), Rules(max_db_loss_s=0))[0] is True  # 0: never


def _require_bird() -> None:
    if shutil.which("bird") is None or shutil.which("birdc") is None:
        reason = "BIRD is not installed (Debian: bird2)"
        if os.environ.get("GTM_TEST_REQUIRE_TOOLS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


@dataclass
class Peering:
    speaker: Path  # the node's BIRD control socket
    peer: Path  # the upstream router's

    def routes(self) -> str:
        out = subprocess.run(
            ["birdc", "-s", str(self.peer), "show", "route", PREFIX],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return out.stdout

    def sees_prefix(self) -> bool:
        return PREFIX in self.routes()


def _conf(router: str, local: str, lport: int, remote: str, rport: int, speaker: bool) -> str:
    static = (
        f"protocol static gtm_anycast {{ ipv4; route {PREFIX} unreachable; }}\n" if speaker else ""
    )
    channel = (
        'ipv4 { import none; export where proto = "gtm_anycast"; };'
        if speaker
        else "ipv4 { import all; export none; };"
    )
    return f"""router id {router};
protocol device {{}}
{static}protocol bgp upstream {{
  local {local} port {lport} as {65001 if speaker else 65002};
  neighbor {remote} port {rport} as {65002 if speaker else 65001};
  multihop;
  connect delay time 1; connect retry time 1; error wait time 1, 2;
  {channel}
}}
"""


@pytest.fixture
def peering(tmp_path: Path) -> Iterator[Peering]:
    _require_bird()
    a_port, b_port = free_tcp_udp_port(), free_tcp_udp_port()
    procs = []
    socks = []
    for name, conf in (
        ("speaker", _conf("10.0.0.1", "127.0.0.1", a_port, "127.0.0.2", b_port, True)),
        ("peer", _conf("10.0.0.2", "127.0.0.2", b_port, "127.0.0.1", a_port, False)),
    ):
        (tmp_path / f"{name}.conf").write_text(conf)
        sock = tmp_path / f"{name}.ctl"
        socks.append(sock)
        procs.append(
            subprocess.Popen(
                [
                    "bird",
                    "-f",
                    "-c",
                    str(tmp_path / f"{name}.conf"),
                    "-s",
                    str(sock),
                    "-P",
                    str(tmp_path / f"{name}.pid"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    try:
        yield Peering(socks[0], socks[1])
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


async def test_the_route_follows_drain_health_and_the_database(
    peering: Peering, tmp_path: Path
) -> None:
    drain = tmp_path / "drain"
    db_lost = [0.0]
    own_listener_ok = [True]

    async def check() -> bool:
        return own_listener_ok[0]

    announcer = Announcer(
        Bird(peering.speaker),
        Rules(fall=2, max_db_loss_s=30),
        db_lost_s=lambda: db_lost[0],
        check=check,
        drain_file=drain,
    )

    async def step_until(expected: bool, what: str) -> None:
        assert await announcer.step() == expected
        await eventually(lambda: peering.sees_prefix() == expected, WITHIN_S, what)

    await _step_ready(announcer)
    await step_until(True, "announced while healthy")
    drain.touch()
    await step_until(False, "withdrawn while draining")
    assert announcer.reason == "draining"
    drain.unlink()
    await step_until(True, "announced again after the drain")
    own_listener_ok[0] = False
    await announcer.step()  # one failed check: still announced
    assert peering.sees_prefix()
    await step_until(False, "withdrawn after two failed checks of its own listener")
    own_listener_ok[0] = True
    await step_until(True, "back once its listener answers")
    db_lost[0] = 45.0
    await step_until(False, "withdrawn without the database")
    db_lost[0] = 0.0
    await step_until(True, "back with the database")
    await announcer.stop()
    await eventually(lambda: not peering.sees_prefix(), WITHIN_S, "withdrawn when the node stops")


async def _step_ready(announcer: Announcer) -> None:
    """Until BIRD's control socket exists and answers."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN_S
    while True:
        try:
            await announcer.speaker.set(False)
            return
        except Exception:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.1)


@pytest.fixture
async def node_with_anycast(
    peering: Peering, tmp_path: Path, geoip_path: Path
) -> AsyncIterator[tuple[Node, asyncio.Event, asyncio.Task[None]]]:
    settings = Settings(
        config=DEMO,
        policies=(POLICIES,),
        geoip_path=geoip_path,
        database_url=f"sqlite:///{tmp_path / 'node.sqlite3'}",
        spool_dir=tmp_path / "spool",
        node_id="anycast-test",
        dns_listen=("127.0.0.1:0",),
        probes=False,
        anycast_bird_socket=peering.speaker,
        anycast_drain_file=tmp_path / "drain",
        anycast_check_interval_s=0.2,
    )
    stop = asyncio.Event()
    ready: asyncio.Future[Node] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_node(settings, stop, ready))
    await asyncio.wait([ready, task], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()
    yield ready.result(), stop, task
    stop.set()
    await task


async def test_a_node_announces_when_serving_and_withdraws_on_drain_and_stop(
    node_with_anycast: tuple[Node, asyncio.Event, asyncio.Task[None]],
    peering: Peering,
    tmp_path: Path,
) -> None:
    _, stop, task = node_with_anycast
    await eventually(peering.sees_prefix, WITHIN_S, "a serving node announces the prefix")
    (tmp_path / "drain").touch()
    await eventually(lambda: not peering.sees_prefix(), WITHIN_S, "a drained node withdraws it")
    (tmp_path / "drain").unlink()
    await eventually(peering.sees_prefix, WITHIN_S, "announced again after the drain")
    stop.set()
    await task
    await eventually(lambda: not peering.sees_prefix(), WITHIN_S, "a stopped node has withdrawn it")


def test_the_shipped_bird_config_parses() -> None:
    _require_bird()
    conf = Path(__file__).resolve().parents[2] / "deploy" / "bird" / "bird.conf"
    out = subprocess.run(
        ["bird", "-p", "-c", str(conf)], capture_output=True, text=True, timeout=30, check=False
    )
    assert out.returncode == 0, out.stderr
