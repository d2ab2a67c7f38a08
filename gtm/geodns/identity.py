"""The server's identity in class CHAOS: ``id.server.`` / ``hostname.bind.`` and
``version.bind.`` / ``version.server.`` (RFC 4892), and in the NSID option (RFC 5001), off unless
configured.

Operators ask which anycast instance answered (``dig CH TXT id.server``), as they do of NSD, Knot
and BIND. Each pair is answered only when its setting is given (``GTM_DNS_SERVER_ID``,
``GTM_DNS_SERVER_VERSION``); otherwise, and for any other CHAOS name or type, REFUSED as for
every name outside the zone. As Knot 3 answers them: TXT (or ANY) in class CH, TTL 0, the
question's name as owner, AA clear (these names are no zone's), no ECS echo. A query with an
NSID option gets the server id back in one, first in the OPT record (an ECS echo stays last),
on every answer; without a server id configured, none.
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address

from gtm.decision.snapshot import Snapshot
from gtm.geodns.render import (
    QUESTION_POINTER,
    OptOut,
    record,
    response,
    txt_rdata,
    with_option,
)
from gtm.geodns.wire import NSID_CODE, Qtype, Query, Rcode
from gtm.geodns.zone import Answer, aggregated_record, question_wire, zone_data

IPAddress = IPv4Address | IPv6Address
QCLASS_CH = 3
_ID_NAMES = frozenset({"id.server.", "hostname.bind."})
_VERSION_NAMES = frozenset({"version.bind.", "version.server."})


@dataclass(frozen=True, slots=True)
class ServerIdentity:
    """What ``id.server.`` and ``version.bind.`` say (None: REFUSED, the default)."""

    server_id: str | None = None
    version: str | None = None

    def text_for(self, query: Query) -> str | None:
        """The TXT string ``query`` is answered with, or None when it is not one of ours."""
        if query.qclass != QCLASS_CH or query.qtype not in (Qtype.TXT, Qtype.ANY):
            return None
        if query.qname_text in _ID_NAMES:
            return self.server_id
        if query.qname_text in _VERSION_NAMES:
            return self.version
        return None

    def with_nsid(self, query: Query, wire: bytes) -> bytes:
        """``wire`` (the response to ``query``) with the NSID option when the query asked for
        it and a server id is configured; else as it is."""
        if self.server_id is None or query.edns is None or not query.edns.nsid:
            return wire
        out = with_option(wire, NSID_CODE, self.server_id.encode())
        return out if out is not None else wire

    def answer(
        self, query: Query, client: IPAddress, snapshot: Snapshot, limit: int | None
    ) -> Answer | None:
        """The response to a CHAOS identity query, or None for every other query."""
        text = self.text_for(query)
        if text is None:
            return None
        raw = text.encode()
        strings = tuple(raw[i : i + 255] for i in range(0, len(raw), 255)) or (b"",)
        edns = query.edns
        wire = response(
            query.id,
            query.flags,
            Rcode.NOERROR,
            authoritative=False,
            question=question_wire(query),
            answer=[record(QUESTION_POINTER, Qtype.TXT, 0, txt_rdata(strings), QCLASS_CH)],
            opt=OptOut(edns.do, None) if edns is not None else None,
            limit=limit,
        )
        rec = aggregated_record(
            outcome="identity",
            name=query.qname_text,
            apex=zone_data(snapshot.topology).apex,
            client=client,
            qtype=query.qtype,
            response="NOERROR+TC" if wire[2] & 0x02 else "NOERROR",
            answer=(),
            versions=snapshot.versions,
        )
        return Answer(wire, Rcode.NOERROR, rec, None)
