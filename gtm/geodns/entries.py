"""The responder's cache entries: the rendered answers of its second level (:class:`Cached`)
and the whole responses of its first (:class:`Exact`), which tally the answers given from them
until the audit writer drains them (gtm.geodns.responder)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gtm.audit.record import AuditRecord


@dataclass(frozen=True, slots=True)
class Cached:
    """A rendered answer of the second level, kept to answer other queries of its key: the
    response with ID 0, patched with each query's ID, flags and question (and ECS address)."""

    template: bytes  # rendered with ID 0 and RD/CD clear
    flags: int
    record: AuditRecord
    rcode_name: str
    truncated: bool
    # Kept per GeoIP network (gtm.geodns.precision): the template's last ``patch`` bytes are
    # the ECS address it was rendered for, replaced with each query's own.
    patch: int = 0
    # Octets of the question name the template was rendered with: another query's name takes
    # their place (the same name in another case; or, for a name that does not exist, any of
    # the same length).
    name_len: int = 0


# Under a GeoIP network's key: its decisions split the network, look the client bucket up.
SPLIT = Cached(b"", 0, None, "", False)  # type: ignore[arg-type]


class Exact:
    """The whole response to one exact query from one sender, and the answers given from it
    since the audit writer last drained them (``n``, with the first and last answer's time)."""

    __slots__ = ("first", "last", "n", "record", "stats_key", "tail", "truncated", "until")

    def __init__(
        self,
        tail: bytes,
        record: AuditRecord,
        stats_key: tuple[str, str, str],
        truncated: bool,
        until: float = math.inf,
    ) -> None:
        self.tail = tail  # the whole response after its ID
        self.record = record
        self.stats_key = stats_key
        self.truncated = truncated
        # A response with a DNS cookie is repeated only until the cookie is due for renewal
        # (gtm.geodns.cookies). Checked at the first answer since each drain of the tallies
        # (at least once a second): the answers in between cost no comparison.
        self.until = until
        self.n = 0
        self.first = self.last = 0.0

    def tally(self, now: float, tallied: list[Exact]) -> bool:
        """One more answer given from this entry at ``now``; listed in ``tallied`` (the
        responder's, drained by the audit writer) at its first since the last drain. False,
        and nothing counted, when the entry has lapsed (:attr:`until`): the query is answered
        the long way. (The UDP listeners inline this for their exact-query hits:
        gtm.geodns.server, gtm.geodns.udp.)"""
        if self.n:
            self.n += 1
        elif now < self.until:
            self.n = 1
            self.first = now
            tallied.append(self)
        else:
            return False
        self.last = now
        return True


def takes_name(cached: Cached, name_len: int, limit: int | None) -> bool:
    """Whether the rendering shared by names that do not exist answers a question name of
    ``name_len`` octets as it stands: it was not truncated, and with this name in place of the
    one it was rendered for it stays within the UDP limit."""
    return not cached.truncated and (
        limit is None or len(cached.template) - cached.name_len + name_len <= limit
    )
