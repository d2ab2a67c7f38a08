"""The key of a rendered answer in the responder's second level: what an answer depends on, and
nothing more, so that queries answered alike share one rendering (gtm.geodns.responder)."""

from __future__ import annotations

from collections.abc import Mapping
from ipaddress import IPv4Address, IPv6Address

from gtm.decision.model import IPNetwork
from gtm.decision.policy import Place
from gtm.decision.routing import resolver_place
from gtm.decision.snapshot import Snapshot
from gtm.geodns.wire import Query

IPAddress = IPv4Address | IPv6Address
# First in the rendered answer's key of a name that does not exist (gtm.geodns.zone.nonexistent),
# in place of the name (with its length): one rendering answers every such name of a length.
NONEXISTENT = "\x00nonexistent"


def answer_key(
    query: Query,
    client: IPAddress,
    limit: int | None,
    snapshot: Snapshot,
    services: Mapping[str, object],
    absent: bool = False,
) -> tuple[tuple[object, ...], IPNetwork | None, tuple[object, ...] | None]:
    """The rendered answer's key for the client bucket; and for an ECS query of a service
    name whose GeoIP network is at least as wide as the ECS subnet, that network and the
    answer's key for the whole of it (gtm.geodns.precision), else None and None.
    ``absent``: the name does not exist, and the key leaves it out; its audit row is the
    sender's network bucket's whatever the ECS (gtm.geodns.zone.aggregated_record), so the
    key holds the sender's bucket."""
    edns = query.edns
    ecs = edns.ecs if edns is not None else None
    shape: tuple[object, ...] | None = None
    if edns is not None:
        if ecs is None:
            shape = (edns.do, edns.nsid)
        elif absent:  # its echo (scope 0) ends the response: patched in per query
            shape = (edns.do, edns.nsid, ecs.family, ecs.source)
        else:
            shape = (edns.do, edns.nsid, ecs.family, ecs.source, ecs.address)
    if ecs is not None and ecs.source > 0 and not absent:
        located = ecs.network.network_address
        bucket: tuple[int, int] = (0, 0)  # the ECS subnet in the shape is the bucket
    else:
        located = client
        bucket = (4, int(client) >> 8) if client.version == 4 else (6, int(client) >> 72)
    geo: int | None = None
    resolver: Place | None = None
    network: IPNetwork | None = None
    network_key: tuple[object, ...] | None = None
    if query.qname_text in services:
        loc = snapshot.geo.locate(located)
        net = loc.network
        # A GeoIP network narrower than the client bucket splits it: key by the address.
        if net is not None and net.prefixlen > (24 if net.version == 4 else 56):
            geo = int(located)
        if ecs is not None and located is not client:
            # An ECS from a resolver the policy does not trust is judged together with the
            # resolver's own place: the same ECS from elsewhere may get another answer.
            resolver = resolver_place(snapshot, client, ecs.network, loc)
            if net is not None and net.prefixlen <= ecs.source:
                network = net
                network_key = (
                    query.qname_text,
                    query.qtype,
                    query.qclass,
                    (shape[:2] if shape else None, ecs.family, ecs.source),
                    limit,
                    net,
                    resolver,
                )
    # Names that do not exist share a rendering per question length: the compressed
    # records after the question point to offsets past it (gtm.geodns.render.compress).
    name: object = (NONEXISTENT, len(query.qname)) if absent else query.qname_text
    key = (name, query.qtype, query.qclass, shape, limit, bucket, geo, resolver)
    return key, network, network_key
