"""The serving gate: every path that picks what answers a user, or writes an alias, asks one
function (qswap.server.registry.serving), and a forced encoder is marked where it answers.

Two halves: a walk over the server's code lists every call that resolves, holds, aliases,
promotes or rolls back an encoder; each must be classified below (a new path fails the walk
until someone says which gate use it makes and covers it here). Then a real server with
sentinels, a refused encoder registered with force (``bad@1``) and a passing one (``mild@1``),
walks the uses over HTTP.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from qswap.errors import GuardRefusedError
from qswap.feedback.experiment import ExperimentRecord
from qswap.guard import GuardRecord, GuardStatus
from qswap.server.registry.records import EncoderRecord
from qswap.server.registry.serving import Use, serving_error

from .conftest import ADMIN, LiveServer, server_settings
from .guarding import build_guard_data, wait_verdict

SERVER = Path(__file__).resolve().parents[2] / "server"
_PICKS = {"acquire", "lease", "set_alias", "resolve", "_resolve_ref", "promote", "rollback", "default_key", "hold",
          "held"}

# (module, enclosing function, method) -> what the call is. "gate:<use>" calls pick what answers
# users and are checked over HTTP below; "read" calls only describe; "registry" calls are the
# gate's own plumbing inside the registry (they end in serving_error); "guard" is the guard's
# own use of an encoder it evaluates (it answers no user).
PATHS = {
    ("http/routes/search.py", "search", "lease"): "gate:name|domain|default",
    ("http/routes/search.py", "_candidate", "lease"): "gate:candidate",
    ("serving/embeddings.py", "embed_texts", "lease"): "gate:name|domain|default",
    ("ray/encoder.py", "lease", "lease"): "gate:name",
    ("traffic/experiments.py", "start", "acquire"): "gate:candidate",
    ("traffic/experiments.py", "promote", "set_alias"): "gate:promote",
    ("traffic/experiments.py", "rollback", "set_alias"): "gate:rollback",
    ("traffic/experiments.py", "after_outcome", "promote"): "gate:promote",
    ("http/routes/embeddings.py", "get_model", "resolve"): "read",
    ("http/routes/encoders.py", "get_encoder", "resolve"): "read",
    ("http/routes/encoders.py", "list_encoders", "default_key"): "read",
    ("http/routes/tei.py", "tei_info", "resolve"): "read",
    ("http/routes/tei.py", "tei_health", "lease"): "gate:name|domain",
    ("http/routes/tei.py", "tei_tokenize", "resolve"): "read",
    ("http/routes/health.py", "readyz", "default_key"): "read",
    ("http/routes/health.py", "info", "default_key"): "read",
    ("state.py", "_load_logged", "default_key"): "read",
    ("state.py", "load", "default_key"): "read",
    ("registry/facade.py", "default_key", "_resolve_ref"): "registry",
    ("registry/facade.py", "resolve", "default_key"): "registry",
    ("registry/facade.py", "resolve", "_resolve_ref"): "registry",
    ("registry/facade.py", "acquire", "resolve"): "registry",
    ("registry/facade.py", "lease", "acquire"): "registry",
    ("registry/facade.py", "held", "hold"): "registry",
    ("registry/facade.py", "_pinned", "default_key"): "registry",
    ("registry/deletion.py", "_serving_default", "default_key"): "registry",
    ("registry/aliases.py", "set_alias", "resolve"): "registry",
    ("ray/registry.py", "resolve", "resolve"): "registry",
    ("ray/registry.py", "set_alias", "set_alias"): "registry",
    ("ray/serve.py", "_encoder_class.encode", "lease"): "registry",
    ("registry/guard_scheduler.py", "_warm", "held"): "guard",
    ("registry/guard_scheduler.py", "evaluate", "held"): "guard",
}


def _calls() -> set[tuple[str, str, str]]:
    """Every call of a picking method in server/ (receivers that are paths left out)."""
    found: set[tuple[str, str, str]] = set()
    for path in sorted(SERVER.rglob("*.py")):
        rel = path.relative_to(SERVER).as_posix()
        stack: list[str] = []

        class Visit(ast.NodeVisitor):
            def visit_FunctionDef(self, node: ast.AST) -> None:
                stack.append(node.name)
                self.generic_visit(node)
                stack.pop()

            visit_AsyncFunctionDef = visit_FunctionDef

            def visit_Call(self, node: ast.Call) -> None:
                f = node.func
                if isinstance(f, ast.Attribute) and f.attr in _PICKS:
                    receiver = ast.unparse(f.value)
                    if not (receiver.startswith("Path(") or receiver == "root"):
                        found.add((rel, ".".join(stack), f.attr))
                self.generic_visit(node)

        Visit().visit(ast.parse(path.read_text()))
    return found


def test_every_path_that_picks_an_encoder_is_classified():
    found = _calls()
    new = sorted(found - set(PATHS))
    assert not new, (f"new paths pick or alias an encoder: {new}; say which serving-gate use each makes "
                     "(qswap.server.registry.serving.Use), add it to PATHS and cover it in this file")
    assert not sorted(set(PATHS) - found), "PATHS lists calls that are gone: remove them"


def test_only_the_gate_reads_a_verdict_and_only_set_alias_writes_an_alias():
    """No module decides by itself whether an encoder may serve; the alias table is written by
    set_alias (gated) and shrunk only by delete_alias and the start-up clean-up."""
    readers, writers = set(), set()
    for path in sorted(SERVER.rglob("*.py")):
        rel = path.relative_to(SERVER).as_posix()
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and node.attr == "servable":
                    readers.add((rel, fn.name))
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "commit" \
                        and (any(k.arg == "aliases" for k in node.keywords) or len(node.args) > 1):
                    writers.add((rel, fn.name))
    assert readers <= {("registry/serving.py", "serving_error"), ("registry/serving.py", "is_forced"),
                       ("registry/serving.py", "needs_force"), ("registry/records.py", "servable")}, readers
    assert writers == {("registry/aliases.py", "set_alias"), ("registry/aliases.py", "delete_alias"),
                       ("registry/facade.py", "load_state")}, writers


def _rec(status: GuardStatus, forced: bool) -> EncoderRecord:
    return EncoderRecord(key="x@1", name="x", version="1", kind="bias", space="s", files={}, registered_at=0.0,
                         source="", guard_status=status, forced=forced, evaluation=GuardRecord(passed=False))


# The module's table, written out: (status, forced on record, force given) -> uses allowed.
@pytest.mark.parametrize("status,forced,given,allowed", [
    (GuardStatus.PASSED, False, False, set(Use)),
    (GuardStatus.UNGUARDED, False, False, set(Use)),
    (GuardStatus.REFUSED, True, False, {Use.NAME, Use.DEFAULT, Use.DOMAIN, Use.ROLLBACK}),
    (GuardStatus.REFUSED, True, True, {Use.NAME, Use.DEFAULT, Use.DOMAIN, Use.ROLLBACK, Use.ALIAS}),
    (GuardStatus.REFUSED, False, False, {Use.DOMAIN}),
    (GuardStatus.INSUFFICIENT, False, True, {Use.DOMAIN, Use.ALIAS}),
    (GuardStatus.FAILED, True, False, {Use.NAME, Use.DEFAULT, Use.DOMAIN, Use.ROLLBACK}),
    (GuardStatus.EVALUATING, True, True, {Use.DOMAIN}),
])
def test_the_gate_table(status, forced, given, allowed):
    got = {u for u in Use if serving_error(_rec(status, forced), u, given) is None}
    assert got == allowed
    for u in set(Use) - allowed:
        assert serving_error(_rec(status, forced), u, given).status == 409


@pytest.fixture(scope="module")
def gated(tmp_path_factory, tiny_base, tiny_model_dir):
    d = build_guard_data(tmp_path_factory.mktemp("gate"), tiny_base)
    s = server_settings(d["tmp"], tiny_model_dir, d["index"], encoders_root=d["root"], admin_token=ADMIN,
                        sentinels=d["sentinels"], feedback_dir=d["tmp"] / "feedback")
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        assert c.post("/v1/encoders", json={"path": "bad1", "force": True}).status_code == 202
        assert c.post("/v1/encoders", json={"path": "mild1"}).status_code == 202
        assert wait_verdict(srv, c, "bad@1")["guard_status"] == "refused"
        assert wait_verdict(srv, c, "mild@1")["guard_status"] == "passed"
        yield srv, c


def _search(c, **kw):
    r = c.post("/v1/search", json={"query": "chess game", "k": 4, **kw})
    assert r.status_code == 200, r.text
    return r.json()["results"][0]["encoder"]


def test_name_domain_and_alias_mark_a_forced_encoder(gated):
    srv, c = gated
    assert _search(c, encoder="bad@1") == {"key": "bad@1", "name": "bad", "version": "1", "forced": True}
    assert _search(c, encoder="mild")["forced"] is False
    r = c.put("/v1/aliases/games", json={"encoder": "bad@1"})          # force is asked for again
    assert r.status_code == 409 and r.json()["error"] == "guard_refused"
    r = c.put("/v1/aliases/games", json={"encoder": "bad@1", "force": True})
    assert r.status_code == 200 and r.json()["forced"] is True
    assert _search(c, domain="games")["forced"] is True
    assert "bad@1" in {m["id"] for m in c.get("/v1/models").json()["data"]}
    assert c.delete("/v1/aliases/games").json()["forced"] is True


def test_a_forced_encoder_is_never_an_experiment_candidate(gated):
    srv, c = gated
    assert c.put("/v1/aliases/prod", json={"encoder": "mild@1"}).status_code == 200
    for cand in ("bad@1", "bad"):
        r = c.post("/v1/experiments", json={"domain": "prod", "candidate": cand, "fraction": 1.0})
        assert r.status_code == 409 and r.json()["error"] == "guard_refused", r.text
    assert c.get("/v1/experiments").json()["experiments"] == []


def _running(srv, domain: str, control: str, candidate: str, **kw) -> None:
    """An experiment record as a store shared with an older server (or a re-evaluation since)
    could hold it: the gate must refuse at promotion time, not only at the start."""
    exps = srv.app.state.qs.experiments
    exps.store.put_experiment(ExperimentRecord(id=f"x{time.monotonic_ns()}", domain=domain, mode="interleave",
                                               fraction=1.0, control=control, candidate=candidate,
                                               status="running", started_at=time.time(), **kw))
    exps._reload()   # what the request path sees, now (it re-reads the store twice a second)


def test_promotion_manual_and_automatic_refuses_a_forced_candidate(gated):
    srv, c = gated
    assert c.put("/v1/aliases/shop", json={"encoder": "mild@1"}).status_code == 200
    _running(srv, "shop", "mild@1", "bad@1")
    # Interleaved searches do not show the forced candidate's lists either.
    r = c.post("/v1/search", json={"query": "chess game", "k": 4, "domain": "shop"})
    assert r.status_code == 200 and r.json()["results"][0]["experiment"] is None
    r = c.post("/v1/experiments/shop/promote")
    assert r.status_code == 409 and r.json()["error"] == "guard_refused", r.text
    with pytest.raises(GuardRefusedError):    # what auto-promotion calls
        srv.app.state.qs.experiments.promote("shop", reason="auto")
    assert c.get("/v1/aliases").json()["aliases"]["shop"] == "mild@1"
    assert c.get("/v1/experiments/shop").json()["status"] == "running"


def test_rollback_and_a_changed_alias(gated):
    srv, c = gated
    assert c.put("/v1/aliases/docs", json={"encoder": "bad@1", "force": True}).status_code == 200
    assert c.post("/v1/experiments", json={"domain": "docs", "candidate": "mild@1"}).status_code == 201
    r = c.post("/v1/experiments/docs/promote")
    assert r.status_code == 200 and r.json()["previous"] == "bad@1"
    # Rolling back to what served the domain before (forced, on record) is allowed ...
    assert c.post("/v1/experiments/docs/rollback").status_code == 200
    assert c.get("/v1/aliases").json()["aliases"]["docs"] == "bad@1"
    # ... but a promotion never overwrites an admin's change of the alias meanwhile.
    assert c.post("/v1/experiments", json={"domain": "docs", "candidate": "mild@1"}).status_code == 201
    assert c.put("/v1/aliases/docs", json={"encoder": "base"}).status_code == 200
    r = c.post("/v1/experiments/docs/promote")
    assert r.status_code == 409 and r.json()["error"] == "conflict"
    assert c.get("/v1/aliases").json()["aliases"]["docs"] == "base"
