"""Replaying a recorded decision: its inputs decided again under the versions it names.

An audit row records the decision's inputs (name, client network, ECS, residency classes,
tenant), the versions in force (topology, policy, GeoIP build) and every region's verdict. A
replay finds those documents (the node's own if they match, else a stored version that hashes
to the same topology and policy), puts back the region health the verdicts name (down,
draining), decides, and compares. Capacity reports are not in the row, so a decision that
spilled is replayed without them and said to be approximate; a different GeoIP build is said
too. Pure: the caller finds the snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import ip_network
from typing import Any

from gtm.audit.record import is_folded
from gtm.decision.model import Channel, DecisionRequest, Reason
from gtm.decision.routing import decide
from gtm.decision.snapshot import HealthState, RegionHealth, Snapshot

_HEALTH = {Reason.DOWN.value: HealthState.DOWN, Reason.DRAINING.value: HealthState.DRAINING}
_CAPACITY = {
    Reason.SPILLED.value,
    Reason.SPILL_TARGET.value,
    Reason.OVERLOADED_NO_HEADROOM.value,
    Reason.CANNOT_TAKE_WORK.value,
}


@dataclass(frozen=True, slots=True)
class Replayed:
    row: str  # node#node_seq
    matches: bool
    recorded: dict[str, Any]  # outcome, region, verdicts
    replayed: dict[str, Any]
    notes: tuple[str, ...]


def versions_match(snapshot: Snapshot, row: dict[str, Any]) -> bool:
    versions = snapshot.versions
    return bool(
        versions.topology == row["topology_version"] and versions.policy == row["policy_version"]
    )


def replay(row: dict[str, Any], snapshot: Snapshot, now: float) -> Replayed:
    """Decide ``row``'s inputs again on ``snapshot`` (of the row's versions)."""
    notes = []
    health = {
        c["region"]: RegionHealth(_HEALTH[c["reason"]], now)
        for c in row["candidates"]
        if c["reason"] in _HEALTH
    }
    if any(c["reason"] in _CAPACITY for c in row["candidates"]):
        notes.append("capacity reports shaped this decision and are not recorded: approximate")
    if any(c["reason"] == Reason.UNTRUSTED_ECS.value for c in row["candidates"]):
        # The row keeps the ECS, not the address of the untrusted resolver that sent it.
        notes.append(
            "residency was judged on the resolver's address too, not recorded: approximate"
        )
    if any(c["reason"] == Reason.SESSION_AFFINITY.value for c in row["candidates"]):
        # gtm.front.affinity: the session (its cookie) is not an input the row records.
        notes.append(
            "kept in the client's session region over the fresh choice, which the replay shows"
        )
    if snapshot.geo.build != row["geoip_build"]:
        notes.append(
            f"GeoIP {snapshot.geo.build} replays a decision made with {row['geoip_build']}"
        )
    state = snapshot.evolve(now, health=health, capacity={})
    network = ip_network(row["client_network"], strict=False)
    if row["channel"] == Channel.DNS.value and is_folded(network):
        notes.append(
            f"a folded row: this decision's answers to every client in {network} while new"
            " client networks came faster than the audit writer sealed them; replayed for"
            " the bucket's first address: approximate"
        )
    ecs = ip_network(row["ecs_prefix"], strict=False) if row["ecs_prefix"] else None
    request = DecisionRequest(
        Channel(row["channel"]),
        network.network_address,
        row["service"] or "",
        row["name"],
        ecs,
        frozenset(row["residency_classes"]),
        row["tenant"],
    )
    decision = decide(request, state, now)
    recorded = {
        "outcome": row["outcome"],
        "region": row["region"],
        "verdicts": {c["region"]: c["status"] for c in row["candidates"]},
    }
    replayed = {
        "outcome": decision.outcome.value,
        "region": decision.region,
        "verdicts": {c.region: c.status.value for c in decision.candidates},
    }
    return Replayed(
        f"{row['node']}#{row['node_seq']}", recorded == replayed, recorded, replayed, tuple(notes)
    )


__all__ = ["Replayed", "replay", "versions_match"]
