"""Errors of the control plane, each with the HTTP status and stable code the API answers with.

LifecycleError (GTMError)   400 bad_request
├── NotFound                404 not_found
├── Refused                 403 forbidden      (four-eyes, someone else's proposal)
├── Conflict                409 conflict       (a step out of order, a stale version)
├── Invalid                 422 ...            (documents or input, with every problem)
└── Tampered                409 tampered       (a row altered behind the service's back)
"""

from __future__ import annotations

from gtm.errors import GTMError, Problem


class LifecycleError(GTMError):
    """A step that cannot be taken: ``status`` is its HTTP status, ``code`` a stable name."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str, problems: list[Problem] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.problems = problems or []
        # Whether a ``denied`` event was written where it was raised; the API records the
        # refusals (403, 409) that were not, so every one is evidence (gtm.admin.app).
        self.recorded = False


class NotFound(LifecycleError):
    status, code = 404, "not_found"


class Refused(LifecycleError):
    status, code = 403, "forbidden"


class Conflict(LifecycleError):
    status, code = 409, "conflict"


class Invalid(LifecycleError):
    status, code = 422, "invalid_documents"


class Tampered(LifecycleError):
    """A stored version whose content no longer hashes to its id: written to behind the admin
    service's back. Nothing is shown, diffed or activated from it."""

    status, code = 409, "tampered"


__all__ = ["Conflict", "Invalid", "LifecycleError", "NotFound", "Refused", "Tampered"]
