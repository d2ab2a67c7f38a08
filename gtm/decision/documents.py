"""Reading YAML documents and turning validation failures into located :class:`Problem` lists.

Shared by the topology and policy loaders so both report errors the same way: every reason at
once, each with its file and its path inside the document.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from gtm.errors import ConfigError, Problem

M = TypeVar("M", bound=BaseModel)


def read_yaml(path: Path) -> Any:
    """Parse one YAML file; raise :class:`ConfigError` naming the file and line on failure."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([Problem(str(path), "", f"cannot read file: {exc.strerror}")]) from exc
    return parse_yaml(text, str(path))


def parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([Problem(source, where, f"invalid YAML: {problem}")]) from exc


def format_location(loc: tuple[int | str, ...]) -> str:
    """Render a pydantic error location as ``regions[2].location.lat``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def problems_from_validation(exc: ValidationError, source: str) -> list[Problem]:
    problems = []
    for err in exc.errors(include_url=False):
        message = err["msg"]
        # Our own validators raise ValueError("..."); pydantic prefixes "Value error, ".
        message = message.removeprefix("Value error, ")
        problems.append(Problem(source, format_location(err["loc"]), message))
    return problems


def validate_document(model: type[M], data: Any, source: str) -> M:
    """Validate ``data`` as ``model``, raising :class:`ConfigError` with every problem."""
    if data is None:
        raise ConfigError([Problem(source, "", "document is empty")])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(problems_from_validation(exc, source)) from exc
