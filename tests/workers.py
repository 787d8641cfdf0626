"""How `make test` splits the suite over its pytest-xdist workers (``pytest -n 2``).

A group of tests runs on one worker, in collection order: each module is a group (its
module-scoped servers start once), except that the tests of a Ray cluster or of the Milvus
server form one group together: a machine holds one of each at a time (the Ray modules share one
cluster, tests/ray/conftest.py; a second standalone Milvus aborts at start). The groups are read
from node ids alone, as the scheduler sees them (xdist's ``xdist_group`` marks do not reach it
under pytest 9).

Within that group the Ray modules run first and the Milvus-server modules last (the Ray one that
needs both between them), so each service can be stopped once its last test is done
(`last_users`) instead of idling beside the worker's other groups until the session ends.
"""

from __future__ import annotations

from typing import Any

import pytest

SERVICES_GROUP = "ray-milvus"
# Modules that ask for the session's Milvus server (tests/conftest.py ``milvus_server``), some by
# name through ``request.getfixturevalue``; `check_services_modules` keeps the list whole.
MILVUS_SERVER_MODULES = frozenset({
    "tests/index/test_backends.py",
    "tests/index/test_milvus_consistency.py",
    "tests/index/test_milvus_server_kill.py",
    "tests/ray/test_serve_milvus.py",
})


def group_of(nodeid: str) -> str:
    """The group of the test with this node id (its module's path, or `SERVICES_GROUP`)."""
    module = nodeid.split("::", 1)[0]
    if module.startswith("tests/ray/") or module in MILVUS_SERVER_MODULES:
        return SERVICES_GROUP
    return module


def _service_rank(module: str) -> int:
    """Order in the services group: Ray modules (0), the Ray module over Milvus (1), the other
    Milvus-server modules (2)."""
    return (module in MILVUS_SERVER_MODULES) + (not module.startswith("tests/ray/"))


def last_users(items: list[pytest.Item]) -> dict[str, str]:
    """Service ("ray", "milvus") -> node id of the last test in ``items`` (run order) that uses it:
    a test of a Ray module, or of a module in `MILVUS_SERVER_MODULES`."""
    last: dict[str, str] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if module.startswith("tests/ray/"):
            last["ray"] = item.nodeid
        if module in MILVUS_SERVER_MODULES:
            last["milvus"] = item.nodeid
    return last


def check_services_modules(items: list[pytest.Item]) -> None:
    """Refuse a run where a module outside `MILVUS_SERVER_MODULES` uses the Milvus server."""
    missing = sorted({i.nodeid.split("::", 1)[0] for i in items
                      if "milvus_server" in getattr(i, "fixturenames", ())
                      and group_of(i.nodeid) != SERVICES_GROUP})
    if missing:
        raise pytest.UsageError(f"{', '.join(missing)} use(s) the Milvus server: add it to "
                                "MILVUS_SERVER_MODULES in tests/workers.py (one server per machine)")


def order_for_workers(items: list[pytest.Item]) -> None:
    """Sort ``items`` so each group is contiguous and the longest groups come first: the Ray and
    Milvus group (its Ray modules first, its Milvus-server modules last), then groups with
    slow-marked tests (real weights, subprocesses), then the rest; otherwise in collection
    order. Workers take groups in this order, so no long group starts last while the other
    worker idles."""
    first: dict[str, int] = {}
    slow: set[str] = set()
    for n, item in enumerate(items):
        g = group_of(item.nodeid)
        first.setdefault(g, n)
        if item.get_closest_marker("slow") is not None:
            slow.add(g)

    def key(item: pytest.Item) -> tuple[bool, bool, int, int]:
        g = group_of(item.nodeid)
        return g != SERVICES_GROUP, g not in slow, first[g], _service_rank(item.nodeid.split("::", 1)[0])

    items.sort(key=key)


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler with `group_of` as the scope, in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False   # keep `order_for_workers`' order, not largest-first
    return GroupScheduling(config, log)
