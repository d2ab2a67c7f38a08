"""What TLS costs the HTTP front: requests/s over plain HTTP and over HTTPS, in one run.

    python bench/http/tls.py [--rounds 3] [--seconds 5] [--connections 32] [--clients 4096]

Two fronts (``gtm serve --http``, one worker each, the demo topology, full decisions and audit
counting), one plain and one with a throwaway certificate made for this run (ECDSA P-256,
self-signed; ``GTM_HTTP_TLS_CERT`` / ``GTM_HTTP_TLS_KEY``), each pinned to the same server core
and ``wrk`` to another, the variants interleaved over rounds:

- ``keep-alive``: wrk's connections stay open, so TLS costs its record encryption only;
- ``new connection``: every request says ``Connection: close``, so each is a new TCP connection,
  and over HTTPS a full handshake (wrk does not resume sessions).

Ratios are per round (each HTTPS variant against the plain one of the same connection mode,
measured minutes apart at most), then the median.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.http.run import (  # noqa: E402
    WrkResult,
    client_addresses,
    free_port,
    missing_tools,
    run_wrk,
    start_gtm,
    stop,
    wait_port,
    write_wrk_script,
)


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (mode 0600, as the front asks)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gtm bench")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "front.crt", directory / "front.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return cert_path, key_path


@dataclass
class Variant:
    name: str
    scheme: str
    port: int
    script: Path
    results: list[WrkResult] = field(default_factory=list)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--clients", type=int, default=4096, help="distinct client addresses")
    args = parser.parse_args()
    if any(p.startswith("wrk") for p in missing_tools()):
        print("cannot run the benchmark: wrk not found (Debian package wrk)", file=sys.stderr)
        return 2
    cores = sorted(os.sched_getaffinity(0))
    server_core, load_core = (str(cores[0]), str(cores[-1])) if len(cores) >= 2 else (None, None)
    with tempfile.TemporaryDirectory(prefix="gtm-bench-tls-") as tmpdir:
        tmp = Path(tmpdir)
        cert, key = make_certificate(tmp)
        addresses = client_addresses(args.clients)
        kept, closing = tmp / "kept.lua", tmp / "close.lua"
        write_wrk_script(kept, addresses, None)
        write_wrk_script(closing, addresses, None, close=True)
        plain_port, tls_port = free_port(), free_port()
        procs = [
            start_gtm(tmp, plain_port, server_core, tag="plain"),
            start_gtm(
                tmp,
                tls_port,
                server_core,
                tag="tls",
                env={"GTM_HTTP_TLS_CERT": str(cert), "GTM_HTTP_TLS_KEY": str(key)},
            ),
        ]
        variants = [
            Variant("http, keep-alive", "http", plain_port, kept),
            Variant("https, keep-alive", "https", tls_port, kept),
            Variant("http, new connection", "http", plain_port, closing),
            Variant("https, new connection (handshake)", "https", tls_port, closing),
        ]
        try:
            wait_port(plain_port)
            wait_port(tls_port)
            for v in variants:  # warm-up
                run_wrk(v.port, 2, args.connections, v.script, load_core, v.scheme)
            for rnd in range(args.rounds):
                order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)]
                for v in order:
                    v.results.append(
                        run_wrk(
                            v.port, args.seconds, args.connections, v.script, load_core, v.scheme
                        )
                    )
                print(
                    f"round {rnd + 1}/{args.rounds}: "
                    + ", ".join(f"{v.name} {v.results[-1].rate:,.0f}/s" for v in variants),
                    flush=True,
                )
        finally:
            for proc in procs:
                stop(proc)
    report(variants, args)
    return 0


def report(variants: list[Variant], args: argparse.Namespace) -> None:
    by = {v.name: v for v in variants}

    def ratio(a: str, b: str) -> float:
        return statistics.median(
            x.rate / y.rate for x, y in zip(by[a].results, by[b].results, strict=True)
        )

    baseline = {
        "https, keep-alive": "http, keep-alive",
        "https, new connection (handshake)": "http, new connection",
    }
    print()
    print(
        f"{args.rounds} rounds x {args.seconds}s, wrk -t1 -c{args.connections}, one server core, "
        f"{args.clients} client addresses; medians over rounds, ratios per round then the median"
    )
    print()
    print("| variant | req/s (median) | min-max | p50 | p99 | vs plain HTTP, same mode | errors |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for v in variants:
        rates = [r.rate for r in v.results]
        vs = f"{ratio(v.name, baseline[v.name]):.2f}x" if v.name in baseline else "1.00x"
        print(
            f"| {v.name} | {statistics.median(rates):,.0f} | {min(rates):,.0f}-{max(rates):,.0f} "
            f"| {statistics.median(r.p50_ms for r in v.results):.2f} ms "
            f"| {statistics.median(r.p99_ms for r in v.results):.2f} ms | {vs} "
            f"| {sum(r.errors for r in v.results)} |"
        )
    print()
    print(
        "https new connection / https keep-alive (the handshake's cost): "
        f"{ratio('https, new connection (handshake)', 'https, keep-alive'):.2f}x"
    )
    print(
        "http new connection / http keep-alive (a TCP connection's cost): "
        f"{ratio('http, new connection', 'http, keep-alive'):.2f}x"
    )


if __name__ == "__main__":
    sys.exit(main())
