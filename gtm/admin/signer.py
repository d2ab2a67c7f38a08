"""The admin service's signing key: Ed25519, in a file of mode 0600, never in the database.

``gtm admin keygen DIR`` makes a pair: ``document-signing.key`` (private, 0600) for the nodes that
serve the admin API (``GTM_DOCUMENT_SIGNING_KEY``), ``document-signing.pub`` for every node
(``GTM_DOCUMENT_KEYS``). Someone holding the database password but not this file cannot make a
version every node accepts (:mod:`gtm.fleet.signed_documents`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gtm.audit.keys import load_private_key
from gtm.fleet.signed_documents import Manifest, key_id
from gtm.secret_files import write_new_owner_only

PRIVATE_NAME = "document-signing.key"
PUBLIC_NAME = "document-signing.pub"


class Signer:
    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.key_id = key_id(key.public_key())

    def public_key(self) -> Ed25519PublicKey:
        return self._key.public_key()

    def sign_bytes(self, body: bytes) -> str:
        return self._key.sign(body).hex()

    def sign(self, manifest: Manifest) -> tuple[bytes, str]:
        """The manifest's canonical bytes (naming this key) and the hex signature over them."""
        body = replace(manifest, key=self.key_id).canonical()
        return body, self._key.sign(body).hex()


def load_signer(path: Path) -> Signer:
    """The signing key in ``path``; :class:`ConfigError` when it is unreadable, not Ed25519,
    or readable by anyone but its owner."""
    return Signer(load_private_key(path, "the signing key"))


def generate(directory: Path) -> tuple[Path, Path]:
    """A new key pair in ``directory``; refuses to overwrite an existing private key."""
    directory.mkdir(parents=True, exist_ok=True)
    private, public = directory / PRIVATE_NAME, directory / PUBLIC_NAME
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    write_new_owner_only(private, pem)  # never replaces a key nodes already trust
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


__all__ = ["PRIVATE_NAME", "PUBLIC_NAME", "Signer", "generate", "load_signer"]
