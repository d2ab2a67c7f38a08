"""DNS processes beside a signed GTM for the tests that judge its answers by other software:
``gtm serve`` itself with a zone key, Knot serving the same zone signed with the same key (the
peer whose answers GTM's are compared with), and the validating resolvers (unbound, PowerDNS
Recursor, delv) anchored on that key. Synchronous: each runs as a process, started once per
test module, polled until it answers.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import dns.dnssec
import dns.exception
import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.zone
import pytest

from gtm.decision.static_records import absolute_owner
from gtm.decision.topology import Topology, load_topology
from gtm.geodns.dnssec_keys import ZoneKey
from tests.conftest import DEMO, ROOT
from tests.support import resolvers
from tests.support.ports import free_tcp_udp_port

APEX = "gtm.example."


def wait_until(cond: Callable[[], bool], within: float, what: str) -> None:
    """Poll ``cond`` until it holds; fail after ``within`` seconds (the synchronous form of
    :func:`tests.support.waiting.eventually`)."""
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in time")
        time.sleep(0.05)


def answers_soa(port: int, recursion: bool = False) -> bool:
    query = dns.message.make_query(APEX, "SOA")
    if not recursion:
        query.flags &= ~dns.flags.RD
    try:
        reply = dns.query.udp(query, "127.0.0.1", port=port, timeout=1)
    except (dns.exception.DNSException, OSError):
        return False
    return reply.rcode() == dns.rcode.NOERROR


@contextmanager
def running(
    argv: list[str],
    log: Path,
    port: int,
    ready: Callable[[int], bool],
    what: str,
    env: dict[str, str] | None = None,
) -> Iterator[int]:
    """Run ``argv`` (output to ``log``) until ``ready(port)``; stopped on exit."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=out, env=env, cwd=ROOT)
    try:

        def up() -> bool:
            assert proc.poll() is None, f"{what} exited: {log.read_text()[-3000:]}"
            return ready(port)

        wait_until(up, 60, what)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def gtm_serve(work: Path, key: ZoneKey | None, env: dict[str, str]) -> Iterator[int]:
    """``gtm serve`` on the demo topology (``env``: test_dig.serve_env), signed with ``key``."""
    if key is not None:
        env = env | {"GTM_DNSSEC_KEY_FILE": str(key.path)}
    port = free_tcp_udp_port()
    argv = [sys.executable, "-m", "gtm", "serve", "--dns", f"127.0.0.1:{port}"]
    with running(argv, work / "gtm.log", port, answers_soa, "gtm serve answering", env) as p:
        yield p


# -- Knot ---------------------------------------------------------------------------------------


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def zone_text(topology: Topology, service_addresses: dict[str, tuple[str, ...]]) -> str:
    """The demo zone as a zone file: SOA, NS and glue, the static records, and each service
    name with the addresses GTM gives a client on loopback (``service_addresses``: A and AAAA
    text by name; a peer has no decision to make)."""
    zone = topology.zone
    soa = zone.soa
    lines = [
        f"{zone.apex} {zone.ttl} IN SOA {soa.mname} {soa.rname} {soa.serial} {soa.refresh} "
        f"{soa.retry} {soa.expire} {soa.minimum}"
    ]
    for ns in zone.nameservers:
        lines.append(f"{zone.apex} {zone.ttl} IN NS {ns.name}")
        lines += [f"{ns.name} {zone.ttl} IN A {a}" for a in ns.ipv4]
        lines += [f"{ns.name} {zone.ttl} IN AAAA {a}" for a in ns.ipv6]
    for r in zone.records:
        owner = absolute_owner(r.name, zone.apex)
        ttl = r.ttl if r.ttl is not None else zone.ttl
        data = r.model_dump()
        kind = data["type"].upper()
        if kind in ("A", "AAAA"):
            rdata = str(data["address"])
        elif kind == "CNAME":
            rdata = data["target"] if data["target"].endswith(".") else data["target"] + "."
        elif kind == "TXT":
            texts = data["text"] if isinstance(data["text"], (list, tuple)) else [data["text"]]
            rdata = " ".join(_quoted(t) for t in texts)
        elif kind == "CAA":
            rdata = f"{data['flags']} {data['tag']} {_quoted(data['value'])}"
        elif kind == "MX":
            rdata = f"{data['preference']} {data['exchange']}"
        elif kind == "SRV":
            rdata = f"{data['priority']} {data['weight']} {data['port']} {data['target']}"
        else:
            raise AssertionError(f"no zone-file form for {kind}")
        lines.append(f"{owner} {ttl} IN {kind} {rdata}")
    for service in topology.services:
        for name in service.dns_names:
            for address in service_addresses[name]:
                kind = "AAAA" if ":" in address else "A"
                lines.append(f"{name} {service.ttl} IN {kind} {address}")
    return "\n".join(lines) + "\n"


def signed_zone_text(text: str, key: ZoneKey, now: float) -> str:
    """``text`` signed with ``key`` (dnspython: DNSKEY added, an NSEC chain, RRSIGs), valid
    from an hour ago for a week, as GTM's own signatures are."""
    zone = dns.zone.from_text(text, origin=APEX, relativize=False)
    dns.dnssec.sign_zone(
        zone,
        keys=[(key.private, key.dnskey)],
        dnskey_ttl=zone.get_rdataset(APEX, "SOA").ttl,  # type: ignore[union-attr]
        inception=int(now - 3600),
        expiration=int(now + 7 * 86400),
    )
    return str(zone.to_text(relativize=False))


def demo_topology() -> Topology:
    return load_topology(DEMO)


@contextmanager
def knot(work: Path, zone_file_text: str) -> Iterator[int]:
    """knotd serving ``zone_file_text`` (signed already: Knot signs nothing itself)."""
    knotd = require("knotd")
    work.mkdir(exist_ok=True)
    zone_file = work / "gtm.example.zone"
    zone_file.write_text(zone_file_text)
    port = free_tcp_udp_port()
    (work / "knot.conf").write_text(
        f"""server:
    listen: 127.0.0.1@{port}
    rundir: {work}
database:
    storage: {work}
zone:
  - domain: {APEX}
    file: {zone_file}
    zonefile-sync: -1
    journal-content: none
log:
  - target: stderr
    any: info
"""
    )
    argv = [knotd, "-c", str(work / "knot.conf")]
    with running(argv, work / "knot.log", port, answers_soa, "knotd answering") as p:
        yield p


# -- validating resolvers --------------------------------------------------------------------


def unbound(work: Path, auth: int, key: ZoneKey) -> list[str]:
    anchor = f"{APEX} IN DS {key.ds(APEX).to_text()}"
    return resolvers.unbound_argv(
        require("unbound"), work, resolver_port(work), auth, trust_anchor=anchor
    )


def socket_dir(stack: ExitStack) -> Path:
    """A directory for PowerDNS Recursor's control socket, removed with ``stack``. A UNIX
    socket's path has at most 107 bytes, and pytest's temporary directories pass that: one
    level deeper under each xdist worker, longer as the run's number grows."""
    return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gtm-pdns-")))


def pdns_recursor(work: Path, auth: int, key: ZoneKey, sockets: Path) -> list[str]:
    (work / "recursor.conf").write_text("")
    (work / "anchor.lua").write_text(f"addTA('{APEX}', '{key.ds(APEX).to_text()}')\n")
    return [
        require("pdns_recursor"),
        f"--config-dir={work}",
        f"--socket-dir={sockets}",
        "--local-address=127.0.0.1",
        f"--local-port={resolver_port(work)}",
        f"--forward-zones=gtm.example=127.0.0.1:{auth}",
        "--dont-query=",  # its default keeps it from asking loopback addresses
        "--dnssec=validate",
        f"--lua-config-file={work / 'anchor.lua'}",
        "--hint-file=no",  # no root priming: nothing but the forwarded zone exists here
        "--security-poll-suffix=",
        "--daemon=no",
        "--threads=1",
        "--disable-syslog",
        "--write-pid=no",
    ]


def delv_anchor(work: Path, key: ZoneKey) -> Path:
    ds = key.ds(APEX)
    path = work / "delv.anchors"
    path.write_text(
        f"trust-anchors {{ {APEX} static-ds {ds.key_tag} {ds.algorithm} {ds.digest_type} "
        f'"{ds.digest.hex()}"; }};\n'
    )
    return path


def resolver_port(work: Path) -> int:
    """The port chosen for the resolver whose folder is ``work`` (chosen once, kept there)."""
    stored = work / "port"
    if not stored.exists():
        stored.write_text(str(free_tcp_udp_port()))
    return int(stored.read_text())


def require(tool: str) -> str:
    """The tool's path; the test fails (CI, ``GTM_TEST_REQUIRE_TOOLS=1``) or skips without it."""
    path = shutil.which(tool)
    if path is None:
        reason = f"{tool} is not installed (Debian: knot, unbound, pdns-recursor, bind9-dnsutils)"
        if os.environ.get("GTM_TEST_REQUIRE_TOOLS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return path
