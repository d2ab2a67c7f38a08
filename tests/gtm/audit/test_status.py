"""The sink read incrementally for the evidence status (``GET /v1/audit/chains``): each line
checked once, a line still being written left for the next read, damage reported with where."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gtm.audit.checkpoints import Checkpoint, DirectorySink, Kind, sign
from gtm.audit.keys import ChainKey
from gtm.audit.status import SinkIndex, node_of


def _signed(key: ChainKey, chain: str, seq: int, at: float, kind: Kind = "checkpoint") -> bytes:
    cp = Checkpoint(kind, chain, seq, f"{seq:064x}", seq * 2, at, "store-1", key.id)
    return sign(cp, key).line()


def test_each_line_is_read_once_and_the_newest_kept(tmp_path: Path) -> None:
    sink = DirectorySink(tmp_path)
    key = ChainKey(Ed25519PrivateKey.generate())
    sink.publish_key(key)
    for seq in (0, 3, 6):
        sink.append(sign(Checkpoint("checkpoint", "n1", seq, f"{seq:064x}", seq, 1.0 + seq,
                                    "store-1", key.id), key))  # fmt: skip
    index = SinkIndex(sink)
    index.refresh()
    [(chain, seen)] = list(index.of_store("store-1"))
    assert chain == "n1" and seen.count == 3
    assert seen.newest is not None and seen.newest[0].checkpoint.seq == 6
    assert list(index.of_store("another store")) == []

    path = next((tmp_path / "chains").glob("n1.*.jsonl"))
    whole = _signed(key, "n1", 9, 20.0, "gap")
    with open(path, "ab") as f:  # a line half written when the index reads
        f.write(whole[:40])
    index.refresh()
    assert dict(index.of_store("store-1"))["n1"].count == 3
    with open(path, "ab") as f:
        f.write(whole[40:] + b"not a checkpoint\n")
    index.refresh()
    seen = dict(index.of_store("store-1"))["n1"]
    assert seen.count == 4  # the three read before were not read again
    assert seen.newest is not None and seen.newest[1] == f"{path}:4"
    assert [(s.checkpoint.kind, loc) for s, loc in seen.marks] == [("gap", f"{path}:4")]
    assert [(p.location, "not a checkpoint" in p.problem) for p in index.problems] == [
        (f"{path}:5", True)
    ]

    # Forged with a key nobody published; then the sink's file cut short.
    other = ChainKey(Ed25519PrivateKey.generate())
    with open(path, "ab") as f:
        f.write(_signed(other, "n1", 99, 30.0))
    index.refresh()
    assert "not trusted" in index.problems[-1].problem
    assert dict(index.of_store("store-1"))["n1"].count == 4
    path.write_bytes(path.read_bytes().splitlines(keepends=True)[0])
    index.refresh()
    assert index.problems[-1].problem.startswith("chain file shrank")
    assert dict(index.of_store("store-1"))["n1"].count == 1  # read again from what is left
    assert index.problem_count == 3


def test_a_workers_chain_belongs_to_its_node() -> None:
    assert node_of("gtm-1/w3") == "gtm-1"
    assert node_of("gtm-1") == "gtm-1"
    assert node_of("region_events") is None
