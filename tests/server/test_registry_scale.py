"""The work a search costs must not grow with the number of registered encoders: a real uvicorn
server, its lines of qswap's own code run per search counted (``threading.settrace``) with 10
encoders registered and again with 210. Lines, not seconds: a count does not move with the
machine's load, and a request path that walked the registry (or the loaded encoders, or their
metric label sets) would add at least one line per encoder, 200 per search."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import qswap.server
from ..encoders.adapters import make_lora
from .conftest import ADMIN, LiveServer, server_settings

SMALL, LARGE = 10, 210
SEARCHES = 20
#: Extra lines per search allowed at LARGE: what differs between two runs of the same searches
#: (a batch that waited a little longer, a timer that fired in the window), far below the
#: LARGE - SMALL lines a walk over the registry would add.
SLACK = 40
ROOT = Path(qswap.server.__file__).parent.parent   # the source tree (qswap.server, qswap.encoders, ...)
OWN, NOT_OWN = str(ROOT) + "/", (str(ROOT / "tests") + "/", str(ROOT / ".venv") + "/")


class LineCounter:
    """Counts the lines of qswap's code (not its tests) that threads started after
    :meth:`install` run while :attr:`on` is set."""

    def __init__(self) -> None:
        self.on = False
        self.lines = 0
        self._lock = threading.Lock()

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and self.on:
            with self._lock:
                self.lines += 1
        return self._local

    def _global(self, frame: FrameType, event: str, arg: Any) -> Any:
        f = frame.f_code.co_filename
        return self._local if f.startswith(OWN) and not f.startswith(NOT_OWN) else None

    def install(self) -> None:
        threading.settrace(self._global)

    def uninstall(self) -> None:
        threading.settrace(None)   # type: ignore[arg-type]


@pytest.fixture(scope="module")
def many_encoders(tmp_path_factory: pytest.TempPathFactory, tiny_base) -> Path:
    root = tmp_path_factory.mktemp("many")
    for i in range(LARGE):
        make_lora(tiny_base, root / f"e{i}", f"e{i}", seed=100 + i)
    return root


def _lines_per_search(srv: LiveServer, counter: LineCounter, encoder: str | None) -> float:
    body: dict[str, Any] = {"query": "chess puzzle game", "k": 5}
    if encoder:
        body["encoder"] = encoder
    with srv.client() as c:
        for _ in range(3):   # warm: first-use work (a binding, a cache) is not per-search work
            assert c.post("/v1/search", json=body).status_code == 200
        counter.lines, counter.on = 0, True
        try:
            for _ in range(SEARCHES):
                assert c.post("/v1/search", json=body).status_code == 200
        finally:
            counter.on = False
    return counter.lines / SEARCHES


def test_a_search_runs_no_more_code_with_more_encoders_registered(tmp_path, tiny_model_dir, index_dir,
                                                                   many_encoders):
    s = server_settings(tmp_path, tiny_model_dir, index_dir, encoders_root=many_encoders,
                        encoder_memory_bytes=1 << 30, hot_encoders=0, admin_token=ADMIN)
    counter = LineCounter()
    counter.install()   # before the server's threads start: they inherit it
    try:
        srv = LiveServer(s).start()
    finally:
        counter.uninstall()
    try:
        def grow(first: int, last: int) -> dict[str, float]:
            with srv.client(ADMIN) as c:
                for i in range(first, last):
                    r = c.post("/v1/encoders", json={"path": f"e{i}"})
                    assert r.status_code in (200, 201), r.text
            wait_for_runtime_local(srv, [f"e{i}@1" for i in range(first, last)])
            return {arm: _lines_per_search(srv, counter, enc) for arm, enc in (("base", None), ("lora", "e0"))}

        small = grow(0, SMALL)
        large = grow(SMALL, LARGE)
    finally:
        srv.stop()
    print(f"lines per search at {SMALL}: {small}; at {LARGE}: {large}", file=sys.stderr)
    for arm in small:
        assert small[arm] > 100, f"the counter saw the {arm} searches run ({small[arm]} lines each)"
        assert large[arm] <= small[arm] + SLACK, \
            f"a {arm} search ran {large[arm]:.0f} lines of qswap code at {LARGE} registered, {small[arm]:.0f} at {SMALL}"


def wait_for_runtime_local(srv: LiveServer, keys: list[str], timeout_s: float = 120.0) -> None:
    """Until each key runs on the shared graph: exports still running would count as search work."""
    deadline = time.monotonic() + timeout_s
    with srv.client(ADMIN) as c:
        for key in keys:
            while (body := c.get(f"/v1/encoders/{key}").json()).get("runtime") != "onnx-shared":
                assert not body.get("runtime_error"), body
                assert time.monotonic() < deadline, f"{key} not on the shared graph after {timeout_s} s: {body}"
                time.sleep(0.05)   # polls a state; orders nothing
