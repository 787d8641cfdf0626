"""qswap.client against a real uvicorn server: every route, sync and async, the named errors of
the one table, and Retry-After honoured on 429."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import httpx
import numpy as np
import pytest

from qswap.client import AsyncClient, Client, EncoderInfo, SearchResponse
from qswap.errors import (ConflictError, DeadlineExceededError, ForbiddenError, IntegrityError, InvalidInputError,
                          InvalidRequestError, LimitExceededError, MethodNotAllowedError, NotFoundError,
                          NotReadyError, OverloadedError, PayloadTooLargeError, QswapError, SpaceMismatchError,
                          UnauthorizedError, UnsupportedMediaTypeError)
from qswap.tuning.register import register_encoder

from ..encoders.adapters import make_overrides
from ..server.conftest import ADMIN, LiveServer, server_settings


@pytest.fixture(scope="module")
def admin(live):
    with Client(live.url, ADMIN) as c:
        yield c


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_every_route_sync(admin, live, encoders_root, reference_pool, tiny_base, tmp_path):
    assert admin.ready().ready is True
    info = admin.info()
    assert info.limits["max_k"] == 20 and info.default_encoder == "base"
    reg = admin.register_path("ft1")
    assert reg.encoder.key == "ft@1"
    assert admin.encoder("ft").key == "ft@1"
    assert isinstance(admin.wait_for_verdict("ft@1"), EncoderInfo)   # no sentinels: unguarded at once
    make_overrides(tiny_base, tmp_path / "up", "up", "bias", seed=21)
    up = admin.upload_encoder(tmp_path / "up")
    assert up.created and up.encoder.key == "up@1"
    assert {"base", "ft@1", "up@1"} <= {e.key for e in admin.encoders().encoders}
    assert admin.set_alias("games", "ft@1").encoder == "ft@1"
    assert admin.aliases()["games"] == "ft@1"
    assert {"qswap/documents", "ft@1", "games"} <= {m.id for m in admin.models()}
    assert admin.model("games").encoder == "ft@1"
    res = admin.search("chess puzzle", domain="games", k=3)
    assert isinstance(res, SearchResponse) and res.results[0].encoder.key == "ft@1" and len(res.results[0].hits) == 3
    page = admin.search(["chess puzzle"], encoder="ft@1", k=2, offset=1).results[0].hits
    assert [h.id for h in page] == [h.id for h in res.results[0].hits[1:3]]
    emb = admin.embeddings(["chess puzzle", "audio"], "games", dimensions=16)
    assert emb.model == "ft@1" and len(emb.data[0].embedding) == 16
    full = admin.embeddings("chess puzzle", "ft@1").data[0].embedding
    assert _cos(full, reference_pool.encode(["chess puzzle"], ["ft@1"])[0]) >= 0.99999
    doc = admin.embeddings("chess puzzle", "qswap/documents").data[0].embedding
    assert _cos(doc, tiny_base.encode_documents(["chess puzzle"])[0]) >= 0.99999
    assert admin.upsert_documents([{"id": "c1", "text": "chess puzzle club", "metadata": {"s": "x"}}]).upserted == 1
    assert admin.search("chess puzzle club", k=1, filter={"s": "x"}).results[0].hits[0].id == "c1"
    assert admin.delete_documents(["c1"]).deleted == 1
    assert admin.delete_alias("games").encoder == "ft@1"
    assert admin.delete_encoder("up@1") == "up@1"


def test_every_route_async(live, tiny_base, tmp_path):
    make_overrides(tiny_base, tmp_path / "au", "au", "bias", seed=22)

    async def main() -> None:
        async with AsyncClient(live.url, ADMIN) as c:
            assert (await c.ready()).ready is True
            assert (await c.info()).model
            assert (await c.upload_encoder(tmp_path / "au")).encoder.key == "au@1"
            assert (await c.wait_for_verdict("au@1")).guard_status == "unguarded"
            assert (await c.register_path("ft2")).encoder.key == "ft@2"
            assert (await c.encoder("au")).key == "au@1"
            assert "au@1" in {e.key for e in (await c.encoders()).encoders}
            assert (await c.set_alias("sound", "au@1")).encoder == "au@1"
            assert (await c.aliases())["sound"] == "au@1"
            assert "sound" in {m.id for m in await c.models()}
            assert (await c.model("sound")).encoder == "au@1"
            many = await asyncio.gather(*(c.search(f"audio {i}", domain="sound", k=2) for i in range(8)))
            assert all(r.results[0].encoder.key == "au@1" for r in many)
            assert len((await c.embeddings(["a", "b"], "sound")).data) == 2
            assert (await c.upsert_documents([{"id": "a1", "text": "audio"}])).upserted == 1
            assert (await c.delete_documents(["a1"])).deleted == 1
            assert (await c.delete_alias("sound")).domain == "sound"
            assert await c.delete_encoder("au@1") == "au@1"
    asyncio.run(main())


def test_tune_register_uses_the_client(live, tiny_base, tmp_path):
    make_overrides(tiny_base, tmp_path / "tr", "tr", "bias", seed=23)
    reply = register_encoder(tmp_path / "tr", live.url, ADMIN)
    assert reply["encoder"]["key"] == "tr@1" and reply["created"] is True
    with pytest.raises(UnauthorizedError):
        register_encoder(tmp_path / "tr", live.url, "wrong-token-0123456789abcdef")
    with pytest.raises(NotFoundError, match="no manifest"):
        register_encoder(tmp_path, live.url, ADMIN)


def test_named_errors_from_a_real_server(admin, live, encoders_root, tmp_path):
    cases = [
        (NotFoundError, lambda: admin.encoder("nope")),
        (InvalidRequestError, lambda: admin.search("x", k=0)),
        (LimitExceededError, lambda: admin.search("x", k=21)),
        (InvalidInputError, lambda: admin._send(_raw("POST", "/v1/embeddings",
                                                      json={"input": [[1, 2]], "model": "base"}))),
        (UnsupportedMediaTypeError, lambda: admin._send(_raw("POST", "/v1/encoders", data={"x": "y"}))),
        (MethodNotAllowedError, lambda: admin._send(_raw("PUT", "/v1/search"))),
        (PayloadTooLargeError, lambda: admin.upsert_documents([{"id": "big", "text": "x" * 70_000}])),
        (SpaceMismatchError, lambda: admin.register_path("alien")),
        (UnauthorizedError, lambda: Client(live.url, "wrong-token-0123456789abcdef").set_alias("g", "base")),
    ]
    admin.register_path("ft1")
    admin.set_alias("busy", "ft@1")
    cases.append((ConflictError, lambda: admin.delete_encoder("ft@1")))   # an alias points at it
    tampered = tmp_path / "tampered"
    shutil.copytree(encoders_root / "part1", tampered)
    (tampered / "adapter.safetensors").write_bytes(b"\x00" * 64)
    cases.append((IntegrityError, lambda: admin.upload_encoder(tampered)))
    with Client(live.url, ADMIN, request_timeout=0.0001) as hurried:
        cases.append((DeadlineExceededError, lambda: hurried.embeddings(["chess"] * 1000, "base")))
        for cls, fn in cases:
            with pytest.raises(QswapError) as e:
                fn()
            assert type(e.value) is cls, (cls, e.value)
            assert e.value.message and e.value.hint
    admin.delete_alias("busy")


def _raw(method: str, path: str, **kw):
    from qswap.client.calls import Call
    return Call(method, path, lambda b: b, **kw)


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory, tiny_model_dir, index_dir):
    """A server admitting one request at a time, without admin routes."""
    s = server_settings(tmp_path_factory.mktemp("oneslot"), tiny_model_dir, index_dir, max_pending=1,
                        read_only_index=True)
    with LiveServer(s) as srv:
        yield srv


def _occupy(batcher) -> tuple[threading.Event, threading.Thread]:
    """Hold the server's only admission slot until the returned event is set."""
    started, release = threading.Event(), threading.Event()

    def block() -> None:
        started.set()
        release.wait(30)

    t = threading.Thread(target=lambda: asyncio.run(batcher.call(block)), daemon=True)
    t.start()
    assert started.wait(30)
    return release, t


def test_429_is_retried_after_retry_after(one_slot):
    batcher = one_slot.app.state.qs.batcher
    release, holder = _occupy(batcher)
    seen: list[tuple[int, float]] = []

    def on_response(r: httpx.Response) -> None:
        seen.append((r.status_code, time.monotonic()))
        if r.status_code == 429:
            release.set()     # the slot frees only once the client has been refused
            holder.join(30)

    client = Client(one_slot.url, max_retries=2)
    client._http.event_hooks["response"] = [on_response]
    res = client.search("chess", k=1)
    assert res.results[0].hits
    assert [s for s, _ in seen] == [429, 200]
    assert seen[1][1] - seen[0][1] >= 1.0   # waited the server's Retry-After: 1


def test_overloaded_and_not_ready_without_retries(one_slot):
    release, holder = _occupy(one_slot.app.state.qs.batcher)
    try:
        with pytest.raises(OverloadedError) as e:
            Client(one_slot.url, max_retries=0).search("chess")
        assert e.value.retry_after == 1
    finally:
        release.set()
        holder.join(30)
    with pytest.raises(ForbiddenError):   # no admin token configured: admin routes are off
        Client(one_slot.url).set_alias("g", "base")
    one_slot.app.state.qs.begin_drain()
    with pytest.raises(NotReadyError):
        Client(one_slot.url, max_retries=0).search("chess")
