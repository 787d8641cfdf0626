"""Adversarial benchmark: what one attacker costs the normal clients of a server.

``qswap serve`` runs as a child process under ``ulimit -n 1024`` (a common service default)
with its default limits, over a writable copy of the benchmark index (the demo corpus,
synthetic vectors in the model's space, as in ``qswap bench serving``) plus two ~1.9 MB
documents (metadata ``section: huge``). Normal clients send single-query searches at a steady
rate on keep-alive connections (the raw asyncio client, :mod:`qswap.bench.loadgen`). For each
attack, a window without the attacker is followed by one with it, for ``--rounds`` rounds; the
figures are over every round's requests together. The attacker is one client:
its own process (its Python never holds the load generator's GIL) and its own address
(``ATTACKER_HOST``, another loopback address, as a client on another machine would be). It
loops, one request at a time:

- ``long_queries``: 64 queries of ~300 words in one request (~130 kB, the issue's item 7);
- ``huge_answers``: 64 queries x k 100 over the two huge documents (the 973-byte request of
  item 8; ``filter`` keeps the hits on them);
- ``big_upsert``: 850 documents in one upsert (item 9), polled to the end before the next;
- ``slow_connections``: 1,000 connections that send half a request head and stall, each
  reopened when the server closes it (item 10);
- ``feedback_flood``: anonymous feedback from 8 connections as fast as the server answers:
  forged impression ids, and again and again the ids of 32 searches the attacker made (the
  server runs with ``--feedback-dir`` for this attack); an admin ``PUT /v1/aliases`` every
  100 ms, before and during the flood, measures what the flood costs admin routes.

Per attack: the normal clients' p50/p99 and failures with and without the attacker, the
attacker's own answers, ``/healthz`` latency, and the server's RSS before and after
(targets: p99 within 2x, 0 failed, RSS within 10 %).
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import random
import selectors
import shlex
import shutil
import socket
import sys
import threading
import time
from collections import Counter
from typing import Any, Callable

from qswap.bench.fixtures import MODEL, load_space_base, load_workload, qswap_command, stamped_index, wait_for_runtime
from qswap.bench.load_options import LOAD_HOST, ByMode, RunDirs, add_model_argument, warm_up
from qswap.bench.loadgen import Request, run_load_sync
from qswap.bench.plots import plot_bars
from qswap.bench.processes import ServerProcess, free_port, http_json
from qswap.bench.results import md_table
from qswap.bench.settle import PROBE_REQUESTS, Rest, metric, settle
from qswap.bench.stats import percentile
from qswap.encoders.runtime.hot import HOT_WINDOW_ROWS
from qswap.errors import InvalidInputError

NAME = "adversarial"
PHASE_S = ByMode(20.0, 4.0)
#: Rounds of (window without, window with the attacker) per attack. p99 of one 10 s window at
#: 20 requests/s is its 2nd-3rd worst request and moved by about +-0.4x between runs; pooled
#: over three rounds it is the 6th-7th worst of ~650, and alternating the windows spreads slow
#: drifts of the machine's load over both sides.
ROUNDS = ByMode(3, 1)
RATE = ByMode(20.0, 10.0)          # normal requests per second
CONNECTIONS = 16                    # normal clients' keep-alive connections (enough to hold the rate)
SLOW = ByMode(1000, 100)
NOFILE = 1024
HUGE_CHARS = 1_900_000
UPSERT_DOCS = ByMode(850, 100)
ATTACKS = ("long_queries", "huge_answers", "big_upsert", "slow_connections", "document_embeddings",
           "abandoned_requests", "feedback_flood")
#: Warm-up searches: more than a hot-encoder window (HOT_WINDOW_ROWS), so that the base runs merged.
HOT_WARM_ROWS = HOT_WINDOW_ROWS + 128
ABANDON_AFTER_S = 0.5               # an abandoning attacker closes its connection this long after sending
FLOOD_CONNECTIONS = 8
IP_BIND_ADDRESS_NO_PORT = 24       # Linux: many connections from one bound address
ATTACKER_HOST = "127.0.0.2"          # the attacker's source address (any 127/8 address reaches LOAD_HOST)
BUSY_HOSTS = ("127.0.0.3", "127.0.0.4")   # busy_after_disconnect's clients, one per heavy request


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench adversarial``."""
    p.add_argument("--phase-seconds", type=float, default=None,
                   help=f"seconds of each window, with and without the attacker ({PHASE_S.describe()})")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"windows without / with the attacker per attack, alternating ({ROUNDS.describe()})")
    p.add_argument("--rate", type=float, default=None, help=f"normal requests per second ({RATE.describe()})")
    p.add_argument("--slow-connections", type=int, default=None, help=f"stalled connections ({SLOW.describe()})")
    p.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated subset of {', '.join(ATTACKS)}")
    add_model_argument(p, MODEL)


class _Http:
    """One keep-alive connection for the attacker (one request at a time)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = self._new()

    def _new(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(LOAD_HOST, self.port, timeout=600, source_address=(ATTACKER_HOST, 0))

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            self.conn.request(method, path, body=data, headers=headers)
            r = self.conn.getresponse()
            return r.status, r.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            self.conn = self._new()
            return 0, b""

    def close(self) -> None:
        self.conn.close()


class Attacker:
    """Loops one attack in a process of its own until stopped; counts what the server answered.

    A process, not a thread: an attacker busy in Python would otherwise hold the load
    generator's GIL and add its waits to the normal clients' measured latency."""

    def __init__(self, name: str, port: int, payloads: dict[str, Any], slow: int) -> None:
        self.name, self.port, self.payloads, self.slow = name, port, payloads, slow
        ctx = multiprocessing.get_context("fork")   # the payloads travel without pickling
        self.stop = ctx.Event()
        self.statuses: Counter[str] = Counter()
        self.answer_bytes: list[int] = []
        self.jobs_done = 0
        self.closed_by_server = 0
        self.admin_ms: dict[str, list[float]] = {"before": [], "during": []}
        self._results, self._report = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=self._child, name=f"attack-{name}", daemon=True)

    def start(self) -> None:
        self.proc.start()

    def finish(self) -> None:
        """Stop sending and collect the counts; a running upsert job is waited for (it must not
        spill into the next window)."""
        self.stop.set()
        if self._results.poll(900):
            got = self._results.recv()
            self.statuses, self.answer_bytes = Counter(got["statuses"]), got["answer_bytes"]
            self.jobs_done, self.closed_by_server = got["jobs_done"], got["closed_by_server"]
            self.admin_ms = got["admin_ms"]
        else:
            self.statuses["attacker_lost"] += 1
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)

    def _child(self) -> None:
        try:
            self._run()
        finally:
            self._report.send({"statuses": dict(self.statuses), "answer_bytes": self.answer_bytes,
                               "jobs_done": self.jobs_done, "closed_by_server": self.closed_by_server,
                               "admin_ms": self.admin_ms})

    def _run(self) -> None:
        {"long_queries": self._requests, "huge_answers": self._requests, "big_upsert": self._upserts,
         "slow_connections": self._slow, "document_embeddings": self._requests,
         "abandoned_requests": self._abandon, "feedback_flood": self._feedback_flood}[self.name]()

    def _requests(self) -> None:
        c = _Http(self.port)
        path, body = _target(self.name, self.payloads[self.name])
        while not self.stop.is_set():
            status, data = c.call("POST", path, body)
            self.statuses[str(status)] += 1
            self.answer_bytes.append(len(data))
        c.close()

    def _abandon(self) -> None:
        """Heavy requests (a search and a document embedding at the token bound, 120 s deadline)
        whose client goes away shortly after sending: the server must stop their work."""
        bodies = [_target(n, self.payloads[n]) for n in ("long_queries", "document_embeddings")]
        i = 0
        while not self.stop.is_set():
            path, body = bodies[i % len(bodies)]
            s = send_raw(self.port, path, body, {"X-Request-Timeout": "120"})
            self.stop.wait(ABANDON_AFTER_S)
            s.close()
            self.statuses["abandoned"] += 1
            i += 1

    def _upserts(self) -> None:
        c = _Http(self.port)
        while not self.stop.is_set():
            status, data = c.call("POST", "/v1/documents", self.payloads["big_upsert"])
            self.statuses[str(status)] += 1
            if status != 202:
                continue
            location = json.loads(data)["id"]
            while True:   # one job at a time, polled to its end (also after stop: no spill-over)
                st, info = c.call("GET", f"/v1/documents/jobs/{location}")
                job = json.loads(info) if st == 200 else {"status": f"http {st}"}
                if job["status"] not in ("queued", "running"):
                    self.statuses[f"job {job['status']}"] += 1
                    self.jobs_done += 1
                    break
                time.sleep(0.2)   # not stop.wait: once stopped, it would poll as fast as the server answers
        c.close()

    def _feedback_flood(self) -> None:
        """Flood feedback from FLOOD_CONNECTIONS connections; time admin alias switches before
        (one second) and during the flood."""
        c = _Http(self.port)
        impressions = []
        for i in range(32):
            status, data = c.call("POST", "/v1/search", {"query": f"chess game {i}", "k": 5})
            if status == 200:
                body = json.loads(data)
                impressions.append((body["impression"], [h["id"] for h in body["results"][0]["hits"]][:1]))
        rng = random.Random(1)
        forged = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
                          for _ in range(16)) + "." + "A" * 22 for _ in range(64)]

        def flood(k: int) -> None:
            f = _Http(self.port)
            n = k
            while not self.stop.is_set():
                imp, clicks = impressions[n % len(impressions)] if n % 2 and impressions else (forged[n % 64], ["x"])
                status, _ = f.call("POST", "/v1/feedback", {"impression": imp, "clicks": clicks})
                self.statuses[str(status)] += 1
                n += FLOOD_CONNECTIONS
            f.close()

        def admin(phase: str, until: float) -> None:
            while not self.stop.is_set() and time.perf_counter() < until:
                t0 = time.perf_counter()
                status, _ = c.call("PUT", "/v1/aliases/flood-admin", {"encoder": "base"})
                self.admin_ms[phase].append((time.perf_counter() - t0) * 1000)
                self.statuses[f"admin {status}"] += 1
                self.stop.wait(0.1)

        admin("before", time.perf_counter() + 1.0)
        threads = [threading.Thread(target=flood, args=(k,), daemon=True) for k in range(FLOOD_CONNECTIONS)]
        for t in threads:
            t.start()
        admin("during", float("inf"))
        for t in threads:
            t.join(60)
        c.close()

    def _slow(self) -> None:
        sel = selectors.DefaultSelector()
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"   # never ends
        socks: set[socket.socket] = set()

        def open_one() -> None:
            s = socket.socket()
            s.setblocking(False)
            try:
                s.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)   # the port is picked at connect
                s.bind((ATTACKER_HOST, 0))
                s.connect_ex((LOAD_HOST, self.port))
            except OSError:
                s.close()
                self.statuses["connect_error"] += 1
                return
            sel.register(s, selectors.EVENT_WRITE)
            socks.add(s)

        for _ in range(self.slow):
            open_one()
        while not self.stop.is_set():
            for key, ev in sel.select(timeout=0.2):
                s = key.fileobj
                if ev & selectors.EVENT_WRITE:
                    try:
                        s.send(head)
                        self.statuses["stalled"] += 1
                        sel.modify(s, selectors.EVENT_READ)
                    except OSError:
                        self._drop(sel, socks, s)
                        open_one()
                    continue
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                if not data:   # closed by the server: the attacker opens another
                    self.closed_by_server += 1
                    self._drop(sel, socks, s)
                    open_one()
                else:
                    self.statuses[data.split(b"\r\n", 1)[0].decode(errors="replace")[:40]] += 1
        for s in list(socks):
            self._drop(sel, socks, s)

    @staticmethod
    def _drop(sel: selectors.BaseSelector, socks: set[socket.socket], s: Any) -> None:
        try:
            sel.unregister(s)
        except (KeyError, ValueError):
            pass
        socks.discard(s)
        s.close()


class HealthProbe:
    """``GET /healthz`` every 0.1 s on a fresh connection: how responsive the event loop is."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.ms: list[float] = []
        self.failed = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="healthz", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            t0 = time.perf_counter()
            try:
                c = http.client.HTTPConnection(LOAD_HOST, self.port, timeout=30)
                c.request("GET", "/healthz")
                ok = c.getresponse().status == 200
                c.close()
            except (OSError, http.client.HTTPException):
                ok = False
            if ok:
                self.ms.append((time.perf_counter() - t0) * 1000)
            else:
                self.failed += 1

    def __enter__(self) -> "HealthProbe":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


def _target(name: str, body: Any) -> tuple[str, Any]:
    """The route an attack's payload goes to."""
    return ("/v1/embeddings" if name == "document_embeddings" else "/v1/search"), body


def send_raw(port: int, path: str, body: Any, headers: dict[str, str] | None = None,
             source: str = ATTACKER_HOST) -> socket.socket:
    """Send one JSON POST on a new connection from ``source`` and return the socket, unread (to abandon it)."""
    data = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    s = socket.create_connection((LOAD_HOST, port), timeout=60, source_address=(source, 0))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {LOAD_HOST}\r\nContent-Type: application/json\r\n{extra}"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def busy_after_disconnect(port: int, payloads: dict[str, Any], held_s: float = 3.0) -> dict[str, Any]:
    """Worker time an abandoned request still costs: each heavy request runs ``held_s``, then its
    client goes away; the time from the disconnect until the server holds no admitted request
    (``idle_after_s``: the model time spent after the disconnect at most, as nothing else runs)
    is compared with one slice (the mean forward pass). ``busy_after_s``: the passes that
    finished after the disconnect, whole (a pass stopped in the middle is not in
    ``qswap_encode_seconds``, which counts finished passes). No other traffic meanwhile. Each
    request comes from a client of its own (``BUSY_HOSTS``): a client that abandoned a large
    request has its next one refused for a while (the server's ``abandon_wait_s``), and
    ``admitted`` says whether the request was still admitted when its client went away."""
    out: dict[str, Any] = {}
    for name, host in zip(("long_queries", "document_embeddings"), BUSY_HOSTS):
        path, body = _target(name, payloads[name])
        s = send_raw(port, path, body, {"X-Request-Timeout": "120"}, source=host)
        time.sleep(held_s)   # the request is running: this is the attacker's choice, not an ordering
        admitted = metric(port, "qswap_admitted_requests") > 0
        busy0, passes0 = metric(port, "qswap_encode_seconds_sum"), metric(port, "qswap_encode_seconds_count")
        s.close()
        t0 = time.perf_counter()
        while metric(port, "qswap_admitted_requests") > 0:
            time.sleep(0.01)
            if time.perf_counter() - t0 > 300:
                break
        busy1, passes1 = metric(port, "qswap_encode_seconds_sum"), metric(port, "qswap_encode_seconds_count")
        mean_pass = busy0 / passes0 if passes0 else None
        idle = time.perf_counter() - t0
        out[name] = {"held_s": held_s, "admitted": admitted, "busy_after_s": busy1 - busy0,
                     "passes_after": passes1 - passes0, "idle_after_s": idle, "mean_pass_s": mean_pass,
                     "within_one_slice": (admitted and mean_pass is not None
                                          and max(idle, busy1 - busy0) <= 2 * mean_pass)}
    return out


def _payloads(work: Any, quick: bool) -> dict[str, Any]:
    rng = random.Random(0)
    words = " ".join(d.text for d in work.docs[:200]).split()
    long_query = " ".join(rng.choice(words) for _ in range(300))
    n = UPSERT_DOCS.pick(quick)
    docs = [{"id": f"attack-{i}", "text": work.docs[i % len(work.docs)].text, "metadata": {"section": "attack"}}
            for i in range(n)]
    return {"long_queries": {"queries": [long_query] * 64, "k": 10},
            "huge_answers": {"queries": [q for q in work.queries[:64]], "k": 100, "filter": {"section": "huge"}},
            "big_upsert": {"documents": docs},
            # the 33 KB request: 64 texts of 255 '. ' for the document tower
            "document_embeddings": {"model": "qswap/documents", "input": [". " * 255] * 64}}


def _window(port: int, reqs: list[Request], seconds: float, rate: float,
            attacker: Attacker | None, at_rest: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], list[float]]:
    """Normal load for ``seconds`` (with ``attacker`` running meanwhile), once the server is at
    rest (``at_rest``: :func:`~qswap.bench.settle.settle`): its summary and the normal
    requests' latencies (ms)."""
    rest = at_rest()
    if not rest["settled"]:
        print(f"NOT SETTLED after {rest['seconds']:.0f} s, waiting for {'; '.join(rest['waiting_for'])}: "
              f"this window is flagged", file=sys.stderr)
    with HealthProbe(port) as probe:
        if attacker is not None:
            attacker.start()
        try:
            res = run_load_sync(LOAD_HOST, port, reqs, concurrency=CONNECTIONS, max_requests=10 ** 7,
                                duration_s=seconds, interval_s=1.0 / rate, timeout_s=60.0)
        finally:
            if attacker is not None:
                attacker.finish()
    lat = res.latencies_ms()
    out = {"sent": res.sent, "ok": len(res.ok), "failed": res.failed, "statuses": res.summary()["statuses"],
           "errors": res.errors(), "p50_ms": percentile(lat, 50) if lat else None,
           "p99_ms": percentile(lat, 99) if lat else None,
           "healthz_p99_ms": percentile(probe.ms, 99) if probe.ms else None,
           "healthz_max_ms": max(probe.ms) if probe.ms else None, "healthz_failed": probe.failed,
           "settle": rest}
    if attacker is not None:
        out["attacker"] = {"answers": dict(attacker.statuses), "jobs_done": attacker.jobs_done,
                           "closed_by_server": attacker.closed_by_server,
                           **({"admin_p99_ms": {k: percentile(v, 99) for k, v in attacker.admin_ms.items() if v}}
                              if attacker.name == "feedback_flood" else {}),
                           "answer_bytes_max": max(attacker.answer_bytes) if attacker.answer_bytes else None}
    return out, lat


def pooled(windows: list[dict[str, Any]], lats: list[list[float]]) -> dict[str, Any]:
    """One summary of several windows of the same kind: counts summed, p50/p99 over every
    window's latencies together, worst /healthz; each window's own summary under ``rounds``.

    Args:
        windows: the windows' summaries (:func:`_window`).
        lats: their latencies (ms), in the same order.

    Returns:
        The pooled summary (the same keys as one window's, plus ``rounds``).
    """
    every = [x for lat in lats for x in lat]
    statuses: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for w in windows:
        statuses.update(w["statuses"])
        errors.update(w["errors"])
    worst = [w["healthz_max_ms"] for w in windows if w["healthz_max_ms"] is not None]
    out: dict[str, Any] = {
        "sent": sum(w["sent"] for w in windows), "ok": sum(w["ok"] for w in windows),
        "failed": sum(w["failed"] for w in windows), "statuses": dict(statuses), "errors": dict(errors),
        "p50_ms": percentile(every, 50) if every else None, "p99_ms": percentile(every, 99) if every else None,
        "healthz_max_ms": max(worst) if worst else None,
        "healthz_failed": sum(w["healthz_failed"] for w in windows), "rounds": windows,
        "settle_max_s": max((w["settle"]["seconds"] for w in windows if "settle" in w), default=None),
        "unsettled": sum(not w["settle"]["settled"] for w in windows if "settle" in w)}
    attackers = [w["attacker"] for w in windows if "attacker" in w]
    if attackers:
        answers: Counter[str] = Counter()
        for a in attackers:
            answers.update(a["answers"])
        admin: dict[str, float] = {}
        for a in attackers:
            for k, v in a.get("admin_p99_ms", {}).items():
                admin[k] = max(admin.get(k, v), v)
        sizes = [a["answer_bytes_max"] for a in attackers if a["answer_bytes_max"] is not None]
        out["attacker"] = {"answers": dict(answers), "jobs_done": sum(a["jobs_done"] for a in attackers),
                           "closed_by_server": sum(a["closed_by_server"] for a in attackers),
                           **({"admin_p99_ms": admin} if admin else {}),
                           "answer_bytes_max": max(sizes) if sizes else None}
    return out


def round_ratios(quiet: dict[str, Any], attacked: dict[str, Any]) -> list[float | None]:
    """Each round's p99 with / without the attacker (None where a window had no answer)."""
    return [a["p99_ms"] / q["p99_ms"] if q["p99_ms"] and a["p99_ms"] else None
            for q, a in zip(quiet["rounds"], attacked["rounds"])]


def run(args: argparse.Namespace) -> int:
    """``qswap bench adversarial``."""
    quick = bool(args.quick)
    seconds = args.phase_seconds or PHASE_S.pick(quick)
    rounds = args.rounds or ROUNDS.pick(quick)
    rate = args.rate or RATE.pick(quick)
    slow = args.slow_connections or SLOW.pick(quick)
    attacks = [a.strip() for a in args.attacks.split(",") if a.strip()]
    unknown = sorted(set(attacks) - set(ATTACKS))
    if unknown or not attacks:
        raise InvalidInputError(f"unknown attacks: {', '.join(unknown) or '(none given)'}",
                                f"choose from {', '.join(ATTACKS)}")
    if seconds <= 0 or rate <= 0 or slow < 1 or rounds < 1:
        raise InvalidInputError("--phase-seconds, --rounds, --rate and --slow-connections must be positive",
                                "e.g. --phase-seconds 20 --rate 20")
    dirs = RunDirs.create(NAME, quick, args.out)
    tmp = dirs.tmp
    work = load_workload(True)   # the demo corpus in both modes: the attacks, not the corpus, are measured
    base = load_space_base(args.model)
    src, _, _ = stamped_index(work, base, tag="default")
    del base
    index = tmp / "index"
    shutil.rmtree(index, ignore_errors=True)
    shutil.copytree(src, index)
    shutil.rmtree(tmp / "state", ignore_errors=True)
    port = free_port()
    serve = qswap_command() + ["serve", "--host", LOAD_HOST, "--port", str(port), "--index", str(index),
                               "--model", args.model, "--device", "cpu", "--state-dir", str(tmp / "state"),
                               "--insecure", "--log-format", "text"]
    if "feedback_flood" in attacks:   # capture on, for the flood's feedback (and its searches)
        serve += ["--feedback-dir", str(tmp / "feedback")]
    cmd = ["bash", "-c", f"ulimit -n {NOFILE} && exec {shlex.join(serve)}"]
    srv = ServerProcess(cmd, port, ready_path="/readyz", log_path=tmp / "server.log")
    payloads = _payloads(work, quick)
    reqs = [Request.post_json("/v1/search", {"query": q, "k": 10}) for q in work.queries]
    res: dict[str, Any] = {"workload": work.source, "phase_s": seconds, "rounds": rounds, "rate_per_s": rate,
                           "connections": CONNECTIONS, "nofile": NOFILE, "slow_connections": slow,
                           "upsert_documents": len(payloads["big_upsert"]["documents"]), "attacks": {}}
    with srv:
        res["server"] = {"command": srv.command, "start_s": srv.start_seconds,
                         "env": {k: v for k, v in os.environ.items() if k.startswith("QSWAP_")}}
        try:
            res["server"]["shared_runtime_wait_s"] = wait_for_runtime(srv, ["base"], "onnx-shared", 900)
        except InvalidInputError as e:   # torch serves meanwhile: recorded, the run goes on
            res["server"]["shared_runtime_error"] = str(e)
        huge = "chess game " * (HUGE_CHARS // 11)
        for i in range(2):
            st, body = http_json("POST", srv.url("/v1/documents"), {"documents": [
                {"id": f"huge-{i}", "text": huge + str(i), "metadata": {"section": "huge"}}]}, timeout=600)
            if st != 200:
                raise InvalidInputError(f"adding a huge document failed ({st}): {body}", "see " + str(tmp))
        # More rows than a hot-encoder window, then wait for its merged session: the base serves
        # every row, so it becomes hot (qswap.encoders.runtime.hot) and its session is built here,
        # not inside whichever attack's window the server's row count reaches the window in.
        warm_up(port, reqs, concurrency=CONNECTIONS, requests=HOT_WARM_ROWS, duration_s=120)
        try:
            res["server"]["hot_wait_s"] = wait_for_runtime(srv, ["base"], "onnx", 300)
        except InvalidInputError as e:   # hot encoders off, or its export failed: recorded, the run goes on
            res["server"]["hot_error"] = str(e)
        # One legitimate request of the largest size grows the runtime's buffers once, before
        # the RSS baseline: a high-water mark of normal use, not something an attack leaves.
        st, body = http_json("POST", srv.url("/v1/search"), {"queries": work.queries[:64], "k": 100}, timeout=600)
        if st != 200:
            raise InvalidInputError(f"the warm-up search failed ({st}): {str(body)[:300]}", "see " + str(tmp))
        res["rss_start_bytes"] = srv.rss()
        # Each window starts on a server at rest: what the last one left (stalled connections
        # being reaped, queued work) must not be measured in the next (qswap.bench.settle).
        pid, probe_body = srv.proc.pid, {"query": work.queries[0], "k": 10}
        rest = Rest.measure(pid, port, "/v1/search", probe_body)
        res["rest"] = {"sockets": rest.sockets, "probe_ms": rest.probe_ms, "probe_bound_ms": rest.probe_bound_ms()}
        last: list[Attacker] = []

        def at_rest() -> dict[str, Any]:
            return settle(pid, port, rest, "/v1/search", probe_body,
                          others_gone=lambda: not any(a.proc.is_alive() for a in last))
        for name in attacks:
            rss_before = srv.rss()
            windows: dict[str, tuple[list[dict[str, Any]], list[list[float]]]] = {"quiet": ([], []),
                                                                                 "attacked": ([], [])}
            for _ in range(rounds):   # alternating: a drift of the machine's load falls on both sides
                for side, attacker in (("quiet", None), ("attacked", Attacker(name, port, payloads, slow))):
                    summary, lat = _window(port, reqs, seconds, rate, attacker, at_rest)
                    last[:] = [attacker] if attacker is not None else []
                    windows[side][0].append(summary)
                    windows[side][1].append(lat)
            rss_after = srv.rss()
            quiet, attacked = pooled(*windows["quiet"]), pooled(*windows["attacked"])
            ratio = (attacked["p99_ms"] / quiet["p99_ms"]) if quiet["p99_ms"] and attacked["p99_ms"] else None
            res["attacks"][name] = {"quiet": quiet, "attacked": attacked, "p99_ratio": ratio,
                                    "round_ratios": round_ratios(quiet, attacked),
                                    "rss_before_bytes": rss_before, "rss_after_bytes": rss_after,
                                    "rss_change": rss_after / rss_before - 1}
            print(f"{name}: p99 {quiet['p99_ms']:.1f} -> {attacked['p99_ms'] or float('nan'):.1f} ms "
                  f"(x{ratio or float('nan'):.2f}; rounds {res['attacks'][name]['round_ratios']}), failed {attacked['failed']}, RSS "
                  f"{rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB", file=sys.stderr)
        res["rss_end_bytes"] = srv.rss()
        res["settle_end"] = at_rest()
        if "abandoned_requests" in attacks:
            res["busy_after_disconnect"] = busy_after_disconnect(port, payloads)
            print(f"busy after disconnect: {res['busy_after_disconnect']}", file=sys.stderr)
    _write(dirs, res)
    dirs.clean_scratch()
    ok = all(a["attacked"]["failed"] == 0 and (a["p99_ratio"] or 99) <= 2.0 and abs(a["rss_change"]) <= 0.10
             and not a["quiet"]["unsettled"] and not a["attacked"]["unsettled"] for a in res["attacks"].values())
    print(f"wrote {dirs.out}: {'all targets met' if ok else 'targets missed (see README.md)'}")
    return 0


def _write(dirs: RunDirs, res: dict[str, Any]) -> None:
    w = dirs.writer
    names = list(res["attacks"])
    A = res["attacks"]
    plot_bars(w.plot_path("p99.png"), names,
              {"p99 without attacker": [A[n]["quiet"]["p99_ms"] or 0 for n in names],
               "p99 with attacker": [A[n]["attacked"]["p99_ms"] or 0 for n in names],
               "p50 without": [A[n]["quiet"]["p50_ms"] or 0 for n in names],
               "p50 with": [A[n]["attacked"]["p50_ms"] or 0 for n in names]},
              ylabel="normal clients' latency (ms)", title="What one attacker costs the normal clients")

    def f(v: Any, nd: int = 1) -> str:
        return "-" if v is None else f"{v:.{nd}f}"
    rows = []
    for n in names:
        q, a = A[n]["quiet"], A[n]["attacked"]
        per_round = " / ".join(f(r, 2) for r in A[n].get("round_ratios", []))
        unsettled = q.get("unsettled", 0) + a.get("unsettled", 0)
        waits = [x for x in (q.get("settle_max_s"), a.get("settle_max_s")) if x is not None]
        settled = f"NOT SETTLED ({unsettled} windows)" if unsettled else (f(max(waits)) if waits else "-")
        rows.append([n, f(q["p50_ms"]), f(a["p50_ms"]), f(q["p99_ms"]), f(a["p99_ms"]), f(A[n]["p99_ratio"], 2),
                     per_round, settled,
                     f"{a['failed']} / {a['sent']}", f(a["healthz_max_ms"]),
                     f"{A[n]['rss_before_bytes'] / 2**20:.0f} -> {A[n]['rss_after_bytes'] / 2**20:.0f} "
                     f"({100 * A[n]['rss_change']:+.1f} %)",
                     ", ".join(f"{k}: {v}" for k, v in sorted(a["attacker"]["answers"].items()))
                     + "".join(f"; admin PUT p99 {k} {v:.1f} ms"
                               for k, v in a["attacker"].get("admin_p99_ms", {}).items())])
    env = " ".join(f"{k}={v}" for k, v in sorted(res["server"].get("env", {}).items()))
    rest = res.get("rest", {})
    md = (f"Server: `qswap serve` with its default limits{f' (environment: `{env}`)' if env else ''} under "
          f"`ulimit -n {res['nofile']}`; workload "
          f"{res['workload']} plus two {HUGE_CHARS / 1e6:.1f} MB documents. Normal clients: "
          f"{res['rate_per_s']:g} single-query searches/s (k 10) on {res['connections']} keep-alive "
          f"connections from {LOAD_HOST}; the attacker, a process of its own, from {ATTACKER_HOST}; each window "
          f"{res['phase_s']:g} s, without then with the attacker, {res.get('rounds', 1)} round(s) of the two "
          f"alternating per attack; p50 / p99 and the p99 ratio are over every round's requests together "
          f"(with ~200 requests per window, one window's p99 is its 2nd-3rd worst request and moves by about "
          f"+-0.4x between runs), the ratio of each round beside it. Every window starts on a server at "
          f"rest (qswap.bench.settle): the attacker's process ended, no request admitted, no more open "
          f"sockets than at rest ({rest.get('sockets', '-')}) and a probe of {PROBE_REQUESTS} sequential normal "
          f"searches with a median within {f(rest.get('probe_bound_ms'))} ms (at rest {f(rest.get('probe_ms'))} ms); "
          f"'settle s' is the longest wait for that before a window of the row. Slow connections: "
          f"{res['slow_connections']}; upsert: {res['upsert_documents']} documents. The RSS baseline is taken "
          f"after a warm-up that includes one legitimate 64-query request (buffers grown once by normal use). "
          f"Latency is measured from each request's actual send: when the server falls behind, the normal "
          f"clients send fewer requests (see 'normal failed' for the count sent).\n\n"
          + md_table(["attack", "p50 ms (without)", "p50 ms (with)", "p99 ms (without)", "p99 ms (with)",
                      "p99 ratio", "p99 ratio per round", "settle s (worst)", "normal failed", "/healthz max ms (with)", "server RSS MiB",
                      "attacker's answers"], rows)
          + f"\n\nTargets: p99 ratio <= 2, 0 failed, RSS within 10 %. Server RSS at start "
          f"{res['rss_start_bytes'] / 2**20:.0f} MiB, at the end {res['rss_end_bytes'] / 2**20:.0f} MiB.\n")
    w.write(res, md)
