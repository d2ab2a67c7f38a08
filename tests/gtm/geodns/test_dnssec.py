"""DNSSEC online signing (issue 17): keys, signed answers checked with dnspython's validator
over real sockets, compact denial (RFC 9824 black lies), the audit of a denied name, truncation,
a rollover's published key, the signature cache, and unbound validating the zone end to end
from its trust anchor (and refusing answers signed with another key).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.dnssec
import dns.edns
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.rrset
import pytest
from typer.testing import CliRunner

from gtm.audit import query as audit_query
from gtm.audit.database import make_async_engine
from gtm.cli.main import app
from gtm.errors import ConfigError
from gtm.geodns.dnssec import NXNAME, Signer, frame_and_sign, nsec_rrset
from gtm.geodns.dnssec_keys import ZoneKey, generate, load_key, load_keys
from gtm.geodns.zone import zone_data
from gtm.node import Node, run_node
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES, ROOT
from tests.support import resolvers
from tests.support.control import KeyHolder
from tests.support.ports import free_tcp_udp_port
from tests.support.waiting import eventually

from .conftest import StartNode, port_of, tcp, udp, write_topology
from .test_dig import require, serve_env
from .test_resolvers import fail_closed_with_nodata, force_eu

APEX = dns.name.from_text("gtm.example.")
DE = "198.51.100.0"  # Frankfurt in the test GeoIP database
RRSIG, NSEC = dns.rdatatype.RRSIG, dns.rdatatype.NSEC


@pytest.fixture
def key(tmp_path: Path) -> ZoneKey:
    return generate(tmp_path / "zone.key")


def dnskeys(*keys: ZoneKey) -> dict[dns.name.Name, dns.rrset.RRset]:
    rrset = dns.rrset.RRset(APEX, dns.rdataclass.IN, dns.rdatatype.DNSKEY)
    for k in keys:
        rrset.add(k.dnskey)
    return {APEX: rrset}


def q(name: str, rdtype: str = "A", *, do: bool = True, ecs: str | None = None, **kw: Any) -> Any:
    options = [dns.edns.ECSOption(ecs, 24)] if ecs else []
    return dns.message.make_query(name, rdtype, use_edns=0, want_dnssec=do, options=options, **kw)


def validate(r: dns.message.Message, *keys: ZoneKey) -> int:
    """Every RRset of the answer and authority sections verified against ``keys``, and those of
    the additional section (glue, MX/SRV target addresses) that came with their RRSIGs (RFC
    4035 §3.1.1: they may be left out for room). The number of answer and authority RRsets
    verified."""
    n = 0
    for section in (r.answer, r.authority, r.additional):
        for rrset in section:
            if rrset.rdtype == RRSIG:
                continue
            if section is r.additional and not any(
                x.rdtype == RRSIG and x.name == rrset.name for x in r.additional
            ):
                continue
            sig = r.find_rrset(section, rrset.name, rrset.rdclass, RRSIG, rrset.rdtype)
            dns.dnssec.validate(rrset, sig, dnskeys(*keys))
            n += section is not r.additional
    return n


def nsec_of(r: dns.message.Message) -> tuple[dns.name.Name, dns.name.Name, set[int]]:
    (rrset,) = [x for x in r.authority if x.rdtype == NSEC]
    (rdata,) = list(rrset)
    types = {int(t) for window, bitmap in rdata.windows for t in _types(window, bitmap)}
    return rrset.name, rdata.next, types


def _types(window: int, bitmap: bytes) -> list[int]:
    return [
        window * 256 + i * 8 + bit
        for i, octet in enumerate(bitmap)
        for bit in range(8)
        if octet & (0x80 >> bit)
    ]


async def both(node: Node, message: dns.message.Message) -> list[dns.message.Message]:
    return [await udp(node, message), await tcp(node, message)]


# -- keys ----------------------------------------------------------------------------------


def test_keygen_writes_a_p256_key_readable_by_its_owner_only(key: ZoneKey) -> None:
    assert key.path.stat().st_mode & 0o777 == 0o600
    assert key.dnskey.algorithm == 13 and key.dnskey.flags == 257
    again = load_key(key.path)
    assert again.dnskey == key.dnskey and again.tag == key.tag
    with pytest.raises(FileExistsError):
        generate(key.path)  # never overwritten


def test_bad_key_files_fail_at_load_naming_the_file(tmp_path: Path, key: ZoneKey) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    def write(name: str, data: bytes, mode: int = 0o600) -> Path:
        path = tmp_path / name
        path.write_bytes(data)
        path.chmod(mode)
        return path

    def pem(private: Any) -> bytes:
        return bytes(
            private.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )

    cases = {
        tmp_path / "missing.key": "cannot read the DNSSEC key",
        write("garbage.key", b"-----BEGIN PRIVATE KEY-----\nnope\n"): "not an unencrypted PEM",
        write("loose.key", key.path.read_bytes(), 0o644): "mode 644",
        write("p384.key", pem(ec.generate_private_key(ec.SECP384R1()))): "secp384r1, not P-256",
        write("ed.key", pem(ed25519.Ed25519PrivateKey.generate())): "not an ECDSA P-256",
    }
    for path, message in cases.items():
        with pytest.raises(ConfigError) as caught:
            load_keys(path)
        (problem,) = caught.value.problems
        assert problem.source == str(path) and message in problem.message, problem
    # Every problem at once; the same key twice is one too.
    with pytest.raises(ConfigError) as caught:
        load_keys(key.path, (*cases, key.path))
    assert len(caught.value.problems) == len(cases) + 1
    assert "the same key as" in caught.value.problems[-1].message


async def test_a_signed_zone_without_its_key_never_starts(tmp_path: Path, geoip_path: Path) -> None:
    missing = tmp_path / "gone.key"
    settings = Settings(
        config=DEMO,
        policies=(POLICIES,),
        geoip_path=geoip_path,
        database_url=f"sqlite:///{tmp_path / 'g.sqlite3'}",
        spool_dir=tmp_path / "spool",
        dns_listen=("127.0.0.1:0",),
        probes=False,
        dnssec_key_file=missing,
    )
    ready: asyncio.Future[Node] = asyncio.get_running_loop().create_future()
    with pytest.raises(ConfigError) as caught:
        await run_node(settings, asyncio.Event(), ready)
    assert str(missing) in str(caught.value) and not ready.done()


def test_serve_refuses_to_start_with_a_bad_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.key"
    bad.write_text("not a key")
    bad.chmod(0o600)
    env = serve_env(tmp_path) | {"GTM_DNSSEC_KEY_FILE": str(bad)}
    port = free_tcp_udp_port()
    done = subprocess.run(
        [sys.executable, "-m", "gtm", "serve", "--dns", f"127.0.0.1:{port}"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert str(bad) in done.stderr and "not an unencrypted PEM" in done.stderr
    assert "gtm.ready" not in done.stderr


def test_cli_ds_prints_ds_and_dnskey_for_every_key(tmp_path: Path, key: ZoneKey) -> None:
    runner = CliRunner()
    made = runner.invoke(
        app, ["dnssec", "keygen", str(tmp_path / "next.key"), "--zone", "gtm.example"]
    )
    assert made.exit_code == 0, made.output
    nxt = load_key(tmp_path / "next.key")
    assert f"IN DS {nxt.tag} 13 2 " in made.output
    shown = runner.invoke(
        app,
        [
            "dnssec",
            "ds",
            "--key-file",
            str(key.path),
            "--key-file",
            str(nxt.path),
            "--zone",
            "gtm.example.",
        ],
    )
    assert shown.exit_code == 0, shown.output
    lines = [line for line in shown.output.splitlines() if not line.startswith(";")]
    assert lines == [
        f"gtm.example. 3600 IN DS {key.ds('gtm.example.').to_text()}",
        f"gtm.example. 3600 IN DNSKEY {key.dnskey.to_text()}",
        f"gtm.example. 3600 IN DS {nxt.ds('gtm.example.').to_text()}",
        f"gtm.example. 3600 IN DNSKEY {nxt.dnskey.to_text()}",
    ]
    assert "signing" in shown.output and "published only" in shown.output
    # From the settings, the zone from the topology; and no key at all is an error.
    env = {
        "GTM_CONFIG": str(DEMO),
        "GTM_DNSSEC_KEY_FILE": str(key.path),
        "GTM_DNSSEC_PUBLISH_KEY_FILES": f'["{nxt.path}"]',
    }
    # (A process of its own: reading the settings configures logging to its stderr.)
    gtm = [sys.executable, "-m", "gtm", "dnssec", "ds"]
    configured = subprocess.run(gtm, env=os.environ | env, cwd=ROOT, capture_output=True, text=True)
    assert configured.returncode == 0, configured.stderr
    assert [x for x in configured.stdout.splitlines() if " IN DS " in x] == [
        line for line in lines if " IN DS " in line
    ]
    env.pop("GTM_DNSSEC_KEY_FILE")
    env.pop("GTM_DNSSEC_PUBLISH_KEY_FILES")
    none = subprocess.run(gtm, env=os.environ | env, cwd=ROOT, capture_output=True, text=True)
    assert none.returncode == 2 and "GTM_DNSSEC_KEY_FILE" in none.stderr


# -- signed answers --------------------------------------------------------------------------


async def test_every_positive_answer_is_signed_and_validates(
    start_node: StartNode, key: ZoneKey
) -> None:
    node = await start_node(dnssec_key_file=key.path)
    cases = [
        ("chat.gtm.example.", "A", DE, {"192.0.2.40"}),  # a geo answer, by ECS
        ("CHAT.Gtm.Example.", "AAAA", DE, {"2001:db8:40::1"}),  # letter case echoed
        ("chat.gtm.example.", "A", None, None),  # from loopback: the region order
        ("gtm.example.", "SOA", None, None),
        ("gtm.example.", "NS", None, None),
        ("gtm.example.", "DNSKEY", None, None),
        ("gtm.example.", "ANY", None, None),
        ("ns1.gtm.example.", "A", None, {"192.0.2.53"}),
    ]
    for name, rdtype, ecs, expected in cases:
        for r in await both(node, q(name, rdtype, ecs=ecs)):
            assert r.rcode() == dns.rcode.NOERROR and r.flags & dns.flags.AA, (name, rdtype)
            assert r.answer and validate(r, key) >= 1
            assert r.question[0].name.to_text() == name  # question case kept by the template
            if expected is not None:
                got = {i.address for x in r.answer if x.rdtype != RRSIG for i in x}
                assert got == expected
    ns = await udp(node, q("gtm.example.", "NS"))
    # The glue is the zone's data, signed too (RFC 4035 §3.1.1), and validates.
    glue = [x for x in ns.additional if x.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA)]
    assert len(glue) == 4 and {x.rdtype for x in ns.additional} == {
        dns.rdatatype.A,
        dns.rdatatype.AAAA,
        RRSIG,
    }
    for rrset in glue:
        sig = ns.find_rrset(ns.additional, rrset.name, 1, RRSIG, rrset.rdtype)
        dns.dnssec.validate(rrset, sig, dnskeys(key))
    dnskey = await udp(node, q("gtm.example.", "DNSKEY"))
    assert list(dnskey.find_rrset(dnskey.answer, APEX, 1, dns.rdatatype.DNSKEY)) == [key.dnskey]
    assert node.dns is not None and node.dns.responder.signer is not None
    assert node.dns.responder.signer.general_path == 0  # every answer spliced on the wire


async def test_static_records_and_cname_chains_are_signed(
    start_node: StartNode, key: ZoneKey
) -> None:
    node = await start_node(dnssec_key_file=key.path)
    CNAME = dns.rdatatype.CNAME
    for name, rdtype, expected in (
        ("gtm.example.", "TXT", {dns.rdatatype.TXT}),
        ("gtm.example.", "CAA", {dns.rdatatype.CAA}),
        ("gtm.example.", "MX", {dns.rdatatype.MX}),
        ("mail.gtm.example.", "A", {dns.rdatatype.A}),
        ("_submission._tcp.gtm.example.", "SRV", {dns.rdatatype.SRV}),
        ("api.gtm.example.", "A", {CNAME, dns.rdatatype.A}),  # into a service name
        ("Api.gtm.example.", "CNAME", {CNAME}),
        ("docs.gtm.example.", "A", {CNAME}),  # out of the zone: the CNAME alone
    ):
        for r in await both(node, q(name, rdtype, ecs=DE)):
            assert r.rcode() == dns.rcode.NOERROR, (name, rdtype)
            assert {x.rdtype for x in r.answer if x.rdtype != RRSIG} == expected, (name, r)
            assert validate(r, key) == len(expected)
    # A CNAME, then NODATA at its target: the NSEC denies the type at the target.
    for r in await both(node, q("api.gtm.example.", "TXT")):
        assert r.rcode() == dns.rcode.NOERROR and validate(r, key) == 3  # CNAME, SOA, NSEC
        owner, _, listed = nsec_of(r)
        assert owner == dns.name.from_text("chat.gtm.example.")
        assert listed == {dns.rdatatype.A, dns.rdatatype.AAAA, RRSIG, NSEC}
    assert node.dns is not None and node.dns.responder.signer is not None
    assert node.dns.responder.signer.general_path == 0


async def test_every_name_and_type_gets_a_valid_signed_answer(
    start_node: StartNode, key: ZoneKey
) -> None:
    """Every name of the demo zone (and names it does not have) by every type a resolver may
    ask, with DO, over UDP at the smallest EDNS size and over TCP: each authoritative answer
    validates (or is truncated, whole over TCP), and none needed dnspython's general path."""
    node = await start_node(dnssec_key_file=key.path)
    names = [
        "gtm.example.",
        "chat.gtm.example.",
        "chat.eu.gtm.example.",
        "eu.gtm.example.",
        "api.gtm.example.",
        "docs.gtm.example.",
        "mail.gtm.example.",
        "_submission._tcp.gtm.example.",
        "ns1.gtm.example.",
        "no.such.gtm.example.",
    ]
    types = ["A", "AAAA", "NS", "SOA", "TXT", "MX", "SRV", "CAA", "CNAME", "DNSKEY", "DS"]
    types += ["ANY", "NSEC", "HINFO", "TYPE65534"]
    for name in names:
        for rdtype in types:
            query = q(name, rdtype, ecs=DE, payload=512)
            for r in await both(node, query):
                assert r.rcode() == dns.rcode.NOERROR, (name, rdtype, r)
                assert r.flags & dns.flags.AA
                if r.flags & dns.flags.TC:
                    assert not r.answer and not r.authority
                    continue
                assert validate(r, key) >= 1, (name, rdtype)
                if not [x for x in r.answer if x.rdtype != RRSIG]:
                    nsec_of(r)  # every empty answer proves it
    assert node.dns is not None and node.dns.responder.signer is not None
    assert node.dns.responder.signer.general_path == 0


async def test_queries_without_do_get_unsigned_answers_and_dnskey(
    start_node: StartNode, key: ZoneKey
) -> None:
    node = await start_node(dnssec_key_file=key.path)
    plain = await udp(node, q("chat.gtm.example.", do=False))
    assert plain.answer and not any(x.rdtype == RRSIG for x in plain.answer)
    missing = await udp(node, q("nope.gtm.example.", do=False))
    assert missing.rcode() == dns.rcode.NXDOMAIN and not any(
        x.rdtype in (RRSIG, NSEC) for x in missing.authority
    )
    keys = await udp(node, q("gtm.example.", "DNSKEY", do=False))
    assert [x.rdtype for x in keys.answer] == [dns.rdatatype.DNSKEY]


async def test_denial_is_compact_black_lies(start_node: StartNode, key: ZoneKey) -> None:
    """RFC 9824: an NSEC at the name, next name \\000.name; NXDOMAIN becomes NOERROR with
    NXNAME; NODATA lists the name's types, never the one asked."""
    node = await start_node(dnssec_key_file=key.path)
    A, AAAA, NS, SOA, DNSKEY = (
        dns.rdatatype.A,
        dns.rdatatype.AAAA,
        dns.rdatatype.NS,
        dns.rdatatype.SOA,
        dns.rdatatype.DNSKEY,
    )
    # The apex holds SOA, NS, the keys and the demo's static records (TXT, CAA, MX).
    static = zone_data(node.runtime.store.current.topology).static.types.get("gtm.example.", set())
    apex_types = {SOA, NS, DNSKEY, RRSIG, NSEC, *static}
    assert {dns.rdatatype.TXT, dns.rdatatype.MX} <= apex_types
    cases = [
        # name, type, expected NSEC types
        ("does-not-exist.gtm.example.", "A", {RRSIG, NSEC, NXNAME}),
        ("a.b.Deep.gtm.example.", "TXT", {RRSIG, NSEC, NXNAME}),
        ("chat.gtm.example.", "TXT", {A, AAAA, RRSIG, NSEC}),  # a service name, other type
        ("chat.gtm.example.", "MX", {A, AAAA, RRSIG, NSEC}),
        ("gtm.example.", "HINFO", apex_types),  # the apex
        ("gtm.example.", "DS", apex_types),
        ("eu.gtm.example.", "A", {RRSIG, NSEC}),  # an empty non-terminal
        ("ns1.gtm.example.", "MX", {A, AAAA, RRSIG, NSEC}),
        ("mail.gtm.example.", "TXT", {A, AAAA, RRSIG, NSEC}),  # a static name
        ("_tcp.gtm.example.", "SRV", {RRSIG, NSEC}),  # above _submission._tcp
    ]
    for name, rdtype, types in cases:
        for r in await both(node, q(name, rdtype)):
            assert r.rcode() == dns.rcode.NOERROR and not r.answer, (name, rdtype)
            assert validate(r, key) == 2  # the SOA and the NSEC
            owner, following, listed = nsec_of(r)
            assert owner == dns.name.from_text(name)
            assert following == dns.name.Name((b"\x00", *dns.name.from_text(name.lower()).labels))
            assert listed == types, (name, rdtype, listed)
            assert dns.rdatatype.from_text(rdtype) not in listed
            assert dns.rdatatype.CNAME not in listed
            soa = r.find_rrset(r.authority, APEX, 1, SOA)
            nsec = r.find_rrset(r.authority, owner, 1, NSEC)
            assert nsec.ttl == soa.ttl == 60  # the negative TTL (RFC 9077)
    assert node.dns is not None and node.dns.responder.signer is not None
    assert node.dns.responder.signer.general_path == 0


async def test_fail_closed_nodata_is_signed_and_denies_the_type(
    start_node: StartNode, key: ZoneKey, tmp_path: Path
) -> None:
    topology, policies = fail_closed_with_nodata(tmp_path)
    holder = KeyHolder(tmp_path / "keys")  # overrides are signed control-log entries
    node = await start_node(
        topology, policies=policies, dnssec_key_file=key.path, document_keys=(holder.public,)
    )
    await force_eu(node.runtime.engine, down=True, holder=holder)

    async def failed_closed() -> bool:
        r = await udp(node, q("chat.eu.gtm.example.", ecs=DE))
        return r.rcode() == dns.rcode.NOERROR and not r.answer

    await eventually(failed_closed, within=10, what="fail-closed NODATA")
    for rdtype in ("A", "AAAA"):
        for r in await both(node, q("chat.eu.gtm.example.", rdtype, ecs=DE)):
            assert validate(r, key) == 2
            _, _, listed = nsec_of(r)
            assert dns.rdatatype.from_text(rdtype) not in listed and {RRSIG, NSEC} <= listed
            soa = r.find_rrset(r.authority, APEX, 1, dns.rdatatype.SOA)
            assert soa.ttl == 2  # the degraded TTL: the failure is cached that long only


async def test_a_denied_name_is_audited_as_what_it_was(start_node: StartNode, key: ZoneKey) -> None:
    node = await start_node(dnssec_key_file=key.path)
    for i in range(5):
        r = await udp(node, q(f"random-{i}.gtm.example."))
        assert r.rcode() == dns.rcode.NOERROR
    r = await udp(node, q("random-9.gtm.example.", do=False))
    assert r.rcode() == dns.rcode.NXDOMAIN
    await node.runtime.writer.flush()
    engine = make_async_engine(node.runtime.settings.database_url)
    try:
        rows = await audit_query.tail(engine, 50)
    finally:
        await engine.dispose()
    denied: dict[str, int] = {}
    for row in rows:
        if row["outcome"] == "nxdomain":
            denied[row["response"]] = denied.get(row["response"], 0) + row["count"]
    # Aggregated as names that do not exist always are; the response says what went out.
    assert denied == {"NOERROR+NXNAME": 5, "NXDOMAIN": 1}
    assert {row["name"] for row in rows if row["outcome"] == "nxdomain"} == {"*.gtm.example."}


async def test_signed_answers_too_big_for_udp_are_truncated_and_whole_over_tcp(
    start_node: StartNode, key: ZoneKey, tmp_path: Path
) -> None:
    def many_addresses(data: dict[str, Any]) -> None:
        for region in data["regions"]:
            region["ipv6"] = [f"{region['ipv6'][0][:-1]}{i:x}" for i in range(1, 61)]

    node = await start_node(
        write_topology(tmp_path / "big.yaml", many_addresses), dnssec_key_file=key.path
    )
    query = q("chat.gtm.example.", "AAAA", ecs=DE, payload=4096)
    r = await udp(node, query)
    assert r.flags & dns.flags.TC and not r.answer and not r.authority
    whole = await tcp(node, query)
    assert not whole.flags & dns.flags.TC and validate(whole, key) == 1
    assert sum(len(x) for x in whole.answer if x.rdtype == dns.rdatatype.AAAA) == 60
    # Unsigned, the same answer fits neither; a small signed one fits 512.
    small = await udp(node, q("gtm.example.", "SOA", payload=512))
    assert not small.flags & dns.flags.TC and validate(small, key) == 1


async def test_a_published_key_is_listed_and_signs_only_the_dnskey_rrset(
    start_node: StartNode, key: ZoneKey, tmp_path: Path
) -> None:
    nxt = generate(tmp_path / "next.key")
    node = await start_node(dnssec_key_file=key.path, dnssec_publish_key_files=(nxt.path,))
    r = await udp(node, q("gtm.example.", "DNSKEY"))
    rrset = r.find_rrset(r.answer, APEX, 1, dns.rdatatype.DNSKEY)
    assert set(rrset) == {key.dnskey, nxt.dnskey}
    sigs = r.find_rrset(r.answer, APEX, 1, RRSIG, dns.rdatatype.DNSKEY)
    assert {s.key_tag for s in sigs} == {key.tag, nxt.tag}
    # A resolver trusting either key's DS accepts the DNSKEY RRset.
    for trusted in (key, nxt):
        dns.dnssec.validate(rrset, sigs, {APEX: rrset}) if trusted else None
        dns.dnssec.validate(rrset, sigs, dnskeys(trusted))
    a = await udp(node, q("chat.gtm.example."))
    assert {s.key_tag for x in a.answer if x.rdtype == RRSIG for s in x} == {key.tag}
    validate(a, key)


# -- the signature cache ---------------------------------------------------------------------


async def test_signatures_are_cached_per_rrset_content(start_node: StartNode, key: ZoneKey) -> None:
    node = await start_node(dnssec_key_file=key.path)
    assert node.dns is not None and node.dns.responder.signer is not None
    signer = node.dns.responder.signer
    await udp(node, q("chat.gtm.example.", ecs=DE))
    made, misses = signer.signatures_made, node.dns_stats.cache_misses
    # Other subnets inside the same Frankfurt network, and TCP: new rendered answers (one
    # per ECS subnet and transport), the same A RRset, so no new signature.
    for ecs, bits in (("198.51.100.128", 25), ("198.51.100.64", 26), (DE, 23), (DE, 24)):
        message = dns.message.make_query(
            "chat.gtm.example.",
            "A",
            use_edns=0,
            want_dnssec=True,
            options=[dns.edns.ECSOption(ecs, bits)],
        )
        for r in await both(node, message):
            assert {i.address for x in r.answer if x.rdtype != RRSIG for i in x} == {"192.0.2.40"}
            validate(r, key)
    assert node.dns_stats.cache_misses >= misses + 7
    assert signer.signatures_made == made


def test_signatures_are_made_again_well_before_they_expire(key: ZoneKey) -> None:
    from gtm.decision.answer_window import AnswerWindow

    now = [1_800_000_000.0]
    signer = Signer(load_keys(key.path), validity_s=8 * 86400)
    rrset = dns.rrset.from_text("chat.gtm.example.", 30, "IN", "A", "192.0.2.40")
    owner = rrset.name.to_wire()
    rdatas = [r.to_wire() for r in rrset]

    def sign(at: float) -> dns.rrset.RRset:
        sigs = dns.rrset.RRset(rrset.name, 1, RRSIG, dns.rdatatype.A)
        sigs.update_ttl(30)
        for wire in signer.signatures(owner, 1, 30, rdatas, APEX, at):
            sigs.add(dns.rdata.from_wire(1, RRSIG, wire, 0, len(wire)))
        return sigs

    first = sign(now[0])
    (sig,) = list(first)
    assert sig.inception <= now[0] - 3000 and sig.expiration == int(now[0] + 8 * 86400)
    assert sign(now[0] + 3600) == first and signer.signatures_made == 1  # cached
    later = sign(now[0] + 2 * 86400)  # a quarter of the validity gone: made again
    assert later != first and signer.signatures_made == 2
    dns.dnssec.validate(rrset, later, dnskeys(key), now=now[0] + 2 * 86400)
    # Cached answers live at most max_answer_age: the window is capped, then dropped.
    window = AnswerWindow()
    window.until = float("inf")
    assert not signer.bound_window(window, now[0], kept=False)  # a fresh window starts here
    assert window.until == now[0] + signer.max_answer_age
    window.until = float("inf")
    assert signer.bound_window(window, now[0] + 10, kept=True)
    assert window.until == now[0] + signer.max_answer_age
    assert not signer.bound_window(window, now[0] + signer.max_answer_age, kept=True)
    assert signer.max_answer_age <= 6 * 3600


def test_the_general_path_signs_alike(key: ZoneKey, geoip_path: Path) -> None:
    """Responses the wire path does not take (compressed names it cannot reuse) are parsed,
    signed and rendered again by dnspython: the same records, validated the same way."""
    from ipaddress import ip_address

    from gtm.geodns.wire import Query, parse_query
    from gtm.geodns.zone import answer
    from gtm.runtime import build_snapshot

    settings = Settings(config=DEMO, policies=(POLICIES,), geoip_path=geoip_path)
    snapshot = build_snapshot(settings, time.time())
    signer = Signer(load_keys(key.path))
    zone = zone_data(snapshot.topology)
    client = ip_address("127.0.0.1")
    for name, rdtype in (
        ("chat.gtm.example.", "A"),
        ("gtm.example.", "DNSKEY"),
        ("gtm.example.", "NS"),
        ("nope.gtm.example.", "A"),
        ("chat.gtm.example.", "TXT"),
        ("api.gtm.example.", "TXT"),
    ):
        query = parse_query(q(name, rdtype).to_wire())
        assert isinstance(query, Query)
        unsigned = answer(query, client, snapshot, time.time(), None)
        fast = signer._finish_wire(unsigned, query, zone, True, None, time.time())
        general = signer._finish_message(unsigned, query, zone, True, None, time.time())
        assert fast is not None
        for result in (fast, general):
            r = dns.message.from_wire(result.wire)
            assert validate(r, key) >= 1
            assert result.record.response == fast.record.response
        a, b = dns.message.from_wire(fast.wire), dns.message.from_wire(general.wire)
        assert a.rcode() == b.rcode()
        for section in ("answer", "authority", "additional"):
            records = [(x.name, x.rdtype, x.covers, x.ttl, len(x)) for x in getattr(a, section)]
            assert sorted(records) == sorted(
                (x.name, x.rdtype, x.covers, x.ttl, len(x)) for x in getattr(b, section)
            )


def test_signatures_framed_here_are_dnspythons_byte_for_byte(key: ZoneKey) -> None:
    """frame_and_sign (the RRSIGs of types whose data is canonical as it is) gives the bytes
    dns.dnssec.sign gives: both sign deterministically (RFC 6979)."""
    rrsets = [
        dns.rrset.from_text("Chat.gtm.example.", 30, "IN", "A", "192.0.2.40", "192.0.2.10"),
        dns.rrset.from_text("chat.gtm.example.", 30, "IN", "AAAA", "2001:db8:40::1"),
        dns.rrset.from_text("gtm.example.", 3600, "IN", "TXT", '"v=spf1 mx -all"', '"b" "a"'),
        dns.rrset.from_text("gtm.example.", 3600, "IN", "CAA", '0 issue "letsencrypt.org"'),
        dns.rrset.from_text("*.gtm.example.", 60, "IN", "A", "192.0.2.1"),  # a literal "*"
        nsec_rrset(dns.name.from_text("NoPe.gtm.example."), 60, {RRSIG, NSEC, NXNAME}),
        dnskeys(key)[APEX],
    ]
    for rrset in rrsets:
        expected = dns.dnssec.sign(
            rrset, key.private, APEX, key.dnskey, inception=1_800_000_000, expiration=1_900_000_000
        ).to_wire()
        got = frame_and_sign(
            key,
            rrset.name.canonicalize().to_wire(),
            rrset.rdtype,
            rrset.ttl,
            [r.to_wire() for r in rrset],
            APEX.to_wire(),
            1_800_000_000,
            1_900_000_000,
        )
        assert got == expected, rrset


def test_nsec_next_name_is_lower_case_whatever_the_question() -> None:
    upper = nsec_rrset(dns.name.from_text("NoPe.Gtm.Example."), 60, {RRSIG, NSEC})
    lower = nsec_rrset(dns.name.from_text("nope.gtm.example."), 60, {RRSIG, NSEC})
    assert list(upper) == list(lower)


# -- a validating resolver, end to end ---------------------------------------------------------

StartUnbound = Callable[[int, ZoneKey], Awaitable[int]]


@pytest.fixture
async def start_unbound(tmp_path: Path) -> AsyncIterator[StartUnbound]:
    """unbound validating the zone served at ``auth`` from ``key``'s DS as its trust anchor."""
    running = resolvers.Resolvers()

    async def answers(port: int) -> bool:
        await resolve(port, "gtm.example.", "SOA")
        return True

    async def start(auth: int, anchored: ZoneKey) -> int:
        work = tmp_path / f"unbound{len(running.procs)}"
        work.mkdir()
        port = free_tcp_udp_port()
        anchor = f"gtm.example. IN DS {anchored.ds('gtm.example.').to_text()}"
        argv = resolvers.unbound_argv(require("unbound"), work, port, auth, trust_anchor=anchor)
        return await running.start(argv, work, port, answers, "unbound answering")

    yield start
    await running.stop()


async def resolve(
    port: int, name: str, rdtype: str = "A", ecs: str | None = None
) -> dns.message.Message:
    query = q(name, rdtype, ecs=ecs)
    return await dns.asyncquery.udp(query, "127.0.0.1", port=port, timeout=3)


async def test_unbound_validates_every_answer_type_the_zone_gives(
    start_node: StartNode, start_unbound: StartUnbound, key: ZoneKey, tmp_path: Path
) -> None:
    topology, policies = fail_closed_with_nodata(tmp_path)
    holder = KeyHolder(tmp_path / "keys")  # overrides are signed control-log entries
    node = await start_node(
        topology, policies=policies, dnssec_key_file=key.path, document_keys=(holder.public,)
    )
    port = await start_unbound(port_of(node), key)
    cases: list[tuple[str, str, str | None, bool]] = [
        # name, type, ECS, whether the answer has records
        ("chat.gtm.example.", "A", DE, True),  # geo answers, by the client's subnet
        ("chat.eu.gtm.example.", "AAAA", DE, True),
        ("chat.gtm.example.", "A", "203.0.113.0", True),
        ("gtm.example.", "SOA", None, True),
        ("gtm.example.", "NS", None, True),
        ("gtm.example.", "DNSKEY", None, True),
        ("ns1.gtm.example.", "A", None, True),
        # Static records (zone.records of the demo topology)
        ("gtm.example.", "TXT", None, True),
        ("gtm.example.", "CAA", None, True),
        ("gtm.example.", "MX", None, True),
        ("mail.gtm.example.", "AAAA", None, True),
        ("_submission._tcp.gtm.example.", "SRV", None, True),
        ("api.gtm.example.", "A", DE, True),  # CNAME to a service name: its geo answer
        ("api.gtm.example.", "TXT", None, False),  # CNAME, then NODATA at its target
        ("docs.gtm.example.", "CNAME", None, True),  # CNAME out of the zone
        # Denial
        ("chat.gtm.example.", "TXT", None, False),  # NODATA
        ("gtm.example.", "HINFO", None, False),  # NODATA at the apex
        ("eu.gtm.example.", "A", None, False),  # an empty non-terminal
        ("no-such-name.gtm.example.", "A", None, False),  # a black lie
        ("x.y.no-such-name.gtm.example.", "AAAA", None, False),
    ]
    for name, rdtype, ecs, positive in cases:
        r = await resolve(port, name, rdtype, ecs)
        assert r.rcode() == dns.rcode.NOERROR, (name, rdtype, r)
        assert r.flags & dns.flags.AD, (name, rdtype, "not validated", r)
        got = [x for x in r.answer if x.rdtype == dns.rdatatype.from_text(rdtype)]
        assert bool(got) == positive, (name, rdtype, r)
    # The fail-closed NODATA of a restricted name validates too.
    await force_eu(node.runtime.engine, down=True, holder=holder)

    async def failed_closed() -> bool:
        r = await resolve(port, "chat.eu.gtm.example.", "A", "198.51.100.0")
        return r.rcode() == dns.rcode.NOERROR and not r.answer and bool(r.flags & dns.flags.AD)

    await eventually(failed_closed, within=20, what="validated fail-closed NODATA")
    log = (tmp_path / "unbound0" / "log").read_text()
    assert "validation failure" not in log, log


@pytest.mark.parametrize("served", ["another key", "unsigned", "tampered signatures"])
async def test_unbound_refuses_answers_it_cannot_validate(
    start_node: StartNode,
    start_unbound: StartUnbound,
    key: ZoneKey,
    tmp_path: Path,
    served: str,
) -> None:
    """Anchored on ``key``, unbound answers SERVFAIL when the zone is signed with another key,
    served unsigned (signatures stripped), or its signatures do not verify."""
    if served == "another key":
        node = await start_node(dnssec_key_file=generate(tmp_path / "impostor.key").path)
    elif served == "unsigned":
        node = await start_node()
    else:
        node = await start_node(dnssec_key_file=key.path)
        assert node.dns is not None and node.dns.responder.signer is not None
        signer = node.dns.responder.signer
        genuine = signer.signatures

        def tampered(*args: Any) -> tuple[bytes, ...]:
            return tuple(s[:-1] + bytes([s[-1] ^ 1]) for s in genuine(*args))

        signer.signatures = tampered  # type: ignore[method-assign]
    port = await start_unbound(port_of(node), key)  # anchored on the real key
    for name, rdtype in (("chat.gtm.example.", "A"), ("gtm.example.", "SOA")):
        r = await resolve(port, name, rdtype)
        assert r.rcode() == dns.rcode.SERVFAIL and not r.answer, (served, name, rdtype, r)
    # val-log-level 2 says why.
    log = (tmp_path / "unbound0" / "log").read_text()
    assert "validation failure" in log and "gtm.example" in log, log


async def test_nsec_and_rrsig_asked_are_answered_with_the_names_own_nsec(
    start_node: StartNode, key: ZoneKey
) -> None:
    """Issue 32: under compact denial every name has an NSEC at itself (a name that does not
    exist, the NXNAME one), so NSEC asked is that NSEC, signed, and RRSIG asked is the RRSIG
    over it; never a NODATA whose NSEC lists the type asked (no validator accepts that)."""
    node = await start_node(dnssec_key_file=key.path)
    A, AAAA, CNAME = dns.rdatatype.A, dns.rdatatype.AAAA, dns.rdatatype.CNAME
    static = zone_data(node.runtime.store.current.topology).static.types.get("gtm.example.", set())
    apex_types = {dns.rdatatype.SOA, dns.rdatatype.NS, dns.rdatatype.DNSKEY, RRSIG, NSEC, *static}
    cases = [
        ("chat.gtm.example.", {A, AAAA, RRSIG, NSEC}),
        ("Chat.GTM.example.", {A, AAAA, RRSIG, NSEC}),
        ("gtm.example.", apex_types),
        ("api.gtm.example.", {CNAME, RRSIG, NSEC}),  # a CNAME owner: not followed
        ("eu.gtm.example.", {RRSIG, NSEC}),  # an empty non-terminal
        ("nope.gtm.example.", {RRSIG, NSEC, NXNAME}),  # the black lie's NSEC
        ("x.y.nope.gtm.example.", {RRSIG, NSEC, NXNAME}),
    ]
    for name, types in cases:
        owner = dns.name.from_text(name)
        following = dns.name.Name((b"\x00", *owner.canonicalize().labels))
        for r in await both(node, q(name, "NSEC", payload=512)):
            assert r.rcode() == dns.rcode.NOERROR and r.flags & dns.flags.AA, (name, r)
            assert not r.authority and validate(r, key) == 1
            (nsec,) = [x for x in r.answer if x.rdtype == NSEC]
            (rdata,) = list(nsec)
            listed = {int(t) for w, bitmap in rdata.windows for t in _types(w, bitmap)}
            assert nsec.name == owner and rdata.next == following and listed == types, name
            assert nsec.ttl == 60  # the negative TTL, as every NSEC here (RFC 9077)
        for r in await both(node, q(name, "RRSIG", payload=512)):
            assert r.rcode() == dns.rcode.NOERROR and not r.authority, (name, r)
            (sigs,) = r.answer
            assert sigs.rdtype == RRSIG and {s.type_covered for s in sigs} == {NSEC}
            assert {s.key_tag for s in sigs} == {key.tag}
    # Without DO: the NSEC of a name that exists is data like any other, asked for by type
    # (RFC 4035 §3); a name that does not exist is NXDOMAIN, as for every other type.
    plain = await udp(node, q("chat.gtm.example.", "NSEC", do=False))
    assert [x.rdtype for x in plain.answer] == [NSEC] and plain.rcode() == dns.rcode.NOERROR
    missing = await udp(node, q("nope.gtm.example.", "NSEC", do=False))
    assert missing.rcode() == dns.rcode.NXDOMAIN and not missing.answer
    assert node.dns is not None and node.dns.responder.signer is not None
    assert node.dns.responder.signer.general_path == 0
