"""Files that hold secrets (private keys, cookie keys): readable by their owner only, or refused.

One check for every such file, so each refuses a loose mode with the same clear error, naming
the file, its mode and the fix, instead of reading a key that others on the machine could too.
"""

from __future__ import annotations

import os
from pathlib import Path

from gtm.errors import ConfigError, Problem


def check_owner_only(path: Path, what: str) -> None:
    """:class:`ConfigError` when ``path`` cannot be read or its mode lets anyone but its owner
    in; ``what`` names the file in the error ("the TLS key")."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(
            [Problem(str(path), "", f"cannot read {what}: {exc.strerror or exc}")]
        ) from None
    if mode & 0o077:
        raise ConfigError(
            [
                Problem(
                    str(path),
                    "",
                    f"mode {mode & 0o777:o}: {what} must be 0600, readable by its owner only "
                    "(chmod 600)",
                )
            ]
        )


def read_owner_only(path: Path, what: str) -> bytes:
    """The bytes of ``path`` after :func:`check_owner_only`."""
    check_owner_only(path, what)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            [Problem(str(path), "", f"cannot read {what}: {exc.strerror or exc}")]
        ) from None


def write_new_owner_only(path: Path, data: bytes) -> None:
    """Write a new secret file: mode 0600 from the first byte, flushed to disk, and never over
    an existing file (:class:`FileExistsError`): a key others already trust is not replaced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


__all__ = ["check_owner_only", "read_owner_only", "write_new_owner_only"]
