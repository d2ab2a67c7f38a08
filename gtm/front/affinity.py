"""Session affinity in proxy mode: a conversation stays in the region whose KV cache holds it.

A model server that has just answered a conversation holds its prompt's prefix in its KV
cache; the next turn served anywhere else pays the whole prefill again. So in proxy mode the
front hands the client a cookie, ``gtm_affinity``, naming the region that answered, and a
later request carrying it is kept in that region while three things hold:

- the region is still **allowed**: it is among this request's candidates and not dropped by
  residency (DESIGN.md rule 1: the request is decided afresh first, under the policy in force
  now, and the session can only pick among the regions that decision left standing; it never
  adds one back);
- it is **healthy**: not dropped as down, draining, fenced or unable to take work;
- it has **headroom**: a fresh capacity report (stale ones prove nothing), not spilling, and
  spare capacity (1 - utilisation) at least ``GTM_HTTP_AFFINITY_MIN_SPARE``.

Otherwise the fresh decision stands and the cookie is issued again for the region that serves.

The cookie cannot choose a region (rule 6: identities are not self-declared): the front signs
it with a MAC (keyed BLAKE2b) under a key derived from ``GTM_HTTP_AFFINITY_KEY_FILE`` (0600),
over the region, the time it was issued and a tag binding it to the service, residency classes,
tenant and client country it was issued for. A cookie that does not verify is ignored and counted
(``forged``), one past ``GTM_HTTP_AFFINITY_TTL_S`` too (``expired``), and a genuine one
presented for another service, class, tenant or country is ignored (``mismatch``). The cookie
carries everything needed to honour it, so there is no per-session table to bound or share:
every node and worker with the same key file honours every other's cookies.

A kept decision is audited as such: the kept region's verdict is ``chosen`` with reason
``session-affinity`` and the fresh choice's verdict ``eligible``, its detail saying the
session was kept elsewhere, so ``gtm audit show`` and the console's explain page say why.
A session that had to move is noted in the row's response field with its reason.

Pure apart from the key: the caller passes the time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from gtm.decision.model import Candidate, Decision, Outcome, Reason, Status
from gtm.decision.snapshot import Snapshot
from gtm.errors import ConfigError, Problem
from gtm.secret_files import read_owner_only

COOKIE = "gtm_affinity"
_COOKIE_B = COOKIE.encode() + b"="
_VERSION = "1"
# A cookie issued this far in the future is from a node whose clock is off: not trusted.
_SKEW_S = 300.0
_MAX_COOKIE = 256  # a longer value is not one of ours
_MEMO_LIMIT = 4096


class Verdict(StrEnum):
    """What became of a request's session (the ``outcome`` label of the metric)."""

    NEW = "new"  # no cookie: decided afresh, and one is issued
    SAME = "same"  # the session's region is the fresh choice anyway
    KEPT = "kept"  # kept in the session's region although the fresh choice was another
    NO_HEADROOM = "no_headroom"
    UNHEALTHY = "unhealthy"
    DISALLOWED = "disallowed"  # the policy in force no longer allows the region for this request
    FORGED = "forged"  # does not verify under the key (tampered, made up, or another key)
    EXPIRED = "expired"
    MISMATCH = "mismatch"  # genuine, but issued for another service, class, tenant or country


# The verdicts that moved a session out of the region it had: noted in the audit row.
MOVED = frozenset({Verdict.NO_HEADROOM, Verdict.UNHEALTHY, Verdict.DISALLOWED})
_RESIDENCY = frozenset({Reason.RESIDENCY, Reason.UNTRUSTED_ECS})


@dataclass(frozen=True, slots=True)
class AffinitySettings:
    key: bytes
    ttl_s: float = 1800.0
    min_spare: float = 0.2


def load_key(path: Path | None) -> bytes:
    """The signing key: derived from the file's contents (mode 0600 or stricter, at least 32
    bytes), or random for this process when no file is configured (then only this process
    honours its cookies: set a file when several workers or nodes serve one name)."""
    if path is None:
        return secrets.token_bytes(32)
    material = read_owner_only(path, "the affinity key").strip()
    if len(material) < 32:
        raise ConfigError([Problem(str(path), "", "the affinity key needs at least 32 bytes")])
    return hashlib.sha256(b"gtm-front-affinity\0" + material).digest()


@dataclass(frozen=True, slots=True)
class Session:
    """What a request's cookie said, and the tag a cookie issued to it carries."""

    verdict: Verdict
    region: str | None  # the region the session was in (a genuine, current cookie only)
    tag: str  # this request's binding (service, classes, tenant, country)
    secure: bool  # the request came over TLS: the cookie is Secure

    def note(self) -> str:
        """For the audit row's response field: why the session did not stay ("" if it did)."""
        if self.verdict in MOVED:
            return f"affinity: left {self.region} ({self.verdict.value})"
        if self.verdict in (Verdict.FORGED, Verdict.EXPIRED, Verdict.MISMATCH):
            return f"affinity cookie ignored ({self.verdict.value})"
        return ""


class Affinity:
    """Reads and issues one front's affinity cookies and keeps the count of each verdict."""

    def __init__(self, settings: AffinitySettings) -> None:
        self.settings = settings
        self._key = settings.key
        self.counts: dict[Verdict, int] = {}
        self._tags: dict[tuple[object, ...], str] = {}
        # Kept decisions' verdicts, memoised by the fresh decision's (shared) candidates: the
        # ledger's memo keys records by the identity of a decision's candidates.
        self._memo: dict[tuple[int, str], tuple[tuple[Candidate, ...], tuple[Candidate, ...]]] = {}

    def _mac(self, text: str, size: int) -> str:
        # Keyed BLAKE2b is a MAC by design (RFC 7693 section 2.5) and costs about half of an
        # HMAC-SHA256 through OpenSSL here.
        digest = hashlib.blake2b(text.encode(), key=self._key, digest_size=size).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")

    def tag(self, decision: Decision, tenant: str | None) -> str:
        """The binding of a cookie issued for ``decision``'s request."""
        binding = (decision.service, decision.residency_classes, tenant, decision.location.country)
        tag = self._tags.get(binding)
        if tag is None:
            service, classes, _, country = binding
            text = f"bind\0{service}\0{','.join(classes)}\0{tenant or ''}\0{country or '-'}"
            if len(self._tags) >= _MEMO_LIMIT:  # tenants and countries: few, but bounded
                self._tags.clear()
            tag = self._tags[binding] = self._mac(text, 8)
        return tag

    def issue(self, region: str, session: Session, now: float) -> bytes:
        """The ``Set-Cookie`` value naming ``region`` for the session's binding."""
        body = f"{_VERSION}.{region}.{int(now)}.{session.tag}"
        value = f"{body}.{self._mac(body, 16)}"
        cookie = f"{COOKIE}={value}; Max-Age={int(self.settings.ttl_s)}; Path=/; HttpOnly"
        cookie += "; SameSite=Lax; Secure" if session.secure else "; SameSite=Lax"
        return cookie.encode("ascii")

    def read(
        self,
        headers: Sequence[tuple[bytes, bytes]],
        decision: Decision,
        tenant: str | None,
        now: float,
        secure: bool,
    ) -> Session:
        """The session a request's headers carry (verdict NEW: none; SAME stands for "genuine
        and current" until :meth:`keep` judges the region)."""
        tag = self.tag(decision, tenant)
        value = _cookie_value(headers)
        if value is None:
            return Session(Verdict.NEW, None, tag, secure)
        parts = value.split(".")
        if len(value) > _MAX_COOKIE or len(parts) != 5 or parts[0] != _VERSION:
            return Session(Verdict.FORGED, None, tag, secure)
        _, region, issued, cookie_tag, mac = parts
        # As bytes: compare_digest refuses str with non-ASCII characters (a TypeError).
        expected = self._mac(value[: -len(mac) - 1], 16).encode("ascii")
        if not hmac.compare_digest(mac.encode("latin-1"), expected):
            return Session(Verdict.FORGED, None, tag, secure)
        try:
            at = int(issued)
        except ValueError:
            return Session(Verdict.FORGED, None, tag, secure)
        if not at <= now + _SKEW_S or now - at > self.settings.ttl_s:
            return Session(Verdict.EXPIRED, None, tag, secure)
        if not hmac.compare_digest(cookie_tag.encode("latin-1"), tag.encode("ascii")):
            return Session(Verdict.MISMATCH, None, tag, secure)
        return Session(Verdict.SAME, region, tag, secure)

    def keep(
        self, decision: Decision, session: Session, snapshot: Snapshot, now: float
    ) -> tuple[Decision, Session]:
        """The decision that serves a request with ``session``: the fresh one, or the session's
        region when it is allowed, healthy and has headroom (the module docstring); with the
        session's final verdict, counted."""
        region = session.region
        verdict = session.verdict
        if region is not None and region != decision.region:
            verdict, decision = self._judge(decision, region, snapshot, now)
        self.counts[verdict] = self.counts.get(verdict, 0) + 1
        if verdict is not session.verdict:
            session = Session(verdict, region, session.tag, session.secure)
        return decision, session

    def _judge(
        self, decision: Decision, region: str, snapshot: Snapshot, now: float
    ) -> tuple[Verdict, Decision]:
        if decision.outcome is Outcome.DENIED:
            return Verdict.DISALLOWED, decision
        if decision.outcome is not Outcome.ANSWER or decision.region is None:
            return Verdict.UNHEALTHY, decision  # no allowed region is healthy
        verdict = next((c for c in decision.candidates if c.region == region), None)
        view = snapshot.regions.get(region)
        if verdict is None or view is None:
            return Verdict.DISALLOWED, decision  # no longer a region of this service
        if verdict.status is Status.DROPPED:
            if verdict.reason in _RESIDENCY:
                return Verdict.DISALLOWED, decision
            return Verdict.UNHEALTHY, decision
        if not has_headroom(snapshot, region, now, self.settings.min_spare):
            return Verdict.NO_HEADROOM, decision
        key = (id(decision.candidates), region)
        memo = self._memo.get(key)
        if memo is None or memo[0] is not decision.candidates:
            if len(self._memo) >= _MEMO_LIMIT:
                self._memo.clear()
            # The entry holds the fresh candidates, so their id is not reused while it exists.
            memo = self._memo[key] = (
                decision.candidates,
                _kept_candidates(decision.candidates, region, decision.region),
            )
        kept = decision._replace(
            region=region,
            regions=(region,),
            ipv4=view.ipv4,
            ipv6=view.ipv6,
            base_url=view.base_url,
            candidates=memo[1],
        )
        return Verdict.KEPT, kept


def has_headroom(snapshot: Snapshot, region: str, now: float, min_spare: float) -> bool:
    """Whether ``region`` proves headroom: a fresh report that it can take work, is not
    spilling and has at least ``min_spare`` of its capacity spare. A stale or missing report
    proves nothing (DESIGN.md: stale reports are ignored, not trusted), as for spill targets."""
    cap = snapshot.capacity.get(region)
    if cap is None or now - cap.reported_at > snapshot.topology.routing.spillover.stale_after_s:
        return False
    return cap.can_take_work and not cap.spilling and 1.0 - cap.utilisation >= min_spare


def _kept_candidates(
    candidates: tuple[Candidate, ...], region: str, fresh: str
) -> tuple[Candidate, ...]:
    out = []
    for c in candidates:
        if c.region == region:
            c = Candidate(
                region,
                Status.CHOSEN,
                Reason.SESSION_AFFINITY,
                f"kept for session affinity; fresh choice {fresh}",
            )
        elif c.region == fresh:
            detail = f"fresh choice; session kept in {region}"
            c = Candidate(
                fresh, Status.ELIGIBLE, c.reason, f"{detail}; {c.detail}" if c.detail else detail
            )
        out.append(c)
    return tuple(out)


def _cookie_value(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The first ``gtm_affinity`` cookie's value in the request's Cookie headers."""
    for name, value in headers:
        if name != b"cookie" or _COOKIE_B not in value:
            continue
        for pair in value.split(b";"):
            pair = pair.strip()
            if pair.startswith(_COOKIE_B):
                return pair[len(_COOKIE_B) :].decode("latin-1")
    return None


__all__ = [
    "COOKIE",
    "MOVED",
    "Affinity",
    "AffinitySettings",
    "Session",
    "Verdict",
    "has_headroom",
    "load_key",
]
