"""Real recursive resolvers on loopback in front of a node: their configuration, and starting
them (each with its own working directory and log) until they answer for the zone."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import dns.exception

from tests.support.waiting import eventually


def unbound_argv(
    unbound: str, work: Path, port: int, auth: int, *, trust_anchor: str | None = None
) -> list[str]:
    """unbound on ``port`` with the zone stubbed to ``auth``, passing ECS on (subnetcache);
    validating, with ``trust_anchor`` (a DS record's text) as the zone's only anchor, if given."""
    validating = trust_anchor is not None
    modules = "subnetcache validator iterator" if validating else "subnetcache iterator"
    anchor = f'  trust-anchor: "{trust_anchor}"\n  val-log-level: 2\n' if validating else ""
    (work / "unbound.conf").write_text(
        f"""server:
  interface: 127.0.0.1
  port: {port}
  do-daemonize: no
  username: ""
  chroot: ""
  directory: "{work}"
  pidfile: ""
  use-syslog: no
  logfile: ""
  verbosity: 1
  do-ip6: no
  do-not-query-localhost: no
  module-config: "{modules}"
  send-client-subnet: 127.0.0.1
  max-client-subnet-ipv4: 24
  qname-minimisation: no
  trust-anchor-file: ""
{anchor}remote-control:
  control-enable: no
stub-zone:
  name: "gtm.example."
  stub-addr: 127.0.0.1@{auth}
"""
    )
    return [unbound, "-d", "-c", str(work / "unbound.conf")]


class Resolvers:
    """Resolver processes started for one test, stopped together at its end."""

    def __init__(self) -> None:
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(
        self,
        argv: Sequence[str],
        work: Path,
        port: int,
        answers: Callable[[int], Awaitable[bool]],
        what: str,
    ) -> int:
        """Run ``argv`` (logging to ``work``/log) until ``answers(port)`` is true; the port."""
        with (work / "log").open("wb") as log:
            proc = await asyncio.create_subprocess_exec(*argv, stdout=log, stderr=log)
        self.procs.append(proc)

        async def ready() -> bool:
            assert proc.returncode is None, (work / "log").read_text()
            try:
                return await answers(port)
            except (TimeoutError, OSError, dns.exception.DNSException):
                return False

        await eventually(ready, within=30, what=what)
        return port

    async def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
