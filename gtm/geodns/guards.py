"""The responder's guards (gtm.geodns.responder): what a query gets before, or instead of, the
zone's answer when the rate limiter holds its sender back or it brings a DNS cookie
(gtm.geodns.cookies). A part of :class:`gtm.geodns.responder.Responder` (one of its base
classes), apart for its size: what it reads of the responder is declared here."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from ipaddress import IPv4Address, IPv6Address
from typing import TYPE_CHECKING

from gtm.geodns.admission import sender_network
from gtm.geodns.budget import Generations
from gtm.geodns.cookies import CLIENT_LEN, LIFETIME_S, Checked, ServerCookies, with_cookie
from gtm.geodns.entries import Exact
from gtm.geodns.identity import ServerIdentity
from gtm.geodns.ratelimit import Limit
from gtm.geodns.rejects import reject_response, slip_response
from gtm.geodns.stats import DnsStats
from gtm.geodns.wire import (
    Edns,
    Query,
    Rcode,
    Reject,
    cookie_option,
    parse_query,
    peer_address,
)
from gtm.runtime import Runtime

IPAddress = IPv4Address | IPv6Address
PROVEN_NETWORKS = 65_536  # networks remembered as proven by a cookie (two generations)


class Guards:
    """The rate limiter's and the cookies' methods of the responder."""

    runtime: Runtime
    stats: DnsStats
    clock: Callable[[], float]
    # DNS cookies (gtm.geodns.cookies): checked where a query is parsed, and the response
    # given one; None: the COOKIE option is ignored. ``require_cookie``: a UDP query with a
    # client cookie but no valid server cookie is answered BADCOOKIE (RFC 7873 §5.2.3).
    cookies: ServerCookies | None
    require_cookie: bool
    identity: ServerIdentity | None
    _udp: dict[str, dict[bytes, Exact]]
    _proven: Generations[Hashable, float]  # network -> until when it is proven (prove)
    _cookied: Generations[Hashable, float]  # network -> until when a cookie proved it

    if TYPE_CHECKING:

        def _repeat(self, by_query: dict[bytes, Exact] | None, wire: bytes) -> bytes | None: ...

        def _answer(
            self, wire: bytes, client: IPAddress, udp: bool, sender: str | IPAddress
        ) -> bytes | None: ...

    def _check_cookie(self, option: bytes, client: IPAddress, now: float) -> Checked:
        """The verdict on a query's COOKIE option (``self.cookies`` is set), counted; a valid
        one proves its sender's network for the cookie's lifetime (:meth:`proven`)."""
        checked = self.cookies.check(option, client, now)  # type: ignore[union-attr]
        if checked.valid:
            self.stats.cookies["valid"] += 1
            network = sender_network(str(client))
            self.prove(network, now)
            self._cookied.put(network, now + LIFETIME_S)
        else:
            self.stats.cookies["new" if len(option) == CLIENT_LEN else "invalid"] += 1
        return checked

    def prove(self, network: Hashable, now: float) -> None:
        """Sender ``network``'s return path is proven at ``now``, for the hour a cookie is
        valid: a query from it brought back a server cookie of ours, or came over a TCP
        connection (whose handshake it answered)."""
        self._proven.put(network, now + LIFETIME_S)

    def proven(self, network: Hashable) -> bool:
        """Whether sender ``network`` (gtm.geodns.admission.sender_network) proved its return
        path within the last hour (:meth:`prove`)."""
        until = self._proven.get(network)
        return until is not None and until > self.clock()

    def speaks_cookies(self, network: Hashable) -> bool:
        """Whether a query from sender ``network`` brought a valid server cookie within the
        last hour: its clients speak cookies, so a datagram in its name without one is
        suspect (gtm.geodns.udp drops those while an established network's socket is behind)."""
        until = self._cookied.get(network)
        return until is not None and until > self.clock()

    def cookie_proves(self, wire: bytes, host: str) -> bool:
        """Whether the query ``wire`` from ``host`` brings a valid server cookie (read without
        parsing the rest: gtm.geodns.wire.cookie_option); False with cookies off."""
        if self.cookies is None:
            return False
        option = cookie_option(wire)
        return (
            option is not None
            and len(option) > CLIENT_LEN
            and self.cookies.valid(option, peer_address(host), self.clock())
        )

    def _rejected(self, reject: Reject, client: IPAddress, udp: bool, now: float) -> bytes | None:
        """The answer to a packet the parser rejected (gtm.geodns.rejects), with the NSID when
        configured and asked for. FORMERR, NOTIMP and BADVERS carry a cookie too (RFC 7873
        §5.2.2-3): a client that retries with another version, or over another path, has it
        already."""
        server_id = self.identity.server_id if self.identity is not None else None
        out = reject_response(self.runtime, self.stats, reject, client, udp, server_id)
        return self._with_cookie_for(out, reject.edns, client, now)

    def _with_cookie_for(
        self, out: bytes | None, edns: Edns | None, client: IPAddress, now: float
    ) -> bytes | None:
        """``out``, an answer that is not the zone's (an error, a slip), with the cookie its
        query's COOKIE option gets (checked and counted), when cookies are on and it brought
        one."""
        if out is None or self.cookies is None or edns is None or edns.cookie is None:
            return out
        return with_cookie(out, self._check_cookie(edns.cookie, client, now))

    def _bad_cookie(self, query: Query, client: IPAddress, checked: Checked) -> bytes | None:
        """BADCOOKIE with a new server cookie, for a UDP query without a valid one while
        cookies are required: the client asks again with it (or over TCP)."""
        self.stats.cookies["badcookie"] += 1
        reject = Reject(
            query.id,
            query.flags,
            Rcode.BADCOOKIE,
            "no valid server cookie",
            query.qname,
            query.qtype,
            query.qclass,
            query.edns,
        )
        out = reject_response(self.runtime, self.stats, reject, client, True)
        return None if out is None else with_cookie(out, checked)

    def _limited(self, wire: bytes, host: str, verdict: Limit) -> bytes | None:
        """A datagram over the rate limit: dropped, or (slip) answered empty and truncated;
        answered as any other when it brings a valid server cookie: its address is proven,
        so it is neither spoofed nor reflected (as BIND and Knot exempt it)."""
        limited: Query | Reject | None = None
        # Parsed only when it may hold a COOKIE option (its code and a length's first octet):
        # a flood held back by the limiter costs a substring search a datagram, not a parse.
        if self.cookies is not None and b"\x00\x0a\x00" in wire:
            limited = parse_query(wire)
            if (
                isinstance(limited, Query)
                and limited.edns is not None
                and limited.edns.cookie is not None
                and len(limited.edns.cookie) > CLIENT_LEN  # a server cookie to check
            ):
                client = peer_address(host)
                if self.cookies.check(limited.edns.cookie, client, self.clock()).valid:
                    return self._repeat(self._udp.get(host), wire) or self._answer(
                        wire, client, True, host
                    )
        self.stats.rate_limited += 1
        if verdict is Limit.DROP:
            return None
        self.stats.slipped += 1
        if limited is None:
            limited = parse_query(wire)
        if not isinstance(limited, Query):
            return None
        client = peer_address(host)
        out = slip_response(self.runtime, self.stats, limited, client)
        # The slip hands out a server cookie: the client's retry that brings it back passes
        # the limiter (above), over UDP, with no need for TCP.
        return self._with_cookie_for(out, limited.edns, client, self.clock())
