"""Answers and audit rows at the precision a decision depends on: the client's GeoIP network.

A decision for an ECS query depends on the client subnet only through where the GeoIP
database places it, and that is the same for every subnet inside one database network (a
/16 of one ISP in one city, say), unless a spill or re-admission share splits the network by
/24 (:func:`gtm.decision.routing.spill_point`). The answer's ECS scope says exactly this to
resolvers (RFC 7871 §7.2.1). So such answers are rendered once per GeoIP network and the
ECS option of the response (the last bytes of the message: the OPT record ends it, and the
ECS echo ends the OPT) is patched with each query's own subnet; and the audit row records the
client at that same precision, the GeoIP network, so a resolver population of many /24s in
one network makes one row per decision, not one per /24 (issue 17: a random-subnet flood made
a row per subnet, and the writer sealing them set the goodput). The row still replays exactly:
the GeoIP network's own address locates to the same place (:mod:`gtm.admin.replay`).

A decision split below the GeoIP network keeps the client /24, as before; so does a GeoIP
network narrower than the ECS subnet (the subnet is then the coarser unit already).
"""

from __future__ import annotations

import dataclasses
import struct

from gtm.audit.record import AuditRecord
from gtm.decision.model import Decision, IPNetwork
from gtm.geodns.wire import ClientSubnet


def holds_network_wide(decision: Decision, network: IPNetwork) -> bool:
    """Whether ``decision`` holds for every client in the GeoIP ``network``: its scope is no
    narrower than the network (0: the same everywhere)."""
    return decision.scope_prefix <= network.prefixlen


def ecs_tail(ecs: ClientSubnet, scope: int) -> bytes:
    """The end of a response echoing ``ecs`` with ``scope``: the option's family, source and
    scope prefix lengths and the address (RFC 7871 §6)."""
    return struct.pack("!HBB", ecs.family, ecs.source, scope) + ecs.address


def patchable(wire: bytes, ecs: ClientSubnet, scope: int) -> int:
    """How many bytes at the end of ``wire`` are the echoed ECS address, to be replaced with
    another query's (same family and source length); 0 when the response does not end with
    the echo (an error without ECS, or a layout this module does not know): not patchable."""
    return len(ecs.address) if wire.endswith(ecs_tail(ecs, scope)) else 0


def widened(record: AuditRecord, network: IPNetwork) -> AuditRecord:
    """``record`` for every client of the GeoIP ``network``, whose row it becomes: its client
    at the network's precision when that is wider than the client network recorded, and its
    ECS prefix at the network's when that was narrower (a /32 source in a network of /24 or
    narrower: the row must not name the first client's address); ``record`` itself when
    neither applies."""
    client_wider = _prefix_len(record.client_network) <= network.prefixlen
    ecs = record.ecs_prefix
    ecs_narrower = ecs is not None and _prefix_len(ecs) > network.prefixlen
    if client_wider and not ecs_narrower:
        return record
    text = str(network)
    return dataclasses.replace(
        record,
        client_network=record.client_network if client_wider else text,
        ecs_prefix=text if ecs is not None else None,
    )


def _prefix_len(network: str) -> int:
    """The prefix length of a network's text; an address without one counts as its full
    length (a host is narrower than any network)."""
    if "/" in network:
        return int(network.rsplit("/", 1)[1])
    return 128 if ":" in network else 32
