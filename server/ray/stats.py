"""A Ray Serve replica's counters, written where operators and benchmarks read every replica
(``<state dir>/replicas/<replica id>.json``), without going through Serve's router (which may send
every call to the same replica)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("qswap.server")

#: The folder under the state dir that replicas write their counters to.
REPLICA_STATS_DIR = "replicas"
#: How often a replica writes them.
STATS_EVERY_S = 0.5


def _write_stats_loop(state_dir: Path, stats: Callable[[], dict[str, Any]], stop: threading.Event,
                      every_s: float = STATS_EVERY_S) -> None:
    """A replica's counters as ``<state dir>/replicas/<replica id>.json`` (atomic, every
    ``every_s``), so that operators and benchmarks read every replica without the router."""
    from qswap.atomic import atomic_write_json
    folder = Path(state_dir) / REPLICA_STATS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    while not stop.wait(every_s):
        try:
            st = stats()
            atomic_write_json(folder / f"{st['replica']}.json", {**st, "written_at": time.time()})
        except Exception:  # noqa: BLE001 - observability must not take the replica down
            log.exception("writing replica stats failed")


def start_stats(state_dir: Path, stats: Callable[[], dict[str, Any]]) -> threading.Event:
    """Write ``stats()`` every :data:`STATS_EVERY_S` on a daemon thread; set the returned event to stop."""
    stop = threading.Event()
    threading.Thread(target=_write_stats_loop, args=(state_dir, stats, stop), name="qswap-replica-stats",
                     daemon=True).start()
    return stop


def replica_id() -> str:
    """This Serve replica's unique id."""
    from ray import serve
    return serve.get_replica_context().replica_id.unique_id
