"""TLS for the front: the certificate chain and key from files, checked, and reloaded on change.

The key file must be readable by its owner alone (mode 0600 or stricter): a key others can read
is refused at start-up with the path and mode, as the other key files of GTM are. A certificate
renewed on disk (certbot, cert-manager) comes into force without a restart: the files are
checked every few seconds and a changed pair is loaded into a new context that serves the
handshakes from then on; a pair that does not load (a half-written file, a key that does not
match) is logged and the last good one stays, as with the GeoIP database.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import structlog

from gtm.errors import ConfigError, Problem
from gtm.secret_files import check_owner_only

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: Path  # PEM: the certificate, then any intermediates
    key: Path  # PEM: the private key, unencrypted, mode 0600 or stricter


def load_context(files: TlsFiles) -> ssl.SSLContext:
    """A server context for ``files``; :class:`ConfigError` naming the file and the reason."""
    check_owner_only(files.key, "the TLS key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # The front speaks HTTP/1.1 only; saying so lets clients that offer h2 settle at once.
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(files.cert, files.key)
    except FileNotFoundError as exc:
        raise ConfigError([Problem(exc.filename or str(files.cert), "", "no such file")]) from None
    except OSError as exc:  # ssl.SSLError included: a bad PEM, a key that does not match
        raise ConfigError(
            [Problem(str(files.cert), "", f"cannot load the TLS certificate and key: {exc}")]
        ) from None
    return context


def _stamp(files: TlsFiles) -> tuple[tuple[int, int, int], ...] | None:
    try:
        return tuple(
            (s.st_ino, s.st_size, s.st_mtime_ns) for s in (os.stat(files.cert), os.stat(files.key))
        )
    except OSError:
        return None


class TlsContexts:
    """The context new handshakes use, swapped when the files change."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._stamp = _stamp(files)
        self._failed: tuple[tuple[int, int, int], ...] | None = None
        self.current = load_context(files)  # raises: a node never starts with a bad pair
        self.reloads = 0
        self.failures = 0

    def check(self) -> bool:
        """Load the files again if they changed since the last look; True when swapped."""
        stamp = _stamp(self.files)
        if stamp is None or stamp == self._stamp or stamp == self._failed:
            return False
        try:
            context = load_context(self.files)
        except ConfigError as exc:
            # Said once per state of the files: a renewal still being written changes them
            # again, and is tried again then.
            self._failed = stamp
            self.failures += 1
            log.error("front.tls_reload_failed", problems=[str(p) for p in exc.problems])
            return False
        self._stamp, self.current = stamp, context
        self.reloads += 1
        log.info("front.tls_reloaded", cert=str(self.files.cert))
        return True

    async def watch(self, interval_s: float, stop: asyncio.Event) -> None:
        """Check the files every ``interval_s`` until ``stop`` is set (a stat of each file; a
        load only when they changed)."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                self.check()


__all__ = ["TlsContexts", "TlsFiles", "load_context"]
