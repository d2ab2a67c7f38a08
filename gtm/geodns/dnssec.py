"""DNSSEC online signing: RRSIGs made as answers are given, as PowerDNS and NS1 do for answers
that differ per client (no zone file to sign ahead of time: the A and AAAA records of a service
name are whatever the decision gives this client).

When the zone is signed (``GTM_DNSSEC_KEY_FILE``, :mod:`gtm.geodns.dnssec_keys`), a query with
the DO bit gets, on top of :func:`gtm.geodns.zone.answer`'s response:

* an RRSIG over every RRset of the answer, authority and additional sections (SOA of negative
  answers, NS at the apex, DNSKEY, the addresses of in-zone nameservers and MX/SRV targets),
  made with the active key; the DNSKEY RRset is signed by every key, published ones included (a
  rollover in progress). Short of UDP room, the additional section's RRSIGs go first (RFC 4035
  §3.1.1).
* compact denial of existence (RFC 9824, "black lies"): a name that does not exist is answered
  NOERROR with an NSEC at the name whose next name is ``\\000.name`` and whose types are RRSIG,
  NSEC and NXNAME; a name without the type asked (NODATA, the fail-closed NODATA of a policy
  included) gets an NSEC at the name listing the types it has (``ZoneData.types_at``), never the
  type asked. An NSEC that covers only the name itself says nothing about any other name, so
  nothing can be walked or synthesised from it, and one signature per answer is enough (RFC 4470
  white lies need two NSECs, NSEC3 two or three). The NSEC is made in :mod:`gtm.geodns.denial`.

DNSKEY queries at the apex are answered with the keys whatever the DO bit. Queries without DO
get the unsigned answer, as from any server: signatures are for the validators that ask.

Cost. Signing runs only when the responder's rendered-answer cache misses (signed answers are
cached with the answer, like unsigned ones: the caches key on the DO bit). The unsigned
response's records are kept as they are and the RRSIGs (and the NSEC) spliced in after each
section's records, with the UDP limit applied again; dnspython parses and renders the whole
message only for shapes that splicing cannot take (a compressed name it cannot reuse), none of
which :mod:`gtm.geodns.render` writes today. Signatures are cached per RRset content (owner,
type, TTL, rdata), so a miss whose RRsets were signed before costs some 20 microseconds more
than unsigned, and only a new RRset (a new name's NSEC, a new answer set) costs an ECDSA
signature: framed by :func:`gtm.geodns.splice.frame_and_sign` for types whose data is its own
canonical form, the same bytes as :func:`dns.dnssec.sign` at a fraction of its cost, by
:func:`dns.dnssec.sign` for the others (names in the data: SOA, NS, CNAME, MX, SRV). Signatures
hold from an hour in the past (clocks are skewed) to ``validity`` ahead, and are made again once
a quarter of that has passed; answers rendered with them are dropped by the responder after at
most :attr:`Signer.max_answer_age` (:meth:`Signer.bound_window`), so no cached answer carries a
signature close to its expiry.
"""

from __future__ import annotations

import dataclasses
import math
from ipaddress import IPv4Address, IPv6Address

import dns.dnssec
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from gtm.audit.record import AuditRecord
from gtm.decision.answer_window import AnswerWindow
from gtm.decision.snapshot import Snapshot
from gtm.geodns.budget import Generations
from gtm.geodns.denial import (
    BLACK_LIE,
    DNSKEY,
    NSEC,
    NXNAME,
    RRSIG,
    denial,
    deny_message,
    nsec_rdata,
    nsec_rrset,
    own_types,
)
from gtm.geodns.dnssec_keys import ZoneKey, ZoneKeys, load_keys
from gtm.geodns.render import compress, name_wire, rcode_name
from gtm.geodns.splice import (
    CANONICAL,
    HEADER,
    NS,
    RR,
    TO_QUESTION,
    Record,
    assemble,
    frame_and_sign,
    from_wire,
    make_record,
    split,
    to_wire,
)
from gtm.geodns.wire import Query
from gtm.geodns.zone import Answer, ZoneData, answer, qtype_name, zone_data
from gtm.settings import Settings

IPAddress = IPv4Address | IPv6Address

INCEPTION_SKEW_S = 3600  # signatures valid from an hour ago: resolvers' clocks are skewed
_RELABELLED = 4096  # relabelled records kept (Signer._relabel)
# Types answered from the signer's own data whatever the DO bit: without DO they are RRsets like
# any other, given when asked for (RFC 4035 §3); only the ones not asked for wait for DO.
_ASKED_BY_TYPE = frozenset({DNSKEY, NSEC, RRSIG})


class Signer:
    """Signs the responses of one zone's responder (one per responder: it also bounds how long
    that responder's cached answers live, :meth:`bound_window`)."""

    def __init__(
        self,
        keys: ZoneKeys,
        *,
        validity_s: float = 7 * 86400,
        cache_entries: int = 20_000,
    ) -> None:
        self.keys = keys
        self.validity_s = validity_s
        self.refresh_s = validity_s / 4  # a signature is made again once it is this old
        # Answers rendered with a signature live at most this long in the responder's caches:
        # a signature in a cached answer always has more than half its validity left.
        self.max_answer_age = min(6 * 3600.0, validity_s / 8)
        # (owner, type, TTL, rdata) -> (RRSIG rdata in wire form, one per signing key; when to
        # sign again). Two generations (gtm.geodns.budget): a flood of random names signs one
        # NSEC each, and costs hit rate here, not memory.
        self._sigs: Generations[tuple[object, ...], tuple[tuple[bytes, ...], float]] = Generations(
            cache_entries
        )
        self._dnskeys = tuple(to_wire(k.dnskey) for k in keys.all)
        # The zone's apex as the signer's name, its wire form, and the text it was made from:
        # made once, not per response (a random-name flood signs a denial for every query,
        # and parsing the name and hashing it in the cache key were a sixth of that).
        self._apex: tuple[dns.name.Name, bytes, str] | None = None
        # Records given another response label (the black lie's "+NXNAME"): a flood's denials
        # are counted on the few aggregated records of their senders, equal from one to the
        # next, and a lookup costs a third of making the record again.
        self._relabelled: dict[tuple[AuditRecord, str], AuditRecord] = {}
        self._answers_until = -math.inf
        self.signatures_made = 0
        self.general_path = 0  # responses signed through dnspython's parse and render

    # -- the responder's hooks ------------------------------------------------------------

    def bound_window(self, window: AnswerWindow, now: float, kept: bool) -> bool:
        """Cap the responder's answer window so that no cached answer outlives
        :attr:`max_answer_age`; False (drop the caches) once they have lived that long."""
        if not kept or now >= self._answers_until:
            kept = False
            self._answers_until = now + self.max_answer_age
        window.until = min(window.until, self._answers_until)
        return kept

    def answer(
        self, query: Query, client: IPAddress, snapshot: Snapshot, now: float, limit: int | None
    ) -> Answer:
        """:func:`gtm.geodns.zone.answer`, signed when the query has the DO bit (see the module
        docstring); ``limit``: the UDP size, None over TCP."""
        edns = query.edns
        do = edns is not None and edns.do
        if not do and query.qtype not in _ASKED_BY_TYPE:
            return answer(query, client, snapshot, now, limit)
        result = answer(query, client, snapshot, now, None)
        zone = zone_data(snapshot.topology)
        if result.rcode not in (0, 3) or not result.wire[2] & 0x04:  # NOERROR/NXDOMAIN, AA
            if limit is None or len(result.wire) <= limit:
                return result
            return answer(query, client, snapshot, now, limit)  # an error too big: never
        if query.qtype in (NSEC, RRSIG):
            own = self._own_records(result, query, zone, do, limit, now)
            if own is not None:
                return own
            if limit is not None and len(result.wire) > limit:
                return answer(query, client, snapshot, now, limit)
            return result  # NXDOMAIN without DO
        signed = self._finish_wire(result, query, zone, do, limit, now)
        if signed is None:  # a shape the wire path does not take: the general one
            self.general_path += 1
            signed = self._finish_message(result, query, zone, do, limit, now)
        return signed

    # -- queries for the records compact denial puts at every name -------------------------

    def _own_records(
        self, result: Answer, query: Query, zone: ZoneData, do: bool, limit: int | None, now: float
    ) -> Answer | None:
        """The answer to a query of type NSEC or RRSIG at a name of the zone, made from the
        unsigned response's header, question and OPT; None for a name that does not exist
        asked without DO (NXDOMAIN, as for any other type).

        Under compact denial every name the zone admits to has an NSEC at itself (for a name
        that does not exist, the one that says NXNAME), so a query for that type is a positive
        answer: the NSEC, signed with DO (what Knot answers from a signed zone's chain, and
        what validates: a NODATA for type NSEC can only be proved by an NSEC whose bitmap
        leaves NSEC out, a contradiction every validator rejects, RFC 4035 §5.4). A query for
        RRSIG gets the RRSIG over that NSEC alone: one RRset, as RFC 8482 answers ANY and Knot
        answers RRSIG, the same for every client (no decision to sign for), and positive: a
        NODATA for RRSIG cannot be proved either (every NSEC lists RRSIG). Validators do not
        validate an RRSIG answer (there are no signatures over signatures); see
        tests/gtm/geodns/test_validators.py for what each resolver makes of it.
        """
        if result.rcode != 0 and not do:
            return None
        parts = split(result.wire)
        if parts is None:
            return None  # nothing render writes (the tests check general_path stays 0)
        qname, question_end, _, _, _, opt = parts
        wire = result.wire
        qid, flags = HEADER.unpack_from(wire)[:2]
        question = wire[12:question_end]
        exists = result.rcode == 0
        apex = name_wire(zone.apex)
        ttl = RR.unpack_from(zone.negative_soa, len(apex))[2]  # RFC 9077: the SOA's minimum
        rdata = nsec_rdata(qname, own_types(query.qname_text, zone, exists))
        signer = self._signer_name(zone.apex)
        nsec = [make_record(TO_QUESTION, qname, NSEC, ttl, rdata)]
        if query.qtype == NSEC:
            records = self._signed(nsec, apex, signer, now) if do else [nsec[0][0]]
        else:
            sigs = self.signatures(qname, NSEC, ttl, [rdata], signer, now)
            records = [TO_QUESTION + RR.pack(RRSIG, 1, ttl, len(sig)) + sig for sig in sigs]
        flags &= ~0xF  # NOERROR, for a name that does not exist too (the black lie)
        out = assemble(qid, flags, question, records, [], [], opt)
        label = "NOERROR" if exists else "NOERROR" + BLACK_LIE
        if limit is not None and len(out) > limit:
            out = assemble(qid, flags | 0x0200, question, [], [], [], opt)
            label += "+TC"
        record = result.record
        if record.outcome == "nodata":  # the zone's own record, not a denial
            record = dataclasses.replace(record, outcome="zone", answer=(qtype_name(query.qtype),))
        if record.response != label:
            record = self._relabel(record, label)
        return Answer(out, 0, record, result.decision)

    # -- the wire path: records spliced in, nothing re-rendered ---------------------------

    def _finish_wire(
        self, result: Answer, query: Query, zone: ZoneData, do: bool, limit: int | None, now: float
    ) -> Answer | None:
        """The signed response made from the unsigned one's bytes: its records kept as they
        are, RRSIGs (and the NSEC) added after each section's records. Taken when every owner
        name is the question (a pointer to it) or written out and no record data holds a
        compressed name, as everything :mod:`gtm.geodns.render` writes is; None otherwise."""
        wire = result.wire
        parts = split(wire)
        if parts is None:
            return None
        qname, question_end, answer_records, authority, additional, opt = parts
        qid, flags = HEADER.unpack_from(wire)[:2]
        rcode = flags & 0xF
        question = wire[12:question_end]
        apex = name_wire(zone.apex)
        record = result.record
        suffix = ""
        if query.qtype == DNSKEY and qname == apex and rcode == 0 and not answer_records:
            answer_records = [
                make_record(TO_QUESTION, qname, DNSKEY, zone.ttl, rdata) for rdata in self._dnskeys
            ]
            authority = []
            record = dataclasses.replace(
                record, outcome="zone", answer=tuple(f"DNSKEY {k.tag}" for k in self.keys.all)
            )
        if do:
            denied = denial(qname, query.qtype, rcode, answer_records, authority, zone)
            if denied is not None:
                nsec, rcode, suffix = denied
                authority = [*authority, nsec]
            signer = self._signer_name(zone.apex)
            an = self._signed(answer_records, apex, signer, now)
            ns = self._signed(authority, apex, signer, now)
            # The additional section's addresses (in-zone glue, MX and SRV targets) are the
            # zone's data: signed too (RFC 4035 §3.1.1 MUST), as Knot and BIND send them.
            ar = self._signed(additional, apex, signer, now)
        else:
            an = [r[0] for r in answer_records]
            ns = [r[0] for r in authority]
            ar = [r[0] for r in additional]
        flags = (flags & ~0xF) | rcode
        out = assemble(qid, flags, question, an, ns, ar, opt)
        if limit is not None and _over(out, limit) and len(ar) > len(additional):
            # RFC 4035 §3.1.1: short of room, the additional RRsets may stay without their
            # RRSIGs (a resolver asks for them when it needs them validated).
            ar = [r[0] for r in additional]
            out = assemble(qid, flags, question, an, ns, ar, opt)
        if (
            limit is not None
            and _over(out, limit)
            and ar
            and not any(r[3] == NS for r in answer_records)
        ):
            # Addresses of MX and SRV targets are extra help: left out first, TC clear (RFC
            # 2181 §9), as unsigned answers do. An NS answer's glue is not (render.response).
            ar = []
            out = assemble(qid, flags, question, an, ns, ar, opt)
        if limit is not None and _over(out, limit):
            # Cut to the question and OPT with TC set, as unsigned answers are: the resolver
            # asks again over TCP and gets the whole signed answer.
            out = assemble(qid, flags | 0x0200, question, [], [], [], opt)
            suffix = "+TC"  # nothing but the question went out (the audit column: 16)
        label = rcode_name(rcode) + suffix
        if record.response != label:
            record = self._relabel(record, label)
        return Answer(out, rcode, record, result.decision)

    def _signer_name(self, apex: str) -> dns.name.Name:
        memo = self._apex
        if memo is None or memo[2] != apex:
            name = dns.name.from_text(apex)
            memo = self._apex = (name, to_wire(name.canonicalize()), apex)
        return memo[0]

    def _relabel(self, record: AuditRecord, label: str) -> AuditRecord:
        key = (record, label)
        out = self._relabelled.get(key)
        if out is None:
            if len(self._relabelled) >= _RELABELLED:
                self._relabelled = {}
            out = self._relabelled[key] = dataclasses.replace(record, response=label)
        return out

    def _signed(
        self, records: list[Record], apex: bytes, signer: dns.name.Name, now: float
    ) -> list[bytes]:
        """A section's records, then the RRSIGs over each of its RRsets."""
        out = [r[0] for r in records]
        rrsets: dict[tuple[bytes, int], tuple[bytes, int, list[bytes]]] = {}
        for r in records:
            group = rrsets.get((r[2], r[3]))
            if group is None:
                rrsets[r[2], r[3]] = (r[1], r[4], [r[5]])
            else:
                group[2].append(r[5])
        for (name, rtype), (owner, ttl, rdatas) in rrsets.items():
            if rtype == RRSIG or (rtype == NS and name != apex) or not _under(name, apex):
                continue  # a delegation's NS, or a name outside: not the zone's data
            for sig in self.signatures(name, rtype, ttl, rdatas, signer, now):
                out.append(owner + RR.pack(RRSIG, 1, ttl, len(sig)) + sig)
        return out

    def signatures(
        self,
        name: bytes,
        rtype: int,
        ttl: int,
        rdatas: list[bytes],
        signer: dns.name.Name,
        now: float,
    ) -> tuple[bytes, ...]:
        """The RRSIG rdata over the RRset (``name``: its owner, lower case, uncompressed wire
        form; ``rdatas``: uncompressed), from the cache while fresh enough, else made with
        dnspython: by the active key, and by every key for the DNSKEY RRset."""
        memo = self._apex
        signer_wire = (
            memo[1] if memo is not None and memo[0] is signer else to_wire(signer.canonicalize())
        )
        key = (name, rtype, ttl, signer_wire, frozenset(rdatas))
        cached = self._sigs.get(key)
        if cached is not None and now < cached[1]:
            return cached[0]
        keys: tuple[ZoneKey, ...] = self.keys.all if rtype == DNSKEY else (self.keys.active,)
        inception, expiration = int(now - INCEPTION_SKEW_S), int(now + self.validity_s)
        if rtype in CANONICAL:
            # The common case (addresses, TXT, keys, the NSEC of every negative answer): the
            # data as on the wire is its canonical form, framed here at a third of the cost.
            sigs = tuple(
                frame_and_sign(k, name, rtype, ttl, rdatas, signer_wire, inception, expiration)
                for k in keys
            )
        else:  # names in the data to put in canonical form: dnspython does it
            owner = dns.name.from_wire(name, 0)[0]
            rrset = dns.rrset.RRset(owner, dns.rdataclass.IN, dns.rdatatype.RdataType.make(rtype))
            rrset.update_ttl(ttl)
            for rdata in rdatas:
                rrset.add(from_wire(rtype, rdata))
            sigs = tuple(
                to_wire(
                    dns.dnssec.sign(
                        rrset,
                        k.private,
                        signer,
                        k.dnskey,
                        inception=inception,
                        expiration=expiration,
                    )
                )
                for k in keys
            )
        self.signatures_made += len(keys)
        self._sigs.put(key, (sigs, now + self.refresh_s))
        return sigs

    # -- the general path: dnspython parses and renders the message -----------------------

    def _finish_message(
        self, result: Answer, query: Query, zone: ZoneData, do: bool, limit: int | None, now: float
    ) -> Answer:
        """As :meth:`_finish_wire`, for any response: parsed, completed and rendered again by
        dnspython (names compressed as it does). Slower; taken only for shapes the wire path
        does not know."""
        msg = dns.message.from_wire(result.wire)
        apex = dns.name.from_text(zone.apex)
        qname = msg.question[0].name
        record = result.record
        label_suffix = ""
        if (
            query.qtype == DNSKEY
            and query.qname_text == zone.apex
            and msg.rcode() == dns.rcode.NOERROR
            and not msg.answer
        ):
            keys = dns.rrset.RRset(qname, dns.rdataclass.IN, dns.rdatatype.DNSKEY)
            keys.update_ttl(zone.ttl)
            for k in self.keys.all:
                keys.add(k.dnskey)
            msg.answer = [keys]
            msg.authority = []
            record = dataclasses.replace(
                record, outcome="zone", answer=tuple(f"DNSKEY {k.tag}" for k in self.keys.all)
            )
        if do:
            label_suffix = deny_message(msg, query, zone)
            for section in (msg.answer, msg.authority, msg.additional):
                signed: list[dns.rrset.RRset] = []
                for rrset in section:
                    signed.append(rrset)
                    if (
                        rrset.rdtype == RRSIG
                        or (rrset.rdtype == dns.rdatatype.NS and rrset.name != apex)
                        or not rrset.name.is_subdomain(apex)
                    ):
                        continue
                    sigs = self.signatures(
                        to_wire(rrset.name.canonicalize()),
                        rrset.rdtype,
                        rrset.ttl,
                        [to_wire(r) for r in rrset],
                        apex,
                        now,
                    )
                    out = dns.rrset.RRset(
                        rrset.name, dns.rdataclass.IN, dns.rdatatype.RRSIG, rrset.rdtype
                    )
                    out.update_ttl(rrset.ttl)
                    for sig in sigs:
                        out.add(from_wire(RRSIG, sig))
                    signed.append(out)
                section[:] = signed
        wire = msg.to_wire(max_size=65535)
        if (
            limit is not None
            and len(wire) > limit
            and any(r.rdtype == RRSIG for r in msg.additional)
        ):
            msg.additional = [r for r in msg.additional if r.rdtype != RRSIG]
            wire = msg.to_wire(max_size=65535)
        if (
            limit is not None
            and len(wire) > limit
            and msg.additional
            and not any(r.rdtype == dns.rdatatype.NS for r in msg.answer)
        ):
            msg.additional = []
            wire = msg.to_wire(max_size=65535)
        if limit is not None and len(wire) > limit:
            msg.answer, msg.authority, msg.additional = [], [], []
            msg.flags |= dns.flags.TC
            wire = msg.to_wire()
            label_suffix = "+TC"
        rcode = msg.rcode()
        label = dns.rcode.to_text(rcode) + label_suffix
        if record.response != label:
            record = dataclasses.replace(record, response=label)
        return Answer(wire, rcode, record, result.decision)


def _under(name: bytes, apex: bytes) -> bool:
    """Whether ``name`` is ``apex`` or below it (both lower case, uncompressed wire form)."""
    pos, size = 0, len(name)
    while pos < size:
        if name[pos:] == apex:
            return True
        pos += name[pos] + 1
    return False


def make_signer(settings: Settings) -> Signer | None:
    """The signer the settings ask for, or None when the zone is not signed. Loads every key:
    :class:`~gtm.errors.ConfigError` naming the file when one cannot be used."""
    if settings.dnssec_key_file is None:
        return None
    keys = load_keys(settings.dnssec_key_file, settings.dnssec_publish_key_files)
    return Signer(keys, validity_s=settings.dnssec_signature_validity_s)


def _over(wire: bytes, limit: int) -> bool:
    """Whether ``wire`` exceeds ``limit`` as it goes out: names compressed (the responder
    compresses every answer, gtm.geodns.render.compress). Measured uncompressed, a signed
    answer that fits compressed lost its additional RRSIGs, or went out TC, for nothing."""
    return len(wire) > limit and len(compress(wire)) > limit


__all__ = [
    "BLACK_LIE",
    "NXNAME",
    "Signer",
    "frame_and_sign",
    "make_signer",
    "nsec_rrset",
]
