"""A real server runs a batch that mixes encoders as one segment call (``mixed_batches``), with
the answers each encoder gives in a batch of its own."""

from __future__ import annotations

import threading

import pytest

from qswap.encoders.runtime.shared_segments import SegmentRunner

from ..handshake import held_first_call
from .conftest import ADMIN, LiveServer, server_settings
from .exact import TOL

KEYS = ["ft@1", "ft@2", "base"]
QUERY = "chess puzzle game"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, tiny_model_dir, index_dir, encoders_root):
    """A server whose mixed batches always run as one segment call, one forward lane (so the
    batch that forms behind a held one is the one the test checks)."""
    s = server_settings(tmp_path_factory.mktemp("mixed"), tiny_model_dir, index_dir, encoders_root=encoders_root,
                        admin_token=ADMIN, mixed_batches="segments", forward_lanes=1)
    with LiveServer(s) as srv:
        yield srv


def test_a_mixed_batch_is_one_segment_call_with_the_one_encoder_answers(mixed, monkeypatch):
    with mixed.client(ADMIN) as admin:
        for d in ("ft1", "ft2"):
            r = admin.post("/v1/encoders", json={"path": d})
            assert r.status_code in (200, 201), r.text
    qs = mixed.app.state.qs
    backend = qs.backend
    for k in KEYS:
        assert backend.wait(k, timeout=120)
    backend.encode([QUERY] * len(KEYS), KEYS)   # the first mixed batch starts the segment graph's build
    assert backend.segments_ready(wait=120)
    with mixed.client() as c:   # each encoder alone: a batch of one encoder (its bound call)
        alone = {k: c.post("/v1/search", json={"query": QUERY, "k": 5, "encoder": k}).json()["results"][0]["hits"]
                 for k in KEYS}
    calls: list[list[str]] = []
    run = SegmentRunner.run

    def spy(runner, session, inputs, mask, keys):
        calls.append(list(keys))
        return run(runner, session, inputs, mask, keys)
    monkeypatch.setattr(SegmentRunner, "run", spy)
    # The first forward waits until the three requests are tokenised and queued behind it: the
    # next batch then holds all three, one row per encoder.
    forward = qs.batcher.forward
    real = forward.encode_fn
    held = held_first_call(real, lambda: qs.batcher._ready.qsize() >= len(KEYS))
    entered = threading.Event()

    def first_held(*a, **kw):
        entered.set()
        return held(*a, **kw)
    forward.encode_fn = first_held
    got: dict[str, list] = {}
    errors: list[str] = []

    def ask(key: str) -> None:
        with mixed.client() as c:
            r = c.post("/v1/search", json={"query": QUERY, "k": 5, "encoder": key})
            if r.status_code != 200:
                errors.append(r.text)
            else:
                got[key] = r.json()["results"][0]["hits"]
    first = threading.Thread(target=ask, args=("base",))
    try:
        first.start()
        assert entered.wait(60)   # the first request's batch is held: the others queue behind it
        threads = [threading.Thread(target=ask, args=(k,)) for k in KEYS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        first.join(timeout=60)
    finally:
        forward.encode_fn = real
    assert not errors
    assert sorted(KEYS) in [sorted(c) for c in calls]   # one call for the three encoders' rows
    for k in KEYS:
        assert [h["id"] for h in got[k]] == [h["id"] for h in alone[k]]
        assert max(abs(a["score"] - b["score"]) for a, b in zip(got[k], alone[k])) <= TOL
