"""A Milvus server on this machine, without containers: the standalone build that the ``milvus``
package ships (``pip install milvus``; Milvus 2.3.x, the newest build on the package index), run
as a child process with its data, config and logs in one folder.

Tests and benchmarks use it to exercise the Milvus backend against a real server over the network
(gRPC on ``port``), including being killed and started again on the same data:

    with LocalMilvus(tmp / "milvus") as srv:
        idx = open_index(f"milvus://127.0.0.1:{srv.port}?collection=docs")
        srv.kill(); srv.start()          # SIGKILL, then the same data and port again
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from qswap.bench.processes import ServerProcess, free_port
from qswap.errors import InvalidInputError


def milvus_package_version() -> str | None:
    """Version of the installed ``milvus`` package (its server build), or None when it is absent."""
    try:
        import milvus
    except ImportError:
        return None
    return str(milvus.__version__)


#: Coordinator intervals for a test server (``LocalMilvus(short_intervals=True)``): (text of the
#: package's config, what replaces it). Milvus's defaults suit a long-lived server; with them a
#: collection is created, flushed and loaded in ~6.5 s on a 2-core machine (a 2 s segment
#: allocation expiry before a flush seals, 1 s checker ticks before a load reports done), ~3.5 s
#: with these. A server started again after a SIGKILL serves only once its dead predecessor's
#: sessions expire (their lease: 30 s by default; 10 s here). Benchmarks keep the defaults.
SHORT_INTERVALS: tuple[tuple[str, str], ...] = (
    ("session:\n    ttl: 30 ", "session:\n    ttl: 10 "),
    ("assignmentExpiration: 2000", "assignmentExpiration: 200"),
    ("checkInterval: 1000", "checkInterval: 100"),
    ("distPullInterval: 500", "distPullInterval: 100"),
    ("queryCoord:\n", "queryCoord:\n  checkSegmentInterval: 100\n  checkChannelInterval: 100\n"
                      "  leaderViewUpdateInterval: 1\n  UpdateNextTargetInterval: 1\n"),
)


class LocalMilvus:
    """A Milvus standalone server process over ``data_dir`` listening on 127.0.0.1:``port``;
    ``short_intervals``: the coordinators' intervals of :data:`SHORT_INTERVALS` (tests)."""

    def __init__(self, data_dir: Path, port: int | None = None, start_timeout_s: float = 180.0,
                 short_intervals: bool = False) -> None:
        if milvus_package_version() is None:
            raise InvalidInputError("no Milvus server build installed", "pip install milvus (or qswap[milvus])")
        self.data_dir = Path(data_dir).resolve()
        self.port = port or free_port()
        self.start_timeout_s = start_timeout_s
        self.short_intervals = short_intervals
        self._proc: ServerProcess | None = None
        self.version: str | None = None
        self.start_seconds: float | None = None

    @property
    def uri(self) -> str:
        """The ``milvus://`` location prefix of this server (append ``?collection=NAME``)."""
        return f"milvus://127.0.0.1:{self.port}"

    @property
    def http_uri(self) -> str:
        """The pymilvus URI of this server (``http://127.0.0.1:PORT``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.proc.pid if self._proc and self._proc.proc else None

    @property
    def running(self) -> bool:
        return bool(self._proc and self._proc.proc and self._proc.proc.poll() is None)

    def start(self) -> "LocalMilvus":
        """Start (or start again, on the same data and port) and wait until it answers queries."""
        from milvus import MilvusServerConfig, _initialize_data_files  # the package's own set-up

        self.data_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        cfg = MilvusServerConfig(data_dir=str(self.data_dir))
        cfg.resolve()                      # free ports for the inner services, configs/milvus.yaml written
        # Our port is written in afterwards: the package's bind probe has no SO_REUSEADDR and fails
        # on a port in TIME_WAIT, which is where it is right after a kill (Milvus itself rebinds it).
        cfg.configurable_items["proxy_port"][1] = self.port
        cfg.write_config()
        if self.short_intervals:
            _shorten_intervals(Path(cfg.base_data_dir) / "configs" / "milvus.yaml")
        _initialize_data_files(cfg.base_data_dir)
        base = Path(cfg.base_data_dir)
        metrics = free_port()              # /healthz lives on the metrics port
        env = {"DEPLOY_MODE": "STANDALONE", "METRICS_PORT": str(metrics), "MILVUS_RUN_DIR": str(base / "run"),
               "LD_LIBRARY_PATH": ":".join([str(base / "bin"), os.environ.get("LD_LIBRARY_PATH", "")])}
        self._proc = ServerProcess([str(base / "bin" / "milvus"), "run", "standalone"], metrics, ready_path="/healthz",
                                   log_path=base / "logs" / "milvus-process.log", env=env, cwd=base,
                                   start_timeout_s=self.start_timeout_s)
        self._proc.start()
        self.version = self._wait_queries(t0)
        self.start_seconds = time.perf_counter() - t0
        return self

    def _wait_queries(self, t0: float) -> str:
        """The server answers /healthz before its proxy serves: wait for a real call, return its version."""
        from pymilvus import MilvusClient
        last: Exception | None = None
        while time.perf_counter() - t0 < self.start_timeout_s:
            if not self.running:
                break
            try:
                c = MilvusClient(uri=f"http://127.0.0.1:{self.port}", timeout=5)
                try:
                    c.list_collections(timeout=5)
                    return str(c.get_server_version(timeout=5))
                finally:
                    c.close()
            except Exception as e:  # noqa: BLE001 - any failure here means "not serving yet"
                last = e
                time.sleep(0.2)
        tail = self._proc.log_tail() if self._proc else ""
        self.stop()
        raise InvalidInputError(f"Milvus at 127.0.0.1:{self.port} did not serve within {self.start_timeout_s:.0f} s "
                                f"({type(last).__name__ if last else 'exited'})\n{tail}",
                                f"see {self.data_dir / 'logs'}")

    def kill(self) -> None:
        """SIGKILL (no flush, no goodbye): what a crash or a lost machine looks like to clients."""
        if self._proc and self._proc.proc and self._proc.proc.poll() is None:
            os.killpg(self._proc.proc.pid, signal.SIGKILL)
            self._proc.proc.wait(10)
        self.stop()

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 20 s; safe to call twice."""
        if self._proc is not None:
            self._proc.stop()
            self._proc = None

    def facts(self) -> dict[str, Any]:
        """What a results file records about this server."""
        return {"server_version": self.version, "package": f"milvus {milvus_package_version()}",
                "start_seconds": round(self.start_seconds or 0.0, 2), "uri": self.http_uri}

    def __enter__(self) -> "LocalMilvus":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _shorten_intervals(config: Path) -> None:
    """Rewrite the written ``milvus.yaml`` with :data:`SHORT_INTERVALS` (each must match once: a
    package whose config differs is refused rather than silently left at its defaults)."""
    text = config.read_text()
    for old, new in SHORT_INTERVALS:
        if text.count(old) != 1:
            raise InvalidInputError(f"{config} has {text.count(old)} lines {old.strip()!r} (one expected)",
                                    "a Milvus package whose config template differs: update SHORT_INTERVALS")
        text = text.replace(old, new)
    config.write_text(text)
