"""An idle search is answered on the forward lane, exactly as the answer stage answers it.

A real server (tiny random-weight model, real index, real uvicorn). The first search finds the
server idle: its forward lane tokenises, encodes and searches it. The same search is then sent
while a second request is admitted (its forward pass held until the second one is counted, a
handshake, and the second held in the tokens stage until the first's search has started, so the
second is still admitted when the first's pass ends): the answer stage runs it. Both answers must
be the same.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

import pytest

from .conftest import LiveServer, server_settings

QUERY = {"query": "chess puzzle game", "k": 8, "with_text": True}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir, index_dir) -> Iterator[LiveServer]:
    s = server_settings(tmp_path_factory.mktemp("idle"), tiny_model_dir, index_dir)
    with LiveServer(s) as server:
        yield server


def _results(r: Any) -> list[Any]:
    assert r.status_code == 200, r.text
    out = r.json()["results"]
    for res in out:
        res.pop("timings")   # when it ran, not what it answered
    return out


def test_an_idle_search_answers_as_the_staged_path(srv: LiveServer) -> None:
    b = srv.app.state.qs.batcher
    search, encode, counted = b._search, b.forward.encode_fn, b.forward.counted
    searched: list[tuple[int, str]] = []   # (k, thread)
    held = {"on": False}
    entered, second_counted, first_searched = threading.Event(), threading.Event(), threading.Event()

    def recording_search(*a: Any, **kw: Any) -> Any:
        searched.append((a[1], threading.current_thread().name))
        if held["on"] and a[1] == QUERY["k"]:
            first_searched.set()
        return search(*a, **kw)

    def holding_encode(*a: Any, **kw: Any) -> Any:
        if held["on"] and not entered.is_set():
            entered.set()
            assert second_counted.wait(10)   # a second request is admitted: this batch is not idle
        return encode(*a, **kw)

    def signalling_counted(job: Any) -> None:
        counted(job)
        if job.texts == ["second"]:
            second_counted.set()
            # Still admitted (held here, in the tokens stage) when the first's forward pass ends.
            assert first_searched.wait(10)

    b._search, b.forward.encode_fn, b.forward.counted = recording_search, holding_encode, signalling_counted
    try:
        with srv.client() as c:
            idle = _results(c.post("/v1/search", json=QUERY))
            assert len(searched) == 1 and searched[0][0] == 8
            lane = searched[0][1]   # answered on a forward lane (any of them), not the answer stage
            assert lane.startswith(b.thread.name) and not lane.endswith("-answers")
            held["on"] = True
            out: dict[str, Any] = {}
            first = threading.Thread(target=lambda: out.update(first=c.post("/v1/search", json=QUERY)))
            first.start()
            try:
                assert entered.wait(10)
                with srv.client() as c2:
                    second = c2.post("/v1/search", json={"query": "second", "k": 2})
            finally:
                first.join(20)
        assert second.status_code == 200, second.text
        staged = _results(out["first"])
        assert (8, f"{b.thread.name}-answers") in searched   # the held batch went to the answer stage
        assert staged == idle
        assert idle[0]["hits"] and all(h["text"] for h in idle[0]["hits"])
    finally:
        b._search, b.forward.encode_fn, b.forward.counted = search, encode, counted
