"""Health observations signed by the node that made them, and the gate that lets a peer's in.

Threat model (DESIGN.md rule 6): the shared database is untrusted storage. An attacker may read
and write every table, but holds no key file. A row of ``health_observations`` moves traffic, so
a node acts on a peer's row only when

* the peer is a member of the fleet's configured membership (:func:`membership`), whose public
  keys come from the signed topology (``fleet.members``: activated with the admin service's
  signature like every published document), else from this node's own settings
  (``GTM_HEALTH_MEMBERS`` entries ``ID=KEY``), never from the database;
* the row verifies with that member's key: each node signs its observations with its own
  Ed25519 key (:class:`NodeKey`, a 0600 file) over every field (node, region, state, since,
  observed_at, detail), so a row edited in SQL, or copied to another region or node, is refused;
* it is dated at most ``max_future_s`` ahead of this node's clock (a row dated ten years ahead
  would otherwise stay "fresh" for ten years), and is no older than what this node already
  accepted from that member for that region (``RegionBook.replace_peers``).

Refused rows are counted (``gtm_health_observations_refused{reason}``) and logged at most once
per :data:`LOG_EVERY_S`; they never stop a sync, and the rest is used.

What remains possible: an attacker can delete rows (a member then seems silent: with a
membership, the state freezes rather than moving), and can put back a member's own row that is
still fresh (younger than ``GTM_HEALTH_OBSERVATION_MAX_AGE_S``) if this node has not yet seen a
newer one: that is the member's own recent word.

Which key: a key of its own per node, not the audit chain's (``audit-signing.key``). The audit key
belongs to a chain, and a node with several worker processes has one chain, spool and key per
worker; the quorum's vote belongs to the node (workers share its observer id), so its workers
share one observation key. Keeping them apart also means the key an operator lists in the
topology signs nothing but health, and either can be rotated alone.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import orjson
import structlog
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gtm import metrics
from gtm.audit.keys import key_id, load_private_key, public_pem
from gtm.decision.topology import FleetMember, public_key_bytes
from gtm.errors import ConfigError, Problem
from gtm.fleet.region_state import Observation
from gtm.secret_files import write_new_owner_only

log = structlog.get_logger(__name__)

KEY_NAME = "health-signing.key"
# What is stored and signed of an observation's detail.
MAX_DETAIL = 500
# Refused rows are logged at most this often (rule 9), with the counts since the last line.
LOG_EVERY_S = 30.0
_DOMAIN = b"gtm health observation v1\0"

SELF_ONLY = "this node only"
FROM_TOPOLOGY = "topology fleet.members"
FROM_SETTINGS = "GTM_HEALTH_MEMBERS"


def micros(t: float) -> int:
    """Unix microseconds, as stored: ``micros(us / 1e6) == us`` for every stored value."""
    return round(t * 1_000_000)


def signed_bytes(o: Observation) -> bytes:
    """What a node signs: every field of the row, times in stored microseconds."""
    fields = [o.node, o.region, o.state.value, micros(o.since), micros(o.observed_at), o.detail]
    return _DOMAIN + orjson.dumps(fields)


def public_hex(key: Ed25519PublicKey) -> str:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


class NodeKey:
    """This node's observation signing key."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public = key.public_key()
        self.id = key_id(self.public)
        self.public_hex = public_hex(self.public)
        self.public_pem = public_pem(self.public).decode()

    def seal(self, o: Observation) -> Observation:
        """``o`` as it is stored (times to the microsecond, detail cut), signed."""
        stored = replace(
            o,
            since=micros(o.since) / 1e6,
            observed_at=micros(o.observed_at) / 1e6,
            detail=o.detail[:MAX_DETAIL],
        )
        return replace(stored, signature=self._key.sign(signed_bytes(stored)).hex(), key_id=self.id)


def load_or_create_node_key(path: Path) -> NodeKey:
    """The key in ``path``, made (0600 from the first byte) when there is none. Made whole in a
    file of its own and linked into place, so worker processes starting together all end up
    with the one key that won. A loose or malformed key file is a start-up error."""
    what = "the node's health observation signing key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        write_new_owner_only(tmp, pem)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process of this node made it first: use theirs
        else:
            log.info(
                "health.signing_key_created",
                path=str(path),
                public_key=public_hex(key.public_key()),
                detail="list it in the topology's fleet.members for this node's observations "
                "to count on its peers",
            )
        finally:
            tmp.unlink(missing_ok=True)
    return NodeKey(load_private_key(path, what))


@dataclass(frozen=True, slots=True)
class Membership:
    """Whose observations count: ``voters`` is the configured membership (a state needs a
    majority of it), empty when this node decides alone; ``keys`` the public keys known."""

    source: str
    keys: Mapping[str, Ed25519PublicKey]
    voters: frozenset[str]
    keyless: tuple[str, ...] = ()  # configured members with no key: they cannot vote


def membership(
    members: Sequence[FleetMember], setting: Sequence[str], own: str, own_key: NodeKey
) -> Membership:
    """The membership in force: the topology's ``fleet.members`` when it has any (GTM_HEALTH_MEMBERS
    is then ignored), else GTM_HEALTH_MEMBERS (``ID=KEY`` entries; a bare ``ID`` has no key
    unless it is this node), else this node alone. :class:`ConfigError` for a malformed entry
    of the setting, with every problem."""
    if members:
        keys = {m.id: Ed25519PublicKey.from_public_bytes(m.key()) for m in members}
        return Membership(FROM_TOPOLOGY, keys, frozenset(keys))
    if not setting:
        return Membership(SELF_ONLY, {own: own_key.public}, frozenset())
    problems: list[Problem] = []
    found: dict[str, Ed25519PublicKey | None] = {}
    for i, entry in enumerate(setting):
        node, _, text = entry.strip().partition("=")
        node, text = node.strip(), text.strip()
        where = f"health_members[{i}]"
        if not node:
            problems.append(Problem("settings", where, f"{entry!r} names no member"))
            continue
        if node in found:
            problems.append(Problem("settings", where, f"member {node!r} is listed twice"))
            continue
        if not text:
            found[node] = own_key.public if node == own else None
            continue
        try:
            found[node] = Ed25519PublicKey.from_public_bytes(public_key_bytes(text))
        except ValueError as exc:
            problems.append(Problem("settings", where, f"member {node!r}: {exc}"))
    if problems:
        raise ConfigError(problems)
    keys = {n: k for n, k in found.items() if k is not None}
    keyless = tuple(sorted(n for n, k in found.items() if k is None))
    return Membership(FROM_SETTINGS, keys, frozenset(found), keyless)


def membership_problems(m: Membership, own: str, own_key: NodeKey, quorum: int) -> list[str]:
    """What an operator should hear about this membership, from this node's point of view."""
    problems = []
    if m.keyless:
        problems.append(
            f"members without a key cannot vote: {', '.join(m.keyless)} (give their keys in the "
            "topology's fleet.members, or as ID=KEY in GTM_HEALTH_MEMBERS)"
        )
    if m.voters and own not in m.voters:
        problems.append(f"this node ({own}) is not a member: its own observations do not count")
    elif own in m.keys and public_hex(m.keys[own]) != own_key.public_hex:
        problems.append(
            f"the membership's key for this node ({own}) is not its key {own_key.public_hex}: "
            "its peers refuse its observations"
        )
    if m.voters and quorum > len(m.voters):
        problems.append(f"health_quorum {quorum} can never be reached by {len(m.voters)} members")
    return problems


def unlisted_fleet(own: str, reporting: Iterable[str]) -> Problem | None:
    """Why this node must not start when others report live to its database and no
    membership is configured (None: it is alone): each node would then decide region health
    from its own probes alone, so one node with a broken probe path fails its regions over
    (a restarting one first of all), where a membership lets its peers outvote it."""
    others = sorted(set(reporting) - {own})
    if not others:
        return None
    return Problem(
        "GTM_HEALTH_MEMBERS",
        "",
        f"other nodes report to this database ({', '.join(others)}) and no fleet membership "
        "is configured: each node would decide region health from its own probes alone, so "
        "one node with a broken probe path would fail its regions over. List the members in "
        "the topology's fleet.members (or GTM_HEALTH_MEMBERS=ID=KEY,...; each node logs its "
        "key at start), or set GTM_FLEET_STANDALONE_HEALTH=true to run each node alone on "
        "purpose",
    )


def gate_for(
    members: Sequence[FleetMember],
    setting: Sequence[str],
    own: str,
    own_key: NodeKey,
    *,
    quorum: int,
    max_future_s: float,
) -> ObservationGate:
    """The gate of the membership in force (:func:`membership`), said in the log with what an
    operator should fix: one line when it is made (at start, and when a topology that changes
    it comes into force), never per sync."""
    m = membership(members, setting, own, own_key)
    log.info(
        "health.membership",
        source=m.source,
        members=sorted(m.voters) if m.voters else [own],
        node=own,
        public_key=own_key.public_hex,
        ignored=list(setting) if m.source == FROM_TOPOLOGY and setting else None,
    )
    for problem in membership_problems(m, own, own_key, quorum):
        log.error("health.membership_problem", source=m.source, detail=problem)
    return ObservationGate(m, max_future_s=max_future_s)


class _RefusalLog:
    """Refused rows, counted by reason and logged at most once per :data:`LOG_EVERY_S` for the
    whole process (a flood of forged rows is one line an interval, not a line a row)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._logged_at: float | None = None
        self._pending: Counter[str] = Counter()
        self._example = ""

    def refuse(self, reason: str, node: object, region: object, detail: str = "") -> None:
        metrics.HEALTH_OBSERVATIONS_REFUSED.labels(reason).inc()
        self._pending[reason] += 1
        self._example = f"{str(node)[:64]}/{str(region)[:64]}: {reason}" + (
            f" ({detail})" if detail else ""
        )
        self.flush()

    def flush(self) -> None:
        now = self._clock()
        if not self._pending or (
            self._logged_at is not None and now - self._logged_at < LOG_EVERY_S
        ):
            return
        log.warning(
            "health.observations_refused",
            refused=dict(self._pending),
            example=self._example,
            detail="rows of health_observations that are not a member's signed, current word "
            "do not count (DESIGN.md rule 6)",
        )
        self._logged_at = now
        self._pending.clear()


REFUSALS = _RefusalLog()


class ObservationGate:
    """Lets through the peers' observations that verify with a member's key and are dated
    within bounds of this node's clock; refuses, counts and (rate-limited) logs the rest."""

    def __init__(self, members: Membership, *, max_future_s: float) -> None:
        self.membership = members
        self.max_future_s = max_future_s
        self.refused: Counter[str] = Counter()  # since this gate was made (for status and tests)

    def admit(self, observations: Iterable[Observation], now: float) -> list[Observation]:
        accepted = []
        for o in observations:
            reason = self._check(o, now)
            if reason is None:
                accepted.append(o)
            else:
                self.refuse(reason, o)
        REFUSALS.flush()
        return accepted

    def refuse(self, reason: str, o: Observation) -> None:
        self.refused[reason] += 1
        REFUSALS.refuse(reason, o.node, o.region, f"key {o.key_id[:16]}" if o.key_id else "")

    def _check(self, o: Observation, now: float) -> str | None:
        key = self.membership.keys.get(o.node)
        if key is None:
            if o.node in self.membership.voters:
                return "member without a key"
            return "not a member"
        if not o.signature:
            return "unsigned"
        if len(o.detail) > MAX_DETAIL:
            return "malformed"
        try:
            body = signed_bytes(o)
        except (TypeError, ValueError, OverflowError):  # text orjson cannot encode, and the like
            return "malformed"
        try:
            key.verify(bytes.fromhex(o.signature), body)
        except (InvalidSignature, ValueError):
            return "bad signature"
        if o.observed_at > now + self.max_future_s:
            return "dated in the future"
        if o.since > o.observed_at:
            return "malformed"
        return None


__all__ = [
    "KEY_NAME",
    "MAX_DETAIL",
    "REFUSALS",
    "Membership",
    "NodeKey",
    "ObservationGate",
    "gate_for",
    "load_or_create_node_key",
    "membership",
    "membership_problems",
    "micros",
    "signed_bytes",
]
