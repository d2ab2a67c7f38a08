"""Decision ids: what an HTTP response names its decision by, and how to find its audit row.

Identical decisions share one audit row per flush window (with a count), so an id cannot be a
row's key: the row does not exist yet when the response goes out. Instead the id carries what
picks the row out afterwards::

    <node>~<unix ms, hex>~<mark>~<serial, hex>

- ``node``: the node (worker) whose audit chain counts the response;
- the time of the decision: the row's ``[first_at_us, last_at_us]`` contains it, since a
  row's times are the earliest and latest decision times of the responses it counts (for a
  proxied exchange, the time its decision was made, however long the exchange lasted);
- ``mark``: a short hash of the client network and the name asked for, the columns that tell
  apart the rows a node writes for the same moment;
- a serial, so that two responses never share an id (logs on both tiers can be joined on it).

:func:`gtm.audit.query.find_decision` turns an id back into its row(s).

>>> i = make_id("gtm-1/w0", 1700000000.1234, "203.0.113.0/24", "chat.gtm.example", 7)
>>> parse_id(i).node, parse_id(i).at_ms
('gtm-1/w0', 1700000000123)
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple


class DecisionIdError(ValueError):
    """A string that is not a decision id."""


class DecisionId(NamedTuple):
    node: str
    at_ms: int
    mark: str
    serial: int


def mark_of(client_network: str, name: str) -> str:
    """8 hex digits from the client network and name: what the id shares with its row."""
    digest = hashlib.blake2b(f"{client_network}\x00{name}".encode(), digest_size=4)
    return digest.hexdigest()


def id_tail(client_network: str, name: str) -> bytes:
    """The part of an id between its time and its serial, with both separators; answers
    cached for a client network render it once."""
    return b"~" + mark_of(client_network, name).encode() + b"~"


def render_id(node_prefix: bytes, at: float, tail: bytes, serial: int) -> bytes:
    """An id from its parts as the answering path holds them: ``node_prefix`` is the node name
    and its separator, ``tail`` from :func:`id_tail`. The milliseconds are cut from the
    microseconds the audit writer stores (``int(at * 1e6)``), not from ``at`` itself: the two
    roundings disagree for about one time in a million."""
    return b"%s%x%s%x" % (node_prefix, int(at * 1_000_000) // 1000, tail, serial)


def make_id(node: str, at: float, client_network: str, name: str, serial: int) -> str:
    return render_id(node.encode() + b"~", at, id_tail(client_network, name), serial).decode()


def parse_id(text: str) -> DecisionId:
    parts = text.strip().rsplit("~", 3)
    if len(parts) != 4 or not parts[0]:
        raise DecisionIdError(f"not a decision id: {text!r} (expected node~time~mark~serial)")
    node, at, mark, serial = parts
    try:
        at_ms, serial_n = int(at, 16), int(serial, 16)
        int(mark, 16)
    except ValueError:
        raise DecisionIdError(f"not a decision id: {text!r} (time, mark, serial are hex)") from None
    if len(mark) != 8:
        raise DecisionIdError(f"not a decision id: {text!r} (the mark is 8 hex digits)")
    return DecisionId(node, at_ms, mark, serial_n)
