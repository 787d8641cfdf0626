"""The feedback package: team-draft interleaving, credit, sign test, RBO, the capture store, export."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from qswap.beir import read_qrels, read_queries
from qswap.errors import ConflictError, InvalidInputError, NotFoundError
from qswap.feedback.export import export_beir, judgements, query_id
from qswap.feedback.interleave import (CANDIDATE, CONTROL, Interleaving, credit, decided, looks,
                                       rank_biased_overlap, sign_test, team_draft)
from qswap.feedback.experiment import ExperimentRecord
from qswap.feedback.store import Feedback, FeedbackStore, Impression, ShadowRun


def _ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


# ----------------------------------------------------------------------------- interleaving

@pytest.mark.parametrize("seed", range(20))
def test_team_draft_is_a_fair_merge(seed):
    rng = random.Random(seed)
    pool = _ids("d", 30)
    a, b = rng.sample(pool, 10), rng.sample(pool, 10)
    out = team_draft(a, b, 10, random.Random(seed))
    assert len(out.ids) == 10 and len(set(out.ids)) == 10
    # Team sizes never differ by more than one at any prefix (captains alternate).
    for i in range(1, 11):
        na = out.teams[:i].count(CONTROL)
        assert abs(na - (i - na)) <= 1
    # Each team's picks appear in the order of its own ranking, and each pick is the best
    # of that ranking not yet shown.
    for team, ranking in ((CONTROL, a), (CANDIDATE, b)):
        for pos, (doc, t) in enumerate(zip(out.ids, out.teams)):
            if t == team:
                best = next(d for d in ranking if d not in out.ids[:pos])
                assert doc == best


def test_team_draft_of_identical_lists_is_the_list():
    a = _ids("d", 10)
    for seed in range(10):
        assert team_draft(a, a, 10, random.Random(seed)).ids == a


def test_team_draft_when_one_list_runs_out():
    for seed in range(6):
        out = team_draft(["x"], _ids("d", 5), 5, random.Random(seed))
        assert sorted(out.ids) == sorted(["x"] + _ids("d", 4))     # the candidate fills the rest
        assert out.teams.count(CONTROL) == 1


def test_credit_and_sign_test():
    shown = Interleaving(["a", "b", "c", "d"], [CONTROL, CANDIDATE, CONTROL, CANDIDATE])
    assert credit(shown, ["b"]) == 1
    assert credit(shown, ["a", "c", "b"]) == -1
    assert credit(shown, ["a", "b"]) == 0
    assert credit(shown, []) == 0
    assert credit(shown, ["zzz"]) == 0           # not shown: no credit
    assert sign_test(0, 0) == 1.0
    assert sign_test(15, 0) < 0.001
    assert sign_test(10, 10) == 1.0
    assert abs(sign_test(9, 1) - 0.021484375) < 1e-9   # 2 * P(X >= 9), X ~ Bin(10, 0.5)


def test_sequential_looks_keep_false_alarms_at_alpha():
    assert looks(5, 4) == [5, 10, 20, 40]
    assert not decided(5, 0, 0.05, 5) and decided(10, 0, 0.05, 5)
    assert not decided(11, 0, 0.05, 5)           # 11 is not a look
    # Under the null (fair coin), stopping at the first significant look happens <= alpha.
    rng = random.Random(0)
    alarms = 0
    for _ in range(300):
        w = l = 0
        for _ in range(looks(10, 6)[-1]):
            if rng.random() < 0.5:
                w += 1
            else:
                l += 1
            if decided(w, l, 0.05, 10, 6):
                alarms += 1
                break
    assert alarms / 300 <= 0.05


def test_rank_biased_overlap():
    a = _ids("d", 10)
    assert rank_biased_overlap(a, a) == pytest.approx(1.0)
    assert rank_biased_overlap(a, _ids("x", 10)) == 0.0
    swapped_top = [a[1], a[0]] + a[2:]
    swapped_bottom = a[:8] + [a[9], a[8]]
    assert 0 < rank_biased_overlap(a, swapped_top) < rank_biased_overlap(a, swapped_bottom) < 1
    with pytest.raises(ValueError):
        rank_biased_overlap(a, a, p=1.0)


# ----------------------------------------------------------------------------- the store

def _imp(rid: str, ids: list[str], query: str = "chess", domain: str | None = "games", ts: float | None = None,
         **kw) -> Impression:
    extra = {"ts": ts} if ts is not None else {}
    return Impression(request_id=rid, qi=0, domain=domain, encoder="base", query=query, ids=ids, **kw, **extra)


def test_store_records_feedback_and_refuses_bad_feedback(tmp_path):
    store = FeedbackStore(tmp_path)
    store.record([_imp("r1", ["a", "b", "c"]), _imp("r2", ["c", "d"], query="audio")])
    store.add_feedback("r1", 0, Feedback(["b"]))
    with pytest.raises(ConflictError):
        store.add_feedback("r1", 0, Feedback(["a"]))         # one feedback per list
    with pytest.raises(NotFoundError):
        store.add_feedback("nope", 0, Feedback(["a"]))
    with pytest.raises(InvalidInputError):
        store.add_feedback("r2", 0, Feedback(["a"]))         # "a" was not shown by r2
    pairs = list(store.labelled("games"))
    assert [(i.request_id, f.clicks) for i, f in pairs] == [("r1", ["b"])]
    assert store.counts() == {"impressions": 2, "feedback": 1, "dropped": 0}
    store.close()


def test_store_queue_is_bounded(tmp_path):
    store = FeedbackStore(tmp_path, queue_size=1)
    store._lock.acquire()          # hold the writer at its first batch: the queue fills
    try:
        store.record([_imp(f"r{i}", ["a"]) for i in range(50)])
    finally:
        store._lock.release()
    c = store.counts()
    assert c["dropped"] > 0 and c["impressions"] + c["dropped"] == 50
    store.close()


def test_store_prunes_by_age_and_size(tmp_path):
    store = FeedbackStore(tmp_path, max_age_s=100, max_bytes=1 << 20)
    now = time.time()
    store.record([_imp("old", ["a"], ts=now - 1000), _imp("new", ["a"], ts=now)])
    store.add_feedback("old", 0, Feedback(["a"]))
    store.flush()
    assert store.prune(now) == 1
    assert store.counts()["impressions"] == 1 and store.counts()["feedback"] == 0
    big = "x" * 4000
    store.record([_imp(f"b{i}", ["a"], query=big, ts=now + i) for i in range(600)])
    store.flush()
    assert store._size() > store.max_bytes
    store.prune(now)
    assert store._size() <= store.max_bytes
    assert 0 < store.counts()["impressions"] < 601      # the oldest went first, not everything
    store.close()


def test_store_survives_a_kill(tmp_path):
    """A feedback acknowledged before SIGKILL is there after it (WAL commit)."""
    code = textwrap.dedent(f"""
        import sys
        from qswap.feedback.store import Feedback, FeedbackStore, Impression
        s = FeedbackStore({str(tmp_path)!r})
        s.record([Impression("r1", 0, "games", "base", "chess", ["a", "b"])])
        s.add_feedback("r1", 0, Feedback(["a"]))
        print("acknowledged", flush=True)
        sys.stdin.read()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "acknowledged"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    store = FeedbackStore(tmp_path)
    assert [(i.request_id, f.clicks) for i, f in store.labelled()] == [("r1", ["a"])]
    store.close()


def test_experiment_counters(tmp_path):
    store = FeedbackStore(tmp_path)
    rec = ExperimentRecord(id="e1", domain="games", mode="interleave", fraction=1.0, control="a@1",
                           candidate="b@1", status="running", started_at=0.0)
    store.put_experiment(rec)
    store.record([_imp("r1", ["a", "b"], teams=[CONTROL, CANDIDATE], experiment="e1"),
                  ShadowRun("e1", 0.5, 10.0), ShadowRun("e1", None)])
    store.add_feedback("r1", 0, Feedback(["b"]), outcome=1)
    st = store.stats("e1")
    assert (st.impressions, st.wins, st.losses, st.shadow_runs, st.shadow_skipped) == (1, 1, 0, 1, 1)
    assert store.experiments() == {"games": rec}
    store.close()


# ----------------------------------------------------------------------------- export

def test_cascade_judgements():
    imp = _imp("r", ["a", "b", "c", "d", "e"])
    assert judgements(imp, Feedback(["c"])) == {"a": 0, "b": 0, "c": 1}
    assert judgements(imp, Feedback(["a", "d"])) == {"a": 1, "b": 0, "c": 0, "d": 1}
    assert judgements(imp, Feedback([])) == {}
    assert judgements(imp, Feedback([], {"e": 2, "a": 0})) == {"e": 2, "a": 0}


def test_export_beir(tmp_path):
    store = FeedbackStore(tmp_path / "fb")
    store.record([_imp("r1", ["a", "b", "c"], query="chess  Openings"), _imp("r2", ["b", "a"], query="chess openings"),
                  _imp("r3", ["c", "d"], query="audio"), _imp("r4", ["d"], query="never clicked")])
    store.add_feedback("r1", 0, Feedback(["c"]))
    store.add_feedback("r2", 0, Feedback(["a"]))       # same query (case and space folded): merged
    store.add_feedback("r3", 0, Feedback(["d"]))
    store.add_feedback("r4", 0, Feedback([]))
    texts = {"a": "text a", "b": "text b", "c": "text c"}     # "d" is no longer in the index
    out = tmp_path / "beir"
    s = export_beir(store.labelled(), out, lambda ids: {i: texts[i] for i in ids if i in texts})
    qrels = read_qrels(out, split="test")
    q = query_id("chess openings")
    assert qrels == {q: {"a": 1, "b": 0, "c": 1}}      # "audio" lost its only click with "d"
    assert read_queries(out)[q] == "chess  Openings"
    assert (s.queries, s.positives, s.negatives, s.impressions) == (1, 2, 1, 4)
    assert json.loads((out / "corpus.jsonl").read_text().splitlines()[0])["_id"] == "a"
    with pytest.raises(InvalidInputError):
        export_beir(iter([]), tmp_path / "empty", lambda ids: {})
    store.close()
