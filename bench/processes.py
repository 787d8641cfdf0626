"""Processes under test: a server started as a child process, its memory, free ports, JSON over HTTP."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qswap.errors import InvalidInputError


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (Linux ``/proc``), in bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError as e:
        raise InvalidInputError(f"cannot read memory of process {pid}: {e}", "is it still running?") from e
    raise InvalidInputError(f"process {pid} reports no VmRSS", "Linux /proc is needed for memory numbers")


def rss_parts(pid: int) -> dict[str, int]:
    """The resident set of process ``pid`` by kind of page, in bytes (Linux ``/proc``):
    ``anon`` (heap, arrays, tensors), ``file`` (mapped files: libraries, memory-mapped weights) and
    ``shmem``; empty where ``/proc`` does not say. Anonymous pages are what a process holds for
    good; file pages can be dropped and read again."""
    parts: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            for key, name in (("RssAnon:", "anon"), ("RssFile:", "file"), ("RssShmem:", "shmem")):
                if line.startswith(key):
                    parts[name] = int(line.split()[1]) * 1024
    except OSError:
        return {}
    return parts


def pss_bytes(pid: int) -> int | None:
    """Proportional set size (shared pages split between sharers), or None where unavailable."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_memory_bytes() -> int | None:
    """Memory the kernel can give new processes without swapping (Linux ``MemAvailable``), or
    None where ``/proc/meminfo`` does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (bound and released; tiny race accepted for benchmarks)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(method: str, url: str, body: Any = None, timeout: float = 120.0,
              headers: Mapping[str, str] | None = None) -> tuple[int, Any]:
    """One JSON request with the standard library (admin calls; not for load): ``(status, json)``."""
    import urllib.error
    import urllib.request
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode("utf-8", "replace")


class ServerProcess:
    """A server under test, run as a child process (its own session) and stopped at exit.

    >>> with ServerProcess(cmd, port, ready_path="/ready", log_path=p) as srv:
    ...     srv.url("/v1/search"), srv.rss()
    """

    def __init__(self, cmd: Sequence[str], port: int, *, ready_path: str = "/health",
                 log_path: Path | None = None, env: Mapping[str, str] | None = None,
                 start_timeout_s: float = 300.0, cwd: Path | None = None, poll_s: float = 0.2) -> None:
        self.cmd = [str(c) for c in cmd]
        self.port = port
        self.ready_path = ready_path
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.start_timeout_s = start_timeout_s
        self.cwd = cwd
        self.poll_s = poll_s   # how often the ready path is asked: the resolution of start_seconds
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_seconds: float | None = None
        self._log = None

    @property
    def command(self) -> str:
        return shlex.join(self.cmd)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self) -> "ServerProcess":
        """Start the process and wait until ``ready_path`` answers 200 (raises if it dies first)."""
        import urllib.error
        import urllib.request
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.cwd, start_new_session=True)
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                raise InvalidInputError(f"server exited with status {self.proc.returncode} during start: "
                                        f"{self.command}\n{tail}", "see the server log above")
            try:
                with urllib.request.urlopen(self.url(self.ready_path), timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError, ValueError):
                pass
            if time.perf_counter() - t0 > self.start_timeout_s:
                self.stop()
                raise InvalidInputError(f"server not ready after {self.start_timeout_s:.0f} s: {self.command}",
                                        "see its log: " + str(self.log_path))
            time.sleep(self.poll_s)
        self.start_seconds = time.perf_counter() - t0
        return self

    def log_tail(self, n: int = 30) -> str:
        if self.log_path and Path(self.log_path).exists():
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        return ""

    def rss(self) -> int:
        assert self.proc is not None
        return rss_bytes(self.proc.pid)

    def rss_parts(self) -> dict[str, int]:
        assert self.proc is not None
        return rss_parts(self.proc.pid)

    def pss(self) -> int | None:
        assert self.proc is not None
        return pss_bytes(self.proc.pid)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; only this process (and its own group)."""
        import signal
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
            self._log = None

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
