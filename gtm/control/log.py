"""The control log in the database: appended under its head's lock, read and verified by every
reader, folded into the state the control plane and the nodes act on.

Appending (the admin service, or the key file's holder at the command line): in the caller's
transaction, the one-row head is updated first (a row lock on PostgreSQL, the write lock on
SQLite), so concurrent writers queue and never fork the log; the new entry follows what the
writer has verified, is checked against the fold (:func:`gtm.control.state.check_applies`), is
signed and lands with the change it records, or not at all.

Reading: :meth:`ControlLog.refresh` reads committed entries after the last one accepted, checks
each (link, signature, stored hash) and folds it, and checks that the entry it accepted last is
still there with the same hash. Every accepted entry is also kept in this reader's own copy on
its disk (:mod:`gtm.control.watermark`), which is where a restarted reader starts from. A log
cut back, forked, edited or missing entries is *refused*: counted
(``gtm_control_log_refused_total``), flagged (``gtm_control_log_broken``), logged once per
change, and the reader keeps its last good state. A reader that starts against a refused log has
no good state: it acts on nothing (:class:`LogRefused`) until the log is repaired.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy import Connection, event, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gtm.audit.schema import control_head, control_log
from gtm.control import watermark
from gtm.control.entry import BadEntry, Entry, EntrySigner, check, from_row, sign
from gtm.control.state import ControlState, check_applies, fold
from gtm.errors import GTMError
from gtm.metrics import CONTROL_LOG_BROKEN, CONTROL_LOG_REFUSED, CONTROL_LOG_SEQUENCE

log = structlog.get_logger(__name__)


class LogRefused(GTMError):
    """The control log in the database cannot be trusted (why says how); nothing may be written
    to it or, before a good state was ever read, acted on."""


class CannotSign(GTMError):
    """This process holds no signing key: it reads the control log, it cannot write it."""


class ControlLog:
    """One process's view of the control log: the last good fold, and the means to extend it.

    ``keys``: the trusted public keys by id (GTM_DOCUMENT_KEYS); ``signer``: the admin service's
    key, on processes that write; ``mark``: the file where this reader keeps the highest entry
    it accepted (None: in memory only, for tools that read once).
    """

    def __init__(
        self,
        keys: Mapping[str, Ed25519PublicKey],
        signer: EntrySigner | None = None,
        *,
        mark: Path | None = None,
        public: Ed25519PublicKey | None = None,
    ) -> None:
        self.keys = dict(keys)
        self.signer = signer
        if signer is not None and public is not None:
            self.keys.setdefault(signer.key_id, public)  # its own entries always verify here
        self.mark_path = mark
        self._good = ControlState()
        self._loaded = False
        self._replica_read = False
        self.refusal: str | None = None
        self._lock = asyncio.Lock()

    @property
    def good(self) -> ControlState:
        """The last good fold (no I/O); :class:`LogRefused` if there never was one."""
        if not self._loaded:
            raise LogRefused(self.refusal or "the control log has not been read yet")
        return self._good

    async def refresh(self, engine: AsyncEngine) -> ControlState:
        """Read and verify committed entries after the last accepted one; the last good state
        (refusing, loudly, what does not verify)."""
        async with self._lock, engine.connect() as conn:
            self._from_replica()
            try:
                state, new = await self._read(conn, self._good)
                await self._still_there(conn)
            except LogRefused as exc:
                self._refuse(str(exc))
                return self.good
            except BadEntry as exc:
                self._refuse(str(exc))
                return self.good
        if self.refusal is not None:
            log.info("control_log.accepted_again", seq=state.seq)
            self.refusal = None
            CONTROL_LOG_BROKEN.set(0)
        self._good, self._loaded = state, True
        CONTROL_LOG_SEQUENCE.set(state.seq)
        if new and self.mark_path is not None:
            watermark.append(self.mark_path, new)
        return state

    def _from_replica(self) -> None:
        """Once, before the first read: start from this reader's own copy, verified again."""
        if self._replica_read or self.mark_path is None:
            return
        self._replica_read = True
        state = watermark.read(self.mark_path, self.keys)
        if state is not None and state.seq > 0:
            self._good, self._loaded = state, True
            log.info("control_log.resumed", seq=state.seq, source=str(self.mark_path))

    async def state(self, conn: AsyncConnection) -> ControlState:
        """The state as ``conn`` sees it: the last good fold and the entries after it that this
        connection can see (its own transaction's, uncommitted, included). The cached fold is
        not changed: a transaction that rolls back leaves nothing behind. Entries after it that
        do not verify are refused, loudly, and the last good state is returned: reads go on from
        what was verified, and :meth:`append` refuses to write after a refused log."""
        good = self.good
        try:
            state, _ = await self._read(conn, good)
        except BadEntry as exc:
            self._refuse(str(exc))
            return good
        return state

    async def append(
        self,
        conn: AsyncConnection,
        kind: str,
        principal: str,
        body: Mapping[str, Any],
        now: float,
    ) -> ControlState:
        """Append one entry in the caller's transaction; the state after it.
        :class:`gtm.control.state.Refusal` when the fold would refuse it."""
        if self.signer is None:
            raise CannotSign(
                "this process has no signing key (GTM_DOCUMENT_SIGNING_KEY): it cannot write "
                "the control log"
            )
        if self.refusal is not None:
            raise LogRefused(f"the control log is refused here: {self.refusal}")
        head = (
            await conn.execute(
                update(control_head)
                .where(control_head.c.id == 1)
                .values(seq=control_head.c.seq)
                .returning(control_head.c.seq, control_head.c.last_hash)
            )
        ).first()
        state = await self.state(conn)
        if self.refusal is not None:  # found just now, reading what follows the good state
            raise LogRefused(f"the control log is refused here: {self.refusal}")
        if head is None or (head.seq, head.last_hash) != (state.seq, state.head):
            raise LogRefused("the control log's head row disagrees with its verified entries")
        entry = sign(
            self.signer,
            seq=state.seq + 1,
            prev_hash=state.head,
            at_us=round(now * 1e6),
            kind=kind,
            principal=principal,
            body=body,
        )
        check_applies(state, entry)
        await conn.execute(
            insert(control_log),
            {
                "seq": entry.seq,
                "prev_hash": entry.prev_hash,
                "at_us": entry.at_us,
                "kind": entry.kind,
                "principal": entry.principal,
                "body": entry.body_text(),
                "key_id": entry.key_id,
                "signature": entry.signature,
                "entry_hash": entry.entry_hash,
            },
        )
        await conn.execute(
            update(control_head)
            .where(control_head.c.id == 1)
            .values(seq=entry.seq, last_hash=entry.entry_hash)
        )
        fold(state, entry)
        self._adopt_on_commit(conn, state, entry)
        return state

    def _adopt_on_commit(self, conn: AsyncConnection, state: ControlState, entry: Entry) -> None:
        """When the appending transaction commits, what this writer signed is accepted here (and
        marked on disk) at once: a log cut back behind its own entries is then refused like any
        other. A rollback forgets it. Both listeners are removed once either fires."""
        sync = conn.sync_connection
        assert sync is not None
        loop = asyncio.get_running_loop()
        settled = False

        def committed(_: Connection) -> None:
            nonlocal settled
            if settled:
                return
            settled = True
            loop.call_soon(settle)  # not during the dispatch that is iterating the listeners
            # Adopted only when it extends exactly what this process holds (entries of other
            # writers in between are left to the next refresh, which copies them in order).
            extends = entry.prev_hash == self._good.head and self._good.seq == entry.seq - 1
            if self._loaded and extends:
                self._good = state
                CONTROL_LOG_SEQUENCE.set(state.seq)
                if self.mark_path is not None:
                    watermark.append(self.mark_path, [entry])

        def rolled_back(_: Connection) -> None:
            nonlocal settled
            if not settled:
                settled = True
                loop.call_soon(settle)

        def settle() -> None:
            for name, fn in (("commit", committed), ("rollback", rolled_back)):
                if event.contains(sync, name, fn):
                    event.remove(sync, name, fn)

        event.listen(sync, "commit", committed)
        event.listen(sync, "rollback", rolled_back)

    async def _read(
        self, conn: AsyncConnection, base: ControlState
    ) -> tuple[ControlState, list[Entry]]:
        """``base`` and the verified entries after it, in order."""
        rows = (
            await conn.execute(
                select(control_log).where(control_log.c.seq > base.seq).order_by(control_log.c.seq)
            )
        ).mappings()
        state = base.copy()
        seen: list[Entry] = []
        for row in rows:
            entry = from_row(dict(row))
            check(entry, self.keys, (state.seq, state.head), row.get("entry_hash"))
            fold(state, entry)
            seen.append(entry)
        return state, seen

    async def _still_there(self, conn: AsyncConnection) -> None:
        """The entry accepted last is still in the log with its hash: a log cut back or
        rewritten behind this reader is refused, not silently read from where it now ends."""
        if self._good.seq == 0:
            return
        stored = (
            await conn.execute(
                select(control_log.c.entry_hash).where(control_log.c.seq == self._good.seq)
            )
        ).scalar_one_or_none()
        if stored != self._good.head:
            raise LogRefused(
                f"entry {self._good.seq}, accepted here, is "
                + ("gone (the log was cut back)" if stored is None else "not what was accepted")
            )

    def _refuse(self, why: str) -> None:
        CONTROL_LOG_REFUSED.labels(reason=_reason(why)).inc()
        CONTROL_LOG_BROKEN.set(1)
        if why != self.refusal:
            log.error(
                "control_log.refused", why=why, keeps=self._good.seq if self._loaded else None
            )
        self.refusal = why


def _reason(why: str) -> str:
    for word, code in (
        ("cut back", "cut_back"),
        ("fork", "forked"),
        ("missing", "missing"),
        ("signature", "bad_signature"),
        ("trusted", "unknown_key"),
        ("link", "forked"),
    ):
        if word in why:
            return code
    return "invalid"


__all__ = ["CannotSign", "ControlLog", "LogRefused"]
