"""Learning from traffic over HTTP: capture, feedback, interleaving and shadow experiments, promotion."""

from __future__ import annotations

import pytest

from qswap.feedback.interleave import CANDIDATE, CONTROL

from .conftest import ADMIN, LiveServer, server_settings

FORGED = "A" * 16 + "." + "B" * 22   # well formed, never issued


@pytest.fixture(scope="module")
def fb_live(tmp_path_factory, tiny_model_dir, index_dir, encoders_root):
    tmp = tmp_path_factory.mktemp("fb")
    s = server_settings(tmp, tiny_model_dir, index_dir, encoders_root=encoders_root, admin_token=ADMIN,
                        feedback_dir=tmp / "feedback")
    with LiveServer(s) as srv:
        with srv.client(ADMIN) as admin:
            for d in ("ft1", "ft2", "bias1"):
                r = admin.post("/v1/encoders", json={"path": d})
                assert r.status_code in (200, 201), r.text
        yield srv


@pytest.fixture(scope="module")
def admin(fb_live):
    with fb_live.client(ADMIN) as c:
        yield c


@pytest.fixture(scope="module")
def anon(fb_live):
    with fb_live.client() as c:
        yield c


def _search(client, **body):
    r = client.post("/v1/search", json={"k": 6, **body})
    assert r.status_code == 200, r.text
    return r.json()["impression"], r.json()["results"]


def _captured(srv, impression):
    """The store's record of a search (its capture key is the impression id's first part)."""
    return srv.app.state.qs.feedback.impression(impression.split(".")[0])


def test_feedback_is_captured_and_checked(anon, fb_live):
    rid, res = _search(anon, queries=["chess puzzle", "audio video"])
    ids = [h["id"] for h in res[1]["hits"]]
    r = anon.post("/v1/feedback", json={"impression": rid, "query_index": 1, "clicks": [ids[2]]})
    assert r.status_code == 200, r.text
    assert r.json() == {"impression": rid, "query_index": 1, "outcome": None}
    assert anon.post("/v1/feedback", json={"impression": rid, "query_index": 1, "clicks": [ids[0]]}).status_code == 409
    r = anon.post("/v1/feedback", json={"impression": FORGED, "clicks": []})
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    shown0 = {h["id"] for h in res[0]["hits"]}
    other = next(f"d{i:03d}" for i in range(50) if f"d{i:03d}" not in shown0)
    r = anon.post("/v1/feedback", json={"impression": rid, "query_index": 0, "clicks": [other]})
    assert r.status_code == 400
    r = anon.post("/v1/feedback", json={"impression": rid, "clicks": ["x"], "grades": {"x": 1}})
    assert r.status_code == 422
    store = fb_live.app.state.qs.feedback
    pairs = [(i.query, f.clicks) for i, f in store.labelled()]
    assert ("audio video", [ids[2]]) in pairs


def test_feedback_needs_capture(tmp_path, tiny_model_dir, index_dir):
    s = server_settings(tmp_path, tiny_model_dir, index_dir, admin_token=ADMIN, read_only_index=True)
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        r = c.post("/v1/feedback", json={"impression": FORGED, "clicks": []})
        assert r.status_code == 409 and "--feedback-dir" in r.json()["hint"]
        assert c.get("/v1/experiments").status_code == 409


def test_interleave_experiment_credit_promote_rollback(admin, anon, fb_live):
    assert admin.put("/v1/aliases/games", json={"encoder": "ft@1"}).status_code == 200
    r = admin.post("/v1/experiments", json={"domain": "games", "candidate": "ft@2", "mode": "interleave",
                                            "fraction": 1.0})
    assert r.status_code == 201, r.text
    exp = r.json()
    assert (exp["control"], exp["candidate"], exp["status"]) == ("ft@1", "ft@2", "running")
    assert admin.post("/v1/experiments", json={"domain": "games", "candidate": "bias"}).status_code == 409
    # What the two encoders answer alone, for the same query.
    q = "chess puzzle game"
    alone = {key: [h["id"] for h in _search(anon, query=q, encoder=key)[1][0]["hits"]] for key in ("ft@1", "ft@2")}
    rid, res = _search(anon, query=q, domain="games")
    row = res[0]
    assert row["experiment"] == {"id": exp["id"], "mode": "interleave", "candidate": "ft@2"}
    shown = [h["id"] for h in row["hits"]]
    assert len(shown) == len(set(shown)) == 6 and set(shown) <= set(alone["ft@1"]) | set(alone["ft@2"])
    imp = _captured(fb_live, rid)
    assert imp.teams is not None and imp.experiment == exp["id"]
    # Click a document only the candidate's team contributed: the candidate wins.
    b_doc = next(d for d, t in zip(imp.ids, imp.teams) if t == CANDIDATE)
    r = anon.post("/v1/feedback", json={"impression": rid, "clicks": [b_doc]})
    assert r.status_code == 200 and r.json()["outcome"] == 1
    rid2, _ = _search(anon, query="audio video", domain="games")
    imp2 = _captured(fb_live, rid2)
    a_doc = next(d for d, t in zip(imp2.ids, imp2.teams) if t == CONTROL)
    assert anon.post("/v1/feedback", json={"impression": rid2, "clicks": [a_doc]}).json()["outcome"] == -1
    v = anon.get("/v1/experiments/games").json()
    assert (v["impressions"], v["wins"], v["losses"], v["ties"]) == (2, 1, 1, 0) and v["p_value"] == 1.0
    metrics = anon.get("/metrics").text
    assert 'qswap_experiment_outcomes{domain="games",outcome="wins"} 1.0' in metrics
    # Promote: the alias switches atomically; rollback restores the control.
    r = admin.post("/v1/experiments/games/promote")
    assert r.status_code == 200 and r.json()["status"] == "promoted" and r.json()["previous"] == "ft@1"
    assert admin.get("/v1/aliases").json()["aliases"]["games"] == "ft@2"
    assert _search(anon, query=q, domain="games")[1][0]["experiment"] is None
    assert admin.post("/v1/experiments/games/promote").status_code == 409
    r = admin.post("/v1/experiments/games/rollback")
    assert r.status_code == 200 and r.json()["status"] == "rolled_back"
    assert admin.get("/v1/aliases").json()["aliases"]["games"] == "ft@1"
    # Admin only.
    assert anon.post("/v1/experiments/games/stop").status_code in (401, 403)


def _click_candidate(srv, client, query, **kw):
    """Search the experiment's domain and click the first document only the candidate showed."""
    rid, _ = _search(client, query=query, domain="sound", **kw)
    imp = _captured(srv, rid)
    mine = [d for d, t in zip(imp.ids, imp.teams) if t == CANDIDATE]
    r = client.post("/v1/feedback", json={"impression": rid, "clicks": mine[:1]})
    assert r.status_code == 200 and r.json()["outcome"] == 1, r.text


def test_auto_promotion_needs_many_clients(admin, anon, fb_live):
    assert admin.put("/v1/aliases/sound", json={"encoder": "ft@1"}).status_code == 200
    assert admin.post("/v1/experiments", json={"domain": "nosuch", "candidate": "ft@2"}).status_code == 404
    assert admin.post("/v1/experiments", json={"domain": "sound", "candidate": "ft@1"}).status_code == 400
    assert admin.post("/v1/experiments", json={"domain": "sound", "candidate": "zz@9"}).status_code == 404
    start = {"domain": "sound", "candidate": "bias@1", "mode": "interleave", "fraction": 1.0,
             "auto_promote_alpha": 0.05, "min_decided": 5}
    # One client can never be enough evidence: the bound on distinct clients is at least 2.
    assert admin.post("/v1/experiments", json={**start, "min_clients": 1}).status_code == 422
    r = admin.post("/v1/experiments", json={**start, "min_clients": 5, "max_per_client": 2})
    assert r.status_code == 201, r.text
    words = ["music", "sound", "audio", "video", "chess", "game", "science", "math", "network", "server"]
    queries = [f"{a} {b}" for a in words for b in words if a != b]
    # One anonymous script: 14 searches and 14 clicks for the candidate (with made-up sessions,
    # which count for nothing without a token) never promote it.
    for n, q in enumerate(queries[:14]):
        _click_candidate(fb_live, anon, q, session=f"made-up-{n}")
    v = anon.get("/v1/experiments/sound").json()
    assert (v["status"], v["wins"], v["clients"], v["counted_wins"]) == ("running", 14, 1, 2)
    assert admin.get("/v1/aliases").json()["aliases"]["sound"] == "ft@1"
    # An application with the token names its users' sessions: each is a client. Looks at 5, 10,
    # 20 ... counted decided impressions, each at 0.05 / 10: 5 straight wins give p = 0.0625
    # (no), 10 give 0.00195 < 0.005: the 2 counted above and 8 sessions promote it.
    promoted_after = None
    for n, q in enumerate(queries[14:30], 1):
        _click_candidate(fb_live, admin, q, session=f"user-{n}")
        if admin.get("/v1/aliases").json()["aliases"]["sound"] == "bias@1":
            promoted_after = n
            break
    assert promoted_after == 8
    v = anon.get("/v1/experiments/sound").json()
    assert v["status"] == "promoted" and v["promoted_by"] == "auto"
    assert (v["counted_wins"], v["counted_losses"], v["clients"]) == (10, 0, 9)


def test_shadow_runs_off_the_response_path(admin, anon, fb_live):
    assert admin.put("/v1/aliases/science", json={"encoder": "ft@1"}).status_code == 200
    r = admin.post("/v1/experiments", json={"domain": "science", "candidate": "ft@2", "mode": "shadow",
                                            "fraction": 1.0})
    assert r.status_code == 201
    rid, res = _search(anon, query="physics chemistry", domain="science")
    assert res[0]["experiment"] is None
    assert res[0]["encoder"]["key"] == "ft@1"
    # The shadow run was scheduled before the answer left: wait for it, then for its record.
    exps, store = fb_live.app.state.qs.experiments, fb_live.app.state.qs.feedback
    assert exps.wait_shadows(10)
    store.flush()
    v = anon.get("/v1/experiments/science").json()
    assert v["shadow_runs"] == 1 and 0 <= v["overlap"] <= 1 and v["shadow_latency_ms"] > 0
    assert admin.post("/v1/experiments/science/stop").json()["status"] == "stopped"
    _search(anon, query="physics chemistry", domain="science")
    assert exps.wait_shadows(10)
    store.flush()
    assert store.stats(r.json()["id"]).shadow_runs == 1     # stopped: no more shadow runs


def test_impression_ids_are_issued_by_the_server_and_bound_to_the_client(anon, admin, fb_live):
    # The same client-chosen X-Request-ID from two clients: two captured searches, two ids.
    r1 = anon.post("/v1/search", json={"query": "chess game", "k": 4}, headers={"X-Request-ID": "same-id"})
    r2 = admin.post("/v1/search", json={"query": "chess game", "k": 4}, headers={"X-Request-ID": "same-id"})
    i1, i2 = r1.json()["impression"], r2.json()["impression"]
    assert i1 != i2 and r1.headers["x-request-id"] == r2.headers["x-request-id"] == "same-id"
    ids1 = [h["id"] for h in r1.json()["results"][0]["hits"]]
    ids2 = [h["id"] for h in r2.json()["results"][0]["hits"]]
    # Each id is worth something only to the client it was issued to (token, or address without one).
    for client, foreign in ((admin, i1), (anon, i2)):
        r = client.post("/v1/feedback", json={"impression": foreign, "clicks": ids1[:1]})
        assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
    key, _, tag = i1.partition(".")
    forged = f"{key}.{'A' if tag[0] != 'A' else 'B'}{tag[1:]}"
    assert anon.post("/v1/feedback", json={"impression": forged, "clicks": ids1[:1]}).status_code == 404
    # The client-chosen id is not a capture key any more.
    assert anon.post("/v1/feedback", json={"request_id": "same-id", "clicks": ids1[:1]}).status_code == 422
    assert anon.post("/v1/feedback", json={"impression": i1, "clicks": ids1[:1]}).status_code == 200
    assert admin.post("/v1/feedback", json={"impression": i2, "clicks": ids2[:1]}).status_code == 200


def test_an_empty_feedback_is_400_and_burns_nothing(anon):
    rid, res = _search(anon, query="audio video")
    r = anon.post("/v1/feedback", json={"impression": rid})
    assert r.status_code == 400 and r.json()["error"] == "invalid_input", r.text
    ids = [h["id"] for h in res[0]["hits"]]
    assert anon.post("/v1/feedback", json={"impression": rid, "clicks": ids[:1]}).status_code == 200


def test_a_feedback_flood_gets_429_and_never_holds_admin_or_search(anon, admin, fb_live):
    """Feedback runs on its own bounded admission: with the store held, two feedbacks are
    admitted and wait, the third is refused at once (429, nothing changed), and admin routes
    and search answer meanwhile."""
    import threading

    from ..handshake import Counter

    qs = fb_live.app.state.qs
    searches = [_search(anon, query=q) for q in ("chess", "audio", "video")]
    entered, release = Counter(), threading.Event()
    original, limit = qs.feedback.impression, qs.feedback_admission.limit

    def held(*a, **kw):
        entered.add()
        release.wait(60)
        return original(*a, **kw)

    codes: list[int] = []

    def send(rid, res):
        with fb_live.client() as c:
            codes.append(c.post("/v1/feedback", json={"impression": rid, "clicks": [res[0]["hits"][0]["id"]]})
                         .status_code)

    qs.feedback.impression, qs.feedback_admission.limit = held, 2
    threads = [threading.Thread(target=send, args=s, daemon=True) for s in searches[:2]]
    try:
        for t in threads:
            t.start()
        assert entered.wait_for(2, 60)
        rid, res = searches[2]
        r = anon.post("/v1/feedback", json={"impression": rid, "clicks": [res[0]["hits"][0]["id"]]})
        assert r.status_code == 429 and r.json()["error"] == "overloaded" and "retry-after" in r.headers
        assert admin.put("/v1/aliases/flood", json={"encoder": "ft@1"}).status_code == 200
        assert anon.post("/v1/search", json={"query": "chess", "domain": "flood"}).status_code == 200
    finally:
        release.set()
        for t in threads:
            t.join(60)
        qs.feedback.impression, qs.feedback_admission.limit = original, limit
    assert codes == [200, 200]
    # The refused one changed nothing: it can be sent again.
    assert anon.post("/v1/feedback", json={"impression": rid, "clicks": [res[0]["hits"][0]["id"]]}).status_code == 200


def test_each_client_is_held_to_the_feedback_rate(anon, fb_live):
    """Over feedback_rate, an address's feedback is 429 with Retry-After (before its id is even
    checked) and changes nothing; another address keeps its own rate meanwhile; a token's
    application is not held to it."""
    import httpx

    from qswap.server.traffic.ratelimit import ClientRateLimit

    qs = fb_live.app.state.qs
    original = qs.feedback_limit
    qs.feedback_limit = ClientRateLimit("feedback", 1.0)   # one a second, a burst of one
    try:
        with httpx.Client(base_url=fb_live.url, timeout=30,
                          transport=httpx.HTTPTransport(local_address="127.0.0.3")) as flooder:
            rid, res = _search(flooder, query="chess game")
            assert flooder.post("/v1/feedback", json={"impression": FORGED, "clicks": []}).status_code == 404
            r = flooder.post("/v1/feedback", json={"impression": rid, "clicks": [res[0]["hits"][0]["id"]]})
            assert r.status_code == 429 and r.json()["error"] == "overloaded", r.text
            assert r.headers["retry-after"] == "1"
            # another address has its own bucket
            assert anon.post("/v1/feedback", json={"impression": FORGED, "clicks": []}).status_code == 404
            # the refused feedback changed nothing, and a second later (the pause) it counts
            r = flooder.post("/v1/feedback", json={"impression": rid, "clicks": [res[0]["hits"][0]["id"]]})
            assert r.status_code == 200, r.text
        # an application with a token relays its users' feedback: not held to one client's rate
        with fb_live.client(ADMIN) as app:
            codes = [app.post("/v1/feedback", json={"impression": FORGED, "clicks": []}).status_code
                     for _ in range(4)]
            assert codes == [404] * 4, codes
    finally:
        qs.feedback_limit = original


def test_rate_buckets_refill_at_the_rate_and_stay_bounded():
    from qswap.server.traffic.ratelimit import ClientRateLimit

    lim = ClientRateLimit("feedback", 2.0, max_clients=2)
    assert [lim.take("a", 0.0) for _ in range(2)] == [0.0, 0.0]   # a burst of one second's worth
    assert lim.take("a", 0.0) == pytest.approx(0.5)                # refused: nothing taken
    assert lim.take("a", 0.5) == 0.0
    assert lim.take("b", 1.0) == 0.0 and lim.take("c", 1.0) == 0.0
    assert len(lim._buckets) == 2 and "a" not in lim._buckets     # the least recently seen is forgotten
    assert ClientRateLimit("feedback", 0.0).take("a", 0.0) == 0.0  # 0: no limit
