"""The client covers the committed OpenAPI schema, typed; against a real server: upsert jobs
(202, polled), health, metrics, TEI, experiments and feedback; no answer told apart from a
refused connection."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from qswap.answers import DocumentJobInfo, Experiment, FeedbackRecorded, Health, Ready, TeiInfo, UpsertResult
from qswap.client import AsyncClient, Client, calls
from qswap.client.routes import Route, Routes
from qswap.errors import ClientTimeoutError, ConflictError, DeadlineExceededError, NotFoundError, UnreachableError

from ..server.conftest import ADMIN, LiveServer, server_settings

OPENAPI = Path(__file__).resolve().parents[2] / "server" / "openapi.json"
# Routes the client sends under another path (the same handler).
SAME_AS = {("POST", "/embeddings"): ("POST", "/v1/embeddings"),
           ("POST", "/tei/{encoder}"): ("POST", "/tei/{encoder}/embed")}


def _schema_routes() -> dict[tuple[str, str], dict]:
    paths = json.loads(OPENAPI.read_text())["paths"]
    return {(m.upper(), p): op for p, ops in paths.items() for m, op in ops.items()}


def test_every_openapi_route_has_a_client_method():
    schema = _schema_routes()
    sent = set(calls.ROUTES) | {k for k, v in SAME_AS.items() if v in calls.ROUTES}
    assert set(schema) - sent == set(), "routes without a client method"
    assert sent - set(schema) == set(), "client methods for routes the schema lacks"
    with Client() as sync:
        for names in calls.ROUTES.values():
            for name in names:
                assert callable(getattr(sync, name)) and callable(getattr(AsyncClient(), name)), name


def test_each_method_returns_the_schemas_answer_model():
    """A builder's ``Call[X]`` names the model the schema answers (2xx) when X is one."""
    schema = _schema_routes()
    for key, names in calls.ROUTES.items():
        answers = schema[key]["responses"]
        refs = {str(r.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref", "")).rsplit("/", 1)[-1]
                for s, r in answers.items() if s.startswith("2")}
        for name in names:
            ret = typing.get_type_hints(getattr(calls, name))["return"]
            (value,) = typing.get_args(ret)
            parts = typing.get_args(value) if typing.get_origin(value) in (typing.Union, types.UnionType) else (value,)
            models = [t for t in parts if isinstance(t, type) and issubclass(t, BaseModel)]
            assert {m.__name__ for m in models} <= refs, (key, name, refs)
            if not models:   # unwrapped (a list or dict of models, a text, a yes): the schema has no bare model
                assert value in (str, bool) or typing.get_origin(value) in (list, dict), (key, name, value)


# A builder's parameter that the body spells otherwise, and body fields the client leaves to the server.
BODY_NAMES = {"query": {"query", "queries"}, "directory": {"archive"}}
NOT_SENT = {("POST", "/v1/embeddings"): {"encoding_format", "user"},   # base64 always; "user" is ignored
            ("POST", "/tei/{encoder}/embed"): {"normalize"}}            # qswap's vectors are always unit length


def test_each_method_sends_every_field_of_the_request_schema():
    """The JSON body's fields (the schema's request model) are the builder's parameters: a field the
    server adds (a protocol change) fails here until the client can send it."""
    import inspect
    spec = json.loads(OPENAPI.read_text())
    for key, names in calls.ROUTES.items():
        body = _schema_routes()[key].get("requestBody", {}).get("content", {})
        schema = body.get("application/json", {}).get("schema")
        if schema is None:
            continue
        if "$ref" in schema:
            schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
        fields = set(schema["properties"])
        in_path = set(re.findall(r"{(\w+)}", key[1]))
        sent = {f for name in names for p in inspect.signature(getattr(calls, name)).parameters
                for f in BODY_NAMES.get(p, {p})}
        assert fields - NOT_SENT.get(key, set()) <= sent, (key, fields - sent)
        assert sent - fields - in_path <= {"archive"}, (key, sent - fields - in_path)   # archive: multipart


def test_routes_are_typed_descriptors():
    """Each route method is a Route over its builder: the builder's signature and docstring, on both clients."""
    for name, attr in vars(Routes).items():
        if isinstance(attr, Route):
            assert attr.build is getattr(calls, name)
            with Client() as c:
                assert getattr(c, name).__doc__ == attr.build.__doc__


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_model_dir, index_dir, encoders_root):
    """A server of its own (a copy of the index: it is written to), capturing feedback, that
    answers upserts of more than 2 documents with a job."""
    tmp = tmp_path_factory.mktemp("routes")
    shutil.copytree(index_dir, tmp / "idx")
    s = server_settings(tmp, tiny_model_dir, tmp / "idx", encoders_root=encoders_root, admin_token=ADMIN,
                        feedback_dir=tmp / "feedback", sync_upsert_documents=2)
    with LiveServer(s) as live:
        with Client(live.url, ADMIN) as c:
            c.register_path("ft1")
            c.register_path("ft2")
            c.set_alias("games", "ft@1")
        yield live


@pytest.fixture(scope="module")
def admin(srv):
    with Client(srv.url, ADMIN) as c:
        yield c


def _docs(prefix: str, n: int) -> list[dict]:
    return [{"id": f"{prefix}{i}", "text": f"chess puzzle number {i}"} for i in range(n)]


def test_upsert_jobs_sync(admin):
    small = admin.upsert_documents(_docs("s", 2))
    assert isinstance(small, UpsertResult) and small.upserted == 2
    job = admin.upsert_documents(_docs("j", 5))
    assert isinstance(job, DocumentJobInfo) and job.documents == 5 and job.status in ("queued", "running", "done")
    done = admin.wait_for_job(job)
    assert done.upserted == 5 and admin.document_job(job.id).status == "done"
    waited = admin.upsert_documents(_docs("w", 6), wait=True)
    assert isinstance(waited, UpsertResult) and waited.upserted == 6 and waited.count == done.count + 6
    with pytest.raises(NotFoundError):
        admin.document_job("0" * 32)


def test_upsert_jobs_async(srv):
    async def main() -> None:
        async with AsyncClient(srv.url, ADMIN) as c:
            job = await c.upsert_documents(_docs("a", 4))
            assert isinstance(job, DocumentJobInfo)
            assert (await c.wait_for_job(job.id)).upserted == 4
            assert (await c.upsert_documents(_docs("b", 3), wait=True)).upserted == 3
            assert (await c.document_job(job.id)).result.upserted == 4
            assert isinstance(await c.healthz(), Health)
    asyncio.run(main())


def test_a_failed_job_raises_its_error():
    """A failed job (as the server words it: status, code, detail, hint) raises that named error."""
    from qswap.client.exchange import job_outcome
    from qswap.errors import InsufficientStorageError
    job = DocumentJobInfo(id="f" * 32, status="failed", documents=3, embedded=3, created_at=0.0, finished_at=1.0,
                          error={"status": 507, "error": "insufficient_storage", "detail": "the disk is full",
                                 "hint": "free space"})
    with pytest.raises(InsufficientStorageError, match="the disk is full"):
        job_outcome(job)
    assert job_outcome(job.model_copy(update={"status": "running", "error": None})) is None


def test_health_metrics_tei(admin):
    assert admin.healthz() == Health(status="ok")
    ready = admin.ready()
    assert isinstance(ready, Ready) and ready.ready and ready.default_encoder == "base"
    text = admin.metrics()
    assert isinstance(text, str) and "qswap_requests_total" in text
    info = admin.tei_info("games")
    assert isinstance(info, TeiInfo) and info.model_id == "ft@1"
    q = admin.tei_embed("games", ["chess puzzle"])
    assert q[0] == pytest.approx(admin.embeddings("chess puzzle", "games").data[0].embedding, abs=1e-6)
    assert admin.tei_health("games") is True
    with pytest.raises(NotFoundError):
        admin.tei_health("nowhere")
    toks = admin.tei_tokenize("games", ["chess puzzle", "audio"])
    assert len(toks) == 2 and toks[0][0].special and not toks[0][1].special
    assert admin.tei_decode("games", [t.id for t in toks[0] if not t.special]) == ["chess puzzle"]
    assert admin.tei_decode("games", [[t.id for t in toks[1] if not t.special]]) == ["audio"]
    d = admin.tei_embed("games", "chess puzzle", prompt_name="passage", dimensions=8)
    assert d[0] == pytest.approx(admin.embeddings("chess puzzle", calls.DOCUMENTS_MODEL, dimensions=8).data[0].embedding,
                                 abs=1e-6)


def test_experiment_and_feedback(admin, srv):
    started = admin.start_experiment("games", "ft@2", mode="interleave", fraction=1.0)
    assert isinstance(started, Experiment) and started.status == "running" and started.control == "ft@1"
    assert [e.domain for e in admin.experiments()] == ["games"]
    res = admin.search("chess puzzle", domain="games", k=4, session="user-1")
    one = res.results[0]
    assert one.experiment is not None and one.experiment.candidate == "ft@2" and res.impression
    with Client(srv.url) as stranger:   # the impression is bound to the client that searched
        with pytest.raises(NotFoundError):
            stranger.feedback(res.impression, clicks=[one.hits[0].id])
    rec = admin.feedback(res.impression, clicks=[one.hits[0].id])
    assert isinstance(rec, FeedbackRecorded) and rec.impression == res.impression and rec.outcome in (-1, 0, 1)
    with pytest.raises(ConflictError):   # a second feedback on the same result list
        admin.feedback(res.impression, clicks=[])
    now = admin.experiment("games")
    assert now.impressions >= 1 and now.wins + now.losses + now.ties == 1
    assert admin.stop_experiment("games").status == "stopped"
    promoted = admin.promote_experiment("games")
    assert promoted.status == "promoted" and admin.aliases()["games"] == "ft@2"
    assert admin.rollback_experiment("games").status == "rolled_back" and admin.aliases()["games"] == "ft@1"
    with pytest.raises(NotFoundError):
        admin.experiment("nowhere")


def _silent_listener() -> socket.socket:
    """A socket that accepts connections (the kernel's backlog) but never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def _closed_port() -> int:
    """A port nothing listens on (bound, never listening: connections are refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_no_answer_is_told_apart_from_refused():
    silent = _silent_listener()
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with Client(url, timeout=0.3) as c:
            with pytest.raises(ClientTimeoutError) as e:
                c.healthz()
        assert isinstance(e.value, DeadlineExceededError) and "no answer within 0.3 s" in str(e.value)

        async def main() -> None:
            async with AsyncClient(url, timeout=0.3) as ac:
                with pytest.raises(ClientTimeoutError):
                    await ac.search("chess")
        asyncio.run(main())
    finally:
        silent.close()
    with Client(f"http://127.0.0.1:{_closed_port()}") as c:
        with pytest.raises(UnreachableError) as e:
            c.healthz()
    assert not isinstance(e.value, DeadlineExceededError) and "is the server running" in str(e.value)
