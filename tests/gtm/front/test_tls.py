"""TLS on the front: certificate and key from files (the key 0600 or stricter, else no start),
verified by a real client against the test's own CA, reloaded when the files change, and the
connection bounds holding for handshakes too."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import os
import ssl
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from structlog.testing import capture_logs

from gtm.errors import ConfigError
from gtm.front.connections import ConnectionLimits
from gtm.front.server import FrontServer
from gtm.front.tls import TlsFiles
from gtm.runtime import Runtime
from gtm.settings import Settings
from tests.conftest import DEMO, POLICIES
from tests.support.waiting import eventually

from .conftest import FrontFactory
from .test_connections import PARTIAL_HEAD, WITHIN, connect, connections

CHAT = "chat.gtm.example"


class Authority:
    """A throwaway CA that issues server certificates for loopback."""

    def __init__(self) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "GTM test CA")])
        now = datetime.datetime.now(datetime.UTC)
        self.name = name
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, directory: Path, common_name: str, key_mode: int = 0o600) -> TlsFiles:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName(CHAT)]
                ),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        directory.mkdir(parents=True, exist_ok=True)
        files = TlsFiles(directory / "front.crt", directory / "front.key")
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        # Written 0600 from the first byte, as an operator's tooling would; then set as asked.
        fd = os.open(files.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
        os.chmod(files.key, key_mode)
        return files


@pytest.fixture
def authority() -> Authority:
    return Authority()


def client_context(authority: Authority) -> ssl.SSLContext:
    return ssl.create_default_context(cadata=authority.pem().decode())


async def peer_common_name(url: str, authority: Authority) -> str:
    """The CN of the certificate a fresh connection is served, verified against the CA."""
    host, port = url.removeprefix("https://").rsplit(":", 1)
    _, writer = await asyncio.open_connection(
        host, int(port), ssl=client_context(authority), server_hostname=host
    )
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        cert = x509.load_der_x509_certificate(der)
        return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)
    finally:
        writer.close()
        await writer.wait_closed()


async def test_https_redirect_verified_against_the_ca(
    start_front: FrontFactory, authority: Authority, tmp_path: Path
) -> None:
    files = authority.issue(tmp_path / "tls", "front-1")
    async with start_front(tls=files) as front:
        assert front.url.startswith("https://127.0.0.1:")
        async with httpx.AsyncClient(
            base_url=front.url, verify=client_context(authority), trust_env=False
        ) as http:
            r = await http.get("/v1/models", headers={"host": CHAT})
        assert r.status_code == 307
        assert r.headers["x-gtm-decision-id"]
        assert r.extensions["http_version"] == b"HTTP/1.1"
        # A client that does not trust the CA gets no answer at all.
        async with httpx.AsyncClient(base_url=front.url, trust_env=False) as stranger:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await stranger.get("/v1/models", headers={"host": CHAT})


async def test_a_renewed_certificate_is_served_without_a_restart(
    start_front: FrontFactory, authority: Authority, tmp_path: Path
) -> None:
    files = authority.issue(tmp_path / "tls", "front-1")
    async with start_front(tls=files, tls_reload_interval_s=0.05) as front:
        tls = front.server.tls
        assert tls is not None
        assert await peer_common_name(front.url, authority) == "front-1"
        # A half-written renewal (a key that does not match the certificate) is refused and
        # the last good pair stays in force.
        renewed = authority.issue(tmp_path / "renewed", "front-2")
        with capture_logs() as logs:
            files.cert.write_bytes(renewed.cert.read_bytes())
            await eventually(lambda: tls.failures >= 1, what="the mismatched pair refused")
        (failed,) = [e for e in logs if e["event"] == "front.tls_reload_failed"]
        assert failed["log_level"] == "error"
        assert "cannot load the TLS certificate and key" in failed["problems"][0]
        assert str(files.cert) in failed["problems"][0]
        assert await peer_common_name(front.url, authority) == "front-1"
        files.key.write_bytes(renewed.key.read_bytes())
        await eventually(lambda: tls.reloads == 1, what="the renewed pair loaded")
        assert await peer_common_name(front.url, authority) == "front-2"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604], ids=["644", "640", "604"])
def test_a_key_others_can_read_refuses_to_start(
    authority: Authority, tmp_path: Path, mode: int
) -> None:
    files = authority.issue(tmp_path / "tls", "front", key_mode=mode)
    runtime = Runtime(settings(tmp_path))  # not started: the check comes before anything runs
    with pytest.raises(ConfigError) as info:
        FrontServer(runtime, "127.0.0.1:0", tls=files)
    problem = info.value.problems[0]
    assert str(files.key) in str(problem)
    assert f"mode {mode:o}" in str(problem) and "chmod 600" in str(problem)


def test_missing_or_mismatched_files_refuse_to_start(authority: Authority, tmp_path: Path) -> None:
    runtime = Runtime(settings(tmp_path))
    one = authority.issue(tmp_path / "one", "one")
    other = authority.issue(tmp_path / "other", "other")
    with pytest.raises(ConfigError, match="cannot load the TLS certificate and key"):
        FrontServer(runtime, "127.0.0.1:0", tls=TlsFiles(one.cert, other.key))
    with pytest.raises(ConfigError, match="cannot read the TLS key"):
        FrontServer(runtime, "127.0.0.1:0", tls=TlsFiles(one.cert, tmp_path / "absent.key"))
    with pytest.raises(ConfigError, match="no such file"):
        FrontServer(runtime, "127.0.0.1:0", tls=TlsFiles(tmp_path / "absent.crt", one.key))


def test_tls_comes_from_the_settings(authority: Authority, tmp_path: Path) -> None:
    files = authority.issue(tmp_path / "tls", "front")
    runtime = Runtime(settings(tmp_path, http_tls_cert=files.cert, http_tls_key=files.key))
    assert FrontServer(runtime, "127.0.0.1:0").url.startswith("https://")
    with pytest.raises(ValueError, match="set both or neither"):
        settings(tmp_path, http_tls_cert=files.cert)


async def test_handshakes_in_progress_hold_slots_under_the_cap(
    start_front: FrontFactory, authority: Authority, tmp_path: Path
) -> None:
    files = authority.issue(tmp_path / "tls", "front")
    limits = ConnectionLimits(max_connections=3, max_per_client=0, header_timeout_s=600)
    async with start_front(tls=files, connection_limits=limits) as front:
        budget = front.server.budget
        # Connected, and no ClientHello: each holds a slot while its handshake may still come.
        silent = [await connect(front) for _ in range(3)]
        async with connections(*silent):
            await eventually(lambda: budget.open == 3, what="three handshakes in progress")
            over = await connect(front)
            async with connections(over):
                await eventually(over.closed.is_set, within=WITHIN, what="past the cap closed")
            assert budget.refused["cap"] == 1
            await silent.pop().aclose()
            await eventually(lambda: budget.open == 2, what="a slot released")
            async with httpx.AsyncClient(
                base_url=front.url, verify=client_context(authority), trust_env=False
            ) as http:
                assert (await http.get("/v1/models", headers={"host": CHAT})).status_code == 307
        await eventually(lambda: budget.open == 0, what="every slot released")


async def test_unfinished_handshakes_are_cut_at_the_head_deadline(
    start_front: FrontFactory, authority: Authority, tmp_path: Path
) -> None:
    files = authority.issue(tmp_path / "tls", "front")
    limits = ConnectionLimits(max_connections=100, max_per_client=0, header_timeout_s=0.5)
    async with start_front(tls=files, connection_limits=limits) as front:
        budget = front.server.budget
        silent = [await connect(front) for _ in range(5)]
        plain = await connect(front, send=PARTIAL_HEAD)  # plain HTTP where TLS is spoken
        async with connections(*silent, plain):
            await eventually(
                lambda: all(c.closed.is_set() for c in [*silent, plain]),
                within=WITHIN,
                what="unfinished handshakes cut",
            )
            assert all(c.received == b"" for c in silent)
            assert not plain.received.startswith(b"HTTP/")  # never an answer in the clear
        await eventually(lambda: budget.open == 0, within=WITHIN, what="slots released")


async def test_a_trickled_body_is_cut_over_tls(
    start_front: FrontFactory, authority: Authority, tmp_path: Path
) -> None:
    files = authority.issue(tmp_path / "tls", "front")
    limits = ConnectionLimits(header_timeout_s=5, body_timeout_s=0.5, body_min_rate=1000)
    async with start_front(tls=files, connection_limits=limits, keep_alive_s=60) as front:
        budget = front.server.budget
        host, port = front.url.removeprefix("https://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(
            host, int(port), ssl=client_context(authority), server_hostname=host
        )
        head = f"POST /v1/models HTTP/1.1\r\nHost: {CHAT}\r\nContent-Length: 9999\r\n\r\n"
        writer.write(head.encode())
        try:
            answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WITHIN)
            assert answer.startswith(b"HTTP/1.1 307 ")  # answered before its body
            for _ in range(int(WITHIN / 0.02)):  # a byte every 20 ms until cut
                if budget.body_timeouts:
                    break
                writer.write(b"x")
                await asyncio.sleep(0.02)
            assert budget.body_timeouts == 1
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                assert await asyncio.wait_for(reader.read(), WITHIN) == b""
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()
        await eventually(lambda: budget.open == 0, within=WITHIN, what="slots released")


def settings(tmp_path: Path, **overrides: object) -> Settings:
    return Settings(
        **{
            "config": DEMO,
            "policies": (POLICIES,),
            "database_url": f"sqlite:///{tmp_path / 'gtm.sqlite3'}",
            "spool_dir": tmp_path / "spool",
            "node_id": "tls-test",
            "probes": False,
            **overrides,
        }
    )
