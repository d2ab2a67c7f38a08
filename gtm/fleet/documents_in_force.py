"""The signed version of the documents a node holds in force, and what it makes of the
database's offers of newer ones (DESIGN.md rule 6).

A node starts from the version it accepted before it restarted, when its own copy on disk
verifies again, else from its files; it then puts in force only a validly signed version with a
higher sequence than the one it holds (or, with no copy, than the sequence it kept on disk), and
refuses, loudly and without raising, every row that does not verify. A database that is behind
the version held (rows deleted or edited: a rollback), or that signs a sequence twice (a fork),
is refused and said so once per episode (``gtm_documents_database_diverged``). What a new
version changes in the node (its snapshot, health book, capacity intake, probes) is the
runtime's: :class:`DocumentsInForce` calls back with the parsed documents.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import structlog

from gtm import metrics
from gtm.decision.bundle import Documents, parse_documents
from gtm.errors import ConfigError
from gtm.fleet.local_documents import Accepted, read_accepted, review, write_accepted
from gtm.fleet.shared_state import Published
from gtm.fleet.signed_documents import Untrusted, load_public_keys
from gtm.settings import Settings

log = structlog.get_logger(__name__)


def documents_from_published(published: Published) -> Documents:
    """Documents published through the shared database, validated like files."""
    return parse_documents(
        published.topology, published.policies, f"published documents #{published.id}"
    )


class DocumentsInForce:
    """The version in force and the database's offers; ``put`` applies a new version's
    documents to the node, ``database_read`` says whether the database has been read yet, and
    ``serving_policy`` names the policy answered from (for the logs)."""

    def __init__(
        self,
        settings: Settings,
        *,
        put: Callable[[Documents, Accepted, Published], None],
        database_read: Callable[[], bool],
        serving_policy: Callable[[], str],
    ) -> None:
        self.settings = settings
        self.keys = load_public_keys(settings.document_keys)
        self._put = put
        self._database_read = database_read
        self._serving_policy = serving_policy
        self.accepted: Accepted | None = None
        # The sequence of the signed version in force (None while the node answers from its
        # own files: no signed version exists, here or in the database).
        self.sequence: int | None = None
        # The sequence alone, also kept on disk (and all a node upgraded from before the copy
        # has): when the copy cannot be used, no older version comes into force.
        self._sequence_file = settings.spool_dir / "documents-in-force"
        self._sequence_floor = _read_sequence(self._sequence_file)
        # The newest valid sequence the database has offered, and whether it is refused for
        # being behind this node's ("behind") or forking from it ("fork").
        self._database_head: int | None = None
        self._diverged: str | None = None
        self._reviewed = False  # the first review sees every row: history is no alarm
        metrics.DOCUMENTS_DIVERGED.set(0)

    def must_exceed(self) -> int | None:
        """The sequence a published version must be above: the one in force, or, until one is,
        one below what this node had before it restarted (that version may come back)."""
        if self.sequence is not None:
            return self.sequence
        return None if self._sequence_floor is None else self._sequence_floor - 1

    def start_from(self, files: Documents) -> Documents:
        """The documents to start with: the signed version this node accepted before, when its
        copy verifies again; else its files."""
        docs = self._from_disk(files)
        self.sequence = None if self.accepted is None else self.accepted.sequence
        metrics.DOCUMENT_SEQUENCE.set(self.sequence or 0)
        return docs

    def _from_disk(self, files: Documents) -> Documents:
        path = self.settings.document_state_path
        try:
            accepted = read_accepted(path, self.keys, self.settings.policy_approvals)
        except Untrusted as exc:
            metrics.DOCUMENTS_REFUSED.labels(exc.reason).inc()
            log.error(
                "documents.local_copy_refused",
                path=str(path),
                reason=exc.reason,
                detail=exc.detail,
            )
            return files
        if accepted is None:
            return files
        try:
            docs = parse_documents(accepted.topology, accepted.policies, f"{path}")
        except ConfigError as exc:
            metrics.DOCUMENTS_REFUSED.labels("invalid").inc()
            log.error(
                "documents.local_copy_rejected",
                path=str(path),
                problems=[str(p) for p in exc.problems],
            )
            return files
        self.accepted = accepted
        log.info(
            "documents.local_copy",
            path=str(path),
            sequence=accepted.sequence,
            version=accepted.manifest.version,
            policy=docs.policy.version,
        )
        return docs

    def _refuse(self, published: Published, reason: str, detail: str) -> None:
        # Whatever the database says, an unapproved, unsigned, replayed or forked version never
        # moves traffic here (DESIGN.md rule 6): the version in force stays.
        metrics.DOCUMENTS_REFUSED.labels(reason).inc()
        log.error("documents.refused", id=published.id, reason=reason, detail=detail)

    def apply(self, rows: list[Published]) -> None:
        """Put in force the signed version with the highest sequence among ``rows``, if it is
        above the one in force; refuse, and say why, every row that does not verify (whatever it
        holds: this never raises for a row), and say loudly when the database is behind this
        node's version or forks from it."""
        first = not self._reviewed
        self._reviewed = True
        result = review(rows, self.keys, self.settings.policy_approvals)
        for published, exc in result.refused:
            self._refuse(published, exc.reason, exc.detail)
        held = self.accepted
        threshold = self.must_exceed()
        newer: list[tuple[Accepted, Published]] = []
        for accepted, published in result.valid:
            sequence = accepted.sequence
            self._database_head = max(sequence, self._database_head or sequence)
            if held is not None and sequence == held.sequence:
                if accepted.manifest_hash != held.manifest_hash:
                    detail = (
                        f"sequence {sequence} signed again as {accepted.manifest_hash[:16]}, "
                        f"not the {held.manifest_hash[:16]} in force"
                    )
                    self._refuse(published, "fork", detail)
                    self._diverge("fork", detail)
            elif threshold is None or sequence > threshold:
                newer.append((accepted, published))
            elif not first:
                # A new row with an old, validly signed version: a copy, or rows renumbered by a
                # restore or a failover. It never comes into force (it is not after the one in
                # force), and it is no alarm: its signature proves it is an activation the
                # fleet made, so it can only be old. Rows that do not verify are the alarm.
                # (At the first look every row is offered; the older ones are history.)
                metrics.DOCUMENTS_SUPERSEDED.inc()
                log.info(
                    "documents.superseded",
                    id=published.id,
                    sequence=sequence,
                    in_force=threshold,
                )
        for accepted, published in newer:  # highest sequence first
            if self._put_in_force(accepted, published):
                break
        self.check_database_head()

    def _put_in_force(self, accepted: Accepted, published: Published) -> bool:
        try:
            docs = documents_from_published(published)
        except ConfigError as exc:
            # The admin service validated them; a node that still cannot (an older version)
            # keeps what it has and says why, rather than answering from half a configuration.
            metrics.DOCUMENTS_REFUSED.labels("invalid").inc()
            log.error(
                "documents.rejected",
                id=published.id,
                problems=[str(p) for p in exc.problems],
            )
            return False
        manifest = accepted.manifest
        self.accepted = accepted
        self.sequence = manifest.sequence
        try:
            write_accepted(self.settings.document_state_path, accepted)
            _write_sequence(self._sequence_file, manifest.sequence)
        except OSError as exc:
            # In force all the same: the database offered it and it verified. A restart before
            # the disk is back starts from the database (or the previous copy) again.
            log.error(
                "documents.local_copy_not_written",
                path=str(self.settings.document_state_path),
                error=str(exc),
            )
        metrics.DOCUMENT_SEQUENCE.set(manifest.sequence)
        if self._diverged is not None:
            self._undiverge(f"sequence {manifest.sequence} put in force")
        self._put(docs, accepted, published)
        return True

    def check_database_head(self) -> None:
        """Once the database has been read: refuse it loudly when its newest valid signed
        version is below the one this node holds (rows deleted or edited: a rollback)."""
        held = self.sequence if self.accepted is not None else self._sequence_floor
        if held is None or not self._database_read():
            return
        head = self._database_head
        if head is not None and head >= held:
            if self._diverged == "behind":
                self._undiverge(f"the database offers sequence {head} again")
            return
        self._diverge(
            "behind",
            f"the database's newest valid signed version is {head if head is not None else 'none'}"
            f", below the {held} this node accepted",
        )

    def _diverge(self, kind: str, detail: str) -> None:
        if self._diverged == kind:
            return  # one error per episode, not one per sync
        self._diverged = kind
        metrics.DOCUMENTS_DIVERGED.set(1)
        metrics.DOCUMENTS_ROLLBACK_REFUSED.labels(kind).inc()
        log.error(
            "documents.database_refused",
            kind=kind,
            detail=detail,
            serving=self.sequence,
            policy=self._serving_policy(),
        )

    def _undiverge(self, detail: str) -> None:
        log.warning("documents.database_agrees", was=self._diverged, detail=detail)
        self._diverged = None
        metrics.DOCUMENTS_DIVERGED.set(0)


def _read_sequence(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _write_sequence(path: Path, sequence: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"{sequence}\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
