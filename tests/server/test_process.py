"""The server as a real process (``python -m qswap.cli serve``): SIGKILL during registrations and
upserts loses no acknowledged write and leaks no upload folder; SIGTERM drains and exits within
its bound; at ~10x its admission capacity it answers 429 at once and keeps the admitted fast;
settings that cannot work stop it at start with one line."""

from __future__ import annotations

import asyncio
import io
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ..encoders.adapters import make_overrides
from ..handshake import Counter
from .conftest import ADMIN


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, tmp: Path, model: Path, index: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / f"server-{self.port}.log", "wb")
        self.log_path = Path(self.log.name)
        cmd = [sys.executable, "-m", "qswap.cli", "serve", "--model", str(model), "--index", str(index),
               "--device", "cpu", "--state-dir", str(tmp / "state"), "--port", str(self.port), *extra]
        # The session's data dir (inherited): its ONNX exports of the tiny model are cached there by
        # content, so a start here exports (and imports torch for it) only if no test did before.
        full_env = {**os.environ, "QSWAP_ADMIN_TOKEN": ADMIN, **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)

    def wait_ready(self, timeout: float = 240.0) -> "ServerProcess":
        """Poll /readyz; a server that never gets ready is killed before the error is raised."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
                try:
                    if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            raise TimeoutError(self.log_path.read_text()[-2000:])
        except BaseException:
            self.kill()
            raise

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30, **kw)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server (if it still runs) and wait for it; SIGKILL if it outlives 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(60)
        self.log.close()


def _archive(src: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        t.add(src, arcname=src.name)
    return buf.getvalue()


@pytest.fixture
def private_index(tmp_path, index_dir) -> Path:
    shutil.copytree(index_dir, tmp_path / "index")
    return tmp_path / "index"


def _restart_keeps(tmp_path: Path, model: Path, index: Path, acked_encoders: list[str],
                   acked_docs: list[str]) -> ServerProcess:
    """Restart the server: every acknowledged write is there, nothing half-done is left over.
    Returns the restarted server, still running (the next round writes to it and kills it: a start
    fewer); stopped here if a check fails."""
    srv = ServerProcess(tmp_path, model, index).wait_ready()
    try:
        assert not list((tmp_path / "state" / "encoders").glob(".incoming-*"))
        with srv.client() as c:
            listed = {e["key"] for e in c.get("/v1/encoders").json()["encoders"]}
            assert set(acked_encoders) <= listed, (acked_encoders, listed)
            for key in acked_encoders[-2:]:
                assert c.post("/v1/search", json={"query": "chess", "encoder": key}).status_code == 200
            for doc_id in acked_docs:
                r = c.post("/v1/search", json={"query": "chess", "k": 1, "filter": {"uid": doc_id},
                                               "with_text": False})
                assert [h["id"] for h in r.json()["results"][0]["hits"]] == [doc_id], doc_id
    except BaseException:
        srv.kill(signal.SIGTERM)
        raise
    return srv


@pytest.mark.slow
def test_sigkill_during_registration_and_upsert_loses_no_acknowledged_write(tmp_path, tiny_model_dir, tiny_base,
                                                                            private_index):
    encoders = tmp_path / "encoders"
    archives = [_archive(make_overrides(tiny_base, encoders / f"k{i}", "killreg", "bias", seed=100 + i,
                                        version=str(i))) for i in range(12)]
    acked_encoders: list[str] = []
    acked_docs: list[str] = []
    rng = random.Random(7)
    next_encoder = 0
    # Each round writes to a running server and SIGKILLs it; the server restarted and checked after
    # it is the next round's (the failures below stop it: the round's SIGKILL, `_restart_keeps`).
    srv = ServerProcess(tmp_path, tiny_model_dir, private_index).wait_ready()
    for round_ in range(2):
        stop = threading.Event()
        registered, upserted = Counter(), Counter()   # this round's acknowledged writes
        refused: list[str] = []                        # what registrations got instead (the failure says it)

        def register() -> None:
            nonlocal next_encoder
            # Registrations start once upserts flow (the document tower's first batch loads it):
            # else all the archives may register before the first upsert, leaving the next round none.
            upserted.wait_for(1, timeout=120)
            with srv.client() as c:
                while not stop.is_set() and next_encoder < len(archives):
                    try:
                        r = c.post("/v1/encoders", files={"archive": ("a.tar.gz", archives[next_encoder],
                                                                      "application/gzip")})
                    except httpx.HTTPError as e:
                        refused.append(type(e).__name__)
                        return
                    if r.status_code in (200, 201):
                        acked_encoders.append(r.json()["encoder"]["key"])
                        next_encoder += 1
                        registered.add()
                    else:
                        refused.append(f"{r.status_code} {r.text[:200]}")

        def upsert() -> None:
            n = 0
            with srv.client() as c:
                while not stop.is_set():
                    doc_id = f"kill-{round_}-{n}"
                    try:
                        r = c.post("/v1/documents", json={"documents": [
                            {"id": doc_id, "text": f"chess game {round_} {n}", "metadata": {"uid": doc_id}}]})
                    except httpx.HTTPError:
                        return
                    if r.status_code == 200:
                        acked_docs.append(doc_id)
                        upserted.add()
                    n += 1

        # Daemon threads, stopped in the finally: a failed assertion must fail the test, never
        # leave client loops (and the server) running so that pytest cannot exit.
        threads = [threading.Thread(target=register, daemon=True), threading.Thread(target=upsert, daemon=True)]
        for t in threads:
            t.start()
        try:
            # A handshake, not a sleep: kill once this round has acknowledged writes of both kinds
            # (a random number of them), while both loops keep requests in flight.
            assert registered.wait_for(rng.randint(1, 3), timeout=120) and upserted.wait_for(rng.randint(1, 3),
                                                                                             timeout=120), \
                (registered.value, upserted.value, refused[-5:], srv.log_path.read_text()[-2000:])
        finally:
            srv.kill(signal.SIGKILL)   # mid-request: an upload is being extracted or registered
            stop.set()
            for t in threads:
                t.join(30)

        srv = _restart_keeps(tmp_path, tiny_model_dir, private_index, acked_encoders, acked_docs)
    srv.kill(signal.SIGTERM)
    assert len(acked_encoders) >= 1 and len(acked_docs) >= 2   # the loops did write something


@pytest.mark.slow
@pytest.mark.serial
def test_sigterm_drains_in_flight_and_exits_within_its_bound(tmp_path, tiny_model_dir, private_index):
    srv = ServerProcess(tmp_path, tiny_model_dir, private_index, "--batch-window-ms", "50",
                        env={"QSWAP_SHUTDOWN_TIMEOUT_S": "5"}).wait_ready()
    results: list[int] = []
    first_ok = threading.Event()
    sent_term = threading.Event()
    answered = Counter()

    def client_loop(i: int) -> None:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            while True:
                try:
                    r = c.post("/v1/search", json={"queries": [f"q{i} chess"] * 8, "k": 5})
                except httpx.HTTPError:   # the listening socket is closed: refused, not hung
                    results.append(-1)
                    return
                results.append(r.status_code)
                answered.add()
                if r.status_code == 200:
                    first_ok.set()
                if r.status_code != 200 or (sent_term.is_set() and len(results) > 400):
                    return

    with ThreadPoolExecutor(8) as ex:
        try:
            futures = [ex.submit(client_loop, i) for i in range(8)]
            assert first_ok.wait(120)
            assert answered.wait_for(answered.value + 16)   # every client is mid-stream, requests in flight
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            sent_term.set()
            for f in futures:
                f.result(timeout=60)
            srv.proc.wait(30)
        finally:   # on a failure the client loops end (connection refused) and the executor can exit
            if srv.proc.poll() is None:
                srv.kill()
    took = time.monotonic() - t0
    srv.log.close()
    assert took < 5 + 5, f"exit took {took:.1f}s"
    # uvicorn re-raises the signal once it has shut down cleanly: exit by SIGTERM, not by a crash.
    assert srv.proc.returncode in (0, -signal.SIGTERM), srv.log_path.read_text()[-2000:]
    assert "Application shutdown complete" in srv.log_path.read_text()
    # Requests were answered (200, or 503 once draining) or found the socket closed; none hung.
    assert results.count(200) >= 1 and set(results) <= {200, 503, -1}, results
    log = srv.log_path.read_text()
    assert "draining" in log


@pytest.mark.slow
@pytest.mark.serial
def test_overload_sheds_with_429_and_keeps_admitted_latency_bounded(tmp_path, tiny_model_dir, private_index):
    capacity = 8
    srv = ServerProcess(tmp_path, tiny_model_dir, private_index,
                        env={"QSWAP_MAX_PENDING": str(capacity), "QSWAP_MAX_PENDING_PER_ENCODER": str(capacity),
                             "QSWAP_REQUEST_TIMEOUT_S": "5"}).wait_ready()
    try:
        statuses: list[int] = []
        admitted_s: list[float] = []
        retry_after: set[str] = set()

        async def one(c: httpx.AsyncClient) -> None:
            t0 = time.perf_counter()
            r = await c.post("/v1/search", json={"queries": ["chess game music"] * 4, "k": 5})
            statuses.append(r.status_code)
            if r.status_code == 200:
                admitted_s.append(time.perf_counter() - t0)
            elif r.status_code == 429:
                retry_after.add(r.headers.get("retry-after", ""))
                assert r.json()["error"] == "overloaded" and r.json()["hint"]

        async def flood() -> None:
            # ~10x what the server admits at once, in waves, for a few seconds.
            limits = httpx.Limits(max_connections=10 * capacity, max_keepalive_connections=10 * capacity)
            async with httpx.AsyncClient(base_url=srv.url, timeout=30, limits=limits) as c:
                stop = time.monotonic() + 3.0
                while time.monotonic() < stop:
                    await asyncio.gather(*(one(c) for _ in range(10 * capacity)))

        asyncio.run(flood())
        metrics = httpx.get(f"{srv.url}/metrics").text
    finally:
        srv.kill(signal.SIGTERM)
    assert statuses.count(429) > 0 and statuses.count(200) > 0, {s: statuses.count(s) for s in set(statuses)}
    assert set(statuses) <= {200, 429, 504}, {s: statuses.count(s) for s in set(statuses)}
    assert retry_after == {"1"}
    admitted_s.sort()
    p99 = admitted_s[int(0.99 * (len(admitted_s) - 1))]
    assert p99 < 5.0, f"p99 of admitted requests {p99:.2f}s"   # the deadline bounds it, no client timeouts
    rejected = [ln for ln in metrics.splitlines() if ln.startswith('qswap_rejected_requests_total{reason="queue_full"}')]
    assert rejected and float(rejected[0].split()[-1]) == statuses.count(429)


@pytest.mark.parametrize("env, message", [
    ({"QSWAP_ADMIN_TOKEN": " " * 20}, "admin_token is empty or contains whitespace"),
])   # (the other refusals of ServerSettings.check are unit tests in test_config.py)
def test_unusable_settings_stop_the_start_with_one_line(tmp_path, tiny_model_dir, env, message):
    p = subprocess.run([sys.executable, "-m", "qswap.cli", "serve", "--model", str(tiny_model_dir)],
                       env={**os.environ, "QSWAP_DATA_DIR": str(tmp_path), **env}, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in p.stderr, p.stderr


@pytest.mark.slow
@pytest.mark.serial
def test_sigterm_answers_long_requests_503_json_and_exits_within_its_bound(tmp_path, tiny_model_dir, private_index):
    """Requests that cannot finish within the drain bound (searches, and document embeddings,
    with feedback capture on) get a 503 JSON (not a 500 from a cancelled task), the process
    exits within the bound plus one second, and an ordinary stop logs no error."""
    bound = 2.0
    # One row per forward pass and 4096-query requests: each needs thousands of passes, far
    # more than the bound, and the micro-batches of all of them interleave.
    srv = ServerProcess(tmp_path, tiny_model_dir, private_index, "--max-queries", "4096",
                        "--feedback-dir", str(tmp_path / "feedback"),
                        env={"QSWAP_SHUTDOWN_TIMEOUT_S": str(bound), "QSWAP_SLICE_TOKENS": "1",
                             "QSWAP_MAX_REQUEST_TOKENS": "100000", "QSWAP_REQUEST_TIMEOUT_S": "600",
                             "QSWAP_MAX_BODY_BYTES": str(8 << 20)}).wait_ready()
    n = 4
    answers: list[httpx.Response] = []

    def long_request(i: int) -> None:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            if i % 2:   # the document tower's path: sliced and drained like a search
                answers.append(c.post("/v1/embeddings", json={
                    "model": "qswap/documents", "input": [f"chess game {i} {j}" for j in range(2048)]}))
            else:
                answers.append(c.post("/v1/search", json={
                    "queries": [f"chess game {i} {j}" for j in range(4096)], "k": 1, "with_text": False}))

    with ThreadPoolExecutor(n) as ex:
        try:
            futures = [ex.submit(long_request, i) for i in range(n)]
            with httpx.Client(base_url=srv.url, timeout=30) as c:   # handshake: all n are admitted
                while not any(ln.startswith("qswap_admitted_requests ") and float(ln.split()[-1]) >= n
                              for ln in c.get("/metrics").text.splitlines()):
                    assert not any(f.done() for f in futures), [r.text[:200] for r in answers]
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            for f in futures:
                f.result(timeout=120)
            srv.proc.wait(60)
        finally:   # on a failure: no server left for the client threads to wait on
            if srv.proc.poll() is None:
                srv.kill()
    took = time.monotonic() - t0
    srv.log.close()
    log = srv.log_path.read_text()
    assert [r.status_code for r in answers] == [503] * n, [r.text[:300] for r in answers]
    for r in answers:
        body = r.json()
        if isinstance(body["error"], dict):   # /v1/embeddings answers in OpenAI's error shape
            assert body["error"]["code"] == "not_ready" and "shutting down" in body["error"]["message"]
        else:
            assert body["error"] == "not_ready" and "shutting down" in body["detail"] and body["hint"]
    assert took < bound + 1, f"exit took {took:.1f}s"
    assert srv.proc.returncode in (0, -signal.SIGTERM), log[-2000:]
    assert "drain bound reached" in log and "Traceback" not in log, log[-3000:]
    assert '"level": "error"' not in log, [ln for ln in log.splitlines() if '"level": "error"' in ln]
