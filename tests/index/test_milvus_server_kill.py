"""A Milvus server killed (SIGKILL) while `qswap serve` writes to it and searches it, then started
again on the same data: every upsert the server acknowledged (200) is there afterwards, while it
is down every request fails fast with 503 ``index_unavailable`` (a hint, ``Retry-After``), and
the same qswap server serves again once Milvus is back, without a restart of its own.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from qswap.index.backends import open_index
from qswap.index.backends.milvus.build import build_collection

from ..handshake import Counter
from ..server.conftest import ADMIN, LiveServer, make_docs, server_settings

pytest.importorskip("milvus")


class Writer(threading.Thread):
    """Upserts one new document per request until stopped; records what was acknowledged."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.acked: list[str] = []
        self.refused: list[tuple[int, dict, dict]] = []   # (status, body, headers)
        self.acks = Counter()
        self.refusals = Counter()
        self.stop = threading.Event()

    def run(self) -> None:
        n = 0
        with httpx.Client(base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
            while not self.stop.is_set():
                doc = {"id": f"w{n}", "text": f"written while the store may die {n}", "metadata": {"w": n}}
                n += 1
                try:
                    r = c.post("/v1/documents", json={"documents": [doc]})
                except httpx.HTTPError as e:   # the qswap server itself must never drop a connection
                    self.refused.append((0, {"error": repr(e)}, {}))
                    self.refusals.add()
                    continue
                if r.status_code == 202:                   # still writing at its deadline: a job to follow
                    r = self._settle(c, r)
                if r.status_code == 200:
                    self.acked.append(doc["id"])
                    self.acks.add()
                else:
                    self.refused.append((r.status_code, r.json(), dict(r.headers)))
                    self.refusals.add()

    def _settle(self, c: httpx.Client, accepted: httpx.Response) -> httpx.Response:
        """Follow a 202's job to its end: ``done`` is an acknowledged write (as a 200 is), ``failed``
        a refusal with the status and error the job records."""
        location = accepted.headers["Location"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            job = c.get(location).json()
            if job["status"] == "done":
                return httpx.Response(200, json=job["result"])
            if job["status"] == "failed":
                return httpx.Response(job["error"].get("status", 500), json=job["error"])
            time.sleep(0.1)   # polling a job, as its clients do
        return httpx.Response(504, json={"error": "job_not_finished", "job": job})


def test_a_killed_milvus_server_loses_no_acknowledged_write(tmp_path, tiny_model_dir, tiny_base, milvus_server):
    # The session's server (a second standalone Milvus beside it aborts at start on this build):
    # killed here and started again on the same data and port, so later tests find it running.
    docs = make_docs(30)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    srv = milvus_server
    writer = None
    try:
        uri = f"http://127.0.0.1:{srv.port}"
        build_collection(corpus, uri, "killed", tiny_base.encode_documents, tiny_base.space, progress=False).close()
        location = f"{srv.uri}?collection=killed"
        settings = server_settings(tmp_path, tiny_model_dir, location, admin_token=ADMIN)
        with LiveServer(settings) as qs, qs.client() as anon:
            writer = Writer(qs.url)
            writer.start()
            assert writer.acks.wait_for(15, timeout=120), writer.refused[:3]
            srv.kill()                                         # mid-traffic: upserts are in flight
            assert writer.refusals.wait_for(3, timeout=60), "no upsert failed while Milvus was down"
            t0 = time.perf_counter()
            r = anon.post("/v1/search", json={"query": "chess", "k": 3})
            down_s = time.perf_counter() - t0
            assert r.status_code == 503 and r.json()["error"] == "index_unavailable", r.text
            assert r.headers["Retry-After"] and "Milvus" in r.json()["detail"] and r.json()["hint"]
            assert down_s < 5.0, f"a request took {down_s:.1f} s to fail while Milvus was down"
            acked_before = writer.acks.value
            srv.start()                                        # the same data and port
            ok = _wait_until_serving(anon)
            assert ok, "qswap did not serve again after Milvus came back"
            assert writer.acks.wait_for(acked_before + 10, timeout=120), writer.refused[-3:]
            writer.stop.set()
            writer.join(60)
            assert not writer.is_alive()
        bad = [(s, b) for s, b, _ in writer.refused if s != 503 or b.get("error") != "index_unavailable"]
        assert not bad, bad[:3]   # every refusal named the cause; no 500, no dropped connection
        with open_index(location) as idx:
            got = idx.get(writer.acked)
            lost = [i for i, d in zip(writer.acked, got) if d is None]
            assert not lost, f"{len(lost)} of {len(writer.acked)} acknowledged upserts lost: {lost[:5]}"
            assert idx.count >= 30 + len(writer.acked)
    finally:
        if writer is not None:
            writer.stop.set()
            writer.join(60)
        if not srv.running:
            srv.start()


def _wait_until_serving(client: httpx.Client, timeout_s: float = 120.0) -> bool:
    """Search until one answers 200 (Milvus takes a few seconds to load the collection again)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = client.post("/v1/search", json={"query": "chess", "k": 3})
        if r.status_code == 200:
            return True
        assert r.status_code == 503 and r.json()["error"] == "index_unavailable", r.text
        time.sleep(0.2)
    return False
