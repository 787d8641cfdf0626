"""What the load benchmarks share: the Debian workload, stamped indexes, random LoRA encoders, a
``qswap serve`` child process and its requests. Benchmarks import these, not each other."""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from qswap import DEFAULT_MODEL
from qswap.bench.processes import ServerProcess, free_port, http_json
from qswap.bench.stats import summarize
from qswap.bench.loadgen import LoadResult, Request
from qswap.errors import InvalidInputError, NotFoundError

MODEL = DEFAULT_MODEL
QUERY_LANGS = ("en", "de", "fr", "it")
_HDR = (("Content-Type", "application/json"),)


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
        from qswap.demo import demo_documents
        rows = demo_documents()
        docs = [Document(r["id"], r["text"], {"section": r.get("section", "")}) for r in rows]
        queries = [r.get("title") or r["text"][:80] for r in rows]
        rng.shuffle(queries)
        return Workload(docs, queries[:max_queries], f"demo corpus ({len(docs)} Debian descriptions, demo_corpus.jsonl)")
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
    from qswap.index import IndexConfig, create_index, open_index

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
    info = open_index(idx_dir, read_only=True)
    meta = {"documents": n, "config": info.config.to_dict(), "build_s": build_s}
    info.close()
    (root / "done").write_text(json.dumps(meta, indent=2))
    return idx_dir, vec_path, ids_path


def index_meta(idx_dir: Path) -> dict[str, Any]:
    """What :func:`stamped_index` recorded about an index (config, build time)."""
    return json.loads((Path(idx_dir).parent / "done").read_text())


def lora_encoders(base: Any, names: list[tuple[str, str]], *, rank: int = 32, seed: int = 0,
                  scale: float = 0.02, tag: str = "") -> Path:
    """Encoder directories ``<root>/<name>-<version>`` of random LoRA adapters on every Linear
    (:func:`~qswap.bench.data.encoders.random_lora_encoder`, cached); returns root."""
    from qswap.bench.data.encoders import random_lora_encoder

    root = cache_dir() / f"lora2-r{rank}-s{seed}-{tag or len(names)}-{base.space.fingerprint[:10]}"
    for i, (name, version) in enumerate(names):
        if not (root / f"{name}-{version}" / "manifest.json").is_file():
            random_lora_encoder(base, root / f"{name}-{version}", name, rank=rank, seed=seed * 1000 + i, scale=scale,
                                version=version, training={"note": "random LoRA adapter for benchmarks"})
    return root


def merged_models(base: Any, enc_root: Path, keys: list[tuple[str, str]], onnx: bool = True) -> dict[str, Path]:
    """Full model directories, one per domain: the base with that domain's adapter merged (cached),
    with (``onnx``) its merged ONNX export under ``onnx/``: the one-model-per-domain way of the
    naive baseline and of peers such as Infinity.

    Args:
        base: the base model the adapters were made against.
        enc_root: encoder folders ``<root>/<name>-<version>`` (see :func:`lora_encoders`).
        keys: (name, version) of each domain.
        onnx: also export each merged model as qswap's ``--backend onnx`` does.

    Returns:
        ``{name: model folder}`` (config, tokenizer, ``model.safetensors``; ``onnx/model.onnx``).
    """
    import torch
    from safetensors.torch import save_file

    from qswap.encoders import EncoderPool, load_encoder

    root = cache_dir() / f"naive-models-{enc_root.name}"
    out = {name: root / name for name, _ in keys}
    todo = [(n, v) for n, v in keys if not (root / n / "done").is_file()
            or (onnx and not (root / n / "onnx" / "done").is_file())]
    if not todo:
        return out
    pool = EncoderPool(base)
    for name, version in todo:
        if (root / name / "done").is_file():
            pool.add(load_encoder(enc_root / f"{name}-{version}", base.space))
            _export_domain(base, pool, f"{name}@{version}", root / name / "onnx")
            pool.remove(f"{name}@{version}")
            continue
        d = root / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        pool.add(load_encoder(enc_root / f"{name}-{version}", base.space))
        state = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in
                 pool.merged_state_dict(f"{name}@{version}").items()}
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        del state
        pool.remove(f"{name}@{version}")
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (base.path / f).is_file():
                shutil.copyfile(base.path / f, d / f)
        (d / "done").write_text("merged from " + str(enc_root / f"{name}-{version}"))
        if onnx:
            pool.add(load_encoder(enc_root / f"{name}-{version}", base.space))
            _export_domain(base, pool, f"{name}@{version}", d / "onnx")
            pool.remove(f"{name}@{version}")
    return out


def _export_domain(base: Any, pool: Any, key: str, out: Path) -> None:
    """The domain's merged model as an ONNX graph, exported and checked as qswap's ``--backend onnx``
    exports are (same code, transformer fusions on)."""
    from qswap.encoders.runtime.onnx_export import export_onnx, own_tensors

    shutil.rmtree(out, ignore_errors=True)
    facts = export_onnx(base, own_tensors(base, pool.merged_state_dict(key)), out, optimize_for="cpu")
    (out / "done").write_text(json.dumps(facts))


def qswap_command() -> list[str]:
    """``qswap`` of this environment (the script next to the interpreter, else ``python -m qswap.cli``)."""
    script = Path(sys.executable).parent / "qswap"
    return [str(script)] if script.exists() else [sys.executable, "-m", "qswap.cli"]


def qswap_server(index: Path, encoders_root: Path, state_dir: Path, log_path: Path, *, model: str = MODEL,
                 extra: list[str] | None = None, port: int | None = None, command: list[str] | None = None,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """A ``qswap serve`` child process on 127.0.0.1 (not started yet); ``command`` and ``env`` run
    another code version (:func:`qswap.bench.revisions.arm_command`), default this one."""
    port = port or free_port()
    shutil.rmtree(state_dir, ignore_errors=True)
    state_dir.mkdir(parents=True)
    cmd = (command or qswap_command()) + ["serve", "--host", "127.0.0.1", "--port", str(port), "--index", str(index),
                             "--read-only-index", "--model", model, "--device", "cpu", "--encoders-root",
                             str(encoders_root), "--state-dir", str(state_dir), "--insecure",
                             "--log-format", "text", *(extra or [])]
    return ServerProcess(cmd, port, ready_path="/readyz", log_path=log_path, env=env)


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


def embedding_requests(texts: list[str], models: list[str], prefix: str = "") -> Callable[[int], Request]:
    """Request ``i`` for an OpenAI-style embeddings route: one text, model ``models[i % m]``.

    Args:
        texts: query texts, used in turn.
        models: model names, round-robin.
        prefix: prepended to every text (Infinity adds no query prefix itself).

    Returns:
        ``make(i) -> Request`` for the load generator (bodies made once, up front).
    """
    pre = [[json.dumps({"input": [prefix + t], "model": m, "encoding_format": "float"}).encode() for m in models]
           for t in texts]
    n, m = len(texts), len(models)

    def make(i: int) -> Request:
        return Request("POST", "/embeddings" if prefix else "/v1/embeddings", pre[i % n][i % m], _HDR, models[i % m])
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


#: The server's count of background builds started (graphs, sessions, merged exports).
BUILDS_METRIC = "qswap_runtime_builds_total"


def builds_started(srv: ServerProcess) -> dict[str, int]:
    """How many runtimes ``srv`` has started building in the background, by kind (``/metrics``).

    Raises:
        InvalidInputError: ``/metrics`` did not answer 200.
    """
    status, body = http_json("GET", srv.url("/metrics"), None, timeout=30)
    if status != 200:
        raise InvalidInputError(f"GET /metrics answered {status}", "is this a qswap server without metrics auth?")
    out: dict[str, int] = {}
    for line in str(body).splitlines():
        if line.startswith(BUILDS_METRIC + '{kind="'):
            kind, _, value = line[len(BUILDS_METRIC) + 7:].partition('"} ')
            out[kind] = int(float(value))
    return out


def builds_between(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The kinds of build started between two :func:`builds_started` reads."""
    return sorted(k for k, n in after.items() if n != before.get(k, 0))


def wait_until_built(srv: ServerProcess, timeout_s: float = 900.0, seen: list[str] | None = None) -> None:
    """Poll ``GET /readyz`` until its ``warming`` list is empty; the kinds it listed are appended to
    ``seen``.

    Raises:
        InvalidInputError: ``/readyz`` did not answer 200, or builds were still running after ``timeout_s``.
    """
    t0 = time.perf_counter()
    while True:
        status, body = http_json("GET", srv.url("/readyz"))
        if status != 200:
            raise InvalidInputError(f"GET /readyz answered {status}: {body}", "see the server log")
        building = body.get("warming", [])
        if not building:
            return
        if seen is not None:
            seen += [b for b in building if b not in seen]
        if time.perf_counter() - t0 > timeout_s:
            raise InvalidInputError(f"still building {', '.join(building)} after {timeout_s:.0f} s",
                                    "see the server log")
        time.sleep(0.5)


def warm_until_settled(srv: ServerProcess, make: Any, *, concurrency: int, requests: int,
                       timeout_s: float = 900.0) -> dict[str, Any]:
    """Warm-up traffic until the server builds nothing more in the background.

    Some of qswap's runtimes are built only once traffic needs them (the segment graph and the
    mixed-batch session at the first batches that mix encoders; a hot encoder's merged graph),
    and answers run on a slower path meanwhile: timing must not start before they are ready.
    Each round sends ``requests`` requests at ``concurrency`` (the traffic to be timed, at its
    highest concurrency, so that every batch shape it makes comes up), then waits while ``GET
    /readyz`` lists builds in ``warming``; a round that started no build (the server's
    :data:`BUILDS_METRIC` unchanged) ends it.

    Args:
        srv: the server.
        make: ``make(i) -> Request`` of the traffic to be timed.
        concurrency: connections of the warm-up.
        requests: requests per round.
        timeout_s: the longest wait in all.

    Returns:
        ``{"seconds", "rounds", "waited_for": [kinds of builds seen]}``.

    Raises:
        InvalidInputError: a request failed, ``/readyz`` did not answer 200, or builds were still
            running after ``timeout_s``.
    """
    from qswap.bench.load_options import warm_up
    t0 = time.perf_counter()
    seen: list[str] = []
    rounds = 0
    while True:
        rounds += 1
        before = builds_started(srv)
        res = warm_up(srv.port, make, concurrency=concurrency, requests=requests, duration_s=timeout_s)
        if res.failed:
            raise InvalidInputError(f"warm-up requests failed: {res.errors()} {res.statuses()}", "see the server log")
        wait_until_built(srv, max(timeout_s - (time.perf_counter() - t0), 0.0), seen)
        if builds_started(srv) == before:
            return {"seconds": time.perf_counter() - t0, "rounds": rounds, "waited_for": seen}


def time_settled(servers: list[ServerProcess], time_it: Any, *, retimes: int = 3,
                 timeout_s: float = 900.0) -> tuple[Any, dict[str, Any]]:
    """``time_it()`` on servers that build nothing while it runs.

    Warm-up cannot promise that every batch shape of the timed traffic came up (batches form by
    arrival), so a timing during which any of ``servers`` started a build (:data:`BUILDS_METRIC`
    moved) is thrown away: the builds are awaited and it runs again. Each kind of build starts at
    most once per server, so a few runs settle it; after ``retimes`` runs again, the last is kept
    and said to be unsettled.

    Returns:
        ``(what time_it returned, {"retimed": runs thrown away, "thrown_for": [the kinds built during
        each], "built_during": bool, "built": [kinds, when built_during]})``.
    """
    attempt = 0
    thrown: list[list[str]] = []   # the kinds built during each timing thrown away
    while True:
        before = [builds_started(s) for s in servers]
        got = time_it()
        moved = {s.port: kinds for s, b in zip(servers, before) if (kinds := builds_between(b, builds_started(s)))}
        built = sorted({k for kinds in moved.values() for k in kinds})
        if not moved or attempt == retimes:
            return got, {"retimed": attempt, "built_during": bool(moved), "thrown_for": thrown,
                         **({"built": built} if moved else {})}
        attempt += 1
        thrown.append(built)
        for s in servers:
            if s.port in moved:
                wait_until_built(s, timeout_s)
        print(f"qswap started building {', '.join(built)} during timing: timed again", file=sys.stderr)
