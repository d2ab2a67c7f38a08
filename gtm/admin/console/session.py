"""Console sessions: an encrypted cookie holding the bearer token, an idle timeout, CSRF.

The cookie is a Fernet token (AES-128-CBC with HMAC-SHA256) over the session's fields, so a
browser can neither read the bearer token out of it nor forge or extend a session. Sessions are
stateless: any admin node holding the same key accepts them (a key file, mode 0600, shared by
the admin nodes; without one each process makes its own, and sessions end with the process).
The idle timeout slides: each request re-seals the cookie with the time it was seen; an absolute
lifetime caps it whatever the activity. Signing out forgets the session's id on this node and
clears the cookie; the token itself stays valid until it is revoked in the API.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass, replace
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

from gtm.errors import ConfigError, Problem
from gtm.secret_files import read_owner_only

COOKIE = "gtm_console"
# Before sign-in there is no session to hold a CSRF token: the sign-in form's token is a
# double-submit cookie instead (a cross-site page can neither read nor set it).
SIGNIN_COOKIE = "gtm_console_signin"


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    token: str  # the bearer the API authenticates; never shown, never logged
    csrf: str
    issued: float
    seen: float


class Expired(Exception):
    """The cookie was a session once, and has lapsed (idle or too old): say so at sign-in."""


def new_session(token: str, now: float) -> Session:
    return Session(secrets.token_urlsafe(12), token, secrets.token_urlsafe(24), now, now)


def csrf_matches(expected: str, offered: str | None) -> bool:
    return offered is not None and hmac.compare_digest(expected.encode(), offered.encode())


def load_key(path: Path | None) -> bytes:
    """The cookie key: derived from the file's contents (mode 0600 or stricter, at least 32
    bytes), or random for this process when no file is configured."""
    if path is None:
        return Fernet.generate_key()
    material = read_owner_only(path, "the console key")
    if len(material.strip()) < 32:
        raise ConfigError([Problem(str(path), "", "the console key needs at least 32 bytes")])
    digest = hashlib.sha256(b"gtm-console-session\0" + material.strip()).digest()
    return base64.urlsafe_b64encode(digest)


class SessionCodec:
    def __init__(self, key: bytes, *, idle_s: float, max_age_s: float) -> None:
        self._fernet = Fernet(key)
        self.idle_s = idle_s
        self.max_age_s = max_age_s
        # Signed-out sessions this node refuses until they would have lapsed anyway.
        self._ended: dict[str, float] = {}

    def seal(self, session: Session) -> str:
        body = json.dumps(
            [session.id, session.token, session.csrf, session.issued, session.seen]
        ).encode()
        return self._fernet.encrypt(body).decode("ascii")

    def open(self, cookie: str | None, now: float) -> Session | None:
        """The session in ``cookie`` seen at ``now``; None when there is none (or it is not
        ours); :class:`Expired` when it was one and has lapsed or was signed out."""
        if not cookie:
            return None
        try:
            fields = json.loads(self._fernet.decrypt(cookie.encode("ascii")))
            session = Session(*fields)
        except (InvalidToken, ValueError, TypeError, UnicodeEncodeError):
            return None
        if (
            now - session.seen > self.idle_s
            or now - session.issued > self.max_age_s
            or session.id in self._ended
        ):
            raise Expired
        return replace(session, seen=now)

    def encrypt(self, data: bytes) -> str:
        """Anything else the console keeps in a cookie (the OIDC flow's state)."""
        return self._fernet.encrypt(data).decode("ascii")

    def decrypt(self, token: str, max_age_s: float) -> bytes:
        """Raises :class:`cryptography.fernet.InvalidToken` when forged or older than allowed."""
        return self._fernet.decrypt(token.encode("ascii"), ttl=int(max_age_s))

    def end(self, session: Session, now: float) -> None:
        self._ended = {sid: at for sid, at in self._ended.items() if now - at < self.max_age_s}
        self._ended[session.id] = now


__all__ = [
    "COOKIE",
    "SIGNIN_COOKIE",
    "Expired",
    "Session",
    "SessionCodec",
    "csrf_matches",
    "load_key",
    "new_session",
]
