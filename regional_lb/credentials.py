"""Secrets the balancer holds: upstream API keys, the admin token, and clients' key digests.

A secret is named in the YAML by where it lives, never by its value: an environment variable
(``env: VLLM_API_KEY``) or a file (``file: /run/secrets/vllm``). A file must not be readable by
group or others (mode 0600 or stricter): a key in a world-readable file is already leaked.
A reference that cannot be resolved fails the configuration at start, naming the variable or
file, rather than at the first probe with every instance suddenly unhealthy.

Client keys are stored as SHA-256 digests (the keys are high-entropy, so a plain digest is
enough) and compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path


class SecretUnavailable(ValueError):
    """The secret's variable is unset or empty, or its file is missing or too readable."""


def read_secret(env: str | None, file: str | None) -> str:
    """The secret's value, stripped of surrounding whitespace (files end with a newline)."""
    if env is not None:
        value = os.environ.get(env, "").strip()
        if not value:
            raise SecretUnavailable(f"environment variable {env} is not set")
        return value
    assert file is not None
    path = Path(file)
    try:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretUnavailable(
                f"secret file {file} is accessible by group or others "
                f"(mode {stat.S_IMODE(mode):04o}); chmod 600 it"
            )
        value = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise SecretUnavailable(f"secret file {file}: {exc.strerror or exc}") from None
    if not value:
        raise SecretUnavailable(f"secret file {file} is empty")
    return value


def key_digest(key: str) -> str:
    """The hex SHA-256 of a client API key: what the configuration stores."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def matches(presented: str, digest: str) -> bool:
    """Constant-time comparison of a presented key with a stored digest."""
    return hmac.compare_digest(key_digest(presented), digest)
