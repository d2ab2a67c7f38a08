"""The signed version a node keeps on its own disk, verified again when read back, and the
review of published rows, which refuses a malformed or hostile row with its reason and uses the
rest (gtm.fleet.local_documents)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from gtm.admin.signer import generate, load_signer
from gtm.fleet.local_documents import Accepted, read_accepted, review, write_accepted
from gtm.fleet.shared_state import Published
from gtm.fleet.signed_documents import Manifest, Untrusted, content_digest
from tests.gtm.fleet.test_document_rollback import (
    EU_CENTRAL,
    LOOSE,
    TOPOLOGY,
    Fleet,
    _still_in_force,
    _two_activations,
    fleet,
)

__all__ = ["fleet"]  # the fixture, shared


async def test_the_local_copy_is_verified_when_read_back(fleet: Fleet) -> None:
    async with fleet.node() as node:
        policy = await _two_activations(fleet, node)
    path = fleet.settings().document_state_path
    keys = {fleet.signer.key_id: fleet.signer.public_key()}
    accepted = read_accepted(path, keys, 1)
    assert accepted is not None and accepted.sequence == 2
    # Edited on disk: EU data to the US under the genuine record. Refused on reading back.
    data = orjson.loads(path.read_bytes())
    path.write_bytes(orjson.dumps({**data, "policies": LOOSE}))
    with pytest.raises(Untrusted) as refused:
        read_accepted(path, keys, 1)
    assert refused.value.reason == "content_mismatch"
    # The node does not use it: it takes activation 2 from the database again.
    async with fleet.node() as restarted:
        _still_in_force(restarted, policy)
    assert read_accepted(path, keys, 1) is not None  # and wrote a good copy back


def test_review_refuses_every_malformed_row_with_its_reason_and_uses_the_rest(
    tmp_path: Path,
) -> None:
    private, _ = generate(tmp_path / "keys")
    signer = load_signer(private)
    keys = {signer.key_id: signer.public_key()}
    body, signature = signer.sign(
        Manifest(
            content_digest(TOPOLOGY, EU_CENTRAL), 2, 2, "alice", ("bob",), 1, 1.0, "bob", "r", ""
        )
    )

    def row(i: int, **fields: Any) -> Published:
        base: dict[str, Any] = {"topology": TOPOLOGY, "policies": EU_CENTRAL,
                                "manifest": body.decode(), "signature": signature}  # fmt: skip
        base |= fields
        return Published(i, "fp", actor="x", reason="x", published_at=0.0, **base)

    rows = [
        row(1, policies="a string"),
        row(2, topology=12),
        row(3, topology=b"bytes"),
        row(4, manifest="garbage"),
        row(5, manifest='{"version": "v"}'),
        row(6, manifest=None),
        row(7, signature=12),
        row(8, policies={"a.yaml": "\ud800"}),
        row(9),
    ]
    result = review(rows, keys, 1)
    assert [p.id for _, p in result.valid] == [9]
    assert isinstance(result.newest, Accepted) and result.newest.sequence == 2
    reasons = {p.id: exc.reason for p, exc in result.refused}
    assert reasons == {
        1: "malformed",
        2: "malformed",
        3: "malformed",
        4: "bad_manifest",
        5: "bad_manifest",
        6: "unsigned",
        7: "malformed",
        8: "malformed",
    }


def test_the_copy_is_replaced_whole_and_garbage_on_disk_is_refused(tmp_path: Path) -> None:
    private, _ = generate(tmp_path / "keys")
    signer = load_signer(private)
    keys = {signer.key_id: signer.public_key()}
    path = tmp_path / "state" / "node-documents.json"
    for sequence in (1, 2):
        body, signature = signer.sign(
            Manifest(
                content_digest(TOPOLOGY, EU_CENTRAL), sequence, 1, "a", ("b",), 1, 1.0, "b", "", ""
            )
        )
        accepted = Accepted.verified(TOPOLOGY, EU_CENTRAL, body.decode(), signature, keys, 1)
        write_accepted(path, accepted)
        again = read_accepted(path, keys, 1)
        assert again is not None and again.sequence == sequence
        assert again.manifest_hash == accepted.manifest_hash
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file left
    data = orjson.loads(path.read_bytes())
    path.write_bytes(orjson.dumps({**data, "sequence": 7}))
    with pytest.raises(Untrusted) as refused:
        read_accepted(path, keys, 1)
    assert refused.value.reason == "local_mismatch"
    for garbage, reason in ((b"{half", "local_corrupt"), (b"[]", "local_corrupt")):
        path.write_bytes(garbage)
        with pytest.raises(Untrusted) as refused:
            read_accepted(path, keys, 1)
        assert refused.value.reason == reason
    assert read_accepted(tmp_path / "absent.json", keys, 1) is None
