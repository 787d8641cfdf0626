"""How `make test` orders the suite for its workers (tests/workers.py): the services group first,
Ray before Milvus inside it, and the last test of each service known so it can be stopped."""

from __future__ import annotations

from dataclasses import dataclass

from .workers import last_users, order_for_workers


@dataclass
class _Item:
    """What the ordering reads of a collected test: its node id and whether it is slow-marked."""

    nodeid: str
    slow: bool = False

    def get_closest_marker(self, name: str) -> object | None:
        return object() if name == "slow" and self.slow else None


def test_services_group_runs_ray_then_milvus_and_knows_each_last_test():
    items = [_Item("tests/core/test_a.py::t1"),
             _Item("tests/index/test_backends.py::t1"),
             _Item("tests/index/test_backends.py::t2"),
             _Item("tests/index/test_milvus_server_kill.py::t1", slow=True),
             _Item("tests/bench/test_b.py::t1", slow=True),
             _Item("tests/ray/test_serve.py::t1"),
             _Item("tests/ray/test_serve_milvus.py::t1"),
             _Item("tests/ray/test_build.py::t1")]
    order_for_workers(items)
    assert [i.nodeid for i in items] == [
        "tests/ray/test_serve.py::t1", "tests/ray/test_build.py::t1",       # Ray, in collection order
        "tests/ray/test_serve_milvus.py::t1",                                # Ray over Milvus
        "tests/index/test_backends.py::t1", "tests/index/test_backends.py::t2",
        "tests/index/test_milvus_server_kill.py::t1",                        # Milvus alone
        "tests/bench/test_b.py::t1",                                         # then slow groups
        "tests/core/test_a.py::t1"]
    assert last_users(items) == {"ray": "tests/ray/test_serve_milvus.py::t1",
                                 "milvus": "tests/index/test_milvus_server_kill.py::t1"}
    assert last_users([_Item("tests/core/test_a.py::t1")]) == {}
