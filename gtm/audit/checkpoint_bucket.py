"""The checkpoint sink in production: an S3-compatible bucket whose objects cannot be rewritten.

Each signed checkpoint (:mod:`gtm.audit.checkpoints`) is one object, written once with S3 Object
Lock in COMPLIANCE mode and a retain-until date (``GTM_AUDIT_CHECKPOINT_RETENTION_DAYS`` from the
write): until then no one, the bucket's owner included, can delete that version or write over
it, so someone holding the database password and the bucket's write key still cannot remove the
checkpoint that contradicts an edited store. Layout under ``s3://BUCKET/PREFIX/``::

    keys/<key id>.pub                                         the chains' public keys
    chains/<chain>.<key id>/<at µs>.<seq>.<kind>.json         one signed checkpoint each

The object's key names its chain, time, sequence and kind, so no two checkpoints share a key; a
put is conditional (``If-None-Match: *``) and carries its Content-MD5 and a SHA-256 checksum
(checked again when read). A put that finds the key taken reads what is there: the same bytes
(a retry whose first answer was lost) is fine, anything else is refused and logged.

A node refuses to start unless the bucket has Object Lock enabled (a sink that can be rewritten
is not evidence). A write the store does not take (the store away, a timeout) raises
:class:`SinkUnavailable` (an ``OSError``, which the anchor logs and counts) and the checkpoint
is kept in memory and written, in order, before the next one: a store that went away loses no
checkpoint while the node runs.

Reading (``gtm audit verify``, the scheduled verification, the evidence status) lists every
object *version* under the prefix, a page at a time, so neither a delete marker (what a plain
DELETE leaves on a locked object) nor a second version written to a key (an overwrite on a store
that does not honour conditional puts) hides a checkpoint: every version is read and checked,
and the delete marker or the extra version is reported as a problem with its key and version.

Credentials come from the environment (``AWS_ACCESS_KEY_ID`` and its kin, or a role the
platform provides), or from ``GTM_AUDIT_CHECKPOINT_CREDENTIALS_FILE`` (the AWS credentials file
format), or the AWS shared files, each of mode 0600 (:mod:`gtm.secret_files`); never from the
settings or a YAML document, and never logged.
"""

from __future__ import annotations

import base64
import configparser
import datetime as dt
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
import structlog
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from gtm.audit.checkpoints import BadCheckpoint, Signed
from gtm.audit.keys import ChainKey, key_id, load_public, public_pem
from gtm.errors import ConfigError, Problem
from gtm.secret_files import check_owner_only, read_owner_only

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from gtm.settings import Settings

log = structlog.get_logger(__name__)

_MAX_PENDING = 10_000  # checkpoints kept while the store is away (a few bytes each)
_READERS = 8  # objects fetched at once when reading


class SinkUnavailable(OSError):
    """The store did not take a write (it is away, or timed out): the checkpoint is retried."""


class SinkConflict(OSError):
    """A checkpoint's key already holds something else: never written over, never retried."""


@dataclass(frozen=True, slots=True)
class BucketAddress:
    bucket: str
    prefix: str  # "" or ending in "/"

    @classmethod
    def parse(cls, url: str) -> BucketAddress:
        if not url.startswith("s3://"):
            raise ConfigError([Problem("settings", "audit_checkpoint_url", "not s3://BUCKET/…")])
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise ConfigError([Problem("settings", "audit_checkpoint_url", "no bucket named")])
        prefix = prefix.strip("/")
        return cls(bucket, f"{prefix}/" if prefix else "")

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def object_key(signed: Signed) -> str:
    """Where a checkpoint goes, under the prefix: its chain, key, time, sequence and kind. The
    time leads, so a chain's objects list in the order its node wrote them."""
    cp = signed.checkpoint
    name = f"{round(cp.at * 1e6):020d}.{cp.seq:020d}.{cp.kind}.json"
    return f"chains/{_safe(cp.chain)}.{cp.key}/{name}"


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _credentials_file(path: Path) -> tuple[str, str, str | None]:
    """Access key, secret and (optional) session token from a 0600 file in the AWS credentials
    format (its ``[default]`` section, or its only one)."""
    what = "the checkpoint bucket's credentials"
    text = read_owner_only(path, what).decode("utf-8", "replace")
    parser = configparser.ConfigParser()
    try:
        parser.read_string(text, source=str(path))
    except configparser.Error as exc:
        raise ConfigError([Problem(str(path), "", f"not a credentials file: {exc}")]) from None
    sections = parser.sections()
    name = "default" if "default" in sections else (sections[0] if len(sections) == 1 else None)
    if name is None:
        raise ConfigError([Problem(str(path), "", "no [default] section")])
    section = parser[name]
    access, secret = section.get("aws_access_key_id"), section.get("aws_secret_access_key")
    if not access or not secret:
        raise ConfigError(
            [Problem(str(path), name, "needs aws_access_key_id and aws_secret_access_key")]
        )
    token = section.get("aws_session_token")
    return access.strip(), secret.strip(), token.strip() if token else None


def _session(credentials_file: Path | None, region: str | None) -> boto3.Session:
    """A session whose credentials come only from the environment, a role, or files of mode
    0600; :class:`ConfigError` otherwise."""
    if credentials_file is not None:
        access, secret, token = _credentials_file(credentials_file)
        return boto3.Session(
            aws_access_key_id=access,
            aws_secret_access_key=secret,
            aws_session_token=token,
            region_name=region,
        )
    session = boto3.Session(region_name=region)
    credentials = session.get_credentials()
    if credentials is None:
        raise ConfigError(
            [
                Problem(
                    "settings",
                    "audit_checkpoint_url",
                    "no credentials for the checkpoint bucket: set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY, give the host a role, or name a credentials file "
                    "(mode 0600) in GTM_AUDIT_CHECKPOINT_CREDENTIALS_FILE",
                )
            ]
        )
    # The AWS shared files hold secrets too: the same rule as every other secret file.
    home = Path(os.path.expanduser("~"))
    shared = Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE", home / ".aws" / "credentials"))
    config = Path(os.environ.get("AWS_CONFIG_FILE", home / ".aws" / "config"))
    method = getattr(credentials, "method", "")
    if method == "shared-credentials-file":
        check_owner_only(shared, "the AWS credentials file")
    elif method in ("config-file", "custom-process", "assume-role", "sso"):
        check_owner_only(config, "the AWS config file")
    return session


class BucketSink:
    """The :class:`~gtm.audit.checkpoints.CheckpointSink` in an S3-compatible bucket with
    Object Lock (see the module docstring). Blocking I/O: call it from a thread."""

    def __init__(
        self,
        url: str,
        *,
        client: S3Client,
        retention_days: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.address = BucketAddress.parse(url)
        self.client = client
        self.retention_days = retention_days
        self.clock = clock
        self.page_size = 1000  # objects a listing page holds (S3's most)
        self._checked = False
        self._lock = threading.Lock()
        self._pending: list[Signed] = []  # not yet taken by the store, oldest first

    @classmethod
    def from_settings(cls, settings: Settings, url: str | None = None) -> BucketSink:
        url = url or settings.audit_checkpoint_url
        if url is None:
            raise ConfigError([Problem("settings", "audit_checkpoint_url", "not set")])
        try:
            session = _session(
                settings.audit_checkpoint_credentials_file, settings.audit_checkpoint_region
            )
            client = cls._client(session, settings.audit_checkpoint_endpoint_url)
        except BotoCoreError as exc:  # no region, a profile that is not there
            raise ConfigError([Problem("settings", "audit_checkpoint_url", _why(exc))]) from None
        return cls(url, client=client, retention_days=settings.audit_checkpoint_retention_days)

    @staticmethod
    def _client(session: boto3.Session, endpoint: str | None) -> S3Client:
        return session.client(
            "s3",
            endpoint_url=endpoint,
            config=Config(
                connect_timeout=5,
                read_timeout=10,
                retries={"mode": "standard", "max_attempts": 3},
                # Path-style addressing works with every S3-compatible store (MinIO, Ceph).
                s3={"addressing_style": "path" if endpoint else "auto"},
            ),
        )

    @property
    def location(self) -> str:
        return str(self.address)

    @property
    def pending(self) -> int:
        """Checkpoints signed and not yet taken by the store."""
        return len(self._pending)

    # -- the bucket must be write-once ------------------------------------------------------

    def _lock_problem(self) -> str | None:
        """Why this bucket is not write-once evidence, or None when it has Object Lock.
        :class:`SinkUnavailable` when the store cannot be asked."""
        bucket = self.address.bucket
        try:
            answer = self.client.get_object_lock_configuration(Bucket=bucket)
        except ClientError as exc:
            code = _code(exc)
            if code == "ObjectLockConfigurationNotFoundError":
                return (
                    f"bucket {bucket} has no Object Lock: its checkpoints could be deleted or "
                    "rewritten, which is not evidence (create the bucket with Object Lock "
                    "enabled)"
                )
            if code in ("NoSuchBucket", "404"):
                return f"bucket {bucket} does not exist"
            if code in ("AccessDenied", "403"):
                return (
                    f"not allowed to read bucket {bucket}'s Object Lock configuration "
                    "(s3:GetBucketObjectLockConfiguration)"
                )
            if _status(exc) >= 500:
                raise SinkUnavailable(f"{self.location}: {_why(exc)}") from None
            return f"bucket {bucket}: {_why(exc)}"
        except BotoCoreError as exc:
            raise SinkUnavailable(f"{self.location}: {_why(exc)}") from None
        enabled = answer.get("ObjectLockConfiguration", {}).get("ObjectLockEnabled")
        if enabled != "Enabled":
            return f"bucket {bucket} has Object Lock {enabled or 'off'}: not write-once"
        return None

    def check(self) -> None:
        """:class:`ConfigError` unless the bucket has Object Lock enabled (or cannot be asked):
        a node refuses to start on a sink that could be rewritten."""
        if self._checked:
            return
        try:
            problem = self._lock_problem()
        except SinkUnavailable as exc:
            problem = f"cannot reach the checkpoint store, so cannot tell it is write-once: {exc}"
        if problem is not None:
            raise ConfigError([Problem(self.location, "", problem)])
        self._checked = True

    # -- writing ----------------------------------------------------------------------------

    def _put(self, key: str, body: bytes) -> None:
        """One write-once object at ``key``; identical bytes already there are fine."""
        name = self.address.prefix + key
        until = dt.datetime.fromtimestamp(self.clock(), dt.UTC) + dt.timedelta(
            days=self.retention_days
        )
        try:
            self.client.put_object(
                Bucket=self.address.bucket,
                Key=name,
                Body=body,
                ContentMD5=base64.b64encode(
                    hashlib.md5(body, usedforsecurity=False).digest()
                ).decode(),
                ChecksumAlgorithm="SHA256",
                ContentType="application/json",
                IfNoneMatch="*",
                ObjectLockMode="COMPLIANCE",
                ObjectLockRetainUntilDate=until,
            )
            return
        except ClientError as exc:
            if _code(exc) not in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise SinkUnavailable(f"{self.location}{key}: {_why(exc)}") from None
        except BotoCoreError as exc:
            raise SinkUnavailable(f"{self.location}{key}: {_why(exc)}") from None
        # The key is taken: a retry of our own write, or something else.
        try:
            there = self.client.get_object(Bucket=self.address.bucket, Key=name)["Body"].read()
        except (ClientError, BotoCoreError) as exc:
            raise SinkUnavailable(f"{self.location}{key}: {_why(exc)}") from None
        if there != body:
            raise SinkConflict(f"{self.location}{key} already holds other bytes: not written over")

    def publish_key(self, key: ChainKey) -> None:
        self.check()
        self._put(f"keys/{key.id}.pub", public_pem(key.public))

    def append(self, signed: Signed) -> None:
        """Write ``signed`` after every checkpoint still pending; :class:`SinkUnavailable` (and
        ``signed`` kept) when the store does not take them."""
        self.check()
        with self._lock:
            self._pending.append(signed)
            while self._pending:
                head = self._pending[0]
                try:
                    self._put(object_key(head), head.line())
                except SinkUnavailable:
                    self._bound()
                    raise
                except SinkConflict:
                    self._pending.pop(0)
                    log.error("audit.checkpoint_conflict", key=object_key(head))
                    raise
                self._pending.pop(0)

    def _bound(self) -> None:
        """Over the bound, drop the oldest plain checkpoint: a later one of its chain vouches
        for everything it did (opens, gaps and cuts are kept)."""
        while len(self._pending) > _MAX_PENDING:
            victim = next(
                (i for i, s in enumerate(self._pending) if s.checkpoint.kind == "checkpoint"), 0
            )
            dropped = self._pending.pop(victim).checkpoint
            log.warning("audit.checkpoint_pending_dropped", chain=dropped.chain, seq=dropped.seq)

    # -- reading ----------------------------------------------------------------------------

    def _where(self, key: str, version: str | None) -> str:
        where = f"s3://{self.address.bucket}/{key}"
        return where if version is None else f"{where}?versionId={version}"

    def _versions(self, under: str) -> Iterator[tuple[str, list[dict[str, Any]], list[str]]]:
        """Each key under ``under`` (relative to the prefix) with its object versions (newest
        first) and its delete markers' version ids, a page of the listing at a time."""
        paginator = self.client.get_paginator("list_object_versions")
        current: str | None = None
        versions: list[dict[str, Any]] = []
        markers: list[str] = []
        pages = paginator.paginate(
            Bucket=self.address.bucket,
            Prefix=self.address.prefix + under,
            PaginationConfig={"PageSize": self.page_size},
        )
        for page in pages:
            entries: list[tuple[str, str, Mapping[str, Any]]] = []
            entries += [(v["Key"], "version", v) for v in page.get("Versions", [])]
            entries += [(m["Key"], "marker", m) for m in page.get("DeleteMarkers", [])]
            entries.sort(key=lambda e: e[0])  # stable: versions stay newest first
            for key, what, entry in entries:
                if key != current:
                    if current is not None:
                        yield current, versions, markers
                    current, versions, markers = key, [], []
                if what == "version":
                    versions.append(dict(entry))
                else:
                    markers.append(str(entry.get("VersionId")))
        if current is not None:
            yield current, versions, markers

    def _get(self, key: str, version: str) -> bytes:
        answer = self.client.get_object(
            Bucket=self.address.bucket, Key=key, VersionId=version, ChecksumMode="ENABLED"
        )
        return answer["Body"].read()

    def keys(self) -> dict[str, Ed25519PublicKey]:
        """The published public keys, by id: every version of each key object (a version whose
        key does not match its name is not trusted)."""
        found: dict[str, Ed25519PublicKey] = {}
        try:
            for key, versions, _ in self._versions("keys/"):
                stem = key.rsplit("/", 1)[-1].removesuffix(".pub")
                for v in versions:
                    public = load_public(self._get(key, v["VersionId"]))
                    if public is not None and key_id(public) == stem:
                        found[stem] = public
        except (ClientError, BotoCoreError) as exc:
            raise SinkUnavailable(f"{self.location}keys/: {_why(exc)}") from None
        return found

    def read(self) -> Iterator[tuple[str, bytes] | BadCheckpoint]:
        """Every version of every checkpoint object with its location (``s3://…?versionId=``),
        and a :class:`BadCheckpoint` for each thing that must not be there: a bucket without
        Object Lock, a delete marker, a key written more than once, a body that fails its
        checksum. :class:`SinkUnavailable` when the store cannot be read."""
        try:
            problem = self._lock_problem()
            if problem is not None:
                yield BadCheckpoint(self.location, problem)
            yield from self._read_chains()
        except (ClientError, BotoCoreError) as exc:
            raise SinkUnavailable(f"{self.location}: {_why(exc)}") from None

    def _read_chains(self) -> Iterator[tuple[str, bytes] | BadCheckpoint]:
        with ThreadPoolExecutor(_READERS, thread_name_prefix="checkpoint-read") as pool:
            batch: list[tuple[str, str]] = []
            for key, versions, markers in self._versions("chains/"):
                for marker in markers:
                    yield BadCheckpoint(
                        self._where(key, marker),
                        "a delete marker hides this checkpoint: someone tried to delete it "
                        "(its locked version is still read)",
                    )
                if len({v.get("ETag") for v in versions}) > 1:
                    yield BadCheckpoint(
                        self._where(key, None),
                        f"{len(versions)} different versions under one checkpoint's key: "
                        "written over out of band (every version is checked)",
                    )
                batch += [(key, str(v["VersionId"])) for v in reversed(versions)]
                if len(batch) >= 4 * _READERS:
                    yield from self._fetch(pool, batch)
                    batch = []
            yield from self._fetch(pool, batch)

    def _fetch(
        self, pool: ThreadPoolExecutor, batch: list[tuple[str, str]]
    ) -> Iterator[tuple[str, bytes] | BadCheckpoint]:
        def one(item: tuple[str, str]) -> tuple[str, bytes] | BadCheckpoint:
            key, version = item
            where = self._where(key, version)
            try:
                return where, self._get(key, version)
            except FlexibleChecksumError as exc:
                return BadCheckpoint(where, f"body fails its checksum: altered ({exc})")

        yield from pool.map(one, batch)

    def read_new(self, after: MutableMapping[str, str]) -> Iterator[tuple[str, bytes]]:
        """The checkpoints written since the last call, for an incremental reader
        (:class:`gtm.audit.status.SinkIndex`): ``after`` maps each chain's folder to the last
        key read there, and is moved on. Objects list in the order their node wrote them (the
        key starts with the time), so only the newer ones are listed and read."""
        bucket, prefix = self.address.bucket, self.address.prefix
        try:
            folders: list[str] = []
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix + "chains/", Delimiter="/"):
                folders += [str(p["Prefix"]) for p in page.get("CommonPrefixes", [])]
            for folder in folders:
                start = after.get(folder, "")
                pages = paginator.paginate(
                    Bucket=bucket,
                    Prefix=folder,
                    StartAfter=start,
                    PaginationConfig={"PageSize": self.page_size},
                )
                for page in pages:
                    for obj in page.get("Contents", []):
                        key = str(obj["Key"])
                        try:
                            got = self.client.get_object(Bucket=bucket, Key=key)
                        except ClientError as exc:
                            if _code(exc) != "NoSuchKey":
                                raise
                            continue  # a delete marker since the listing: verify reports it
                        yield self._where(key, None), got["Body"].read()
                        after[folder] = key
        except (ClientError, BotoCoreError) as exc:
            raise SinkUnavailable(f"{self.location}: {_why(exc)}") from None


__all__ = ["BucketAddress", "BucketSink", "SinkConflict", "SinkUnavailable", "object_key"]
