"""qswap.client against a server with sentinels: the guard's refusal arrives as
GuardRefusedError with the per-sentinel table, and wait_for_verdict returns the verdict."""

from __future__ import annotations

import pytest

from qswap.client import Client
from qswap.errors import GuardRefusedError

from ..server.conftest import ADMIN, LiveServer, server_settings
from ..server.test_guard_server import guard_data  # noqa: F401  (the sentinel index and encoders)


@pytest.fixture(scope="module")
def guarded_client(guard_data, tiny_model_dir):  # noqa: F811
    d = guard_data
    s = server_settings(d["tmp"], tiny_model_dir, d["index"], encoders_root=d["root"], admin_token=ADMIN,
                        sentinels=d["sentinels"])
    with LiveServer(s) as srv, Client(srv.url, ADMIN) as c:
        yield c


def test_guard_refusal_and_verdicts(guarded_client):
    c = guarded_client
    with pytest.raises(GuardRefusedError) as e:
        c.register_path("bad2", wait=True)
    assert e.value.guard["passed"] is False and {x["name"] for x in e.value.guard["checks"]} == {"alpha", "beta"}
    r = c.register_path("bad1")               # answered at once: 202, evaluating
    assert r.encoder.guard_status == "evaluating"
    assert c.wait_for_verdict("bad@1", timeout=120, poll_s=0.05).guard_status == "refused"
    with pytest.raises(GuardRefusedError):
        c.search("chess game", encoder="bad@1")
    assert c.register_path("mild1").encoder.key == "mild@1"
    assert c.wait_for_verdict("mild@1", timeout=120, poll_s=0.05).guard_status == "passed"
    ids = {m.id for m in c.models()}
    assert "mild@1" in ids and "bad@1" not in ids       # only servable encoders are listed
    assert c.model("bad@1").guard_status == "refused"   # but each can be looked up
