"""Serving benchmark: latency and QPS of ``POST /v1/search`` against concurrency.

The server is the real one, ``qswap serve``, run as a child process on 127.0.0.1 with the
real model (multilingual-e5-small, bundled). Load comes from :mod:`qswap.bench.loadgen`
(closed loop: ``c`` keep-alive connections, each sending its next query when the last
answer arrived), bounded in requests and seconds per run.

Two arms are measured side by side at every concurrency, alternating run by run (A B B A):
all requests to one encoder, and requests spread round-robin over 8 encoders (mixed
traffic). Both arms use LoRA encoders over the shared base (random adapters: speed does
not depend on what they learned). Each response's ``took_ms`` and per-query timings give
the time breakdown: HTTP + client (client latency minus ``took_ms``), queue (waiting for a
batch), encode (the batch's forward pass), search (the batch's index search), other.

Documents: the Debian package-descriptions corpus (``qswap bench data debian``, ~60k
texts) stored with **synthetic** embeddings stamped with the real model's embedding space.
Embedding the 60k long descriptions with e5-small on this 2-core machine runs at ~30 docs/s
when the machine is otherwise idle and ~8 docs/s when shared (35 minutes to two hours), so
the index vectors are clustered random unit vectors; queries are
real Debian short descriptions (en/de/fr/it) encoded by the real model on every request.
Latency is representative (same sizes, same code path); the hits are not meaningful.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qswap.bench.harness import (ByMode, LoadDefaults, LoadOptions, ResultWriter, RunDirs, ServerProcess,
                                 add_load_arguments, add_model_argument, free_port, http_json, interleaved, md_table,
                                 plot_bars, plot_lines, ratio_summary, summarize, warm_up)
from qswap.bench.loadgen import LoadResult, Request
from qswap.errors import InvalidInputError, NotFoundError

NAME = "serving"
MODEL = "multilingual-e5-small"
N_ENCODERS = 8
QUERY_LANGS = ("en", "de", "fr", "it")
#: Load options of ``qswap bench serving``: full run and ``--quick``.
LOAD = LoadDefaults(levels=ByMode((1, 2, 4, 8, 16, 32, 64), (1, 4)), seconds=ByMode(8.0, 2.0),
                    requests=ByMode(3000, 40), rounds=ByMode(2, 1), rounds_help="A/B rounds per level")


# --------------------------------------------------------------------------- shared fixture


def cache_dir() -> Path:
    """Reusable benchmark inputs (indexes, encoders, full models): ``<data dir>/bench/cache``."""
    from qswap.paths import data_dir
    d = data_dir() / "bench" / "cache"
    d.mkdir(parents=True, exist_ok=True)
    return d


@dataclass
class Workload:
    """Documents to index and query texts to send, with a sentence saying where they come from."""

    docs: list[Any]          # qswap.index.Document
    queries: list[str]
    source: str


def debian_dir() -> Path:
    """The Debian benchmark (built from apt's lists on first use)."""
    from qswap.paths import data_dir
    d = data_dir() / "bench" / "debian"
    if not (d / "corpus.jsonl").is_file():
        from qswap.bench.data.debian import build_debian_beir
        print(f"building the Debian benchmark in {d} (once)", file=sys.stderr)
        build_debian_beir(d, progress=True)
    return d


def load_workload(quick: bool, max_queries: int = 4000, seed: int = 0) -> Workload:
    """Quick: the 400-document demo corpus, queries = its titles. Full: the Debian corpus with
    real short descriptions in en/de/fr/it as queries (shuffled, at most ``max_queries``)."""
    from qswap.index import Document

    rng = random.Random(seed)
    if quick:
        import qswap
        path = Path(qswap.__file__).parent / "data" / "demo_corpus.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        docs = [Document(r["id"], r["text"], {"section": r.get("section", "")}) for r in rows]
        queries = [r.get("title") or r["text"][:80] for r in rows]
        rng.shuffle(queries)
        return Workload(docs, queries[:max_queries], f"demo corpus ({len(docs)} Debian descriptions, {path.name})")
    d = debian_dir()
    docs = []
    with open(d / "corpus.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                docs.append(Document(r["_id"], r["text"], {"section": (r.get("metadata") or {}).get("section", "")}))
    queries = []
    for lang in QUERY_LANGS:
        p = d / f"queries-{lang}.jsonl"
        if p.is_file():
            with open(p, encoding="utf-8") as f:
                queries += [json.loads(line)["text"] for line in f if line.strip()]
    if not queries:
        raise NotFoundError(f"no queries in {d}", "rebuild it: qswap bench data debian --out " + str(d))
    rng.shuffle(queries)
    return Workload(docs, queries[:max_queries],
                    f"Debian package descriptions ({len(docs):,} documents, queries in {'/'.join(QUERY_LANGS)})")


def load_space_base(model: str = MODEL) -> Any:
    """The base model, on CPU (its space stamps the index; adapters are made against it)."""
    from qswap.encoders import load_base
    return load_base(model, device="cpu")


def stamped_index(work: Workload, base: Any, *, config: Any = None, tag: str = "default",
                  seed: int = 0) -> tuple[Path, Path, Path]:
    """An index of ``work.docs`` with synthetic vectors in ``base``'s space (cached).

    Returns ``(index_dir, vectors_npy, ids_jsonl)``: the vectors exactly as stored (float16
    rounded back to float32) and the documents in row order, for the naive baseline.
    """
    import numpy as np

    from qswap.bench.data.synthetic import clustered_embeddings
    from qswap.index import DocumentIndex, IndexConfig, create_index

    n = len(work.docs)
    key = f"stamped-{n}-{seed}-{tag}-{base.space.fingerprint[:10]}"
    root = cache_dir() / key
    idx_dir, vec_path, ids_path = root / "index", root / "vectors.npy", root / "docs.jsonl"
    if (root / "done").is_file():
        return idx_dir, vec_path, ids_path
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    x = clustered_embeddings(n, base.dim, n_clusters=max(8, min(1024, n // 50)), seed=seed)
    cfg = config if config is not None else IndexConfig()
    t0 = time.perf_counter()
    idx = create_index(idx_dir, work.docs, x, base.space, cfg,
                       build={"vectors": "synthetic clustered (qswap bench), not model embeddings"}, progress=True)
    idx.close()
    build_s = time.perf_counter() - t0
    np.save(vec_path, x.astype(np.float16).astype(np.float32))
    with open(ids_path, "w", encoding="utf-8") as f:
        for d in work.docs:
            f.write(json.dumps({"id": d.id, "text": d.text}, ensure_ascii=False) + "\n")
    info = DocumentIndex.open(idx_dir, read_only=True)
    meta = {"documents": n, "config": info.config.to_dict(), "build_s": build_s}
    info.close()
    (root / "done").write_text(json.dumps(meta, indent=2))
    return idx_dir, vec_path, ids_path


def index_meta(idx_dir: Path) -> dict[str, Any]:
    """What :func:`stamped_index` recorded about an index (config, build time)."""
    return json.loads((Path(idx_dir).parent / "done").read_text())


def lora_encoders(base: Any, names: list[tuple[str, str]], *, rank: int = 32, seed: int = 0,
                  scale: float = 0.02, tag: str = "") -> Path:
    """Encoder directories ``<root>/<name>-<version>`` of random LoRA adapters (cached); returns root.

    ``lora_B`` is drawn from N(0, ``scale``) instead of peft's zeros, so every adapter really
    changes the forward pass (and outputs differ per encoder).
    """
    import copy
    import tempfile

    import torch
    from peft import LoraConfig, get_peft_model

    from qswap.encoders import save_encoder

    root = cache_dir() / f"lora-r{rank}-s{seed}-{tag or len(names)}-{base.space.fingerprint[:10]}"
    missing = [(n, v) for n, v in names if not (root / f"{n}-{v}" / "manifest.json").is_file()]
    if not missing:
        return root
    root.mkdir(parents=True, exist_ok=True)
    model = get_peft_model(copy.deepcopy(base.model), LoraConfig(r=rank, lora_alpha=rank,
                                                                 target_modules=["query", "key", "value", "dense"]))
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, version) in enumerate(names):
            if (name, version) not in missing:
                continue
            g = torch.Generator().manual_seed(seed * 1000 + i)
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if "lora_A" in pname:
                        p.copy_(torch.empty_like(p).uniform_(-1, 1, generator=g) / p.shape[1] ** 0.5)
                    elif "lora_B" in pname:
                        p.copy_(torch.randn(p.shape, generator=g) * scale)
            peft_dir = Path(tmp) / f"{name}-{version}"
            model.save_pretrained(str(peft_dir))
            save_encoder(root / f"{name}-{version}", name=name, version=version, kind="lora", space=base.space,
                         lora_dir=peft_dir, training={"note": "random LoRA adapter for benchmarks"})
    del model
    return root


def qswap_command() -> list[str]:
    """``qswap`` of this environment (the script next to the interpreter, else ``python -m qswap.cli``)."""
    script = Path(sys.executable).parent / "qswap"
    return [str(script)] if script.exists() else [sys.executable, "-m", "qswap.cli"]


def qswap_server(index: Path, encoders_root: Path, state_dir: Path, log_path: Path, *, model: str = MODEL,
                 extra: list[str] | None = None, port: int | None = None) -> ServerProcess:
    """A ``qswap serve`` child process on 127.0.0.1 (not started yet)."""
    port = port or free_port()
    shutil.rmtree(state_dir, ignore_errors=True)
    state_dir.mkdir(parents=True)
    cmd = qswap_command() + ["serve", "--host", "127.0.0.1", "--port", str(port), "--index", str(index),
                             "--read-only-index", "--model", model, "--device", "cpu", "--encoders-root",
                             str(encoders_root), "--state-dir", str(state_dir), "--insecure",
                             "--log-format", "text", *(extra or [])]
    return ServerProcess(cmd, port, ready_path="/readyz", log_path=log_path)


def register(srv: ServerProcess, rel_path: str) -> tuple[dict[str, Any], float]:
    """``POST /v1/encoders`` by path; returns (response, seconds)."""
    t0 = time.perf_counter()
    status, body = http_json("POST", srv.url("/v1/encoders"), {"path": rel_path})
    dt = time.perf_counter() - t0
    if status not in (200, 201):
        raise InvalidInputError(f"registering {rel_path} failed with {status}: {body}", "see the server log")
    return body, dt


def search_requests(queries: list[str], keys: list[str], k: int = 10, offset: int = 0) -> Any:
    """Request ``i``: query ``queries[(i + offset) % n]`` with encoder ``keys[i % len(keys)]``."""
    pre = [[json.dumps({"query": q, "encoder": key, "k": k}).encode() for key in keys] for q in queries]
    hdr = (("Content-Type", "application/json"),)
    n, m = len(queries), len(keys)

    def make(i: int) -> Request:
        return Request("POST", "/v1/search", pre[(i + offset) % n][i % m], hdr, keys[i % m])
    return make


def breakdown(res: LoadResult) -> dict[str, float]:
    """Mean and p50 ms of HTTP+client, queue, encode, search, other, from kept response bodies."""
    parts: dict[str, list[float]] = {"http_client": [], "queue": [], "encode": [], "search": [], "other": []}
    for s in res.ok:
        if s.body is None:
            continue
        d = json.loads(s.body)
        t = d["results"][0]["timings"]
        took = float(d["took_ms"])
        parts["http_client"].append(s.latency_s * 1e3 - took)
        parts["queue"].append(t["queue_ms"])
        parts["encode"].append(t["encode_ms"])
        parts["search"].append(t["search_ms"])
        parts["other"].append(took - t["queue_ms"] - t["encode_ms"] - t["search_ms"])
    out: dict[str, float] = {}
    for k, v in parts.items():
        st = summarize(v, (50,))
        out[f"{k}_mean"] = st["mean"]
        out[f"{k}_p50"] = st["p50"]
    return out


# --------------------------------------------------------------------------- the benchmark


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench serving``."""
    add_load_arguments(p, LOAD)
    add_model_argument(p, MODEL)
    p.add_argument("--backend", choices=("shared", "onnx", "torch"), default="shared",
                   help="the server's query-encoder backend (default: shared, the server's default); with shared "
                        "or onnx, timing starts once every encoder runs on ONNX Runtime")
    p.add_argument("--query-precision", choices=("fp32", "bf16"), default="fp32",
                   help="the server's --query-precision (torch backend; default: fp32)")


def wait_for_runtime(srv: ServerProcess, keys: list[str], runtime: str, timeout_s: float = 900.0) -> float:
    """Poll ``GET /v1/encoders/{key}`` until every key reports ``runtime``; returns the seconds waited."""
    t0 = time.perf_counter()
    while True:
        pending = []
        for k in keys:
            status, body = http_json("GET", srv.url(f"/v1/encoders/{k}"))
            if status != 200:
                raise InvalidInputError(f"GET /v1/encoders/{k} answered {status}: {body}", "see the server log")
            if body.get("runtime_error"):
                raise InvalidInputError(f"the {runtime} export of {k} failed: {body['runtime_error']}",
                                        "see the server log, or run with --backend torch")
            if body.get("runtime") != runtime:
                pending.append(k)
        if not pending:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            raise InvalidInputError(f"{len(pending)} encoders not on {runtime} after {timeout_s:.0f} s "
                                    f"({', '.join(pending[:3])})", "see the server log")
        time.sleep(1.0)


def run(args: argparse.Namespace) -> int:
    """``qswap bench serving``."""
    opts = LoadOptions.from_args(args, LOAD)
    quick, levels = opts.quick, opts.levels
    dirs = RunDirs.create(NAME, quick, args.out)
    tmp = dirs.tmp

    work = load_workload(quick)
    base = load_space_base(args.model)
    idx_dir, _, _ = stamped_index(work, base, tag="default")
    names = [(f"d{i}", "1") for i in range(N_ENCODERS)]
    enc_root = lora_encoders(base, names)
    del base
    srv = qswap_server(idx_dir, enc_root, tmp / "state", tmp / "server.log", model=args.model,
                       extra=["--backend", args.backend, "--query-precision", args.query_precision])
    results: dict[str, Any] = {"backend": args.backend, "query_precision": args.query_precision,
                               "workload": work.source, "index": index_meta(idx_dir),
                               "vectors": "synthetic clustered unit vectors stamped with the model's space",
                               "encoders": f"{N_ENCODERS} random LoRA adapters (rank 32, all dense layers)",
                               "levels": levels, "seconds_per_run": opts.seconds,
                               "max_requests_per_run": opts.requests, "rounds": opts.rounds, "arms": {}}
    with srv:
        results["server"] = {"command": srv.command, "start_s": srv.start_seconds}
        reg_s = [register(srv, f"{n}-{v}")[1] for n, v in names]
        results["registration_s"] = summarize(reg_s)
        keys = [f"{n}@{v}" for n, v in names]
        if args.backend != "torch":
            results["runtime_wait_s"] = wait_for_runtime(
                srv, ["base", *keys], "onnx-shared" if args.backend == "shared" else args.backend)
        arms = {"1 encoder": search_requests(work.queries, keys[:1]),
                "8 encoders": search_requests(work.queries, keys)}
        # Warm-up: every adapter loaded and its code paths run before anything is timed.
        warm_up(srv.port, arms["8 encoders"], concurrency=4, requests=64, duration_s=30)
        per: dict[str, dict[int, list[LoadResult]]] = {a: {} for a in arms}
        for c in levels:
            def one(arm: str, c: int = c) -> LoadResult:
                return opts.run(srv.port, arms[arm], c, keep_bodies=True)
            got = interleaved({a: (lambda a=a: one(a)) for a in arms}, rounds=opts.rounds, warmup=0)
            for a, rs in got.items():
                per[a][c] = rs
            print(f"c={c}: " + ", ".join(f"{a} {sum(r.qps for r in rs) / len(rs):.1f} qps" for a, rs in got.items()),
                  file=sys.stderr)
        results["server"]["rss_bytes_end"] = srv.rss()
    results["arms"] = _summaries(per)
    results["ratios_8_vs_1"] = _ratios(per, levels)
    _write(dirs.writer, results, levels)
    dirs.clean_scratch()
    print(f"wrote {dirs.out}")
    return 0


def _summaries(per: dict[str, dict[int, list[LoadResult]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm, by_c in per.items():
        rows = {}
        for c, rs in by_c.items():
            lat = [x for r in rs for x in r.latencies_ms()]
            merged = LoadResult([s for r in rs for s in r.samples], sum(r.elapsed_s for r in rs), c, "")
            rows[str(c)] = {
                "qps_rounds": [r.qps for r in rs], "qps": summarize([r.qps for r in rs], (50,))["p50"],
                "latency_ms": summarize(lat), "sent": sum(r.sent for r in rs),
                "failed": sum(r.failed for r in rs), "errors": merged.errors(),
                "breakdown_ms": breakdown(merged)}
        out[arm] = rows
    return out


def _ratios(per: dict[str, dict[int, list[LoadResult]]], levels: list[int]) -> dict[str, Any]:
    out = {}
    for c in levels:
        a, b = per["8 encoders"][c], per["1 encoder"][c]
        out[str(c)] = {"qps": ratio_summary([r.qps for r in a], [r.qps for r in b]).to_dict(),
                       "p99": ratio_summary([summarize(r.latencies_ms())["p99"] for r in a],
                                            [summarize(r.latencies_ms())["p99"] for r in b]).to_dict()}
    return out


def _write(w: ResultWriter, res: dict[str, Any], levels: list[int]) -> None:
    arms = res["arms"]
    lat = {f"{a} {p}": [arms[a][str(c)]["latency_ms"][p] for c in levels] for a in arms for p in ("p50", "p99")}
    plot_lines(w.plot_path("latency_vs_concurrency.png"), levels, lat, xlabel="concurrent connections",
               ylabel="latency (ms)", title="/v1/search latency", logx=True, logy=True)
    qps = {a: [arms[a][str(c)]["qps"] for c in levels] for a in arms}
    bands = {a: ([min(arms[a][str(c)]["qps_rounds"]) for c in levels], [max(arms[a][str(c)]["qps_rounds"]) for c in levels])
             for a in arms}
    plot_lines(w.plot_path("qps_vs_concurrency.png"), levels, qps, xlabel="concurrent connections",
               ylabel="successful requests / s", title="/v1/search throughput (band: min-max of rounds)",
               logx=True, bands=bands)
    parts = ("http_client", "queue", "encode", "search", "other")
    mixed = arms["8 encoders"]
    plot_bars(w.plot_path("breakdown.png"), [str(c) for c in levels],
              {p: [max(0.0, mixed[str(c)]["breakdown_ms"][f"{p}_mean"]) for c in levels] for p in parts},
              ylabel="mean ms per request", title="Where the time goes (8 encoders, by concurrency)", stacked=True)

    rows = []
    for c in levels:
        r1, r8 = arms["1 encoder"][str(c)], arms["8 encoders"][str(c)]
        ratio = res["ratios_8_vs_1"][str(c)]["qps"]
        rows.append([c, r1["qps"], r1["latency_ms"]["p50"], r1["latency_ms"]["p95"], r1["latency_ms"]["p99"],
                     r8["qps"], r8["latency_ms"]["p50"], r8["latency_ms"]["p95"], r8["latency_ms"]["p99"],
                     f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})", r1["failed"] + r8["failed"]])
    table = md_table(["conc.", "1 enc QPS", "p50 ms", "p95 ms", "p99 ms", "8 enc QPS", "p50 ms", "p95 ms", "p99 ms",
                      "QPS 8/1 (range)", "failed"], rows)
    brows = []
    for c in levels:
        b = mixed[str(c)]["breakdown_ms"]
        brows.append([c] + [b[f"{p}_mean"] for p in parts] + [b[f"{p}_p50"] for p in ("queue", "encode", "search")])
    btable = md_table(["conc.", "HTTP+client", "queue", "encode", "search", "other", "queue p50", "encode p50",
                       "search p50"], brows)
    idx = res["index"]["config"]
    md = (f"Workload: {res['workload']}. Index: {res['index']['documents']:,} documents, "
          f"{idx['kind']} {idx['quant']} dim {idx['dim']}, rescore {idx['rescore']} (qswap's default for this size); "
          f"**vectors: {res['vectors']}** (embedding the 60k documents with e5-small here runs at ~30 docs/s idle, "
          "~8 docs/s shared: 35 minutes to two hours), queries: real "
          f"text encoded by the real model per request. Encoders: {res['encoders']}.\n\n"
          f"Each level: {res['rounds']} round(s) per arm, alternating, each at most {res['max_requests_per_run']} "
          f"requests or {res['seconds_per_run']:g} s; server backend: {res.get('backend', 'torch')}, "
          f"query precision {res.get('query_precision', 'fp32')}"
          + (f" (every encoder on it after {res['runtime_wait_s']:.0f} s)" if "runtime_wait_s" in res else "")
          + "; closed loop on 127.0.0.1, client and server share the "
          f"machine's cores. QPS = median over rounds; latency percentiles pool the rounds.\n\n"
          f"{table}\n### Time breakdown, 8 encoders (mean ms per request)\n\n"
          "HTTP+client = client-measured latency minus the server's `took_ms`; queue/encode/search from "
          f"the response's `timings`.\n\n{btable}")
    w.write(res, md)
