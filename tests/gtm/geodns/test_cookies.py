"""DNS cookies (gtm.geodns.cookies): RFC 9018's published server cookies, the checks of RFC 7873,
and a node asked by dnspython, dig and kdig over real sockets.

Before cookies were built, the COOKIE option was ignored: no response carried one, a malformed
option was answered as if it were absent, BADCOOKIE did not exist and the rate limiter could
not tell a resolver proven by its cookie from a forged address. Each of those is asserted here.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from ipaddress import ip_address
from pathlib import Path

import dns.edns
import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import pytest

from gtm.errors import ConfigError
from gtm.geodns.cookies import (
    LIFETIME_S,
    RENEW_S,
    SKEW_S,
    ServerCookies,
    load_cookies,
    parse_secret,
)
from gtm.geodns.entries import Exact
from gtm.geodns.wire import Query, Rcode, Reject, cookie_well_formed, parse_query
from gtm.node import Node, shared_cookie_secret
from gtm.settings import Settings
from tests.support.waiting import eventually

from .conftest import StartNode, port_of, raw_udp, tcp, udp
from .test_dig import require

SECRET = bytes.fromhex("e5e973e5a6b2a43f48e7dc849e37bfcf")
V4 = ip_address("198.51.100.100")
A1 = bytes.fromhex("2464c4abcf10c957010000005cf79f111f8130c3eee29480")
A2 = bytes.fromhex("2464c4abcf10c957010000005cf7a871d4a564a1442aca77")
CLIENT = bytes.fromhex("2464c4abcf10c957")


# -- RFC 9018 Appendix A -------------------------------------------------------------------------


def test_the_published_server_cookies_are_made_exactly() -> None:
    cookies = ServerCookies(SECRET)
    # A.1: a client cookie alone gets a new server cookie.
    first = cookies.check(CLIENT, V4, 1559731985)
    assert (first.option, first.valid) == (A1, False)
    # A.2: forty minutes later the cookie is valid and, past half an hour, renewed.
    renewed = cookies.check(A1, V4, 1559734385)
    assert (renewed.option, renewed.valid) == (A2, True)
    # A.3: another client whose cookie has reserved octets set: they are part of the hash.
    # It comes back 1 h 52 min after it was stamped: out of date, so a new one is made.
    a3 = bytes.fromhex("fc93fc62807ddb8601abcdef5cf78f71a314227b6679ebf5")
    a3_client = ip_address("203.0.113.203")
    assert cookies.check(a3, a3_client, 0x5CF78F71 + 60).valid  # within its hour: ours
    third = cookies.check(a3, a3_client, 1559734700)
    assert not third.valid
    assert third.option == bytes.fromhex("fc93fc62807ddb86010000005cf7a9acf73a7810aca2381e")


def test_a_rolled_over_secret_still_accepts_the_previous_ones_cookies() -> None:
    # A.4: an IPv6 client's cookie made with the secret before a rollover.
    old = bytes.fromhex("dd3bdf9344b678b185a6f5cb60fca715")
    new = bytes.fromhex("445536bcd2513298075a5d379663c962")
    cookie = bytes.fromhex("22681ab97d52c298010000005cf7c57926556bd0934c72f8")
    client = ip_address("2001:db8:220:1:59de:d0f4:8769:82b8")
    at = 0x5CF7C579 + 60
    assert ServerCookies(new, old).check(cookie, client, at).valid
    assert not ServerCookies(new).check(cookie, client, at).valid
    # Renewed with the new secret, which the new secret alone then accepts.
    renewed = ServerCookies(new, old).check(cookie, client, at + RENEW_S).option
    assert renewed != cookie and ServerCookies(new).check(renewed, client, at + RENEW_S).valid


def test_a_cookie_is_valid_for_its_address_and_its_hour_only() -> None:
    cookies = ServerCookies(SECRET)
    stamp = 1559731985
    assert cookies.check(A1, V4, stamp + LIFETIME_S).valid
    assert not cookies.check(A1, V4, stamp + LIFETIME_S + 1).valid
    assert cookies.check(A1, V4, stamp - SKEW_S).valid  # our clock behind the issuer's
    assert not cookies.check(A1, V4, stamp - SKEW_S - 1).valid
    assert not cookies.check(A1, ip_address("198.51.100.101"), stamp).valid
    assert not cookies.check(A1[:8] + b"\x02" + A1[9:], V4, stamp).valid  # another version
    assert not cookies.check(A1[:-1] + b"\x00", V4, stamp).valid
    # Across the 32-bit wrap of the timestamp: an hour, not four billion seconds.
    wrapped = cookies.make(CLIENT, V4, 0xFFFFFF00)
    assert cookies.check(CLIENT + wrapped, V4, (0xFFFFFF00 + 1000) & 0xFFFFFFFF).valid


def test_a_young_cookie_is_echoed_and_the_response_lapses_when_it_is_due() -> None:
    cookies = ServerCookies(SECRET)
    checked = cookies.check(A1, V4, 1559731985 + 600.5)
    # Echoed as received: the response stays a function of the query's bytes.
    assert checked.valid and checked.option == A1
    assert checked.until == pytest.approx(1559731985 + RENEW_S + 0.5)
    fresh = cookies.check(CLIENT, V4, 1000.25)
    assert not fresh.valid and fresh.until == 1000.25 + RENEW_S


def test_the_option_lengths_rfc_7873_allows() -> None:
    assert [n for n in range(0, 45) if cookie_well_formed(n)] == [8, *range(16, 41)]


def _query_with(*options: dns.edns.Option) -> bytes:
    return dns.message.make_query(
        "chat.gtm.example.", "A", use_edns=0, options=list(options)
    ).to_wire()


@pytest.mark.parametrize("size", [0, 7, 9, 15, 41])
def test_a_malformed_cookie_option_is_formerr_with_an_opt(size: int) -> None:
    parsed = parse_query(_query_with(dns.edns.GenericOption(10, bytes(size))))
    assert isinstance(parsed, Reject) and parsed.rcode == Rcode.FORMERR
    assert parsed.edns is not None  # the OPT was read: the FORMERR carries one


def test_two_cookie_options_are_formerr_and_a_good_one_is_read() -> None:
    two = _query_with(dns.edns.GenericOption(10, CLIENT), dns.edns.GenericOption(10, CLIENT))
    parsed = parse_query(two)
    assert isinstance(parsed, Reject) and "more than one COOKIE" in parsed.reason
    good = parse_query(_query_with(dns.edns.GenericOption(10, A1)))
    assert isinstance(good, Query) and good.edns is not None and good.edns.cookie == A1


def test_secret_files_are_owner_only_and_hold_one_or_two_secrets(tmp_path: Path) -> None:
    path = tmp_path / "cookie.secret"
    path.write_text(f"{'11' * 16}\n{SECRET.hex()}\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="0600"):
        load_cookies(path, None)
    path.chmod(0o600)
    cookies = load_cookies(path, None)
    assert cookies.check(A1, V4, 1559731985).valid  # the second line: the previous secret
    assert cookies.make(CLIENT, V4, 1) == ServerCookies(bytes([0x11] * 16)).make(CLIENT, V4, 1)
    for bad in ("", "xyz", "11" * 15, "\n".join(["11" * 16] * 3)):
        with pytest.raises(ConfigError):
            parse_secret(bad, "test")
    assert load_cookies(None, SECRET.hex()).check(A1, V4, 1559731985).valid


def test_an_entry_with_a_cookie_lapses_at_its_first_answer_after_a_drain() -> None:
    entry = Exact(b"", None, ("udp", "A", "NOERROR"), False, until=100.0)  # type: ignore[arg-type]
    tallied: list[Exact] = []
    assert entry.tally(99.0, tallied) and entry.tally(100.5, tallied)  # within one drain
    entry.n = 0  # the audit writer drained it
    assert not entry.tally(100.5, tallied) and entry.n == 0
    assert tallied == [entry]  # listed once, at its first answer


def test_every_worker_is_given_one_cookie_secret(tmp_path: Path) -> None:
    base = Settings(database_url="sqlite://", spool_dir=tmp_path)
    shared = shared_cookie_secret(base)
    assert shared.dns_cookie_secret is not None
    parse_secret(shared.dns_cookie_secret.get_secret_value(), "generated")
    assert shared_cookie_secret(shared) is shared  # a given secret is kept
    path = tmp_path / "s"
    assert (
        shared_cookie_secret(
            base.model_copy(update={"dns_cookie_secret_file": path})
        ).dns_cookie_secret
        is None
    )
    assert "dns_cookie_secret=SecretStr('**********')" in repr(shared)


# -- a node, over real sockets -------------------------------------------------------------------


def _cookie_of(message: dns.message.Message) -> bytes | None:
    for option in message.options:
        if option.otype == dns.edns.OptionType.COOKIE:
            return option.to_wire()
    return None


def _ask(option: bytes, name: str = "chat.gtm.example.") -> dns.message.Message:
    return dns.message.make_query(
        name, "A", use_edns=0, options=[dns.edns.GenericOption(10, option)]
    )


async def test_a_node_hands_out_cookies_and_echoes_them_back(start_node: StartNode) -> None:
    node = await start_node()
    stats = node.dns.responder.stats  # type: ignore[union-attr]
    first = await udp(node, _ask(CLIENT))
    issued = _cookie_of(first)
    assert issued is not None and issued[:8] == CLIENT and len(issued) == 24
    assert first.rcode() == dns.rcode.NOERROR and first.answer
    assert stats.cookies["new"] == 1
    # Brought back: valid, and echoed as it came (it is younger than half an hour).
    again = await udp(node, _ask(issued))
    assert _cookie_of(again) == issued and again.answer == first.answer
    assert stats.cookies["valid"] == 1
    # The same bytes again come from the first level: the same answer, not checked again.
    hit = await udp(node, _ask(issued))
    assert _cookie_of(hit) == issued and stats.cookies["valid"] == 1
    # The same cookie from another address is not this client's: a new one for that address.
    other = await udp(node, _ask(issued), source="127.0.0.2")
    assert _cookie_of(other) not in (None, issued)
    assert stats.cookies["invalid"] == 1
    # Over TCP too; and a query without a cookie is answered without one, as before.
    assert _cookie_of(await tcp(node, _ask(CLIENT))) is not None
    plain = await udp(node, dns.message.make_query("chat.gtm.example.", "A", use_edns=0))
    assert _cookie_of(plain) is None and plain.answer == first.answer
    # A malformed option: FORMERR with an OPT, on the wire too.
    bad = await raw_udp(node, _query_with(dns.edns.GenericOption(10, bytes(12))))
    assert bad is not None
    reply = dns.message.from_wire(bad)
    assert reply.rcode() == dns.rcode.FORMERR and reply.edns == 0


async def test_the_first_level_renews_a_cookie_due_for_it(start_node: StartNode) -> None:
    node = await start_node()
    responder = node.dns.responder  # type: ignore[union-attr]
    issued = _cookie_of(await udp(node, _ask(CLIENT)))
    assert issued is not None
    echoed = _cookie_of(await udp(node, _ask(issued)))
    assert echoed == issued  # kept as a first-level entry for these bytes
    now = responder.clock()
    later = now + RENEW_S + 5
    # The caches themselves still hold then: what renews the cookie is the entry's own bound.
    assert responder._window.until > later
    list(responder.drain_tallies())  # the audit writer's drain
    responder.clock = lambda: later
    renewed = _cookie_of(await udp(node, _ask(issued)))
    assert renewed is not None and renewed[:8] == CLIENT and renewed != issued
    assert responder.stats.cookies["valid"] == 2  # checked again: the long way


async def test_required_cookies_get_badcookie_then_the_answer(start_node: StartNode) -> None:
    node = await start_node(dns_require_cookie=True)
    stats = node.dns.responder.stats  # type: ignore[union-attr]
    refused = await udp(node, _ask(CLIENT))
    assert refused.rcode() == 23  # BADCOOKIE, with a cookie to retry with
    assert not refused.answer
    issued = _cookie_of(refused)
    assert issued is not None
    answered = await udp(node, _ask(issued))
    assert answered.rcode() == dns.rcode.NOERROR and answered.answer
    # A client that speaks no cookies is answered as before; TCP proves the address itself.
    plain = await udp(node, dns.message.make_query("chat.gtm.example.", "A", use_edns=0))
    assert plain.answer
    assert (await tcp(node, _ask(CLIENT))).answer
    assert stats.cookies["badcookie"] == 1


async def test_a_proven_cookie_passes_the_rate_limiter(start_node: StartNode) -> None:
    node = await start_node(dns_rate_limit=1, dns_rate_slip=0, dns_rate_limit_exempt=())
    responder = node.dns.responder  # type: ignore[union-attr]
    assert responder.rrl is not None
    issued = _cookie_of(await udp(node, _ask(CLIENT)))
    assert issued is not None
    # Far past the limit (the limiter says so for most of them): each query with the valid
    # cookie is answered in full, none counted as limited.
    for _ in range(20):
        reply = await udp(node, _ask(issued))
        assert reply.answer and not reply.flags & dns.flags.TC
    assert responder.rrl.limited >= 5  # 20 round trips would need 15 s to stay under it
    assert responder.stats.rate_limited == 0
    # Without it, the same sender is held back: dropped and counted (five at once: at most a
    # token or two has come back meanwhile).
    plain = dns.message.make_query("chat.gtm.example.", "A", use_edns=0).to_wire()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _ in range(5):
            sock.sendto(plain, ("127.0.0.1", port_of(node)))
        await eventually(lambda: responder.stats.rate_limited >= 1, 10, "the queries limited")


def _ours(node: Node, reply: dns.message.Message) -> bytes:
    """The cookie ``reply`` carries, checked to be this client's and a valid one of the
    node's for 127.0.0.1."""
    responder = node.dns.responder  # type: ignore[union-attr]
    issued = _cookie_of(reply)
    assert issued is not None, f"no cookie in the {dns.rcode.to_text(reply.rcode())}"
    assert issued[:8] == CLIENT and len(issued) == 24
    assert responder.cookies.check(issued, V_LOOP, responder.clock()).valid
    return issued


V_LOOP = ip_address("127.0.0.1")


async def test_error_answers_carry_a_cookie_unless_the_cookie_is_the_error(
    start_node: StartNode,
) -> None:
    # Before, FORMERR, BADVERS and NOTIMP went out without the cookie: a client speaking
    # cookies (RFC 7873 §5.2) had to ask again to get one.
    node = await start_node()
    cookie = dns.edns.GenericOption(10, CLIENT)
    newer = dns.message.make_query("chat.gtm.example.", "A", use_edns=1, options=[cookie])
    badvers = dns.message.from_wire(await raw_udp(node, newer.to_wire()) or b"")
    assert badvers.rcode() == dns.rcode.BADVERS
    _ours(node, badvers)
    status = _ask(CLIENT)
    status.set_opcode(dns.opcode.STATUS)
    notimp = dns.message.from_wire(await raw_udp(node, status.to_wire()) or b"")
    assert notimp.rcode() == dns.rcode.NOTIMP
    _ours(node, notimp)
    # An ECS option with more address octets than its source length allows: FORMERR, and
    # the cookie option beside it was sound.
    bad_ecs = dns.edns.GenericOption(8, bytes.fromhex("0001180000c00002ff"))
    formerr = dns.message.from_wire(await raw_udp(node, _query_with(cookie, bad_ecs)) or b"")
    assert formerr.rcode() == dns.rcode.FORMERR
    _ours(node, formerr)
    # The cookie option itself malformed (RFC 7873 §5.2.2): FORMERR with no cookie.
    broken = dns.message.from_wire(
        await raw_udp(node, _query_with(dns.edns.GenericOption(10, bytes(12)))) or b""
    )
    assert broken.rcode() == dns.rcode.FORMERR and _cookie_of(broken) is None


async def test_a_slip_hands_out_a_cookie_whose_retry_passes_the_limiter(
    start_node: StartNode,
) -> None:
    # Before, a slip carried no cookie: a cookie-speaking client held back had to retry over
    # TCP, though a cookie of ours would pass the limiter over UDP.
    node = await start_node(dns_rate_limit=1, dns_rate_slip=1, dns_rate_limit_exempt=())
    responder = node.dns.responder  # type: ignore[union-attr]
    slip = None
    for _ in range(50):
        reply = await udp(node, _ask(CLIENT))
        if reply.flags & dns.flags.TC:
            slip = reply
            break
    assert slip is not None, "no query was held back at one a second"
    assert not slip.answer and responder.stats.slipped >= 1
    issued = _ours(node, slip)
    retry = await udp(node, _ask(issued))
    assert retry.answer and not retry.flags & dns.flags.TC


async def _run(tool: str, port: int, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        require(tool),
        "@127.0.0.1",
        "-p",
        str(port),
        "+time=5",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_dig_and_kdig_speak_cookies_with_a_node(start_node: StartNode) -> None:
    node = await start_node(dns_require_cookie=True)
    port = port_of(node)
    # dig: BADCOOKIE, then its retry with the server cookie is answered.
    out = await _run("dig", port, "+cookie", "chat.gtm.example.", "A")
    assert "BADCOOKIE, retrying" in out, out
    assert "status: NOERROR" in out and "(good)" in out, out
    cookie = next(line for line in out.splitlines() if "COOKIE:" in line).split()[2]
    assert len(cookie) == 48
    # Given that cookie back: answered at once, the same cookie echoed.
    out = await _run("dig", port, f"+cookie={cookie}", "chat.gtm.example.", "A")
    assert "BADCOOKIE" not in out and "status: NOERROR" in out and cookie in out, out
    # kdig with the cookie dig was given: the same server accepts it from the same address.
    out = await _run("kdig", port, f"+cookie={cookie}", "chat.gtm.example.", "A")
    assert "NOERROR" in out and cookie.lower() in out.lower().replace(" ", ""), out


def test_the_cookie_secret_command_writes_an_owner_only_file(tmp_path: Path) -> None:
    path = tmp_path / "cookie.secret"
    run: Callable[[], subprocess.CompletedProcess[str]] = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "gtm", "dns", "cookie-secret", str(path)],
        capture_output=True,
        text=True,
        env=os.environ | {"GTM_LOG_FORMAT": "json"},
        timeout=60,
    )
    done = run()
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = path.read_text()
    load_cookies(path, None)
    again = run()
    assert again.returncode == 2 and "never overwritten" in again.stderr
    assert path.read_text() == secret


async def test_a_node_accepts_cookies_made_with_its_secret_file(
    start_node: StartNode, tmp_path: Path
) -> None:
    # Another member of the anycast set made this cookie with the shared secret.
    path = tmp_path / "cookie.secret"
    path.write_text(SECRET.hex() + "\n")
    path.chmod(0o600)
    node: Node = await start_node(dns_cookie_secret_file=path)
    now = int(node.dns.responder.clock())  # type: ignore[union-attr]
    cookie = CLIENT + ServerCookies(SECRET).make(CLIENT, ip_address("127.0.0.1"), now)
    reply = await udp(node, _ask(cookie))
    assert _cookie_of(reply) == cookie
    assert node.dns.responder.stats.cookies["valid"] == 1  # type: ignore[union-attr]


async def test_a_loose_secret_file_stops_the_start(start_node: StartNode, tmp_path: Path) -> None:
    path = tmp_path / "cookie.secret"
    path.write_text(SECRET.hex() + "\n")
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="mode 640") as caught:
        await start_node(dns_cookie_secret_file=path)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("needs", ["dns_require_cookie", "dns_establish_with_cookie"])
def test_what_needs_cookies_is_refused_with_cookies_off(needs: str) -> None:
    with pytest.raises(ValueError, match=f"{needs} needs dns_cookies"):
        Settings(database_url="sqlite://", dns_cookies=False, **{needs: True})
