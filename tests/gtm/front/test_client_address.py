"""Reading the client address: the peer, or trusted proxies' forwarding headers."""

from __future__ import annotations

from ipaddress import ip_address, ip_network

import pytest

from gtm.front.client_address import ForwardingError, TrustedProxies, client_address

PROXIES = TrustedProxies([ip_network("10.0.0.0/8"), ip_network("2001:db8:ff::/48")])
PROXY = ip_address("10.0.0.1")
OUTSIDER = ip_address("192.0.2.1")


def test_untrusted_peer_is_the_client_whatever_it_claims() -> None:
    assert client_address(OUTSIDER, PROXIES, [b"for=1.2.3.4"], [b"5.6.7.8"]) == OUTSIDER
    assert client_address(OUTSIDER, PROXIES, [], [b"garbage"]) == OUTSIDER
    assert client_address(PROXY, TrustedProxies([]), [], [b"5.6.7.8"]) == PROXY


@pytest.mark.parametrize(
    ("forwarded", "xff", "expected"),
    [
        ([], [b"198.51.100.7"], "198.51.100.7"),
        ([], [b"1.1.1.1, 198.51.100.7, 10.9.9.9"], "198.51.100.7"),
        ([], [b"1.1.1.1", b"198.51.100.7"], "198.51.100.7"),  # repeated headers are one list
        ([], [b"198.51.100.7:5555"], "198.51.100.7"),
        ([], [b"[2001:db8::7]:443"], "2001:db8::7"),
        ([], [b"10.1.1.1, 10.2.2.2"], "10.1.1.1"),  # every hop trusted: the leftmost
        ([b'for="[2001:db8::9]:80";proto=https, for=10.3.3.3'], [b"8.8.8.8"], "2001:db8::9"),
        ([b"For=203.0.113.4;by=10.0.0.1"], [], "203.0.113.4"),
        ([b"for=unknown"], [], "10.0.0.1"),
        ([b"for=_hidden, for=10.4.4.4"], [], "10.4.4.4"),
    ],
)
def test_trusted_chain_is_read_right_to_left(
    forwarded: list[bytes], xff: list[bytes], expected: str
) -> None:
    assert client_address(PROXY, PROXIES, forwarded, xff) == ip_address(expected)


def test_ipv4_mapped_peer_matches_ipv4_networks() -> None:
    mapped = ip_address("::ffff:10.0.0.1")
    assert client_address(mapped, PROXIES, [], [b"198.51.100.7"]) == ip_address("198.51.100.7")


@pytest.mark.parametrize(
    ("forwarded", "xff"),
    [
        ([], [b"not-an-ip"]),
        ([], [b"1.2.3.4, "]),
        ([], [b"[2001:db8::1"]),
        ([], [b",".join([b"10.0.0.2"] * 40)]),
        ([b"for"], []),
        ([b"proto=https"], []),
        ([b'for="1.2.3.4'], []),
        ([b"for=1.2.3.4;for=5.6.7.8"], []),
        ([b"for=300.1.1.1"], []),
    ],
)
def test_malformed_headers_from_a_trusted_peer_are_errors(
    forwarded: list[bytes], xff: list[bytes]
) -> None:
    with pytest.raises(ForwardingError):
        client_address(PROXY, PROXIES, forwarded, xff)
