"""The examples in the code's docstrings (``>>>``) are run, so that none goes stale: every
module of both packages, imported (``__main__`` modules, which run a command, left out)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import gtm
import regional_lb
from tests.conftest import ROOT

MODULES = sorted(
    m.name
    for package in (gtm, regional_lb)
    for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
    if not m.name.endswith(".__main__")
)


def test_every_modules_examples_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # examples name the repository's files (policies/) by relative path
    attempted, failed = 0, []
    for name in MODULES:
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
        attempted += result.attempted
        if result.failed:
            failed.append(f"{name}: {result.failed} of {result.attempted}")
    assert not failed, failed
    assert attempted >= 25, f"only {attempted} examples found: is the walk finding the modules?"
