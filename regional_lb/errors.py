"""Exceptions raised by the regional balancer.

RegionalError
├── ConfigError        the balancer's YAML or settings are invalid (every reason listed)
├── RequestError       the client's request is malformed (maps to a 4xx)
├── NoInstanceError    no instance can serve the model (503)
├── Overloaded         the admission queue is full or the wait would pass its timeout (429)
└── UpstreamError      an instance failed while serving a request (502/504)
"""

from __future__ import annotations


class RegionalError(Exception):
    """Base class of every error the regional tier raises on purpose."""


class ConfigError(RegionalError):
    """The configuration failed validation; ``problems`` lists every reason with its location."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


class RequestError(RegionalError):
    """A client error: carries the HTTP status and the OpenAI-style error ``type``/``code``."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        self.status = status
        self.code = code
        self.param = param
        super().__init__(message)


class NoInstanceError(RegionalError):
    """No healthy instance has, or can load, the requested model."""


class Overloaded(RegionalError):
    """Admission refused; ``retry_after`` is the predicted drain time in seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        self.retry_after = retry_after
        super().__init__(message)


class UpstreamError(RegionalError):
    """The instance answered with a 5xx, timed out, or closed the connection mid-response."""
