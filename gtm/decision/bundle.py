"""A topology and its policies validated together: what a node answers from, and what a command
that only reads the documents in force needs (without a node's moving parts to import)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gtm.decision.documents import parse_yaml
from gtm.decision.policy import PolicySet, load_policy, parse_policies
from gtm.decision.topology import Topology, load_topology, parse_topology


@dataclass(frozen=True, slots=True)
class Documents:
    topology: Topology
    policy: PolicySet


def load_documents(config: Path, policies: tuple[Path, ...]) -> Documents:
    """Topology and policy, validated together; :class:`ConfigError` with every problem."""
    topology = load_topology(config)
    return Documents(topology, load_policy(policies, topology))


def parse_documents(topology_text: str, policies: Mapping[str, str], source: str) -> Documents:
    """A topology and its policies given as text, validated like files; :class:`ConfigError`
    with every problem, each named by ``source`` and its file."""
    topology = parse_topology(parse_yaml(topology_text, f"{source}: topology"), source)
    policy = parse_policies(
        [(f"{source}: {name}", text) for name, text in sorted(policies.items())], topology
    )
    return Documents(topology, policy)


__all__ = ["Documents", "load_documents", "parse_documents"]
