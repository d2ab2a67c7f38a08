"""The checkpoint sink in a write-once bucket (gtm.audit.checkpoint_bucket), against moto's S3
server over real HTTP: nodes anchor their chains there, ``verify`` reads only the bucket and
the public keys, and the attack it exists for (the database password and the bucket's write
key, used to remove or rewrite a checkpoint) is refused by the store or caught by ``verify``."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import orjson
import pytest
import structlog
from botocore.config import Config
from botocore.exceptions import ClientError
from moto.server import ThreadedMotoServer
from prometheus_client import REGISTRY
from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit.anchor import read_store_id
from gtm.audit.checkpoint_bucket import BucketSink, SinkUnavailable
from gtm.audit.checkpoints import open_sink
from gtm.audit.schema import decisions
from gtm.audit.status import SinkIndex, evidence_status
from gtm.decision.snapshot import Snapshot
from gtm.errors import ConfigError
from gtm.settings import Settings
from tests.gtm.audit.test_audit import records
from tests.gtm.audit.test_evidence import Store, _problems, _traffic
from tests.support.tamper import triggers_off

ROOT = Path(__file__).resolve().parents[3]
ACCESS, SECRET = "AKIAGTMTESTKEY000001", "gtm-test-secret-never-logged"


def _start(port: int = 0) -> ThreadedMotoServer:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = _start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Credentials from the environment only (no file of the machine's is read)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))


def _client(endpoint: str, attempts: int = 3) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        config=Config(retries={"mode": "standard", "max_attempts": attempts}),
    )


def _bucket(endpoint: str, *, locked: bool = True) -> str:
    name = f"gtm-evidence-{uuid.uuid4().hex[:12]}"
    _client(endpoint).create_bucket(Bucket=name, ObjectLockEnabledForBucket=locked)
    return name


def _settings(endpoint: str, bucket: str, tmp: Path, **more: Any) -> Settings:
    return Settings(
        audit_checkpoint_url=f"s3://{bucket}/evidence",
        audit_checkpoint_endpoint_url=endpoint,
        audit_checkpoint_region="us-east-1",
        spool_dir=tmp / "spool",
        **more,
    )


def _objects(endpoint: str, bucket: str) -> list[dict[str, Any]]:
    """Every version of every checkpoint object."""
    listing = _client(endpoint).list_object_versions(Bucket=bucket, Prefix="evidence/chains/")
    return list(listing.get("Versions", []))


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    return _bucket(s3_endpoint)


@pytest.fixture
def store(engine: AsyncEngine, tmp_path: Path, s3_endpoint: str, bucket: str) -> Store:
    sink = open_sink(_settings(s3_endpoint, bucket, tmp_path))
    assert isinstance(sink, BucketSink)
    return Store(engine, sink, tmp_path)  # type: ignore[arg-type]


async def _truncate_tail(engine: AsyncEngine, node: str, after: int) -> None:
    async with engine.begin() as conn:
        await triggers_off(conn)
        await conn.execute(
            delete(decisions).where(decisions.c.node == node, decisions.c.node_seq > after)
        )


async def test_nodes_anchor_to_the_bucket_and_verify_catches_a_cut_tail_from_it_alone(
    store: Store, snapshot: Snapshot, engine: AsyncEngine, tmp_path: Path, s3_endpoint: str,
    bucket: str,
) -> None:  # fmt: skip
    a, b = await store.node("node-a"), await store.node("node-b")
    await _traffic(a, snapshot)
    await _traffic(b, snapshot)
    # One object per checkpoint, each under COMPLIANCE retention until about 2555 days on.
    objects = _objects(s3_endpoint, bucket)
    # open and 4 checkpoints per node (the stop's is skipped: nothing moved). Not the event
    # chain's: these nodes wrote no event, and a writer checkpoints only heads it wrote.
    assert len(objects) >= 2 * 5
    s3 = _client(s3_endpoint)
    head = s3.head_object(Bucket=bucket, Key=objects[0]["Key"], VersionId=objects[0]["VersionId"])
    assert head["ObjectLockMode"] == "COMPLIANCE"
    assert (head["ObjectLockRetainUntilDate"] - head["LastModified"]).days >= 2554
    body = s3.get_object(Bucket=bucket, Key=objects[0]["Key"])["Body"].read()
    assert orjson.loads(body)["checkpoint"]["chain"] in ("node-a", "node-b", "region_events")

    # A verifier with nothing but the bucket (a sink of its own: no state of the nodes').
    fresh = open_sink(_settings(s3_endpoint, bucket, tmp_path / "auditor"))
    clean = await Store(engine, fresh, tmp_path).verify()  # type: ignore[arg-type]
    assert clean.breaks == [], _problems(clean)
    assert clean.chains["node-a"].anchored_seq == 12

    await _truncate_tail(engine, "node-a", 9)
    cut = await Store(engine, fresh, tmp_path).verify()  # type: ignore[arg-type]
    assert [(x.node, x.node_seq) for x in cut.breaks] == [("node-a", 10)], _problems(cut)
    assert "the tail is gone" in cut.breaks[0].problem
    assert f"s3://{bucket}/evidence/chains/node-a." in cut.breaks[0].problem


async def test_gtm_audit_verify_reads_the_bucket(
    store: Store, snapshot: Snapshot, database_url: str, tmp_path: Path, s3_endpoint: str,
    bucket: str,
) -> None:  # fmt: skip
    if not database_url.startswith("sqlite"):
        pytest.skip("the command is the same on PostgreSQL; once is enough")
    await _traffic(await store.node("node-a"), snapshot)
    env = os.environ | {
        "GTM_DATABASE_URL": database_url,
        "GTM_AUDIT_CHECKPOINT_ENDPOINT_URL": s3_endpoint,
        "GTM_AUDIT_CHECKPOINT_REGION": "us-east-1",
        "GTM_SPOOL_DIR": str(tmp_path / "verifier-spool"),
    }
    args = [sys.executable, "-m", "gtm", "audit", "verify", "--checkpoints",
            f"s3://{bucket}/evidence"]  # fmt: skip
    verify = await asyncio.to_thread(
        subprocess.run, args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert f"from s3://{bucket}/evidence/: 0 break(s)" in verify.stdout
    assert "12 decision row(s)" in verify.stdout
    assert SECRET not in verify.stdout + verify.stderr

    # A store that does not answer is an error that says so, never "0 checkpoints".
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    away = env | {"GTM_AUDIT_CHECKPOINT_ENDPOINT_URL": f"http://127.0.0.1:{closed}"}
    failed = await asyncio.to_thread(
        subprocess.run, args, env=away, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert f"error: the checkpoint sink: s3://{bucket}/evidence/" in failed.stderr
    assert "Traceback" not in failed.stderr


async def test_the_evidence_status_reads_the_bucket_incrementally(
    store: Store, snapshot: Snapshot, engine: AsyncEngine
) -> None:
    a = await store.node("node-a")
    index = SinkIndex(store.sink)  # type: ignore[arg-type]
    first = await evidence_status(engine, index)
    assert first.sink == store.sink.location
    # node-a's open; none of the event chain: the node wrote no event, and a writer
    # checkpoints only heads it wrote.
    assert first.sink_checkpoints == 1 and first.problems == []
    read: list[str] = []
    sink = store.sink
    original = sink.read_new  # type: ignore[attr-defined]

    def counted(after: Any) -> Any:
        for location, line in original(after):
            read.append(location)
            yield location, line

    sink.read_new = counted  # type: ignore[attr-defined]
    await _traffic(a, snapshot)
    status = await evidence_status(engine, index)
    [chain] = [c for c in status.chains if c.chain == "node-a"]
    assert chain.last_checkpoint is not None and chain.last_checkpoint.in_sink
    assert chain.last_checkpoint.checkpoint.seq == 12 and chain.unanchored_rows == 0
    assert chain.last_checkpoint.location is not None
    assert chain.last_checkpoint.location.startswith(f"{sink.location}chains/node-a.")
    assert len(read) == status.sink_checkpoints - first.sink_checkpoints  # only the new ones


async def test_the_bucket_refuses_to_lose_a_checkpoint_to_its_own_write_key(
    store: Store, snapshot: Snapshot, engine: AsyncEngine, s3_endpoint: str, bucket: str
) -> None:
    """The attack: the database password and the bucket's write key, used to remove the
    checkpoints that contradict a cut tail. COMPLIANCE mode refuses every deletion of a
    version; what the S3 API does let through (a delete marker, a new version over a key) does
    not hide the locked version from verify, and verify says what was tried. (Unlike S3, moto
    lets a COMPLIANCE retention be shortened, after which the version can be deleted: that
    refusal is S3's guarantee and is not tested here.)"""
    a = await store.node("node-a")
    await _traffic(a, snapshot)
    attacker = _client(s3_endpoint, attempts=1)  # the same key the nodes write with
    victims = [o for o in _objects(s3_endpoint, bucket) if "/node-a." in o["Key"]]
    for victim in victims:
        with pytest.raises(ClientError) as denied:
            attacker.delete_object(Bucket=bucket, Key=victim["Key"], VersionId=victim["VersionId"])
        assert denied.value.response["Error"]["Code"] == "AccessDenied"
        with pytest.raises(ClientError) as denied:
            attacker.delete_object(Bucket=bucket, Key=victim["Key"], VersionId=victim["VersionId"],
                                   BypassGovernanceRetention=True)  # fmt: skip
        assert denied.value.response["Error"]["Code"] == "AccessDenied"
    attacker.delete_objects(
        Bucket=bucket,
        Delete={"Objects": [{"Key": v["Key"], "VersionId": v["VersionId"]} for v in victims]},
    )
    # A conditional put (what the sink sends) on a taken key is refused.
    with pytest.raises(ClientError) as taken:
        attacker.put_object(Bucket=bucket, Key=victims[-1]["Key"], Body=b"{}", IfNoneMatch="*")
    assert taken.value.response["Error"]["Code"] == "PreconditionFailed"
    # Every version is still there.
    assert {v["VersionId"] for v in victims} <= {
        o["VersionId"] for o in _objects(s3_endpoint, bucket)
    }

    # What S3 allows on a locked object: a delete marker over the newest checkpoint.
    newest = max(victims, key=lambda o: o["Key"])
    attacker.delete_object(Bucket=bucket, Key=newest["Key"])
    with pytest.raises(ClientError):
        attacker.get_object(Bucket=bucket, Key=newest["Key"])  # hidden from a plain read
    await _truncate_tail(engine, "node-a", 9)
    store.sink.page_size = 2  # type: ignore[attr-defined]  # a listing of many pages
    result = await store.verify()
    problems = _problems(result)
    assert ("node-a", 10) in [(x.node, x.node_seq) for x in result.breaks], problems
    assert "the tail is gone" in problems
    assert "a delete marker hides this checkpoint: someone tried to delete it" in problems
    assert newest["Key"] in problems


async def test_a_checkpoint_edited_out_of_band_is_caught_never_used(
    store: Store, snapshot: Snapshot, engine: AsyncEngine, s3_endpoint: str, bucket: str
) -> None:
    """A new version written over a checkpoint's key without the condition (S3 versioning
    allows it; the locked version stays): the edit does not verify, and both are reported."""
    a = await store.node("node-a")
    await _traffic(a, snapshot)
    victim = max((o for o in _objects(s3_endpoint, bucket) if "/node-a." in o["Key"]),
                 key=lambda o: o["Key"])  # fmt: skip
    s3 = _client(s3_endpoint)
    original = s3.get_object(Bucket=bucket, Key=victim["Key"])["Body"].read()
    edited = orjson.loads(original)
    edited["checkpoint"]["seq"] = 9  # vouch for less, so a cut tail would pass
    s3.put_object(Bucket=bucket, Key=victim["Key"], Body=orjson.dumps(edited) + b"\n")
    assert len([o for o in _objects(s3_endpoint, bucket) if o["Key"] == victim["Key"]]) == 2

    await _truncate_tail(engine, "node-a", 9)
    store.sink.page_size = 1  # type: ignore[attr-defined]  # the two versions on two pages
    result = await store.verify()
    problems = _problems(result)
    assert "signature does not verify: forged or altered" in problems
    assert "2 different versions under one checkpoint's key: written over out of band" in problems
    # The locked original is still read: the cut tail is caught.
    assert ("node-a", 10) in [(x.node, x.node_seq) for x in result.breaks], problems


async def test_a_bucket_without_object_lock_is_refused_at_start(
    engine: AsyncEngine, tmp_path: Path, s3_endpoint: str
) -> None:
    plain = _bucket(s3_endpoint, locked=False)
    store = Store(engine, open_sink(_settings(s3_endpoint, plain, tmp_path)), tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as refused:
        await store.node("node-a")
    message = str(refused.value.problems[0])
    assert f"bucket {plain} has no Object Lock" in message
    assert "not evidence" in message
    assert _objects(s3_endpoint, plain) == []  # nothing written to it

    # verify reading such a bucket says so too.
    result = await store.verify()
    assert any("has no Object Lock" in b.problem for b in result.breaks)


def test_credentials_come_from_the_environment_or_a_0600_file_only(
    tmp_path: Path, s3_endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    creds = tmp_path / "bucket-credentials"
    creds.write_text(f"[default]\naws_access_key_id = {ACCESS}\naws_secret_access_key = {SECRET}\n")
    creds.chmod(0o644)
    settings = _settings(s3_endpoint, bucket, tmp_path, audit_checkpoint_credentials_file=creds)
    with pytest.raises(ConfigError) as loose:
        open_sink(settings)
    message = str(loose.value.problems[0])
    assert "mode 644" in message and "chmod 600" in message
    assert SECRET not in message

    creds.chmod(0o600)
    sink = open_sink(settings)
    assert isinstance(sink, BucketSink)
    sink.check()  # the credentials work

    # The AWS shared credentials file is held to the same rule.
    shared = tmp_path / "aws-credentials"
    shared.write_text(creds.read_text())
    shared.chmod(0o640)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(shared))
    with pytest.raises(ConfigError, match="mode 640"):
        open_sink(_settings(s3_endpoint, bucket, tmp_path))
    shared.chmod(0o600)
    assert isinstance(open_sink(_settings(s3_endpoint, bucket, tmp_path)), BucketSink)


async def test_a_store_that_goes_away_mid_run_loses_no_checkpoint(
    engine: AsyncEngine, snapshot: Snapshot, tmp_path: Path
) -> None:
    """Its own server, stopped and started again on its port: the checkpoint signed while the
    store was away is logged, counted, kept, and written before the next one."""
    server = _start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    bucket = _bucket(endpoint)
    sink = BucketSink(f"s3://{bucket}/evidence", client=_client(endpoint, attempts=1),
                      retention_days=1)  # fmt: skip
    store = Store(engine, sink, tmp_path)  # type: ignore[arg-type]
    try:
        node = await store.node("node-a")
        rows = records(snapshot)
        node.writer.count(rows[0])
        await node.writer.flush()
        assert await node.anchor.checkpoint("checkpoint") == 1
        before = len(_objects(endpoint, bucket))
        failures = REGISTRY.get_sample_value(
            "gtm_audit_checkpoint_failures_total", {"where": "sink"}
        ) or 0.0  # fmt: skip

        server.stop()
        node.writer.count(rows[1])
        await node.writer.flush()
        with structlog.testing.capture_logs() as logs:
            assert await node.anchor.checkpoint("checkpoint") == 0
        assert sink.pending == 1
        failed = [e for e in logs if e["event"] == "audit.checkpoint_sink_failed"]
        assert failed and failed[0]["chain"] == "node-a" and failed[0]["seq"] == 2
        assert f"s3://{bucket}/evidence/" in failed[0]["error"]
        assert REGISTRY.get_sample_value(
            "gtm_audit_checkpoint_failures_total", {"where": "sink"}
        ) == failures + 1  # fmt: skip
        with pytest.raises(SinkUnavailable):
            sink.keys()  # reading says the store is away, never "no checkpoints"

        server = _start(port)
        node.writer.count(rows[2])
        await node.writer.flush()
        assert await node.anchor.checkpoint("checkpoint") == 1
        assert sink.pending == 0
        written = [orjson.loads(s3_body) for s3_body in _bodies(endpoint, bucket)]
        seqs = sorted(
            w["checkpoint"]["seq"] for w in written if w["checkpoint"]["chain"] == "node-a"
        )
        assert 2 in seqs and 3 in seqs  # the one signed while away, and the next
        assert len(written) == before + 2
        await node.writer.stop()
        await node.anchor.stop()
        result = await store.verify()
        assert result.breaks == [], _problems(result)
        assert result.chains["node-a"].anchored_seq == 3
        assert await read_store_id(engine) is not None
    finally:
        server.stop()


def _bodies(endpoint: str, bucket: str) -> list[bytes]:
    s3 = _client(endpoint)
    return [
        s3.get_object(Bucket=bucket, Key=o["Key"], VersionId=o["VersionId"])["Body"].read()
        for o in _objects(endpoint, bucket)
    ]
