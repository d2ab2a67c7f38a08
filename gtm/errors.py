"""Exceptions raised by the global tier.

    GTMError
    ├── ConfigError          a topology, policy or settings document is invalid (all reasons)
    ├── GeoIPError           the GeoIP database is missing, unreadable or of the wrong type
    ├── AuditError           the audit store cannot be reached or its chain does not verify
    └── Untrusted            a published document that must not come into force
                             (gtm.fleet.signed_documents)

Validation errors carry a list of :class:`Problem` so a caller can print every reason with its
file and location instead of stopping at the first.
"""

from __future__ import annotations

from dataclasses import dataclass


class GTMError(Exception):
    """Base class of every error GTM raises on purpose."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One reason a document was rejected: where it is and what is wrong."""

    source: str  # file name, or "<string>" for documents that were not read from disk
    location: str  # dotted path inside the document, e.g. "regions[2].location.lat"
    message: str

    def __str__(self) -> str:
        where = f"{self.source}: {self.location}" if self.location else self.source
        return f"{where}: {self.message}"


class ConfigError(GTMError):
    """A document failed validation; ``problems`` lists every reason."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


class GeoIPError(GTMError):
    """The GeoIP database cannot be used."""


class AuditError(GTMError):
    """The audit store failed, or its hash chain does not verify."""
