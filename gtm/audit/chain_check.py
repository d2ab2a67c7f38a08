"""One chain's rows checked, in sequence order, against their links and the signed checkpoints
that vouch for them: the core of ``gtm audit verify`` (:mod:`gtm.audit.verify`, which streams
the rows and reads the sink; its docstring has the threat model and every rule checked here).
Pure logic, no I/O.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gtm.audit.checkpoints import Checkpoint
from gtm.audit.record import GENESIS, ChainBreak
from gtm.audit.spool_reports import SpoolReport


@dataclass
class ChainResult:
    chain: str
    rows: int = 0
    answers: int = 0
    last_seq: int = 0
    anchored_seq: int = 0  # the newest checkpoint the chain matched
    anchored: Checkpoint | None = None  # that checkpoint (where a later pass can start)
    checkpoints: int = 0
    started: Checkpoint | None = None  # where verification started (a cut, or ``start``)
    # Rows the checkpoints vouch for that are not in the store yet, and the node's report that
    # its spool still holds them (0 / None: nothing missing, or missing and a break).
    spooled: int = 0
    spool: SpoolReport | None = None


class ChainCheck:
    """One chain's rows, fed in sequence order, checked against its links and checkpoints."""

    def __init__(
        self,
        chain: str,
        anchors: list[tuple[Checkpoint, str]],
        rehash: Callable[[str, dict[str, Any]], str],
        seq_key: str,
        counted: bool,
        start: Checkpoint | None = None,
        attest: Callable[[dict[str, Any]], str | None] | None = None,
        spool: SpoolReport | None = None,
    ) -> None:
        self.result = ChainResult(chain, checkpoints=len(anchors))
        self._spool = spool  # the chain's node's report of what its spool still holds
        # Who wrote each row (event signatures): a row nobody's key vouches for is a break
        # at that row, however well it hashes.
        self._attest = attest
        self.breaks: list[ChainBreak] = []
        self._by_seq: dict[int, list[tuple[Checkpoint, str]]] = defaultdict(list)
        for cp, location in anchors:
            self._by_seq[cp.seq].append((cp, location))
        self._newest = max((cp.seq for cp, _ in anchors), default=None)
        self._rehash, self._seq_key, self._counted = rehash, seq_key, counted
        self._prev_hash = GENESIS
        # Retention removed the rows through the newest cut: the chain starts after it.
        cuts = [cp for cp, _ in anchors if cp.kind == "cut"]
        self.cut = max(cuts, key=lambda cp: cp.seq) if cuts else None
        # A later start point (a checkpoint a previous pass matched) moves the base on too.
        bases = [cp for cp in (self.cut, start) if cp is not None]
        self.base = max(bases, key=lambda cp: cp.seq) if bases else None
        if self.base is not None:
            r = self.result
            r.last_seq = r.anchored_seq = self.base.seq
            r.anchored = r.started = self.base
            r.answers = self.base.answers if counted else 0
            self._prev_hash = self.base.head
        else:
            for cp, location in self._by_seq.get(0, []):
                self._match(cp, location, GENESIS, 0)

    @property
    def after(self) -> int:
        """Only rows after the base are read: one at or before a cut is not evidence, and
        one at or before a start point was verified by an earlier pass."""
        return -1 if self.base is None else self.base.seq

    @property
    def resumes(self) -> Checkpoint | None:
        """The checkpoint this check resumes at (a previous pass's, or ``--since``'s) when it
        is not a retention cut: the row there must still be there, as it was."""
        base = self.base
        return None if base is None or base.kind == "cut" or base.seq == 0 else base

    def check_resumed(self, row: dict[str, Any] | None) -> None:
        """The row at :attr:`resumes`: rows before it are not read again, so without this a
        tail cut back to (or rewritten behind) the last verified checkpoint would go unseen
        until the next full verification."""
        base = self.resumes
        if base is None:
            return
        if row is None:
            self._break(
                base.seq,
                f"the row this check resumed at is gone: the checkpoint of {base.at:.3f} "
                "vouches for it (the tail was cut back)",
            )
        elif row["row_hash"] != base.head:
            self._break(
                base.seq,
                f"row hash differs from the checkpoint of {base.at:.3f} this check resumed at: "
                "rewritten",
            )

    def _break(self, seq: int, problem: str) -> None:
        self.breaks.append(ChainBreak(self.result.chain, seq, problem))

    def _match(self, cp: Checkpoint, location: str, digest: str, answers: int) -> None:
        if cp.head != digest:
            # Where: a decision row carries no signature of its own, so the rewrite lies
            # between the newest checkpoint that still matched and this one.
            matched = self.result.anchored_seq
            still = f" (row {matched} still matches its checkpoint)" if matched else ""
            self._break(
                cp.seq,
                f"row hash differs from the checkpoint at {location}: rewritten (and re-hashed) "
                f"in rows {matched + 1}..{cp.seq}{still}",
            )
        elif self._counted and cp.answers != answers:
            self._break(
                cp.seq,
                f"{answers} answers through this row, the checkpoint at {location} says "
                f"{cp.answers}",
            )
        elif cp.seq >= self.result.anchored_seq:
            self.result.anchored_seq, self.result.anchored = cp.seq, cp

    def feed(self, row: dict[str, Any]) -> None:
        r = self.result
        seq = row[self._seq_key]
        if self.base is not None and seq <= self.base.seq:
            return  # retained past its cut (no longer vouched for), or verified before
        if seq != r.last_seq + 1:
            self._break(seq, f"sequence jumps from {r.last_seq} to {seq}")
        if row["prev_hash"] != self._prev_hash:
            self._break(seq, "prev_hash does not match the previous row")
        if self._rehash(row["prev_hash"], row) != row["row_hash"]:
            self._break(seq, "row content does not match its hash")
        elif self._attest is not None and (problem := self._attest(row)) is not None:
            self._break(seq, problem)
        r.rows += 1
        if self._counted:
            r.answers += int(row["count"])
        r.last_seq, self._prev_hash = seq, row["row_hash"]
        for cp, location in self._by_seq.get(seq, []):
            self._match(cp, location, row["row_hash"], r.answers)

    def finish(self) -> None:
        r = self.result
        if self._newest is None:
            # Rows whose every one carries its writer's verified signature (the event chain)
            # are not yet anchored, not unvouched: a node's first events come before its first
            # checkpoint, and a clean start must not read as a break (DESIGN.md rule 10).
            if r.rows and self._attest is None:
                self._break(
                    1,
                    "no checkpoint vouches for this chain: rows written outside GTM, or its "
                    "node's checkpoint sink is missing",
                )
            return
        if self._newest > r.last_seq:
            vouched_at = min(cp.at for cp, _ in self._by_seq[self._newest])
            if self._spool is not None and self._spool.holds(r.last_seq, self._newest, vouched_at):
                r.spooled, r.spool = self._newest - r.last_seq, self._spool
                return
            where = next(loc for cp, loc in self._by_seq[self._newest])
            what = "every row of the chain is gone" if r.rows == 0 else "the tail is gone"
            self._break(
                r.last_seq + 1,
                f"{what}: the checkpoint at {where} vouches for rows up to {self._newest}, "
                f"the store ends at {r.last_seq}",
            )
