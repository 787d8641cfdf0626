"""Ray nodes started with ``ray start`` as separate processes: a multi-node cluster on one machine.

Each node is ``ray start --block`` in a session of its own, with its own resources and its own
temp dir. Stopping a node signals exactly its process group, then kills by pid any process of
that node that left the group (Ray's worker processes call ``setsid``); they are found by the
node's temp dir on their command line. ``ray stop`` is never used: it stops every Ray process
on the machine, including other test runs' clusters.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from qswap.bench.processes import free_port

RAY = str(Path(sys.executable).with_name("ray"))
#: The environment of every node (and of drivers that join them). No token auth: the nodes
#: listen on this machine only, and a driver's auth mode is fixed when it imports Ray, so a
#: pytest process that already imported it could not switch to a token. The GCS marks a node
#: dead after 4 missed health checks 0.5 s apart (Ray's default: 5 × 3 s).
NODE_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4",
            "RAY_health_check_initial_delay_ms": "0",
            "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


class RayNode:
    """One Ray node as a child process.

    Args:
        temp_dir: the node's Ray temp dir (short: Ray's socket paths must stay under 108 bytes).
        cpus: the node's CPUs.
        resources: custom resources (e.g. ``{"qswap_worker": 1}``).
        head: None for a head node, else the head's address to join.
    """

    def __init__(self, temp_dir: Path, cpus: float, resources: dict[str, float], head: str | None = None) -> None:
        self.temp_dir = Path(temp_dir)
        self.cpus = cpus
        self.resources = resources
        self.head = head
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.temp_dir.with_suffix(".log")
        self.address: str | None = head

    def start(self, timeout: float = 60.0) -> "RayNode":
        """Start the node; for a head, wait until it prints its address (raises after ``timeout``)."""
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        cmd = [RAY, "start", "--block", f"--num-cpus={self.cpus}", f"--resources={json.dumps(self.resources)}",
               f"--temp-dir={self.temp_dir}", "--disable-usage-stats",
               f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"]
        if self.head is None:
            # Ports of their own: the defaults (6379, 10001, 8265) may be taken by another cluster.
            cmd += ["--head", "--port=0", f"--ray-client-server-port={free_port()}", "--include-dashboard=false",
                    f"--dashboard-port={free_port()}"]
        else:
            cmd += [f"--address={self.head}"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **NODE_ENV})
        if self.head is None:
            deadline = time.monotonic() + timeout
            while self.address is None:
                m = re.search(r"--address='([^']+)'", self.log.read_text(errors="replace"))
                if m:
                    self.address = m.group(1)
                elif self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"ray head did not start: {self.log.read_text(errors='replace')[-2000:]}")
                else:
                    time.sleep(0.1)   # polls the node's log for its address; orders nothing
        return self

    def own_pids(self) -> list[int]:
        """Every live process of this node: its group, and those whose command line names its temp dir."""
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                cmdline = (d / "cmdline").read_bytes().decode(errors="replace")
                pgid = os.getpgid(int(d.name))
            except (OSError, ProcessLookupError):
                continue
            if (self.proc is not None and pgid == self.proc.pid) or str(self.temp_dir) + "/" in cmdline:
                pids.append(int(d.name))
        return pids

    def kill(self) -> None:
        """SIGKILL the node's process group (raylet and its helpers): a node lost without warning.
        Its worker processes exit on their own when their raylet is gone."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the node's group, SIGKILL it after ``timeout``, then any of its processes left."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while (left := self.own_pids()) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)   # waits for the kernel to reap them; orders nothing


def alive_nodes() -> dict[str, dict[str, Any]]:
    """Node id -> resources of every alive node of the connected cluster."""
    import ray
    return {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}


def wait_nodes(count: int, timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    """Wait until the connected cluster has exactly ``count`` alive nodes; return them."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = alive_nodes()
        if len(nodes) == count:
            return nodes
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(nodes)} alive Ray nodes after {timeout} s, expected {count}")
        time.sleep(0.1)   # polls the GCS; orders nothing


def serve_replicas() -> dict[str, list[str]]:
    """Deployment class (``QswapIngress``, ``QswapEncoder``) -> node ids of its alive replicas,
    from the GCS actor table (Ray's state, not qswap's)."""
    import ray
    out: dict[str, list[str]] = {}
    for a in ray._private.state.state.actor_table(None).values():   # noqa: SLF001 - GCS view, no dashboard needed
        name = a.get("ActorClassName", "")
        if a.get("State") == "ALIVE" and name.startswith("ServeReplica:"):
            out.setdefault(name.rsplit(":", 1)[-1], []).append(a["Address"]["NodeID"])
    return out
