"""OpenAI-compatible request parsing and error bodies, shared by the proxy and the simulator.

The proxy must reject bad input before anything is counted as outstanding, so validation here
is strict about what routing needs (model, prompt, a sane ``max_tokens``) and lenient about
everything else, which is passed through to the instance untouched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from regional_lb.balancing.cost import Endpoint, RequestShape, estimate_tokens
from regional_lb.errors import RequestError

DEFAULT_MAX_TOKENS = 256
MAX_TOKENS_LIMIT = 1 << 20
MAX_CHOICES = 128

PATHS: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embedding",
}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    shape: RequestShape
    stream: bool
    body: dict[str, Any]


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param=param)


def _text_tokens(value: Any, param: str) -> int:
    """Tokens in a prompt/input: counted when given as token ids, estimated from text."""
    if isinstance(value, str):
        return estimate_tokens(len(value))
    if isinstance(value, list) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return len(value)
        if all(isinstance(v, str) for v in value):
            return sum(estimate_tokens(len(v)) for v in value)
        if all(isinstance(v, list) and all(isinstance(t, int) for t in v) for v in value):
            return sum(len(v) for v in value)
    raise _bad(f"'{param}' must be a string, a list of strings or a list of token ids", param)


def _message_tokens(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array", "messages")
    chars = 0
    for k, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise _bad(f"'messages[{k}]' must be an object with a 'role'", f"messages[{k}]")
        content = msg.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    chars += len(part["text"])
        elif content is not None:
            raise _bad(
                f"'messages[{k}].content' must be a string or an array", f"messages[{k}].content"
            )
        chars += 4  # role and separators cost a few tokens per message
    return estimate_tokens(chars)


def _max_tokens(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or not (1 <= value <= MAX_TOKENS_LIMIT)
        ):
            raise _bad(f"'{key}' must be an integer between 1 and {MAX_TOKENS_LIMIT}", key)
        return value
    return DEFAULT_MAX_TOKENS


def _n(body: dict[str, Any]) -> int:
    """Choices asked for: each decodes its own tokens, so the cost scales with them (the
    shape's ``max_tokens`` is the total the request may produce)."""
    value = body.get("n", 1)
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or not (1 <= value <= MAX_CHOICES):
        raise _bad(f"'n' must be an integer between 1 and {MAX_CHOICES}", "n")
    return value


def decode_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(f"The body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _bad("The body must be a JSON object")
    return body


def parse_request(endpoint: Endpoint, raw: bytes) -> ParsedRequest:
    body = decode_json(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a string", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    if endpoint == "chat":
        prompt, max_tokens = _message_tokens(body.get("messages")), _max_tokens(body) * _n(body)
    elif endpoint == "completion":
        if "prompt" not in body:
            raise _bad("'prompt' is required", "prompt")
        prompt = _text_tokens(body["prompt"], "prompt")
        max_tokens = _max_tokens(body) * _n(body)
    else:
        if "input" not in body:
            raise _bad("'input' is required", "input")
        prompt, max_tokens, stream = _text_tokens(body["input"], "input"), 0, False
    return ParsedRequest(RequestShape(model, endpoint, prompt, max_tokens), stream, body)
