"""Static records in the zone (issue 17): ``zone.records`` in the topology.

Besides its SOA and NS, and the service names :func:`decide` answers, the zone can hold fixed
records: A, AAAA, CNAME, TXT, CAA, MX and SRV. Each list entry is one record (one RR), as a
line of a zone file is::

    zone:
      records:
        - {name: "@", type: TXT, text: "example-site-verification=4f2a"}
        - {name: "@", type: CAA, tag: issue, value: letsencrypt.org}
        - {name: "@", type: MX, preference: 10, exchange: mail.gtm.example.}
        - {name: mail, type: A, address: 192.0.2.25}
        - {name: _imaps._tcp, type: SRV, priority: 0, weight: 1, port: 993,
           target: mail.gtm.example.}
        - {name: api, type: CNAME, target: chat.gtm.example.}

Owner names (``name``) are ``@`` (the apex), relative to the apex (``www``, ``_sip._tcp``) or
absolute with a trailing dot (``www.gtm.example.``). Target names (CNAME ``target``, MX
``exchange``, SRV ``target``) are always absolute, the trailing dot optional, as every other
name in the topology: ``mx.mail.example`` is never read as ``mx.mail.example.gtm.example.``.

Field errors (types, ranges, a TXT string over 255 octets, an unknown CAA tag) come from the
models below; the rules that span records (:func:`record_problems`: owners in the zone, CNAME
exclusivity, no static addresses at service names, duplicates, RRset TTLs, MX/SRV targets that
are CNAMEs, loops) are checked with the rest of the topology's cross-references. Both report the
record's path, ``zone.records[3].target``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from ipaddress import IPv4Address, IPv6Address
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# Limits: a zone file of this size is far past any use a traffic manager's zone has, and keeps
# one topology's rendered records to a few MiB at most.
MAX_RECORDS = 10_000
MAX_TXT_OCTETS = 8_192  # one TXT record's text (DKIM keys of 4096 bits take about 800)
MAX_RRSET_OCTETS = 16_384  # one RRset as answered (a response over TCP carries at most 65,535)
MAX_CAA_VALUE = 1_024
MAX_CNAME_CHAIN = 8  # CNAMEs followed inside the zone for one answer (BIND follows up to 16)
MAX_TTL = 2**31 - 1  # RFC 2181 §8

STATIC_TYPES = ("A", "AAAA", "CNAME", "TXT", "CAA", "MX", "SRV")

_LABEL = re.compile(r"^[a-z0-9_-]{1,63}$")
_CAA_TAG = re.compile(r"^[a-z0-9]{1,15}$")
# RFC 8659 §4.2: issuer-domain-name *( ";" parameter ), parameter = tag "=" value.
_CAA_DOMAIN = re.compile(r"^([a-z0-9]([a-z0-9-]*[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")
_CAA_PARAMETER = re.compile(r"^([a-z0-9]+(-+[a-z0-9]+)*)[ \t]*=[ \t]*([\x21-\x3a\x3c-\x7e]*)$")
# Property tags a CA acts on (RFC 8659 §4.2-4.4; RFC 9495 issuemail; the CA/Browser Forum's
# contactemail, contactphone and issuevmc). Another tag is almost always a typo, and one marked
# critical would stop every CA from issuing.
CAA_TAGS = frozenset(
    {"issue", "issuewild", "iodef", "issuemail", "issuevmc", "contactemail", "contactphone"}
)
_ISSUER_TAGS = frozenset({"issue", "issuewild", "issuemail", "issuevmc"})


def _labels_ok(labels: list[str], value: str) -> None:
    for label in labels:
        if label == "*":
            raise ValueError(f"{value!r}: wildcard names are not supported")
        if not _LABEL.match(label):
            raise ValueError(
                f"{value!r} is not a valid DNS name (labels are 1-63 letters, digits, '-' or '_')"
            )


def owner_syntax(value: str) -> str:
    """An owner as written, lower-cased and checked: ``@``, relative or absolute (dot)."""
    name = value.strip().lower()
    if name == "@":
        return name
    if not name or name == ".":
        raise ValueError("an owner name must not be empty (use '@' for the apex)")
    _labels_ok(name.removesuffix(".").split("."), value)
    if len(name.removesuffix(".")) > 253:
        raise ValueError(f"{value!r} is longer than 253 characters")
    return name


def target_syntax(value: str, *, root_ok: bool = False) -> str:
    """An absolute target name, lower case with a trailing dot; ``.`` only when ``root_ok``."""
    name = value.strip().lower()
    if name == ".":
        if root_ok:
            return name
        raise ValueError("the root '.' is not a valid target here")
    if not name:
        raise ValueError("a target name must not be empty")
    _labels_ok(name.removesuffix(".").split("."), value)
    name = name if name.endswith(".") else name + "."
    if len(name) > 254:
        raise ValueError(f"{value!r} is longer than 253 characters")
    return name


def absolute_owner(name: str, apex: str) -> str:
    """The absolute owner of a record whose ``name`` passed :func:`owner_syntax`."""
    if name == "@":
        return apex
    if name.endswith("."):
        return name
    return f"{name}.{apex}"


U16 = Annotated[int, Field(ge=0, le=65_535)]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="owner: '@', relative to the apex, or absolute with a dot")
    ttl: int | None = Field(default=None, ge=0, le=MAX_TTL, description="default: zone.ttl")

    @field_validator("name")
    @classmethod
    def _owner(cls, v: str) -> str:
        return owner_syntax(v)

    def rdata_key(self) -> tuple[object, ...]:
        """What makes two records of the same owner and type identical (RFC 2181 §5)."""
        raise NotImplementedError

    def rdata_length(self) -> int:
        raise NotImplementedError

    def describe(self) -> str:
        """The data in zone-file presentation form, short: for messages and the audit."""
        raise NotImplementedError


class ARecord(_Record):
    type: Literal["A"]
    address: IPv4Address

    def rdata_key(self) -> tuple[object, ...]:
        return (self.address,)

    def rdata_length(self) -> int:
        return 4

    def describe(self) -> str:
        return str(self.address)


class AAAARecord(_Record):
    type: Literal["AAAA"]
    address: IPv6Address

    def rdata_key(self) -> tuple[object, ...]:
        return (self.address,)

    def rdata_length(self) -> int:
        return 16

    def describe(self) -> str:
        return str(self.address)


class CNAMERecord(_Record):
    type: Literal["CNAME"]
    target: str

    @field_validator("target")
    @classmethod
    def _target(cls, v: str) -> str:
        return target_syntax(v)

    def rdata_key(self) -> tuple[object, ...]:
        return (self.target,)

    def rdata_length(self) -> int:
        return len(self.target) + 1

    def describe(self) -> str:
        return self.target


class TXTRecord(_Record):
    """``text``: one string, cut into character-strings of 255 octets (UTF-8) as DKIM and SPF
    records are (the reader joins them), or a list whose items are the character-strings
    themselves, each at most 255 octets."""

    type: Literal["TXT"]
    text: str | tuple[str, ...]

    @field_validator("text")
    @classmethod
    def _text(cls, v: str | tuple[str, ...]) -> str | tuple[str, ...]:
        if isinstance(v, str):
            total = len(v.encode())
        else:
            if not v:
                raise ValueError("a TXT record needs at least one string")
            for i, s in enumerate(v):
                if len(s.encode()) > 255:
                    raise ValueError(
                        f"text[{i}] is {len(s.encode())} octets; a character-string holds at "
                        "most 255 (give the text as one string to have it cut)"
                    )
            total = sum(len(s.encode()) for s in v)
        if total > MAX_TXT_OCTETS:
            raise ValueError(f"{total} octets of text; at most {MAX_TXT_OCTETS} per record")
        return v

    def strings(self) -> tuple[bytes, ...]:
        """The character-strings of the record, each at most 255 octets."""
        if isinstance(self.text, str):
            data = self.text.encode()
            return tuple(data[i : i + 255] for i in range(0, len(data), 255)) or (b"",)
        return tuple(s.encode() for s in self.text)

    def rdata_key(self) -> tuple[object, ...]:
        return self.strings()

    def rdata_length(self) -> int:
        return sum(1 + len(s) for s in self.strings())

    def describe(self) -> str:
        return "TXT"


class CAARecord(_Record):
    type: Literal["CAA"]
    flags: Literal[0, 128] = Field(default=0, description="128: issuer critical")
    tag: str
    value: str = Field(max_length=MAX_CAA_VALUE)

    @field_validator("tag")
    @classmethod
    def _tag(cls, v: str) -> str:
        tag = v.strip().lower()
        if not _CAA_TAG.match(tag):
            raise ValueError(f"{v!r} is not a CAA tag (1-15 letters and digits)")
        if tag not in CAA_TAGS:
            raise ValueError(f"unknown CAA tag {v!r}; known: {', '.join(sorted(CAA_TAGS))}")
        return tag

    @field_validator("value")
    @classmethod
    def _value(cls, v: str, info: ValidationInfo) -> str:
        if not v.isascii() or any(not 0x20 <= ord(c) < 0x7F for c in v):
            raise ValueError("a CAA value is printable ASCII")
        tag = info.data.get("tag")  # absent when the tag itself was wrong
        if tag in _ISSUER_TAGS:
            problem = _issuer_value_problem(v)
            if problem:
                raise ValueError(f"CAA {tag} value {v!r}: {problem}")
        elif tag == "iodef":
            if not v.startswith(("mailto:", "http://", "https://")):
                raise ValueError("a CAA iodef value is a mailto:, http:// or https:// URL")
        elif tag is not None and not v.strip():
            raise ValueError(f"a CAA {tag} value must not be empty")
        return v

    def rdata_key(self) -> tuple[object, ...]:
        return (self.flags, self.tag, self.value)

    def rdata_length(self) -> int:
        return 2 + len(self.tag) + len(self.value)

    def describe(self) -> str:
        return f'{self.flags} {self.tag} "{self.value}"'


def _issuer_value_problem(value: str) -> str | None:
    """Why ``value`` is not an issue/issuewild value (RFC 8659 §4.2), or None. An empty
    issuer (``";"`` or ``""``) is valid: no CA may issue."""
    issuer, _, rest = value.partition(";")
    issuer = issuer.strip(" \t")
    if issuer and not _CAA_DOMAIN.match(issuer.lower()):
        return f"{issuer!r} is not an issuer domain name"
    for parameter in rest.split(";") if rest.strip(" \t") else []:
        parameter = parameter.strip(" \t")
        if parameter and not _CAA_PARAMETER.match(parameter.lower()):
            return f"{parameter!r} is not a tag=value parameter"
    return None


class MXRecord(_Record):
    type: Literal["MX"]
    preference: U16
    exchange: str = Field(description="absolute; '.' with preference 0 is a null MX (RFC 7505)")

    @field_validator("exchange")
    @classmethod
    def _exchange(cls, v: str) -> str:
        return target_syntax(v, root_ok=True)

    def rdata_key(self) -> tuple[object, ...]:
        return (self.preference, self.exchange)

    def rdata_length(self) -> int:
        return 2 + (1 if self.exchange == "." else len(self.exchange) + 1)

    def describe(self) -> str:
        return f"{self.preference} {self.exchange}"


class SRVRecord(_Record):
    type: Literal["SRV"]
    priority: U16
    weight: U16
    port: U16
    target: str = Field(description="absolute; '.' says the service is not offered")

    @field_validator("target")
    @classmethod
    def _target(cls, v: str) -> str:
        return target_syntax(v, root_ok=True)

    def rdata_key(self) -> tuple[object, ...]:
        return (self.priority, self.weight, self.port, self.target)

    def rdata_length(self) -> int:
        return 6 + (1 if self.target == "." else len(self.target) + 1)

    def describe(self) -> str:
        return f"{self.priority} {self.weight} {self.port} {self.target}"


StaticRecord = Annotated[
    ARecord | AAAARecord | CNAMERecord | TXTRecord | CAARecord | MXRecord | SRVRecord,
    Field(discriminator="type"),
]

_TAG_IN_LOCATION = re.compile(r"^(zone\.records\[\d+\])\.(?:" + "|".join(STATIC_TYPES) + r")\b")


def untagged_location(location: str) -> str:
    """``zone.records[3].MX.exchange`` (pydantic names the union member it tried) as
    ``zone.records[3].exchange``."""
    return _TAG_IN_LOCATION.sub(r"\1", location)


def record_problems(
    apex: str,
    ttl: int,
    records: tuple[StaticRecord, ...],
    services: Mapping[str, str],
    glue_names: frozenset[str],
) -> list[tuple[str, str]]:
    """The rules that span records, as (location, message): see the module docstring.
    ``services``: service DNS name -> service id; ``glue_names``: in-zone nameserver names."""
    problems: list[tuple[str, str]] = []

    def problem(i: int, field: str | None, message: str) -> None:
        where = f"zone.records[{i}]" + (f".{field}" if field else "")
        problems.append((where, message))

    owners: dict[int, str] = {}
    for i, r in enumerate(records):
        owner = absolute_owner(r.name, apex)
        if not r.name.endswith(".") and r.name != "@" and _in_zone(r.name + ".", apex):
            relative = r.name.removesuffix(apex.removesuffix(".")).removesuffix(".") or "@"
            problem(
                i,
                "name",
                f"{r.name!r} is relative to the apex, so it means {owner}: write {relative!r}, "
                f"or {r.name + '.'!r} (absolute names end with a dot)",
            )
        elif not _in_zone(owner, apex):
            problem(i, "name", f"{owner} is outside the zone {apex}")
        elif len(owner) > 254:
            problem(i, "name", f"{owner} is longer than 253 characters")
        else:
            owners[i] = owner

    by_owner: dict[str, list[int]] = {}
    for i, owner in owners.items():
        by_owner.setdefault(owner, []).append(i)
    cnames: dict[str, CNAMERecord] = {}
    for owner, idx in by_owner.items():
        first = next((i for i in idx if records[i].type == "CNAME"), None)
        if first is None:
            continue
        cname = records[first]
        assert isinstance(cname, CNAMERecord)
        cnames[owner] = cname
        for j in idx:
            if j != first:
                problem(
                    j,
                    "name",
                    f"{owner} has a CNAME (zone.records[{first}]): no other record may be "
                    "there (RFC 1034 §3.6.2)",
                )
    # Names that exist: owners, services, glue, the apex and every name between them and it.
    existing: set[str] = {apex, *owners.values(), *services, *glue_names}
    for name in list(existing):
        while name != apex and _in_zone(name, apex):
            name = name.split(".", 1)[1]
            existing.add(name)
    addressed = set(services) | set(glue_names)
    addressed |= {owners[i] for i in owners if records[i].type in ("A", "AAAA")}

    seen: dict[tuple[object, ...], int] = {}
    rrset_ttl: dict[tuple[str, str], tuple[int, int]] = {}
    rrset_size: dict[tuple[str, str], int] = {}
    for i, owner in owners.items():
        r = records[i]
        if r.type == "CNAME":
            if owner == apex:
                problem(i, "type", "a CNAME cannot be at the zone apex (the SOA and NS are)")
            if owner in services:
                problem(i, "name", f"{owner} is the DNS name of service {services[owner]!r}")
            if owner in glue_names:
                problem(i, "name", f"{owner} is a nameserver of the zone (RFC 2181 §10.3)")
        if r.type in ("A", "AAAA"):
            if owner in services:
                problem(
                    i,
                    "name",
                    f"{owner} is the DNS name of service {services[owner]!r}: its addresses "
                    "come from the decision, not from static records",
                )
            elif owner in glue_names:
                problem(i, "name", f"{owner} is a nameserver: its addresses are in nameservers")
        if r.type == "SRV" and (owner == apex or not _srv_owner(owner)):
            problem(i, "name", f"{owner}: an SRV owner is _service._proto.name (RFC 2782)")
        key = (owner, r.type, *r.rdata_key())
        if key in seen:
            problem(i, None, f"duplicates zone.records[{seen[key]}] (same name, type and data)")
        else:
            seen[key] = i
        record_ttl = ttl if r.ttl is None else r.ttl
        set_ttl = rrset_ttl.setdefault((owner, r.type), (record_ttl, i))
        if set_ttl[0] != record_ttl:
            problem(
                i,
                "ttl",
                f"TTL {record_ttl} differs from zone.records[{set_ttl[1]}]'s {set_ttl[0]}: the "
                f"records of one RRset ({owner} {r.type}) share one TTL (RFC 2181 §5.2)",
            )
        size = rrset_size.get((owner, r.type), 0) + 12 + r.rdata_length()
        rrset_size[owner, r.type] = size
        if size > MAX_RRSET_OCTETS >= size - 12 - r.rdata_length():
            problem(i, None, f"the {owner} {r.type} RRset is over {MAX_RRSET_OCTETS} octets")
        if isinstance(r, MXRecord | SRVRecord):
            field, target = (
                ("exchange", r.exchange) if isinstance(r, MXRecord) else ("target", r.target)
            )
            if target in cnames:
                problem(
                    i,
                    field,
                    f"{target} is a CNAME: an {r.type} target must be the name that has the "
                    "addresses (RFC 2181 §10.3)",
                )
            elif target != "." and _in_zone(target, apex) and target not in addressed:
                problem(i, field, f"{target} is in the zone but has no addresses")
        if isinstance(r, MXRecord) and r.exchange == ".":
            mx = [j for j in by_owner[owner] if records[j].type == "MX"]
            if r.preference != 0 or len(mx) > 1:
                problem(i, "exchange", "a null MX ('.') has preference 0 and is alone (RFC 7505)")
        if isinstance(r, CNAMERecord) and _in_zone(r.target, apex):
            if r.target not in existing:
                problem(i, "target", f"{r.target} is in the zone but does not exist")
            else:
                chain = [owner, r.target]
                while chain[-1] in cnames and len(chain) <= MAX_CNAME_CHAIN + 1:
                    nxt = cnames[chain[-1]]
                    if nxt.target in chain:
                        chain.append(nxt.target)
                        problem(i, "target", "CNAME loop: " + " -> ".join(chain))
                        break
                    chain.append(nxt.target)
                else:
                    if len(chain) > MAX_CNAME_CHAIN + 1:
                        problem(
                            i,
                            "target",
                            f"more than {MAX_CNAME_CHAIN} CNAMEs in a row from {owner}",
                        )
    return problems


def _srv_owner(owner: str) -> bool:
    labels = owner.split(".")
    return len(labels) >= 3 and labels[0].startswith("_") and labels[1].startswith("_")


def _in_zone(name: str, apex: str) -> bool:
    return name == apex or name.endswith("." + apex)
