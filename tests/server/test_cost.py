"""What one request may cost: work bounded in tokens (a large request split into micro-batches
that other requests interleave with, its deadline enforced between them, an oversized one
refused), response bytes bounded (texts and metadata cut and flagged per hit, a total bound).

Ordering between the event loop and the batch worker uses events, never sleeps.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Iterator

import httpx
import numpy as np
import pytest

from qswap.server.serving.admission import Ticket
from qswap.server.serving.batching import MicroBatcher
from qswap.errors import DeadlineExceededError

from .conftest import ADMIN, LiveServer, server_settings


class GatedModel:
    """Fake encode/search: the first encode call waits for ``go``; calls are recorded."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.entered = threading.Event()
        self.go = threading.Event()

    def encode(self, texts: list[str], keys: list[str]) -> np.ndarray:
        self.calls.append(list(texts))
        if len(self.calls) == 1:
            self.entered.set()
            assert self.go.wait(30)
        return np.array([[float(len(t)), 0.0] for t in texts], dtype=np.float32)

    @staticmethod
    def search(q: np.ndarray, k: int, flt, with_text: bool) -> list[list[str]]:
        return [[f"{int(row[0])}:{r}" for r in range(k)] for row in q]


def _batcher(model: GatedModel) -> MicroBatcher:
    # two tokens per query; a forward pass holds 4 tokens (rows x longest): two rows at most
    b = MicroBatcher(encode=model.encode, search=model.search, window_s=0.0, max_batch=64, adaptive=False,
                     count_tokens=lambda texts: [2] * len(texts), max_batch_tokens=4)
    b.start()
    return b


def test_a_large_request_is_split_and_other_requests_interleave():
    model = GatedModel()
    b = _batcher(model)
    big = ["a" * (i + 1) for i in range(6)]   # 6 queries: three micro-batches of two rows
    try:
        async def main():
            big_task = asyncio.create_task(b.search(big, "k", 1, ticket=Ticket()))
            assert await asyncio.to_thread(model.entered.wait, 30)   # its first micro-batch is running
            small_task = asyncio.create_task(b.search(["zzzzzzzzzz"], "k", 1, ticket=Ticket()))
            await asyncio.sleep(0)   # one loop turn: the small request is queued (no timing involved)
            model.go.set()
            return await big_task, await small_task
        big_out, small_out = asyncio.run(main())
    finally:
        b.stop()
    # The small request ran right after the big one's first micro-batch, not after all of it.
    assert model.calls == [big[0:2], ["zzzzzzzzzz"], big[2:4], big[4:6]]
    assert [h[0] for h in big_out.hits] == [f"{i + 1}:0" for i in range(6)]   # rows back in order
    assert small_out.hits == [["10:0"]]


def test_a_request_past_its_deadline_stops_between_micro_batches():
    model = GatedModel()
    b = _batcher(model)
    released: list[str] = []
    try:
        async def main():
            with pytest.raises(DeadlineExceededError):
                await b.search(["a" * (i + 1) for i in range(6)], "k", 1, ticket=Ticket(0.2),
                               on_done=lambda: released.append("big"))
            model.go.set()   # its first micro-batch ends only now, after the 504
            return await b.search(["q"], "k", 1, ticket=Ticket())
        after = asyncio.run(main())
    finally:
        b.stop()
    assert model.calls == [["a", "aa"], ["q"]]   # the rest of the expired request never ran
    assert after.hits == [["1:0"]] and released == ["big"]


def test_a_large_request_never_joins_a_batch_whole_but_takes_its_share_in_slices():
    model = GatedModel()
    # a pass holds 16 tokens, one request's share is 4 (two rows of two tokens)
    b = MicroBatcher(encode=model.encode, search=model.search, window_s=0.0, max_batch=64, adaptive=False,
                     count_tokens=lambda texts: [2] * len(texts), max_batch_tokens=16, slice_tokens=4)
    b.start()
    big = ["b" * (i + 1) for i in range(6)]
    try:
        async def main():
            first = asyncio.create_task(b.search(["a"], "k", 1, ticket=Ticket()))
            assert await asyncio.to_thread(model.entered.wait, 30)
            small = asyncio.create_task(b.search(["cc"], "k", 1, ticket=Ticket()))
            await asyncio.sleep(0)   # queued before the big one (one loop turn, no timing)
            large = asyncio.create_task(b.search(big, "k", 1, ticket=Ticket()))
            await asyncio.sleep(0)
            model.go.set()
            return await first, await small, await large
        _, _, large_out = asyncio.run(main())
    finally:
        b.stop()
    # 7 rows x 2 tokens would fit the 16-token pass, but the big request only gets its share
    assert model.calls == [["a"], ["cc"], big[0:2], big[2:4], big[4:6]]
    assert [h[0] for h in large_out.hits] == [f"{i + 1}:0" for i in range(6)]


# ----------------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def bounded(tmp_path_factory, tiny_model_dir, index_dir) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("bounded")
    import shutil
    shutil.copytree(index_dir, tmp / "index")
    s = server_settings(tmp, tiny_model_dir, tmp / "index", admin_token=ADMIN, backend="torch",
                        max_request_tokens=400, max_batch_tokens=256, slice_tokens=128, max_hit_text_chars=128,
                        max_hit_metadata_bytes=96, max_response_bytes=1 << 20)
    with LiveServer(s) as srv:
        yield srv


def test_a_request_over_the_token_limit_is_refused_and_one_within_it_is_served(bounded):
    long = " ".join(["chess game music"] * 30)   # ~64 tokens each (the tiny model's max length)
    with bounded.client() as c:
        r = c.post("/v1/search", json={"queries": [long] * 8, "k": 3})
        assert r.status_code == 422, r.text
        body = r.json()
        assert body["error"] == "limit_exceeded" and "limit per request is 400" in body["detail"] and body["hint"]
        r = c.post("/v1/search", json={"queries": [long] * 3, "k": 3})   # ~192 tokens: split, served
        assert r.status_code == 200 and len(r.json()["results"]) == 3
        assert c.post("/v1/search", json={"queries": ["chess"] * 8, "k": 3}).status_code == 200


def test_hits_are_cut_and_flagged_and_the_whole_answer_is_bounded(bounded):
    from qswap.answers import SearchResponse

    big_text = "chess " * 20000                   # ~120 kB: cut to 128 characters
    big_meta = {"blob": "x" * 500, "n": 1}        # over 96 bytes: left out
    docs = [{"id": "huge1", "text": big_text, "metadata": big_meta},
            {"id": "huge2", "text": big_text + "game", "metadata": {"small": True}}]
    with bounded.client(ADMIN) as admin, bounded.client() as c:
        assert admin.post("/v1/documents", json={"documents": docs}).status_code == 200
        r = c.post("/v1/search", json={"query": "chess", "k": 60})
        assert r.status_code == 200, r.text
        assert SearchResponse.model_validate_json(r.content).model_dump() == r.json()
        hits = {h["id"]: h for h in r.json()["results"][0]["hits"]}
        assert hits["huge1"]["text"] == big_text[:128] and hits["huge1"]["metadata"] == {}
        assert hits["huge1"]["truncated"] is True
        assert hits["huge2"]["text"] == big_text[:128] and hits["huge2"]["metadata"] == {"small": True}
        assert hits["huge2"]["truncated"] is True
        small = [h for h in hits.values() if h["id"].startswith("d")]
        assert small and all(h["truncated"] is False and len(h["text"]) < 128 for h in small)
        # The 973-byte request shape (queries x 64, k 100) over huge documents: the
        # answer is bounded by the cut texts (the two huge documents alone would be 15 MB).
        shape = {"queries": ["chess"] * 64, "k": 100}
        assert len(json.dumps(shape)) < 1024
        r = c.post("/v1/search", json=shape)
        assert r.status_code == 200 and len(r.content) < 1 << 20, (r.status_code, len(r.content))
        results = r.json()["results"]
        assert len(results) == 64 and all(len(q["hits"]) == 52 for q in results)
        assert all(h["truncated"] for q in results for h in q["hits"] if h["id"].startswith("huge"))


def test_an_answer_over_the_byte_bound_is_refused(tmp_path, tiny_model_dir, index_dir):
    s = server_settings(tmp_path, tiny_model_dir, index_dir, backend="torch", max_response_bytes=4096)
    with LiveServer(s) as srv, srv.client() as c:
        assert c.post("/v1/search", json={"query": "chess", "k": 2}).status_code == 200
        r = c.post("/v1/search", json={"queries": ["chess", "game", "music"], "k": 50})
        assert r.status_code == 422, r.text
        assert r.json()["error"] == "limit_exceeded" and "4096 bytes" in r.json()["detail"] and r.json()["hint"]


@pytest.mark.parametrize("bulk_lane", [True, False])
def test_a_large_upsert_is_a_job_and_searches_run_between_its_slices(tmp_path, tiny_model_dir, index_dir, bulk_lane):
    """A large upsert answers 202 with a job; its embedding runs in slices and a search that
    arrives meanwhile runs beside the slice in progress (bulk lane) or before the next slice
    (one lane), never after the whole job. The first slices are gated (events) to order the turns."""
    import shutil
    shutil.copytree(index_dir, tmp_path / "index")
    s = server_settings(tmp_path, tiny_model_dir, tmp_path / "index", admin_token=ADMIN, backend="torch",
                        sync_upsert_documents=4, slice_tokens=64, bulk_lane=bulk_lane)
    with LiveServer(s) as srv, srv.client(ADMIN) as admin, srv.client() as anon:
        state = srv.app.state.qs
        real = state.embed_documents
        entered, gate, sizes = threading.Event(), threading.Semaphore(0), []

        def gated(texts):
            sizes.append(len(texts))
            entered.set()
            assert gate.acquire(timeout=30)
            return real(texts)
        state.embed_documents = gated
        docs = [{"id": f"job-{i}", "text": f"chess puzzle physics {i}", "metadata": {"job": True}} for i in range(40)]
        r = admin.post("/v1/documents", json={"documents": docs})
        assert r.status_code == 202, r.text
        job = r.json()
        assert job["status"] in ("queued", "running") and job["documents"] == 40 and job["result"] is None
        assert r.headers["location"] == f"/v1/documents/jobs/{job['id']}"
        assert entered.wait(30)                        # slice 1 is on the worker
        result: list[httpx.Response] = []
        searcher = threading.Thread(target=lambda: result.append(anon.post("/v1/search", json={"query": "chess"})))
        searcher.start()
        if bulk_lane:   # the search runs on the first lane while slice 1 is still in the model
            searcher.join(30)
            assert result and result[0].status_code == 200
            assert admin.get(r.headers["location"]).json()["embedded"] == 0
            gate.release()
        else:
            while state.batcher.pending < 2:           # the search is admitted and queued behind slice 1
                assert searcher.is_alive()
            gate.release()                             # slice 1 ends; slice 2 queues behind the search
            searcher.join(30)
            assert result and result[0].status_code == 200
        polled = admin.get(r.headers["location"]).json()
        while polled["embedded"] == 0:                 # slice 1 written into the job's count
            polled = admin.get(r.headers["location"]).json()
        assert polled["status"] == "running" and 0 < polled["embedded"] < 40, polled   # slice 2 still gated
        for _ in range(40):
            gate.release()
        while polled["status"] in ("queued", "running"):
            polled = admin.get(r.headers["location"]).json()
        assert polled["status"] == "done" and polled["result"] == {"upserted": 40, "count": 90}, polled
        assert polled["embedded"] == 40 and len(sizes) > 2 and max(sizes) < 40
        # On the bulk lane the document tower holds one core: its ONNX Runtime session has no
        # worker threads of its own (spinning beside the searches on the core they leave it).
        from qswap.encoders.runtime.documents import machine_threads
        threads = state.document_encoder()._session.get_session_options().intra_op_num_threads
        assert threads == (1 if bulk_lane else machine_threads()), threads
        hits = anon.post("/v1/search", json={"query": "chess", "k": 40, "filter": {"job": True}}).json()
        assert len(hits["results"][0]["hits"]) == 40
        # A small upsert answers when written; an unknown job is a 404.
        r = admin.post("/v1/documents", json={"documents": docs[:2]})
        assert r.status_code == 200 and r.json() == {"upserted": 2, "count": 90}
        assert admin.get("/v1/documents/jobs/" + "0" * 32).status_code == 404


def test_closing_the_guard_stops_a_running_evaluation_at_its_next_chunk():
    """SIGTERM cancels guard evaluations: close() (called when the drain begins) stops the
    one running at its next chunk of sentinel queries instead of letting it run on."""
    from qswap.guard.evaluator import EvaluationCancelled, GuardEvaluator
    from qswap.guard.sentinels import IndexSentinel

    texts = [f"query {i}" for i in range(100)]   # several chunks
    entered, go, calls = threading.Event(), threading.Event(), []

    def encode(chunk, keys):
        calls.append(len(chunk))
        entered.set()
        assert go.wait(30)
        return np.zeros((len(chunk), 2), dtype=np.float32)

    s = IndexSentinel("s", None, [str(i) for i in range(len(texts))], texts, [{"d": 1}] * len(texts))
    guard = GuardEvaluator([s], index=None, encode=encode)
    job = guard.submit(lambda: guard.evaluate("k", ["base"]))
    assert entered.wait(30)   # the first chunk is being encoded
    guard.close()
    go.set()
    with pytest.raises(EvaluationCancelled, match="cancelled"):
        job.result(30)
    assert len(calls) == 1    # no chunk after the close
