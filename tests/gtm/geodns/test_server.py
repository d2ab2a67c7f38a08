"""The responder over real sockets: dnspython clients against a node's UDP and TCP listeners."""

from __future__ import annotations

import asyncio
import struct
import time
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import dns.edns
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
from prometheus_client import REGISTRY, generate_latest
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit import query as audit_query
from gtm.audit.database import make_async_engine
from gtm.decision.snapshot import HealthState, RegionCapacity, RegionHealth

from .conftest import StartNode, audited, port_of, raw_udp, tcp, udp, write_topology

DE, US, JP = "198.51.100.0", "203.0.113.0", "192.0.2.0"
EU_V4 = {"192.0.2.30", "192.0.2.40"}
EU_V6 = {"2001:db8:30::1", "2001:db8:40::1"}

# For tests that set health or capacity with runtime.swap: the node's own state sync recomposes
# from its health book every interval (0.5 s by default) and would put the composed state back
# over the test's swap mid-test (a region marked DOWN answered again, on a loaded machine).
HOLD_SWAPS_S = 3600.0


def q(
    name: str = "chat.gtm.example.",
    rdtype: str = "A",
    ecs: tuple[str, int] | None = None,
    **kw: Any,
) -> dns.message.Message:
    options = list(kw.pop("options", []))
    if ecs:
        options.append(dns.edns.ECSOption(ecs[0], ecs[1]))
        kw.setdefault("use_edns", 0)
    return dns.message.make_query(name, rdtype, options=options, **kw)


def addresses(r: dns.message.Message) -> set[str]:
    return {item.address for rrset in r.answer for item in rrset}


def ecs_of(r: dns.message.Message) -> dns.edns.ECSOption | None:
    found = [o for o in r.options if isinstance(o, dns.edns.ECSOption)]
    assert len(found) <= 1
    return found[0] if found else None


async def test_service_answer(start_node: StartNode) -> None:
    node = await start_node()
    query = q("CHAT.Gtm.Example.", ecs=(DE, 24))
    r = await udp(node, query)
    assert r.id == query.id and r.rcode() == dns.rcode.NOERROR
    assert r.flags & dns.flags.AA and r.flags & dns.flags.RD and not r.flags & dns.flags.RA
    assert addresses(r) == {"192.0.2.40"}  # Frankfurt client -> eu-central
    assert r.answer[0].ttl == 30
    assert r.question[0].name.to_text() == "CHAT.Gtm.Example."  # case echoed
    assert r.answer[0].name.to_text() == "CHAT.Gtm.Example."
    option = ecs_of(r)
    assert option is not None and (option.address, option.srclen, option.scopelen) == (DE, 24, 24)
    r6 = await udp(node, q("chat.gtm.example.", "AAAA", ecs=(US, 24)), host="::1")
    assert addresses(r6) == {"2001:db8:10::1"}  # Washington client -> us-east, over IPv6


async def test_apex_and_zone_names(start_node: StartNode) -> None:
    node = await start_node()
    soa = await udp(node, q("gtm.example.", "SOA", use_edns=False))
    assert soa.rcode() == dns.rcode.NOERROR and soa.flags & dns.flags.AA
    assert soa.answer[0].rdtype == dns.rdatatype.SOA and soa.answer[0][0].serial == 2026112201
    ns = await udp(node, q("gtm.example.", "NS"))
    assert {r.target.to_text() for r in ns.answer[0]} == {"ns1.gtm.example.", "ns2.gtm.example."}
    glue = {(rr.name.to_text(), rr.rdtype) for rr in ns.additional}
    assert ("ns1.gtm.example.", dns.rdatatype.A) in glue
    assert ("ns2.gtm.example.", dns.rdatatype.AAAA) in glue
    ns1 = await udp(node, q("ns1.gtm.example.", "A"))
    assert addresses(ns1) == {"192.0.2.53"}


async def test_nxdomain_nodata_and_refused(start_node: StartNode) -> None:
    node = await start_node()
    nx = await udp(node, q("nope.gtm.example."))
    assert nx.rcode() == dns.rcode.NXDOMAIN and nx.flags & dns.flags.AA and not nx.answer
    assert nx.authority[0].rdtype == dns.rdatatype.SOA and nx.authority[0].ttl == 60
    for name, rdtype in (
        ("chat.gtm.example.", "MX"),
        ("eu.gtm.example.", "A"),
        ("gtm.example.", "A"),
        ("ns1.gtm.example.", "TXT"),
        ("chat.gtm.example.", "TYPE1000"),
    ):
        nodata = await udp(node, q(name, rdtype))
        assert nodata.rcode() == dns.rcode.NOERROR, (name, rdtype)
        assert not nodata.answer and nodata.authority[0].rdtype == dns.rdatatype.SOA
    for name in ("example.com.", "gtm.example.org.", "."):
        refused = await udp(node, q(name))
        assert refused.rcode() == dns.rcode.REFUSED
        assert not refused.answer and not refused.authority  # never a referral
        assert not refused.flags & dns.flags.AA
    chaos = await udp(node, dns.message.make_query("gtm.example.", "TXT", rdclass="CH"))
    assert chaos.rcode() == dns.rcode.REFUSED


async def test_edns_handling(start_node: StartNode) -> None:
    node = await start_node()
    plain = await udp(node, q(use_edns=False))
    assert plain.edns == -1  # no OPT in, no OPT out
    with_do = await udp(node, q(use_edns=0, want_dnssec=True, payload=4096))
    assert with_do.edns == 0 and with_do.ednsflags & dns.flags.DO
    assert with_do.payload == 1232
    unknown = await udp(
        node, q(use_edns=0, ednsflags=0x4000, options=[dns.edns.GenericOption(65001, b"xyz")])
    )
    assert unknown.rcode() == dns.rcode.NOERROR and unknown.options == ()
    assert unknown.ednsflags == 0  # unknown flags are not echoed
    badvers = await udp(node, q(use_edns=1))
    assert badvers.rcode() == dns.rcode.BADVERS and badvers.edns == 0 and not badvers.answer


async def test_nodata_for_a_missing_family_holds_over_the_decisions_scope(
    start_node: StartNode, tmp_path: Path
) -> None:
    """US East has no IPv6 here: AAAA from a US network is NODATA, but from Europe it is an
    answer, so that NODATA depends on the client's location and carries the decision's scope
    (a resolver caching it at scope 0 would give it to every client). NODATA for a type no
    decision gives (TXT) is the same from everywhere: scope 0."""

    def no_v6_in_us_east(data: dict[str, Any]) -> None:
        for region in data["regions"]:
            if region["id"] == "us-east":
                region["ipv6"] = []

    node = await start_node(write_topology(tmp_path / "topology.yaml", no_v6_in_us_east))
    a = await udp(node, q(ecs=(US, 24)))
    assert addresses(a) == {"192.0.2.10"}
    scope = ecs_of(a).scopelen  # type: ignore[union-attr]
    assert scope > 0
    aaaa = await udp(node, q(rdtype="AAAA", ecs=(US, 24)))
    assert aaaa.rcode() == dns.rcode.NOERROR and not aaaa.answer
    assert aaaa.authority[0].rdtype == dns.rdatatype.SOA
    assert ecs_of(aaaa).scopelen == scope  # type: ignore[union-attr]
    europe = await udp(node, q(rdtype="AAAA", ecs=(DE, 24)))
    assert addresses(europe) <= EU_V6 and addresses(europe)
    txt = await udp(node, q(rdtype="TXT", ecs=(US, 24)))
    assert txt.rcode() == dns.rcode.NOERROR and not txt.answer
    assert ecs_of(txt).scopelen == 0  # type: ignore[union-attr]


async def test_client_subnet_cases(start_node: StartNode) -> None:
    node = await start_node()
    without = await udp(node, q(use_edns=0))
    assert ecs_of(without) is None
    zero = await udp(node, q(ecs=("0.0.0.0", 0)))
    option = ecs_of(zero)
    assert option is not None and (option.srclen, option.scopelen) == (0, 0)
    tokyo = await udp(node, q(ecs=(JP, 25)))
    assert addresses(tokyo) == {"192.0.2.60"}
    soa = await udp(node, q("gtm.example.", "SOA", ecs=(DE, 24)))
    option = ecs_of(soa)
    assert option is not None and option.scopelen == 0  # location-independent answer
    v6 = await udp(node, q(ecs=("2001:db8:aaaa::", 48)))
    option = ecs_of(v6)
    assert addresses(v6) == {"192.0.2.40"} and option is not None and option.scopelen == 48
    # Family 3, and an address with bits set past its source prefix: FORMERR.
    base = q(use_edns=0).to_wire()
    for body in (
        struct.pack("!HBB", 3, 24, 0) + b"\xc6\x33\x64",
        struct.pack("!HBB", 1, 20, 0) + b"\xc6\x33\x6f",
    ):
        option_wire = struct.pack("!HH", 8, len(body)) + body
        wire = bytearray(base[:-2]) + struct.pack("!H", len(option_wire)) + option_wire
        reply = await raw_udp(node, bytes(wire))
        assert reply is not None
        parsed = dns.message.from_wire(reply)
        assert parsed.rcode() == dns.rcode.FORMERR and parsed.id == int.from_bytes(base[:2])


async def test_any_is_answered_minimally(start_node: StartNode) -> None:
    node = await start_node()
    r = await udp(node, q("chat.gtm.example.", "ANY", ecs=(DE, 24)))
    assert len(r.answer) == 1 and r.answer[0].rdtype == dns.rdatatype.A
    apex = await udp(node, q("gtm.example.", "ANY"))
    assert [rr.rdtype for rr in apex.answer] == [dns.rdatatype.SOA]


async def test_truncation_and_tcp_fallback(start_node: StartNode, tmp_path: Path) -> None:
    def many_addresses(data: dict[str, Any]) -> None:
        for region in data["regions"]:
            if region["jurisdiction"] == "EU":  # whichever EU region the client is sent to
                region["ipv6"] = [f"{region['ipv6'][0][:-1]}{i:x}" for i in range(1, 31)]

    node = await start_node(write_topology(tmp_path / "big.yaml", many_addresses))
    name = "chat.eu.gtm.example."
    small = await udp(node, q(name, "AAAA", use_edns=False), host="::1")
    assert small.flags & dns.flags.TC and not small.answer  # 30 AAAA do not fit 512 octets
    edns = await udp(node, q(name, "AAAA", use_edns=0, payload=4096))
    assert not edns.flags & dns.flags.TC and len(addresses(edns)) == 30
    assert len(edns.to_wire()) <= 1232
    tiny = await udp(node, q(name, "AAAA", use_edns=0, payload=600))
    assert tiny.flags & dns.flags.TC and tiny.edns == 0  # OPT kept when truncated
    full = await tcp(node, q(name, "AAAA", use_edns=False))
    assert not full.flags & dns.flags.TC and len(addresses(full)) == 30


async def test_several_queries_on_one_tcp_connection_and_idle_close(
    start_node: StartNode,
) -> None:
    node = await start_node(dns_tcp_idle_s=0.5)
    from .conftest import port_of

    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(node))
    queries = [q("chat.gtm.example.", t) for t in ("A", "AAAA", "SOA")]
    for m in queries:  # pipelined: all sent before any answer is read
        wire = m.to_wire()
        writer.write(struct.pack("!H", len(wire)) + wire)
    await writer.drain()
    for m in queries:
        (length,) = struct.unpack("!H", await reader.readexactly(2))
        reply = dns.message.from_wire(await reader.readexactly(length))
        assert reply.id == m.id
    assert await asyncio.wait_for(reader.read(), 3) == b""  # closed after the idle timeout
    writer.close()
    await writer.wait_closed()


async def test_opcode_and_formerr(start_node: StartNode) -> None:
    node = await start_node()
    wire = bytearray(q(use_edns=False).to_wire())
    wire[2] |= 15 << 3  # opcode 15
    notimp = dns.message.from_wire(await raw_udp(node, bytes(wire)) or b"")
    assert notimp.rcode() == dns.rcode.NOTIMP and notimp.opcode() == 15
    two = bytearray(q(use_edns=False).to_wire())
    two[5] = 0  # QDCOUNT 0, question left as trailing bytes
    reply = await raw_udp(node, bytes(two))
    assert reply is not None and reply[:2] == bytes(two[:2]) and reply[3] & 0xF == 1
    assert await raw_udp(node, b"\x01\x02\x03", wait=0.3) is None  # no header: dropped


async def test_restricted_name_never_leaves_the_eu(start_node: StartNode) -> None:
    node = await start_node(state_sync_interval_s=HOLD_SWAPS_S)
    clients = [(DE, 24), (US, 24), (JP, 25), ("100.64.0.0", 16), ("2001:db8:bbbb::", 48), None]

    async def answers() -> list[dns.message.Message]:
        out = []
        for ecs in clients:
            for rdtype in ("A", "AAAA"):
                out.append(await udp(node, q("chat.eu.gtm.example.", rdtype, ecs=ecs)))
        return out

    for r in await answers():
        assert addresses(r) and addresses(r) <= EU_V4 | EU_V6
    runtime = node.runtime
    runtime.swap(health={"eu-central": RegionHealth(HealthState.DOWN, 0.0)})
    for r in await answers():
        assert addresses(r) <= {"192.0.2.30", "2001:db8:30::1"}  # eu-west only
    runtime.swap(
        health={
            "eu-central": RegionHealth(HealthState.DOWN, 0.0),
            "eu-west": RegionHealth(HealthState.DOWN, 0.0),
        }
    )
    for r in await answers():
        # Fails closed, never elsewhere: the policy's NODATA, with the SOA resolvers cache.
        assert r.rcode() == dns.rcode.NOERROR and not r.answer
        assert [rrset.rdtype for rrset in r.authority] == [dns.rdatatype.SOA]
    unrestricted = await udp(node, q("chat.gtm.example.", ecs=(DE, 24)))
    assert addresses(unrestricted) == {"192.0.2.10"}  # unrestricted traffic fails over


async def test_a_new_snapshot_replaces_cached_answers(start_node: StartNode) -> None:
    node = await start_node(state_sync_interval_s=HOLD_SWAPS_S)
    query = q(ecs=(DE, 24))
    assert addresses(await udp(node, query)) == {"192.0.2.40"}
    assert addresses(await udp(node, query)) == {"192.0.2.40"}
    await node.runtime.writer.flush()  # answers from the exact-query cache are counted there
    assert node.dns_stats.cache_hits >= 1
    node.runtime.swap(health={"eu-central": RegionHealth(HealthState.DOWN, 0.0)})
    assert addresses(await udp(node, query)) == {"192.0.2.30"}


async def test_routine_capacity_reports_keep_cached_answers(start_node: StartNode) -> None:
    """A healthy region's report moves a figure no decision reads: the cached answers stay
    (no new render), and the audit counts every answer under the one decision epoch."""
    node = await start_node(state_sync_interval_s=HOLD_SWAPS_S)
    query = q(ecs=(DE, 24))

    def report(eu_central: float, spilling: bool = False) -> None:
        now = time.time()
        node.runtime.swap(
            capacity={
                "eu-central": RegionCapacity(eu_central, now, spilling),
                "eu-west": RegionCapacity(0.3, now, False),
            }
        )

    report(0.4)  # the first reports are new inputs: a new epoch
    epoch = node.runtime.store.current.epoch
    assert addresses(await udp(node, query)) == {"192.0.2.40"}
    misses = node.dns_stats.cache_misses
    for u in (0.5, 0.2, 0.6):
        report(u)
        assert addresses(await udp(node, query)) == {"192.0.2.40"}
    assert node.dns_stats.cache_misses == misses
    assert node.runtime.store.current.epoch == epoch
    # Over the high watermark: a new epoch, decided afresh.
    report(0.97, spilling=True)
    assert node.runtime.store.current.epoch != epoch
    await udp(node, query)
    assert node.dns_stats.cache_misses == misses + 1
    rows = await audited(
        node, "SELECT snapshot_version, SUM(count) FROM decisions GROUP BY snapshot_version"
    )
    assert dict(rows)[epoch] == 4  # four answers, one epoch, however many snapshots


async def test_rate_limiting_spares_other_networks_and_tcp(start_node: StartNode) -> None:
    node = await start_node(dns_rate_limit=20.0, dns_rate_slip=2, dns_rate_limit_exempt=())
    wire = q(use_edns=False).to_wire()
    started = time.monotonic()
    replies = await asyncio.gather(*(raw_udp(node, wire, wait=0.5) for _ in range(120)))
    elapsed = time.monotonic() - started
    answered = [r for r in replies if r is not None]
    truncated = [r for r in answered if dns.message.from_wire(r).flags & dns.flags.TC]
    full = len(answered) - len(truncated)
    assert full <= 20 + 20 * elapsed + 1  # the burst, plus what refilled during the flood
    assert truncated  # slip: some limited responses go out truncated...
    assert len(answered) < 120  # ...and the rest are dropped
    assert node.dns_stats.rate_limited >= 120 - full
    # An innocent network (127.0.1.0/24) is answered in full during the same second.
    innocent = await asyncio.gather(*(raw_udp(node, wire, source="127.0.1.1") for _ in range(15)))
    assert all(
        r is not None and not dns.message.from_wire(r).flags & dns.flags.TC for r in innocent
    )
    # TCP is never limited.
    over_tcp = await asyncio.gather(*(tcp(node, q()) for _ in range(10)))
    assert all(addresses(r) for r in over_tcp)
    exported = generate_latest(REGISTRY).decode()
    assert f"gtm_dns_rate_limited_total {float(node.dns_stats.rate_limited)}" in exported
    assert node.dns_stats.slipped >= len(truncated)
    assert f"gtm_dns_rate_limit_slipped_total {float(node.dns_stats.slipped)}" in exported


async def test_fuzzed_packets_never_stop_the_server(start_node: StartNode) -> None:
    import random

    node = await start_node()
    rng = random.Random(1234)
    valid = [
        q(ecs=(DE, 24)).to_wire(),
        q("gtm.example.", "NS", use_edns=0).to_wire(),
        q("nope.gtm.example.", use_edns=False).to_wire(),
    ]
    loop = asyncio.get_running_loop()
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        target = ("127.0.0.1", node.dns.bound[0][1]) if node.dns else ("", 0)
        for i in range(1500):
            if i % 3 == 0:
                packet = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 300)))
            else:
                packet = bytearray(rng.choice(valid))
                for _ in range(rng.randrange(1, 6)):
                    packet[rng.randrange(len(packet))] = rng.getrandbits(8)
                packet = bytes(packet[: rng.randrange(len(packet) + 1)])
            await loop.sock_sendto(sock, packet, target)
            if i % 100 == 0:  # a well-formed client keeps getting correct answers
                assert addresses(await udp(node, q(ecs=(DE, 24)))) == {"192.0.2.40"}
    assert addresses(await udp(node, q(ecs=(DE, 24)))) == {"192.0.2.40"}
    assert addresses(await tcp(node, q(ecs=(US, 24)))) == {"192.0.2.10"}
    # Over TCP, several fuzzed messages per connection: each is answered with its own ID (a
    # query with a readable header) or the connection is closed (nothing readable, or a
    # response), and nothing else on the connection is lost.
    port = port_of(node)
    for _ in range(40):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(5):
                packet = bytearray(rng.choice(valid))
                packet[rng.randrange(2, len(packet))] = rng.getrandbits(8)
                packet[2] &= 0x7F  # a query, not a response: it must be answered
                writer.write(struct.pack("!H", len(packet)) + packet)
                await writer.drain()
                (length,) = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 3))
                reply = await reader.readexactly(length)
                assert reply[:2] == packet[:2] and reply[2] & 0x80
        finally:
            writer.close()
    assert addresses(await tcp(node, q(ecs=(US, 24)))) == {"192.0.2.10"}


async def test_every_response_is_counted_in_the_audit(
    start_node: StartNode, tmp_path: Path
) -> None:
    node = await start_node()
    url = node.runtime.settings.database_url
    sent = 0
    for ecs in [(DE, 24), (US, 24), (JP, 25), None]:
        for name, rdtype in (
            ("chat.gtm.example.", "A"),
            ("chat.eu.gtm.example.", "AAAA"),
            ("nope.gtm.example.", "A"),
            ("example.com.", "A"),
            ("gtm.example.", "SOA"),
        ):
            # Repeats are answered from the exact-query cache and tallied on its entry.
            for _ in range(3):
                await udp(node, q(name, rdtype, ecs=ecs))
                sent += 1
    await tcp(node, q())
    sent += 1
    assert await raw_udp(node, b"\x00\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00") is not None
    sent += 1  # FORMERR (QDCOUNT 0) is an answer too
    assert await raw_udp(node, b"\x00", wait=0.3) is None  # dropped: not an answer
    await node.runtime.writer.flush()
    engine: AsyncEngine = make_async_engine(url)
    try:
        assert await audit_query.total_count(engine) == sent
        rows = await audit_query.tail(engine, 100)
        kinds = {(r["name"], r["outcome"]) for r in rows}
        # Names that do not exist, and refusals, are counted per (zone, outcome, sender's
        # network bucket), not per name (gtm.geodns.zone.AGGREGATED_OUTCOMES).
        assert ("*.gtm.example.", "nxdomain") in kinds
        assert ("*.", "refused") in kinds
        assert any(r["outcome"] == "malformed" for r in rows)
        german = [
            r
            for r in rows
            if r["ecs_prefix"] == "198.51.100.0/24" and r["name"] == "chat.gtm.example."
        ]
        assert german and german[0]["region"] == "eu-central"
        assert german[0]["answer"] == ["192.0.2.40"] and german[0]["query_type"] == "A"
        # The audit keeps client networks, never addresses: /24 (v4) or /56 (v6) at most.
        for row in rows:
            net = ip_network(row["client_network"])
            assert net.prefixlen <= (24 if net.version == 4 else 56), row
    finally:
        await engine.dispose()


async def test_identical_bytes_from_two_networks_stay_two_clients(start_node: StartNode) -> None:
    node = await start_node()
    wire = q(use_edns=False).to_wire()
    for source in ("127.0.0.1", "127.0.1.1", "127.0.0.1", "127.0.1.1"):
        reply = await raw_udp(node, wire, source=source)
        assert reply is not None and reply[:2] == wire[:2]
    patched = b"\xbe\xef" + wire[2:]  # another ID: echoed, the rest served from the cache
    reply = await raw_udp(node, patched)
    assert reply is not None and reply[:2] == b"\xbe\xef"
    assert dns.message.from_wire(reply).answer
    await node.runtime.writer.flush()
    engine = make_async_engine(node.runtime.settings.database_url)
    try:
        rows = await audit_query.tail(engine, 10)
    finally:
        await engine.dispose()
    counts = {r["client_network"]: r["count"] for r in rows if r["name"] == "chat.gtm.example."}
    assert counts == {"127.0.0.0/24": 3, "127.0.1.0/24": 2}


async def test_tcp_connections_over_the_cap_are_refused_and_counted(start_node: StartNode) -> None:
    """RFC 7766 section 6.2.2 leaves the cap to the server: connections over it are closed at
    once (the client retries elsewhere), the open ones go on, and the refusals are exported."""
    node = await start_node(dns_tcp_max_connections=2)
    port = port_of(node)
    wire = q().to_wire()
    framed = struct.pack("!H", len(wire)) + wire

    async def open_and_ask() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(framed)
        await writer.drain()
        try:
            (length,) = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), 3))
            return reader, writer, await reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError):
            return reader, writer, b""  # closed (or reset) without an answer

    held = [await open_and_ask() for _ in range(2)]
    assert all(dns.message.from_wire(answer).answer for _, _, answer in held)
    _, refused_writer, refused = await open_and_ask()
    assert refused == b""
    refused_writer.close()
    assert node.dns_stats.tcp_refused == 1
    # The held connections still answer (several queries per connection).
    reader, writer, _ = held[0]
    writer.write(framed)
    await writer.drain()
    (length,) = struct.unpack("!H", await reader.readexactly(2))
    assert dns.message.from_wire(await reader.readexactly(length)).answer
    for _, w, _ in held:
        w.close()
        await w.wait_closed()
    # Once one closes, a new connection is served again.
    for _ in range(50):
        if node.dns_stats.tcp_connections < 2:
            break
        await asyncio.sleep(0.05)
    _, again_writer, again = await open_and_ask()
    again_writer.close()
    assert dns.message.from_wire(again).answer
    exported = generate_latest(REGISTRY).decode()
    assert "gtm_dns_tcp_refused_total 1.0" in exported
