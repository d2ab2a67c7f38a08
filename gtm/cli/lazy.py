"""Command groups imported when one of their commands runs, not when ``gtm`` starts.

Each group's module imports what its commands need (the admin service, SQLAlchemy, the decision
code: about two seconds together); ``gtm --help`` needs none of it. The root group lists the
lazy groups by name and one-line help, and imports a group's module only to run or describe
that group itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import typer.main
from typer.core import TyperGroup

# name -> ("module:attribute" of its typer app, its one-line help)
Lazy = Mapping[str, tuple[str, str]]


def load(target: str, name: str) -> Any:
    """The click group of the typer app at ``target`` ("module:attribute"), named ``name``."""
    module, _, attribute = target.partition(":")
    group = typer.main.get_group(getattr(importlib.import_module(module), attribute))
    group.name = name
    return group


def lazy_group(groups: Lazy) -> type[TyperGroup]:
    """A root group class (``typer.Typer(cls=...)``) with ``groups`` added lazily."""

    class LazyGroup(TyperGroup):
        lazy: Lazy = groups
        _describing = False

        def list_commands(self, ctx: Any) -> list[str]:
            return sorted({*super().list_commands(ctx), *self.lazy})

        def get_command(self, ctx: Any, cmd_name: str) -> Any:
            if cmd_name in self.lazy and cmd_name not in self.commands:
                target, help_text = self.lazy[cmd_name]
                if self._describing:
                    # Listed in this group's help: its name and help line are all that is shown.
                    return TyperGroup(name=cmd_name, help=help_text)
                self.commands[cmd_name] = load(target, cmd_name)
            return super().get_command(ctx, cmd_name)

        def format_help(self, ctx: Any, formatter: Any) -> None:
            self._describing = True
            try:
                super().format_help(ctx, formatter)
            finally:
                self._describing = False

    return LazyGroup


__all__ = ["Lazy", "lazy_group", "load"]
