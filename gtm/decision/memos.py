"""Bounds of the decision core's memos, as shares of the node's memory budget (DESIGN.md rule 8).

The slow path of a decision memoises what it works out: per snapshot the routing plans, policy
verdicts and rankings of the locations it has decided for (:mod:`gtm.decision.plan`) and its
spill heads (:mod:`gtm.decision.routing`); per process the client networks the audit records
(:func:`gtm.decision.routing.client_network`), and the GeoIP locations and database networks
of the addresses it has located (:mod:`gtm.decision.geoip`). A query the DNS path's fast paths
cannot take (an ECS source longer than the audit's precision, /32 say) reaches them all, so a
flood of such queries from random subnets fills each to its bound. Those bounds were fixed
(8,192 plans, 16,384 of the others: about 35 MiB in all) and outside the budget, so at a small
budget the memos alone outgrew it. Each is now a share of the same figure as the DNS path's
tables (``GTM_DNS_CACHE_BUDGET_MB``; :mod:`gtm.geodns.budget` counts the shares among its own,
and they sum to the whole).

A memo at its bound is cleared and refills with the working set (a miss costs the work
memoised, never memory). The limits are process-wide, as the memos are: the composition root
sets them once at start (:func:`bound`; each worker process its own), and until then they are
those of the default budget.

Example::

    >>> MemoLimits.from_mb(64).plans
    820
"""

from __future__ import annotations

from dataclasses import dataclass

_MIB = 1 << 20
# Bytes per entry, measured with tracemalloc under a flood of 20,000 random ECS /20 subnets
# (when those still went the slow path; bench/dns/flood.py's ecs32-200k floods it now): 5,390
# locations' plans and rankings with their Location objects took 10.5 MiB (2,000 bytes a
# location; a verdict is per country, far fewer), and up to a quarter as many spill heads may
# each keep a plan of some 1.1 KiB alive (routing.py), so 2,300 a plan; a GeoIP bucket's
# Location with its network object about 450; a network object with its key about 300.
PLAN_ENTRY_BYTES = 2300
LOCATION_ENTRY_BYTES = 450
NETWORK_ENTRY_BYTES = 300
# Shares of the budget. Plans: a resolver population's places, most of them answered from the
# DNS path's own tables (only their first query reaches a plan). Locations: both GeoIP bucket
# tables together. Networks: the client-network memo and the GeoIP network memo, each.
PLAN_SHARE = 0.03
LOCATION_SHARE = 0.015
NETWORK_SHARE = 0.01
MEMO_SHARES = (PLAN_SHARE, LOCATION_SHARE, NETWORK_SHARE)
_MIN_ENTRIES = 64  # below this a memo would be cleared every few misses
# What no table holds is kept out of the shares: the audit writer's seal in progress, its
# database driver's page cache, the threads' stacks and the allocator's slack. With every table
# full (a 200,000-subnet flood at a 16 MiB budget, bench/dns/flood.py) the heap grew by 18 MiB
# when the shares were of the whole budget: 2 MiB past it, as much again at 32 MiB (32 of 32).
RESERVE_MB = 4.0


def tables_mb(budget_mb: float) -> float:
    """The part of a budget of ``budget_mb`` MiB that is shared out over the tables and memos:
    all but the reserve, and never less than a quarter of it (a budget too small to hold the
    reserve still gets tables, at their smallest).

    >>> tables_mb(64), tables_mb(16), tables_mb(4)
    (60.0, 12.0, 1.0)
    """
    return max(budget_mb - RESERVE_MB, budget_mb / 4)


@dataclass(frozen=True, slots=True)
class MemoLimits:
    """Entry limits of the decision core's memos."""

    plans: int  # plans, verdicts and rankings per snapshot, each; spill heads a quarter of it
    locations: int  # GeoIP bucket and per-address locations, both tables together
    networks: int  # client networks (routing) and GeoIP database networks, each

    @classmethod
    def from_mb(cls, mb: float) -> MemoLimits:
        """The limits for a budget of ``mb`` MiB."""
        total = tables_mb(mb) * _MIB
        return cls(
            plans=max(_MIN_ENTRIES, int(total * PLAN_SHARE / PLAN_ENTRY_BYTES)),
            locations=max(_MIN_ENTRIES, int(total * LOCATION_SHARE / LOCATION_ENTRY_BYTES)),
            # Two memos of networks share the share.
            networks=max(_MIN_ENTRIES, int(total * NETWORK_SHARE / (2 * NETWORK_ENTRY_BYTES))),
        )


DEFAULT_BUDGET_MB = 64.0  # GTM_DNS_CACHE_BUDGET_MB's default (gtm.settings takes it from here)
LIMITS = MemoLimits.from_mb(DEFAULT_BUDGET_MB)


def bound(limits: MemoLimits) -> None:
    """Set the limits for this process (the composition root, once at start). Memos already
    past the new limits shrink at their next insertion (they are cleared)."""
    global LIMITS
    LIMITS = limits
