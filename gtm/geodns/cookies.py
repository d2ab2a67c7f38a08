"""DNS cookies (RFC 7873), with the server cookies of RFC 9018: what a query's COOKIE option
proves, and the option its response carries.

A client sends an 8-octet client cookie; the server answers with it and a server cookie, a
keyed hash of the client cookie, the client's address and the time. A later query that brings
that server cookie back proves the client receives what is sent to its address: an off-path
attacker forging the address never sees the cookie. The construction is RFC 9018's (version 1,
SipHash-2-4 under a 16-octet secret, a 32-bit timestamp), so servers of one anycast set that
share the secret (NSD, Knot, BIND, PowerDNS and this one) accept each other's cookies.

A server cookie is valid from five minutes before its timestamp (clock skew) to an hour after;
past half an hour a new one is handed out in its place (RFC 9018 §4.3). A valid cookie younger
than that is echoed as received, so the response is a function of the query's bytes alone and
the responder's first level (exact query bytes per sender) keeps working for cookie-speaking
resolvers: its entries lapse when the cookie they carry is due for renewal (:attr:`Checked.until`).

The secret comes from a file (mode 0600: ``gtm.secret_files``) or the environment, so every
worker and every member of an anycast set can share it; a second secret, the previous one, is
still accepted during a rollover. Without either, a random secret per start: cookies then stop
being valid at a restart (clients are handed new ones; nothing else is lost).

Pure logic: the caller passes the time.
"""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path

from siphash24 import siphash24

from gtm.errors import ConfigError, Problem
from gtm.geodns.render import with_option
from gtm.geodns.wire import COOKIE_CODE
from gtm.secret_files import read_owner_only

IPAddress = IPv4Address | IPv6Address

CLIENT_LEN = 8
SERVER_LEN = 16  # RFC 9018's server cookie: version, reserved, timestamp, hash
SECRET_LEN = 16
VERSION = 1
LIFETIME_S = 3600  # a server cookie is valid this long after its timestamp (RFC 9018 §4.3)
RENEW_S = 1800  # and is replaced by a new one past this age
SKEW_S = 300  # a timestamp this far ahead of our clock is still accepted
# Octets the response's COOKIE option takes in the OPT record (code, length, both cookies).
OPTION_LEN = 4 + CLIENT_LEN + SERVER_LEN
_STAMP = struct.Struct("!I")


def _age(stamp: int, now: int) -> int:
    """Seconds from ``stamp`` to ``now`` in serial number arithmetic (RFC 1982): negative when
    the stamp is ahead; right across the 32-bit wrap."""
    diff = (now - stamp) & 0xFFFFFFFF
    return diff - (1 << 32) if diff >= 1 << 31 else diff


@dataclass(frozen=True, slots=True)
class Checked:
    """What a query's COOKIE option came to."""

    option: bytes  # the response's COOKIE option data: the client cookie and a server cookie
    valid: bool  # the query brought back a server cookie of ours, for this address, in date
    until: float  # the response may be repeated (a first-level entry) until this time


class ServerCookies:
    """Checks the cookies queries bring and makes the ones responses carry (RFC 9018)."""

    def __init__(self, secret: bytes, previous: bytes | None = None) -> None:
        for key in (secret, previous):
            if key is not None and len(key) != SECRET_LEN:
                raise ValueError(f"a cookie secret is {SECRET_LEN} octets, not {len(key)}")
        self._secret = secret
        self._keys = (secret,) if previous is None else (secret, previous)

    @classmethod
    def random(cls) -> ServerCookies:
        return cls(secrets.token_bytes(SECRET_LEN))

    def _hash(self, key: bytes, client_cookie: bytes, head: bytes, client: IPAddress) -> bytes:
        # Client cookie | version | reserved | timestamp | client address (RFC 9018 §4.4).
        return bytes(siphash24(client_cookie + head + client.packed, key=key).digest())

    def make(self, client_cookie: bytes, client: IPAddress, now: int) -> bytes:
        """A new server cookie for ``client_cookie`` from ``client`` at ``now`` (seconds)."""
        head = bytes((VERSION, 0, 0, 0)) + _STAMP.pack(now & 0xFFFFFFFF)
        return head + self._hash(self._secret, client_cookie, head, client)

    def _valid_age(self, option: bytes, client: IPAddress, seconds: int) -> int | None:
        """The age of the server cookie ``option`` brings when it is ours for ``client`` and in
        date at ``seconds``; None when it is not."""
        server = option[CLIENT_LEN:]
        if len(server) != SERVER_LEN or server[0] != VERSION:
            return None
        head = server[:8]
        age = _age(_STAMP.unpack_from(head, 4)[0], seconds)
        if not -SKEW_S <= age <= LIFETIME_S:
            return None
        client_cookie = option[:CLIENT_LEN]
        for key in self._keys:
            if secrets.compare_digest(self._hash(key, client_cookie, head, client), server[8:]):
                return age
        return None

    def valid(self, option: bytes, client: IPAddress, now: float) -> bool:
        """Whether ``option`` (a well-formed COOKIE option) brings a server cookie of ours for
        ``client``, in date at ``now``: :meth:`check`'s verdict alone, with no cookie made."""
        return self._valid_age(option, client, int(now)) is not None

    def check(self, option: bytes, client: IPAddress, now: float) -> Checked:
        """The verdict on a well-formed COOKIE option (the parser checked its length:
        :func:`gtm.geodns.wire.cookie_well_formed`) from ``client`` at ``now``, and the option
        to answer with."""
        seconds = int(now)
        client_cookie = option[:CLIENT_LEN]
        age = self._valid_age(option, client, seconds)
        if age is not None:
            if age < RENEW_S:
                # Echoed as received: the response stays a function of the query.
                return Checked(option, True, now + (RENEW_S - age))
            return Checked(
                client_cookie + self.make(client_cookie, client, seconds), True, now + RENEW_S
            )
        # A client cookie alone, or a server cookie not ours (another secret, another address,
        # out of date, another construction): a new one.
        fresh = client_cookie + self.make(client_cookie, client, seconds)
        return Checked(fresh, False, now + RENEW_S)


def with_cookie(wire: bytes, checked: Checked) -> bytes:
    """``wire`` (a response whose query brought a COOKIE option) with the option ``checked``
    says to answer with, first in its OPT record (an ECS echo stays last)."""
    out = with_option(wire, COOKIE_CODE, checked.option)
    return wire if out is None else out


def parse_secret(text: str, source: str) -> tuple[bytes, bytes | None]:
    """The secret and, on a second line, the previous one (hex, 32 digits each) from the
    text of a secret file or variable named ``source`` in errors."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not 1 <= len(lines) <= 2:
        raise ConfigError(
            [
                Problem(
                    source,
                    "",
                    "a cookie secret is one line of 32 hex digits (and optionally "
                    "a second: the previous secret, still accepted)",
                )
            ]
        )
    keys: list[bytes] = []
    for line in lines:
        try:
            key = bytes.fromhex(line)
        except ValueError:
            key = b""
        if len(key) != SECRET_LEN:
            raise ConfigError(
                [
                    Problem(
                        source,
                        "",
                        f"a cookie secret is {2 * SECRET_LEN} hex digits "
                        "(`gtm dns cookie-secret` makes one)",
                    )
                ]
            )
        keys.append(key)
    return keys[0], keys[1] if len(keys) > 1 else None


def load_cookies(path: Path | None, value: str | None) -> ServerCookies:
    """The server cookies of a secret file (mode 0600), else of a secret given in the
    environment, else of a random secret for this process."""
    if path is not None:
        raw = read_owner_only(path, "the DNS cookie secret")
        return ServerCookies(*parse_secret(raw.decode("ascii", "replace"), str(path)))
    if value is not None:
        return ServerCookies(*parse_secret(value, "GTM_DNS_COOKIE_SECRET"))
    return ServerCookies.random()


def new_secret() -> str:
    """A new secret's file content: 32 hex digits and a newline."""
    return secrets.token_bytes(SECRET_LEN).hex() + "\n"


__all__ = [
    "COOKIE_CODE",
    "OPTION_LEN",
    "Checked",
    "ServerCookies",
    "load_cookies",
    "new_secret",
    "parse_secret",
    "with_cookie",
]
