"""Read consistency of the Milvus backend: reads are "Session" by default (a process sees its own
writes at once, without waiting for the server's time tick on every search), settable with
QSWAP_MILVUS_CONSISTENCY, and a bad value is a one-line error."""

from __future__ import annotations

import pytest

from qswap.errors import InvalidInputError
from qswap.index import Document
from qswap.index.backends import open_index

from .conftest import hash_embed, make_space


def _create(location: str, n: int = 20):
    from qswap.index.backends.milvus.build import create_collection
    from qswap.index.backends.milvus.connection import parse_location
    docs = [Document(f"d{i}", f"document number {i}", {}) for i in range(n)]
    uri, coll = parse_location(location)
    return create_collection(uri, coll, docs, hash_embed([d.text for d in docs]), make_space())


def test_a_write_is_seen_by_another_connection_of_the_process(milvus_server):
    """Session consistency is per process and collection, not per client: an index opened before
    the write (another connection, as another request handler would hold) finds the new document."""
    loc = f"milvus://127.0.0.1:{milvus_server.port}?collection=consistency_a"
    writer = _create(loc)
    reader = open_index(loc, read_only=True)
    try:
        assert reader.info()["milvus"]["read_consistency"] == "Session"
        writer.upsert([Document("fresh", "a brand new text", {})], hash_embed(["a brand new text"]))
        assert reader.search(hash_embed(["a brand new text"]), 1)[0][0].id == "fresh"
        writer.delete(["fresh"])
        assert all(h.id != "fresh" for h in reader.search(hash_embed(["a brand new text"]), 5)[0])
    finally:
        reader.close()
        writer.close()


def test_consistency_from_the_environment(tmp_path, monkeypatch):
    loc = f"milvus://{tmp_path / 'c.db'}?collection=c"
    _create(loc).close()
    monkeypatch.setenv("QSWAP_MILVUS_CONSISTENCY", "strong")
    with open_index(loc) as idx:
        assert idx.info()["milvus"]["read_consistency"] == "Strong"
        assert idx.search(hash_embed(["document number 3"]), 1)[0][0].id == "d3"
    monkeypatch.setenv("QSWAP_MILVUS_CONSISTENCY", "sometimes")
    with pytest.raises(InvalidInputError, match="QSWAP_MILVUS_CONSISTENCY='sometimes'"):
        open_index(loc)
