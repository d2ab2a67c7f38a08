"""The control log's head, checkpointed outside the database, and the log checked against it.

A reader's mark (:mod:`gtm.control.watermark`) protects that reader; a new admin node, an
auditor's laptop or a node whose disk was replaced has no mark. For them the head is signed into
the same write-once checkpoint store as the audit chains (chain ``control_log``): a log cut back,
wiped or forked behind a checkpoint is then a break that ``gtm audit verify`` names, with the
entry where it is. The admin service checkpoints only a head it verified (every entry up to it
signed by the admin key), so no row written by hand can be vouched for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.checkpoints import (
    BadCheckpoint,
    Checkpoint,
    CheckpointSink,
    Sink,
    parse,
    sign,
)
from gtm.audit.checkpoints import check as check_checkpoint
from gtm.audit.keys import ChainKey
from gtm.audit.record import ChainBreak
from gtm.audit.schema import control_log
from gtm.control.entry import GENESIS, BadEntry, check, from_row
from gtm.control.log import ControlLog, LogRefused

CHAIN = "control_log"  # the control log's name in checkpoints and in ChainBreak reports


class ControlAnchor:
    """Signs the control log's verified head into the sink whenever it moved."""

    def __init__(
        self,
        control: ControlLog,
        sink: Sink,
        key: ChainKey,
        store: Callable[[], str | None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.control = control
        self.sink = sink
        self.key = key
        self.store = store
        self.clock = clock
        self.last = 0

    async def checkpoint_if_moved(self) -> bool:
        if self.control.refusal is not None:
            return False  # never vouch for a log this process refuses
        try:
            state = self.control.good
        except LogRefused:  # never read: nothing to vouch for
            return False
        store = self.store()
        if state.seq <= self.last or store is None:
            return False
        checkpoint = Checkpoint(
            "checkpoint", CHAIN, state.seq, state.head, 0, self.clock(), store, self.key.id,
            detail="the control log's verified head",
        )  # fmt: skip
        await asyncio.to_thread(self.sink.append, sign(checkpoint, self.key))
        self.last = state.seq
        return True


async def verify_control_log(
    engine: AsyncEngine,
    keys: Mapping[str, Ed25519PublicKey],
    checkpoints: Iterable[Checkpoint],
) -> tuple[int, list[ChainBreak]]:
    """Every entry's link, signature and stored hash, and every checkpoint of the log's head
    against the entry it names; (entries checked, breaks). An entry that does not verify is
    reported at its sequence and the check goes on from it, so one edit is one break."""
    breaks: list[ChainBreak] = []
    seen: dict[int, str] = {}
    after = (0, GENESIS)
    async with engine.connect() as conn:
        rows = (await conn.execute(select(control_log).order_by(control_log.c.seq))).mappings()
        for row in rows:
            try:
                entry = from_row(dict(row))
            except BadEntry as exc:
                breaks.append(ChainBreak(CHAIN, exc.seq, exc.reason))
                continue
            try:
                check(entry, keys, after, row.get("entry_hash"))
            except BadEntry as exc:
                breaks.append(ChainBreak(CHAIN, entry.seq, exc.reason))
            seen[entry.seq] = entry.entry_hash
            after = (entry.seq, entry.entry_hash)
    for cp in checkpoints:
        if cp.chain != CHAIN:
            continue
        held = seen.get(cp.seq)
        if held is None:
            why = "a checkpoint outside the database vouches for it; the log has it no more"
            breaks.append(ChainBreak(CHAIN, cp.seq, f"{why} (cut back or wiped)"))
        elif held != cp.head:
            breaks.append(
                ChainBreak(CHAIN, cp.seq, "not the entry its checkpoint vouches for (a fork)")
            )
    return len(seen), breaks


def sink_checkpoints(sink: CheckpointSink) -> tuple[list[Checkpoint], list[ChainBreak]]:
    """The control log's checkpoints in ``sink`` whose signatures verify with the sink's keys;
    a line that does not is a break with its location, never skipped silently."""
    keys = sink.keys()
    found: list[Checkpoint] = []
    bad: list[ChainBreak] = []
    for item in sink.read():
        if isinstance(item, BadCheckpoint):
            bad.append(ChainBreak(CHAIN, 0, f"{item.location}: {item.problem}"))
            continue
        location, line = item
        try:
            signed = parse(line, location)
            if signed.checkpoint.chain != CHAIN:
                continue
            check_checkpoint(signed, keys, location)
        except BadCheckpoint as exc:
            bad.append(ChainBreak(CHAIN, 0, f"{exc.location}: {exc.problem}"))
            continue
        found.append(signed.checkpoint)
    return found, bad


__all__ = ["CHAIN", "ControlAnchor", "sink_checkpoints", "verify_control_log"]
