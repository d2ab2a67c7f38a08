"""Who the client is: the socket peer, or what trusted proxies in front of us say it is.

Forwarding headers are believed only when the peer itself is a configured trusted proxy; from
anyone else they are ignored (a client can write any ``X-Forwarded-For`` it likes). When the
peer is trusted the chain is read right to left, skipping further trusted proxies: the first
address that is not a trusted proxy is the client (the left part of the chain was written by
the client and proves nothing). ``Forwarded`` (RFC 7239) wins over ``X-Forwarded-For`` when
both are present, because it is the standard one and proxies that send both agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

# Bounds on what a trusted chain may hold; a longer one is malformed rather than slow to read.
MAX_HOPS = 32
_CACHE_LIMIT = 100_000


class ForwardingError(ValueError):
    """A trusted proxy sent a forwarding header that cannot be read."""

    def __init__(self, header: str, problem: str) -> None:
        super().__init__(f"{header}: {problem}")
        self.header = header
        self.problem = problem


_ADDRESSES: dict[str, IPAddress] = {}


def parse_peer(host: str) -> IPAddress:
    """The socket peer's address (memoised: constructing ip_address objects is the expensive
    part of reading a peer, and the same peers recur on keep-alive connections and proxies)."""
    addr = _ADDRESSES.get(host)
    if addr is None:
        if len(_ADDRESSES) >= _CACHE_LIMIT:
            _ADDRESSES.clear()
        addr = ip_address(host.split("%", 1)[0])  # drop an IPv6 zone id
        _ADDRESSES[host] = addr
    return addr


class TrustedProxies:
    """The configured proxy networks, with a per-address memo of the membership test."""

    def __init__(self, networks: Iterable[IPNetwork]) -> None:
        self.networks: tuple[IPNetwork, ...] = tuple(networks)
        self._memo: dict[IPAddress, bool] = {}
        self.resolved: dict[
            tuple[IPAddress, tuple[bytes, ...], tuple[bytes, ...]], IPAddress | ForwardingError
        ] = {}

    def __bool__(self) -> bool:
        return bool(self.networks)

    def __contains__(self, address: IPAddress) -> bool:
        hit = self._memo.get(address)
        if hit is None:
            mapped = address.ipv4_mapped if isinstance(address, IPv6Address) else None
            probe = mapped if mapped is not None else address
            hit = any(probe in net for net in self.networks if net.version == probe.version)
            if len(self._memo) >= _CACHE_LIMIT:
                self._memo.clear()
            self._memo[address] = hit
        return hit


def _strip_port_v4(text: str) -> str:
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def _xff_hops(values: Sequence[bytes]) -> list[str]:
    hops: list[str] = []
    for value in values:
        for part in value.decode("latin-1").split(","):
            hops.append(part.strip())
    return hops


def _parse_xff_hop(hop: str) -> IPAddress:
    text = hop
    if text.startswith("["):  # "[2001:db8::1]:443"
        end = text.find("]")
        if end < 0:
            raise ForwardingError("X-Forwarded-For", f"unbalanced bracket in {hop!r}")
        text = text[1:end]
    else:
        text = _strip_port_v4(text)
    try:
        return ip_address(text)
    except ValueError:
        raise ForwardingError("X-Forwarded-For", f"not an address: {hop!r}") from None


def _forwarded_hops(values: Sequence[bytes]) -> list[str | None]:
    """The ``for=`` node of each forwarded-element; None for "unknown" or an obfuscated node
    (RFC 7239 section 6), which names nobody we could locate."""
    hops: list[str | None] = []
    for value in values:
        for element in value.decode("latin-1").split(","):
            node: str | None = None
            found = False
            for pair in element.split(";"):
                key, sep, val = pair.strip().partition("=")
                if not sep:
                    if pair.strip():
                        raise ForwardingError("Forwarded", f"not a key=value pair: {pair!r}")
                    continue
                if key.strip().lower() != "for":
                    continue
                if found:
                    raise ForwardingError("Forwarded", "more than one for= in one element")
                found = True
                val = val.strip()
                if len(val) >= 2 and val[0] == '"' and val[-1] == '"':
                    val = val[1:-1]
                elif '"' in val:
                    raise ForwardingError("Forwarded", f"unbalanced quotes in {val!r}")
                node = val
            if not found:
                raise ForwardingError("Forwarded", f"element without for=: {element.strip()!r}")
            hops.append(node)
    return hops


def _parse_forwarded_node(node: str | None) -> IPAddress | None:
    if node is None:
        return None
    if node.lower() == "unknown" or node.startswith("_"):
        return None
    if node.startswith("["):
        end = node.find("]")
        if end < 0:
            raise ForwardingError("Forwarded", f"unbalanced bracket in {node!r}")
        text = node[1:end]
    else:
        text = _strip_port_v4(node)
    try:
        return ip_address(text)
    except ValueError:
        raise ForwardingError("Forwarded", f"not an address: {node!r}") from None


def client_address(
    peer: IPAddress,
    trusted: TrustedProxies,
    forwarded: Sequence[bytes] = (),
    x_forwarded_for: Sequence[bytes] = (),
) -> IPAddress:
    """The client's address; :class:`ForwardingError` when a trusted peer's header is bad.

    ``forwarded`` and ``x_forwarded_for`` are every value of those headers, in arrival order.
    """
    if not trusted or peer not in trusted or not (forwarded or x_forwarded_for):
        return peer
    # Memoised per trusted set: parsing addresses costs more than a whole decision, and behind
    # a proxy the same clients (and the same malformed headers) recur.
    key = (peer, tuple(forwarded), tuple(x_forwarded_for))
    memo = trusted.resolved
    hit = memo.get(key)
    if hit is None:
        try:
            hit = _from_chain(peer, trusted, forwarded, x_forwarded_for)
        except ForwardingError as exc:
            hit = exc
        if len(memo) >= _CACHE_LIMIT:
            memo.clear()
        memo[key] = hit
    if isinstance(hit, ForwardingError):
        raise ForwardingError(hit.header, hit.problem)
    return hit


def _from_chain(
    peer: IPAddress,
    trusted: TrustedProxies,
    forwarded: Sequence[bytes],
    x_forwarded_for: Sequence[bytes],
) -> IPAddress:
    addresses: list[IPAddress | None]
    if forwarded:
        nodes = _forwarded_hops(forwarded)
        if len(nodes) > MAX_HOPS:
            raise ForwardingError("Forwarded", f"more than {MAX_HOPS} hops")
        addresses = [_parse_forwarded_node(n) for n in nodes]
    else:
        hops = _xff_hops(x_forwarded_for)
        if len(hops) > MAX_HOPS:
            raise ForwardingError("X-Forwarded-For", f"more than {MAX_HOPS} hops")
        addresses = [_parse_xff_hop(h) for h in hops]
    client = peer
    for addr in reversed(addresses):
        if addr is None:
            # A hop that hides its address: nothing to its left can be believed either; the
            # nearest proxy that we trust is the best location we have.
            return client
        client = addr
        if addr not in trusted:
            return addr
    return client
