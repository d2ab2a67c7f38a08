"""The zone's DNSSEC keys: ECDSA P-256 (algorithm 13) private keys in PEM files of mode 0600.

One key signs (``GTM_DNSSEC_KEY_FILE``, the active key); any others
(``GTM_DNSSEC_PUBLISH_KEY_FILES``) are only published in the DNSKEY RRset, and sign it, so a
resolver holding either key's DS accepts the zone while a key is being rolled (see the README,
"DNSSEC"). Every key is a combined signing key (CSK: DNSKEY flags 257, ZONE and SEP): it signs
the DNSKEY RRset and the zone's data, and its DS goes to the parent.

A key file that is missing, readable by others, not a PEM private key, or not on the P-256 curve
is a start-up error naming the file: a zone configured as signed never answers unsigned.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import dns.dnssec
import dns.name
import dns.rdtypes.ANY.DNSKEY
import dns.rdtypes.ANY.DS
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gtm.errors import ConfigError, Problem
from gtm.secret_files import read_owner_only, write_new_owner_only

ALGORITHM = 13  # ECDSAP256SHA256 (RFC 6605)
CSK_FLAGS = 257  # ZONE | SEP: one key signs the DNSKEY RRset and the zone's data
WHAT = "the DNSSEC key"


@dataclass(frozen=True, slots=True)
class ZoneKey:
    """One key: its private half, its DNSKEY rdata and key tag, and where it came from."""

    path: Path
    private: ec.EllipticCurvePrivateKey
    dnskey: dns.rdtypes.ANY.DNSKEY.DNSKEY
    tag: int

    def ds(self, apex: str, digest: str = "SHA256") -> dns.rdtypes.ANY.DS.DS:
        """The DS record the parent zone publishes for this key (RFC 4509: SHA-256)."""
        return dns.dnssec.make_ds(dns.name.from_text(apex), self.dnskey, digest)


@dataclass(frozen=True, slots=True)
class ZoneKeys:
    """The active key, which signs every RRset, and the published ones, which sign only the
    DNSKEY RRset (a rollover in progress)."""

    active: ZoneKey
    published: tuple[ZoneKey, ...] = ()

    @property
    def all(self) -> tuple[ZoneKey, ...]:
        return (self.active, *self.published)


def zone_key(path: Path, private: ec.EllipticCurvePrivateKey) -> ZoneKey:
    dnskey = dns.dnssec.make_dnskey(private.public_key(), ALGORITHM, flags=CSK_FLAGS)
    return ZoneKey(path, private, dnskey, dns.dnssec.key_id(dnskey))


def load_key(path: Path) -> ZoneKey:
    """The key in ``path``; :class:`ConfigError` naming the file when it cannot be used."""
    data = read_owner_only(path, WHAT)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        reason = str(exc).split("\n")[0] or type(exc).__name__
        raise ConfigError(
            [Problem(str(path), "", f"not an unencrypted PEM private key: {reason}")]
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError(
            [Problem(str(path), "", f"a {type(key).__name__}, not an ECDSA P-256 private key")]
        )
    if not isinstance(key.curve, ec.SECP256R1):
        raise ConfigError(
            [
                Problem(
                    str(path),
                    "",
                    f"an ECDSA key on {key.curve.name}, not P-256 (DNSSEC algorithm 13)",
                )
            ]
        )
    return zone_key(path, key)


def load_keys(active: Path, published: tuple[Path, ...] = ()) -> ZoneKeys:
    """Every key, checked together: all problems at once, each naming its file."""
    problems: list[Problem] = []
    keys: list[ZoneKey] = []
    for path in (active, *published):
        try:
            keys.append(load_key(path))
        except ConfigError as exc:
            problems += exc.problems
    tags: dict[int, Path] = {}
    for key in keys:
        if key.tag in tags:
            same = key.dnskey == next(k.dnskey for k in keys if k.tag == key.tag)
            problems.append(
                Problem(
                    str(key.path),
                    "",
                    ("the same key as " if same else f"key tag {key.tag} is also that of ")
                    + f"{tags[key.tag]}: each DNSSEC key must be listed once",
                )
            )
        tags.setdefault(key.tag, key.path)
    if problems:
        raise ConfigError(problems)
    return ZoneKeys(keys[0], tuple(keys[1:]))


def generate(path: Path) -> ZoneKey:
    """A new P-256 key written to ``path`` (PKCS#8 PEM, mode 0600 from the first byte; an
    existing file is never overwritten)."""
    private = ec.generate_private_key(ec.SECP256R1())
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    write_new_owner_only(path, pem)
    return zone_key(path, private)


__all__ = ["ALGORITHM", "CSK_FLAGS", "ZoneKey", "ZoneKeys", "generate", "load_key", "load_keys"]
