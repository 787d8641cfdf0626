"""qswap serve --ray: two ingress and two encoder replicas on a local Ray cluster, against the
single-process server."""

from __future__ import annotations

import threading
import time
from typing import Iterator

import httpx
import pytest

from ..handshake import Counter
from ..server.conftest import ADMIN, LiveServer, server_settings
from .conftest import ray_settings, replica_stats, wait_ready

STATE_DIRS: dict = {}
QUERIES = ["chess game", "linux server network", "music audio video", "physics chemistry science",
           "python library tool", "search index query"]


@pytest.fixture(scope="module")
def ray_url(ray_cluster, serve_port, tmp_path_factory, tiny_model_dir, ray_index, ray_encoders) -> Iterator[str]:
    from ray import serve

    from qswap.server.ray.serve import RayOptions, deploy
    tmp = tmp_path_factory.mktemp("rayserve")
    s = ray_settings(tmp, tiny_model_dir, ray_index, encoders_root=ray_encoders, feedback_dir=tmp / "feedback",
                     port=serve_port)
    url = deploy(s, RayOptions(replicas=2, max_encoders=2, replica_cpus=0.5))
    wait_ready(url, 2)
    STATE_DIRS["ray"] = s.state_dir
    yield url
    serve.delete("qswap")

# Replicas poll the shared registry every 0.2 s; the bound leaves room for a 2-core CI machine
# running Ray, the load threads and the rest of the suite (1 s was exceeded there once).
PROPAGATION_S = 3.0


def test_single_process_server_refused_on_the_replicas_state_dir(ray_url, tmp_path, tiny_model_dir, ray_index):
    s = server_settings(tmp_path, tiny_model_dir, ray_index, read_only_index=True, state_dir=STATE_DIRS["ray"])
    srv = LiveServer(s)
    try:
        with pytest.raises(RuntimeError, match="in use by another server"):
            srv.start()
    finally:
        srv.stop()


def test_deploy_on_serve_running_elsewhere_is_refused_and_changes_nothing(ray_url, tmp_path, tiny_model_dir,
                                                                          ray_index, ray_encoders):
    """Serve keeps the HTTP options it started with: a second deployment asking for another port
    would answer elsewhere than asked. It is refused, naming the port, and the app keeps serving."""
    from ray import serve

    from qswap.errors import InvalidInputError
    from qswap.server.ray.serve import RayOptions, deploy
    s = ray_settings(tmp_path, tiny_model_dir, ray_index, encoders_root=ray_encoders)
    port = int(ray_url.rsplit(":", 1)[1])
    with pytest.raises(InvalidInputError, match=f"127.0.0.1:{port}") as e:
        deploy(s, RayOptions(replicas=1, replica_cpus=0.5), app_name="other")
    assert f"--port {port}" in e.value.hint
    assert set(serve.status().applications) == {"qswap"}
    with httpx.Client(base_url=ray_url, timeout=30) as c:
        assert c.post("/v1/search", json={"query": "chess", "k": 2}).status_code == 200


def admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {ADMIN}"})


def test_same_hits_as_single_process(ray_url, tmp_path, tiny_model_dir, ray_index, ray_encoders):
    # the single-process server over a copy-free read-only open of the same index
    s = server_settings(tmp_path, tiny_model_dir, ray_index, read_only_index=True, encoders_root=ray_encoders,
                        admin_token=ADMIN)
    with LiveServer(s) as single, admin(ray_url) as rc, single.client(ADMIN) as sc:
        for c in (rc, sc):
            r = c.post("/v1/encoders", json={"path": "e1"})
            assert r.status_code in (200, 201), r.text
        for enc in (None, "enc1@1"):
            for q in QUERIES:
                body = {"query": q, "k": 5, **({"encoder": enc} if enc else {})}
                a = rc.post("/v1/search", json=body)
                b = sc.post("/v1/search", json=body)
                assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
                ha, hb = a.json()["results"][0]["hits"], b.json()["results"][0]["hits"]
                # the same documents in the same order; scores equal up to float noise (the two
                # servers batch and run the encoder in different processes)
                assert [h["id"] for h in ha] == [h["id"] for h in hb] and len(ha) == 5
                assert max(abs(x["score"] - y["score"]) for x, y in zip(ha, hb)) < 1e-4
                assert a.json()["results"][0]["encoder"]["key"] == (enc or "base")


def _search(c: httpx.Client, **body) -> httpx.Response:
    return c.post("/v1/search", json={"query": "chess game", "k": 3, **body})


def test_registration_on_one_replica_is_served_by_the_other(ray_url):
    before = replica_stats(STATE_DIRS["ray"])
    assert len(before) == 2
    with admin(ray_url) as c:
        r = c.post("/v1/encoders", json={"path": "e2"})
        assert r.status_code == 201, r.text
        # Every request right after the acknowledgement: whichever replica admits it knows enc2.
        for _ in range(30):
            r = _search(c, encoder="enc2")
            assert r.status_code == 200, r.text
            assert r.json()["results"][0]["encoder"]["key"] == "enc2@1"
        # Same 4xx as one process for an unknown encoder and a reserved name.
        r = _search(c, encoder="nope")
        assert r.status_code == 404 and r.json()["error"] == "not_found"
        r = c.post("/v1/encoders", json={"path": "../x"})
        assert r.status_code == 422 and set(r.json()) >= {"error", "detail", "hint"}
    after = replica_stats(STATE_DIRS["ray"])
    admitted = {rid: after[rid]["admitted"] - before[rid]["admitted"] for rid in after}
    # Both replicas admitted requests for the encoder registered through one of them.
    assert all(n > 0 for n in admitted.values()), admitted

    # A deletion through one replica: soon (PROPAGATION_S) no replica knows the encoder any more.
    import time
    with admin(ray_url) as c:
        assert c.delete("/v1/encoders/enc2@1").status_code == 200
        t0 = time.monotonic()
        while True:
            tables = replica_stats(STATE_DIRS["ray"])
            if len(tables) == 2 and all(t["registered"] is not None and "enc2@1" not in t["registered"]
                                        for t in tables.values()):
                break
            assert time.monotonic() - t0 < PROPAGATION_S, f"deletion not seen by every replica within {PROPAGATION_S} s"
        for _ in range(6):
            r = _search(c, encoder="enc2@1")
            assert r.status_code == 404 and r.json()["error"] == "not_found"


def test_alias_switch_seen_everywhere_and_fails_nothing_under_load(ray_url):
    import threading
    import time
    with admin(ray_url) as c:
        for p in ("e1", "e3"):
            assert c.post("/v1/encoders", json={"path": p}).status_code in (200, 201)
        assert c.put("/v1/aliases/legal", json={"encoder": "enc1@1"}).status_code == 200
    stop = threading.Event()
    results: list[tuple[int, str | None]] = []

    def load() -> None:
        with httpx.Client(base_url=ray_url, timeout=30) as cl:
            while not stop.is_set():
                r = _search(cl, domain="legal")
                results.append((r.status_code, r.json()["results"][0]["encoder"]["key"] if r.status_code == 200 else r.text))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    lags = []
    try:
        with admin(ray_url) as c:
            for target in ("enc3@1", "enc1@1", "enc3@1", "enc1@1"):
                r = c.put("/v1/aliases/legal", json={"encoder": target})
                assert r.status_code == 200, r.text
                t0 = time.monotonic()
                # every replica's alias table has the new target within PROPAGATION_S
                while True:
                    ts = time.monotonic()
                    tables = replica_stats(STATE_DIRS["ray"])
                    if len(tables) == 2 and all(t["aliases"].get("legal") == target for t in tables.values()):
                        break
                    assert ts - t0 < PROPAGATION_S, f"alias switch to {target} not seen by every replica within {PROPAGATION_S} s"
                lags.append(ts - t0)
                assert {_search(c, domain="legal").json()["results"][0]["encoder"]["key"] for _ in range(4)} == {target}
    finally:
        stop.set()
        for t in threads:
            t.join()
    failed = [r for r in results if r[0] != 200]
    assert len(results) > 20 and not failed, failed[:3]
    assert {k for _, k in results} <= {"enc1@1", "enc3@1"}


def test_upsert_through_one_replica_is_visible_on_all(ray_url):
    import time
    with admin(ray_url) as c:
        doc = {"id": "new-doc", "text": "puzzle puzzle puzzle chess chess",
               "metadata": {"section": "games", "uid": "ray-upsert"}}
        r = c.post("/v1/documents", json={"documents": [doc]})
        assert r.status_code == 200, r.text
        count = r.json()["count"]
        t0 = time.monotonic()
        while True:   # every ingress replica reopens the index at the writer's new generation
            stats = replica_stats(STATE_DIRS["ray"])
            if len(stats) == 2 and {s["index_documents"] for s in stats.values()} == {count}:
                break
            assert time.monotonic() - t0 < PROPAGATION_S, stats
        # Both replicas answer it. The filter on its own metadata makes the check exact: with a
        # random-weight model its rank among look-alike texts is float noise between processes.
        for _ in range(10):
            hits = _search(c, query="puzzle chess", k=3, filter={"uid": "ray-upsert"}).json()["results"][0]["hits"]
            assert [h["id"] for h in hits] == ["new-doc"]
            assert c.get("/readyz").json()["index_documents"] == count
        r = c.request("DELETE", "/v1/documents", json={"ids": ["new-doc"]})
        assert r.status_code == 200 and r.json()["deleted"] == 1


def test_killed_replica_loses_no_registration_and_fails_only_its_in_flight(ray_url):
    import os
    import signal
    import threading
    import time
    stats = replica_stats(STATE_DIRS["ray"])
    victim = sorted(stats.values(), key=lambda s: s["pid"])[0]
    stop = threading.Event()
    spans: list[tuple[float, float, int]] = []
    answered = Counter()
    acked: list[str] = []

    def load() -> None:
        with httpx.Client(base_url=ray_url, timeout=30) as cl:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    code = _search(cl, encoder="enc1@1").status_code
                except httpx.HTTPError:
                    code = -1
                spans.append((t0, time.monotonic(), code))
                answered.add()

    def register() -> None:
        with admin(ray_url) as cl:
            for p in ("e0", "e0v2"):
                for _ in range(50):
                    try:
                        r = cl.post("/v1/encoders", json={"path": p})
                    except httpx.HTTPError:
                        continue
                    if r.status_code in (200, 201):
                        acked.append(r.json()["encoder"]["key"])
                        break
                    time.sleep(0.1)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    assert answered.wait_for(6)                       # the load is running before the kill
    reg = threading.Thread(target=register)
    reg.start()
    t_kill = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    reg.join()
    # Traffic goes on after the kill and the registrations: 20 more answered requests.
    assert answered.wait_for(answered.value + 20)
    stop.set()
    for t in threads:
        t.join()
    in_flight = [s for s in spans if s[0] <= t_kill <= s[1]]
    failed = [s for s in spans if s[2] != 200]
    assert len(spans) > 20
    # every failure was a request in flight when the replica died, and no more than those
    assert all(s[0] <= t_kill <= s[1] for s in failed), failed
    assert len(failed) <= len(in_flight), (len(failed), len(in_flight))
    assert sorted(acked) == ["enc0@1", "enc0@2"]
    # the replacement replica comes up and every replica lists every acknowledged encoder
    deadline = time.monotonic() + 60
    while True:
        now = replica_stats(STATE_DIRS["ray"])
        if len(now) == 2 and victim["replica"] not in now:
            break
        assert time.monotonic() < deadline, "no replacement replica"
        time.sleep(0.5)
    with admin(ray_url) as c:
        for _ in range(10):
            keys = {e["key"] for e in c.get("/v1/encoders").json()["encoders"]}
            assert {"enc0@1", "enc0@2", "enc1@1", "enc3@1"} <= keys and "enc2@1" not in keys
            assert _search(c, encoder="enc0@2").status_code == 200


def _spans_under_load(url: str, clients: int, body: dict, stop: "threading.Event",
                      spans: list[tuple[float, float, int]]) -> list["threading.Thread"]:
    """``clients`` threads searching ``body`` until ``stop``; each request's (start, end, status)."""
    import threading
    import time

    def load() -> None:
        with httpx.Client(base_url=url, timeout=30) as cl:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    code = _search(cl, **body).status_code
                except httpx.HTTPError:
                    code = -1
                spans.append((t0, time.monotonic(), code))

    threads = [threading.Thread(target=load) for _ in range(clients)]
    for t in threads:
        t.start()
    return threads


def _upserts(url: str, prefix: str, n: int, spans: list[tuple[float, float, int]], acked: list[str],
             started: "threading.Event") -> None:
    """``n`` upserts of one new document each; the acknowledged ids in ``acked``."""
    import time
    with admin(url) as c:
        for i in range(n):
            doc = {"id": f"{prefix}-{i}", "text": f"kill test document {i} chess", "metadata": {}}
            t0 = time.monotonic()
            try:
                code = c.post("/v1/documents", json={"documents": [doc]}).status_code
            except httpx.HTTPError:
                code = -1
            spans.append((t0, time.monotonic(), code))
            if code == 200:
                acked.append(doc["id"])
            started.set()


def _only_in_flight_failed(spans: list[tuple[float, float, int]], t_kill: float) -> None:
    failed = [s for s in spans if s[2] != 200]
    in_flight = [s for s in spans if s[0] <= t_kill <= s[1]]
    assert all(s[0] <= t_kill <= s[1] for s in failed), failed
    assert len(failed) <= len(in_flight), (len(failed), len(in_flight))


def _indexed_count(url: str) -> int:
    """Documents in the index once both ingress replicas are at the same generation (a change
    made through one replica reaches the other within its 0.2 s poll)."""
    import time
    deadline = time.monotonic() + PROPAGATION_S
    while True:
        stats = replica_stats(STATE_DIRS["ray"])
        if len(stats) == 2 and len({s["index_generation"] for s in stats.values()}) == 1:
            break
        assert time.monotonic() < deadline, ("ingress replicas stay at different index generations", stats)
    with httpx.Client(base_url=url, timeout=30) as c:
        return c.get("/readyz").json()["index_documents"]


def test_killed_encoder_replica_loses_no_write_and_fails_only_its_in_flight(ray_url):
    import os
    import signal
    import threading
    import time
    victim = sorted(replica_stats(STATE_DIRS["ray"], "encoder").values(), key=lambda s: s["pid"])[0]
    before = _indexed_count(ray_url)
    stop, started = threading.Event(), threading.Event()
    spans: list[tuple[float, float, int]] = []
    writes: list[tuple[float, float, int]] = []
    acked: list[str] = []
    threads = _spans_under_load(ray_url, 3, {"encoder": "enc1@1"}, stop, spans)
    writer = threading.Thread(target=_upserts, args=(ray_url, "enc-kill", 8, writes, acked, started))
    writer.start()
    started.wait(60)
    t_kill = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    writer.join()
    # the replacement encoder replica comes up; load runs on meanwhile
    deadline = time.monotonic() + 60
    while True:
        now = replica_stats(STATE_DIRS["ray"], "encoder")
        if len(now) == 2 and victim["replica"] not in now:
            break
        assert time.monotonic() < deadline, "no replacement encoder replica"
    stop.set()
    for t in threads:
        t.join()
    assert len(spans) > 20
    _only_in_flight_failed(spans + writes, t_kill)
    assert len(acked) == 8   # document writes never touch the encoders
    assert _indexed_count(ray_url) == before + 8
    with admin(ray_url) as c:
        for _ in range(6):   # both encoder replicas serve again
            assert _search(c, encoder="enc1@1").status_code == 200
        assert c.request("DELETE", "/v1/documents", json={"ids": acked}).json()["deleted"] == 8


def test_killed_index_writer_loses_no_acknowledged_write(ray_url, ray_index):
    import threading
    import time

    import ray

    from qswap.server.ray.index import NAMESPACE, writer_name
    writer = ray.get_actor(writer_name(ray_index), namespace=NAMESPACE)
    before = _indexed_count(ray_url)
    stop, started = threading.Event(), threading.Event()
    spans: list[tuple[float, float, int]] = []
    writes: list[tuple[float, float, int]] = []
    acked: list[str] = []
    threads = _spans_under_load(ray_url, 2, {}, stop, spans)
    w = threading.Thread(target=_upserts, args=(ray_url, "writer-kill", 12, writes, acked, started))
    w.start()
    started.wait(60)
    t_kill = time.monotonic()
    ray.kill(writer, no_restart=False)   # Ray restarts it (max_restarts=-1); it reopens the index
    w.join()
    stop.set()
    for t in threads:
        t.join()
    _only_in_flight_failed(spans + writes, t_kill)
    assert len(acked) >= 10, writes   # at most the upsert in flight at the kill failed (one client)
    # every acknowledged document is in the index, on every ingress replica
    assert _indexed_count(ray_url) == before + len(acked), writes
    with admin(ray_url) as c:
        r = c.request("DELETE", "/v1/documents", json={"ids": [f"writer-kill-{i}" for i in range(12)]})
        assert r.status_code == 200 and r.json()["deleted"] == len(acked)


def _eventually(fn, what: str):
    """``fn()`` until it returns something truthy, within the replicas' propagation bound."""
    t0 = time.monotonic()
    while not (out := fn()):
        assert time.monotonic() - t0 < PROPAGATION_S, f"{what} not seen by every replica within {PROPAGATION_S} s"
    return out


def test_feedback_and_interleaving_across_replicas(ray_url):
    """Capture, feedback and an interleaving experiment on Ray: the capture store and the
    experiment table are shared by the ingress replicas (one SQLite file on shared storage), so
    feedback credits the experiment whichever replica answered the search or takes the click."""
    with admin(ray_url) as c:
        assert c.post("/v1/encoders", json={"path": "e1"}).status_code in (200, 201)
        assert c.put("/v1/aliases/fb", json={"encoder": "base"}).status_code == 200
        body = {"domain": "fb", "candidate": "enc1@1", "mode": "interleave", "fraction": 1.0}
        r = _eventually(lambda: (x := c.post("/v1/experiments", json=body)).status_code == 201 and x,
                        "the alias and the encoder")
        assert r.json()["control"] == "base"
        outcomes = []
        for q in QUERIES * 2:
            def interleaved():
                s = c.post("/v1/search", json={"query": q, "k": 4, "domain": "fb"})
                assert s.status_code == 200, s.text
                return s if s.json()["results"][0]["experiment"] is not None else None
            s = _eventually(interleaved, "the experiment")
            res = s.json()["results"][0]
            assert res["experiment"]["candidate"] == "enc1@1"
            # Issued by one ingress replica, accepted by whichever answers the feedback (one key)
            f = c.post("/v1/feedback", json={"impression": s.json()["impression"],
                                             "clicks": [res["hits"][0]["id"]]})
            assert f.status_code == 200, f.text
            outcomes.append(f.json()["outcome"])
        v = c.get("/v1/experiments/fb").json()
        assert v["impressions"] == len(outcomes) and 0 not in outcomes   # one click: never a tie
        assert (v["wins"], v["losses"]) == (outcomes.count(1), outcomes.count(-1))
        r = c.post("/v1/experiments/fb/promote")
        assert r.status_code == 200 and r.json()["status"] == "promoted"
        _eventually(lambda: all(c.get("/v1/aliases").json()["aliases"]["fb"] == "enc1@1" for _ in range(4)),
                    "the promotion")
