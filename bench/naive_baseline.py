"""qswap side by side with the usual way: one full model per domain behind FastAPI + FAISS.

``qswap bench baseline`` starts two servers as child processes on 127.0.0.1 and loads them
alternately with the same mixed traffic (8 domains by default, round-robin), at several concurrency
levels:

- qswap: ``qswap serve`` with 8 LoRA encoders over one shared base (cross-domain batches);
- naive: this module's FastAPI app (``python -m qswap.bench.naive_baseline``), which loads a
  complete model per domain (its own copy of every weight; no shared base), encodes each
  request's query on its own in the request's thread (no batching across requests or domains)
  and searches one ``faiss.IndexFlatIP``. By default (``--naive-runtime onnx``) each domain
  model is the same fast runtime qswap's merged exports use: a merged ONNX Runtime graph per
  domain (transformer fusions on, checked against torch) with the domain's own word-embedding
  table; ``--naive-runtime torch`` loads each as a sentence-transformers model instead.

Both serve the same functions: each naive domain model is the base with that domain's LoRA
adapter merged in, both search the same vectors exactly (qswap: flat fp32 index; naive:
IndexFlatIP over the same float16-rounded rows), and the benchmark checks that they return
the same top 10. Reported: QPS and p99 ratios per level (median and spread over rounds) and
resident memory (RSS) per domain.

The naive app shares one document index between domains, which flatters it: a model
fine-tuned per domain changes the document space too, so each domain would need its own
re-embedded index (another ``n_docs * dim * 4`` bytes and a full re-embedding).

Serve the naive app alone::

    python -m qswap.bench.naive_baseline --port 8101 --embeddings docs.npy \\
        --corpus docs.jsonl --domain legal=/models/legal --domain medical=/models/medical

``POST /search`` takes ``{"domain", "query", "k"}`` and returns ``{"hits": [{"id", "score",
"text"}], "timings_ms": {"encode", "search"}}``; ``GET /stats`` reports the process's RSS
after loading each domain (``/proc/self/status``).
"""

# No ``from __future__ import annotations``: FastAPI must see the request model class itself.
import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from qswap.bench.processes import rss_bytes
from qswap.bench.load_options import ByMode, LoadDefaults, add_load_arguments, add_model_argument

QUERY_PREFIX = "query: "
#: How the naive server runs each domain's merged model: its ONNX graph, or sentence-transformers.
RUNTIMES = ("onnx", "torch")


def _load_docs(path: Path | None, n: int) -> tuple[list[str], list[str]]:
    """(ids, texts) of the first ``n`` JSONL lines (row numbers as ids where a line has none)."""
    ids: list[str] = []
    texts: list[str] = []
    if path is not None:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if len(texts) >= n:
                    break
                if line.strip():
                    d = json.loads(line)
                    ids.append(str(d.get("id", d.get("_id", len(ids)))))
                    texts.append(d.get("text", ""))
    ids += [str(i) for i in range(len(ids), n)]
    texts += [""] * (n - len(texts))
    return ids, texts


class _OnnxDomain:
    """One domain on ONNX Runtime: its merged graph (``<dir>/onnx/model.onnx``), its own copy of the
    word-embedding table (read from its full ``model.safetensors``) and the tokenizer."""

    def __init__(self, path: Path, threads: int) -> None:
        import numpy as np
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        from qswap.encoders.runtime.onnx import available_providers, make_session

        state = load_file(str(path / "model.safetensors"))
        table = [k for k in state if k.endswith("word_embeddings.weight")]
        self.table = np.ascontiguousarray(state[table[0]], dtype=np.float32)
        del state
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.enable_truncation(512)
        pad = json.loads((path / "config.json").read_text()).get("pad_token_id") or 0
        self.tokenizer.enable_padding(pad_id=pad)
        # Requests run concurrently in FastAPI's thread pool, each its own forward: spinning
        # workers would steal the cores other requests' forwards need.
        self.session = make_session(path / "onnx" / "model.onnx", threads, available_providers(), spin=False)

    def encode(self, texts: list[str], normalize_embeddings: bool = True, **_: Any) -> Any:
        import numpy as np
        enc = self.tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in enc], dtype=np.int64)
        mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
        return self.session.run(["embedding"], {"inputs_embeds": np.take(self.table, ids, axis=0),
                                                "attention_mask": mask})[0]


def create_app(domains: dict[str, Path], embeddings: Path, corpus: Path | None = None,
               query_prefix: str = QUERY_PREFIX, runtime: str = "onnx", threads: int | None = None) -> Any:
    """The naive FastAPI app: ``domains`` maps a name to a full model dir (see :func:`qswap.bench.fixtures.merged_models`);
    ``runtime``: ``onnx`` (its merged ONNX graph) or ``torch`` (sentence-transformers)."""
    import faiss
    import numpy as np
    from fastapi import FastAPI, HTTPException
    from pydantic import BaseModel

    vectors = np.ascontiguousarray(np.load(embeddings), dtype=np.float32)
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    del vectors
    ids, texts = _load_docs(corpus, index.ntotal)
    rss = {"after_index": rss_bytes(os.getpid())}
    models: dict[str, Any] = {}
    load_seconds: dict[str, float] = {}
    for name, path in domains.items():
        t0 = time.perf_counter()
        # Each domain gets its own full model: a fine-tuned copy per domain is the usual way.
        if runtime == "onnx":
            models[name] = _OnnxDomain(Path(path), threads or os.cpu_count() or 1)
        else:
            from sentence_transformers import SentenceTransformer
            models[name] = SentenceTransformer(str(path), device="cpu")
        load_seconds[name] = time.perf_counter() - t0
        gc.collect()
        rss[f"after_{name}"] = rss_bytes(os.getpid())

    app = FastAPI(title="naive baseline")

    class SearchBody(BaseModel):
        domain: str
        query: str
        k: int = 10

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "domains": sorted(models)}

    @app.get("/stats")
    def stats() -> dict[str, Any]:
        return {"rss_bytes": rss_bytes(os.getpid()), "rss_after": rss, "load_seconds": load_seconds,
                "domains": list(models), "docs": int(index.ntotal), "runtime": runtime}

    # A plain ``def`` endpoint: FastAPI runs it in its thread pool, as most such apps do.
    @app.post("/search")
    def search(body: SearchBody) -> dict[str, Any]:
        model = models.get(body.domain)
        if model is None:
            raise HTTPException(404, f"unknown domain {body.domain!r}")
        t0 = time.perf_counter()
        q = model.encode([query_prefix + body.query], normalize_embeddings=True, convert_to_numpy=True,
                         show_progress_bar=False)
        t1 = time.perf_counter()
        scores, rows = index.search(np.asarray(q, dtype=np.float32), body.k)
        t2 = time.perf_counter()
        hits = [{"id": ids[int(i)], "score": float(s), "text": texts[int(i)]}
                for s, i in zip(scores[0], rows[0]) if i >= 0]
        return {"hits": hits, "timings_ms": {"encode": (t1 - t0) * 1e3, "search": (t2 - t1) * 1e3}}

    return app


# --------------------------------------------------------------------------- the benchmark

NAME = "baseline"
N_DOMAINS = 8
#: Load options of ``qswap bench baseline``: full run and ``--quick``.
LOAD = LoadDefaults(levels=ByMode((1, 8, 32), (1, 4)), seconds=ByMode(8.0, 2.0), requests=ByMode(2000, 30),
                    rounds=ByMode(3, 1), rounds_help="alternating rounds per level")
DOMAINS = ByMode(N_DOMAINS, 2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench baseline``."""
    from qswap.bench.fixtures import MODEL
    add_load_arguments(p, LOAD)
    p.add_argument("--domains", type=int, default=None, help=f"domains ({DOMAINS.describe()})")
    p.add_argument("--naive-runtime", choices=RUNTIMES, default="onnx",
                   help="the naive server's runtime: one merged ONNX Runtime graph per domain (the fast runtime "
                        "qswap uses, so the comparison is fair) or one sentence-transformers model per domain")
    add_model_argument(p, MODEL)


def _agreement(qs_srv: Any, nv_srv: Any, queries: list[str], domains: list[str], n: int) -> dict[str, Any]:
    """Mean overlap of the top 10 ids of both servers for the same (query, domain) pairs."""
    from qswap.bench.processes import http_json
    overlaps, top1 = [], []
    for i in range(n):
        q, d = queries[i % len(queries)], domains[i % len(domains)]
        _, a = http_json("POST", qs_srv.url("/v1/search"), {"query": q, "encoder": f"{d}@1", "k": 10, "with_text": False})
        _, b = http_json("POST", nv_srv.url("/search"), {"query": q, "domain": d, "k": 10})
        ia = [h["id"] for h in a["results"][0]["hits"]]
        ib = [h["id"] for h in b["hits"]]
        overlaps.append(len(set(ia) & set(ib)) / 10)
        top1.append(float(bool(ia) and bool(ib) and ia[0] == ib[0]))
    return {"pairs": n, "mean_overlap_at_10": sum(overlaps) / n, "top1_same": sum(top1) / n}


def run(args: argparse.Namespace) -> int:
    """``qswap bench baseline``."""
    from qswap.bench.load_options import LoadOptions, RunDirs, warm_up
    from qswap.bench.processes import ServerProcess, free_port, http_json
    from qswap.bench.stats import interleaved, ratio_summary, summarize
    from qswap.bench.loadgen import Request
    from qswap.bench.fixtures import (index_meta, load_space_base, load_workload, lora_encoders, merged_models, qswap_server,
                                      register, search_requests, stamped_index, time_settled, wait_for_runtime,
                                      warm_until_settled)
    from qswap.index import IndexConfig

    opts = LoadOptions.from_args(args, LOAD)
    quick, levels = opts.quick, opts.levels
    n_dom = args.domains or DOMAINS.pick(quick)
    dirs = RunDirs.create(NAME, quick, args.out)
    tmp = dirs.tmp

    work = load_workload(quick)
    base = load_space_base(args.model)
    # Exact search on both sides, so the comparison is about serving, not about the index.
    idx_dir, vec_path, docs_path = stamped_index(work, base, tag="flat",
                                                 config=IndexConfig(kind="flat", quant="fp32", rescore=False))
    keys = [(f"d{i}", "1") for i in range(n_dom)]
    domains = [n for n, _ in keys]
    enc_root = lora_encoders(base, keys)
    models = merged_models(base, enc_root, keys, onnx=args.naive_runtime == "onnx")
    del base
    qs = qswap_server(idx_dir, enc_root, tmp / "state", tmp / "qswap.log", model=args.model)
    nv_port = free_port()
    nv_cmd = [sys.executable, "-m", "qswap.bench.naive_baseline", "--port", str(nv_port), "--embeddings",
              str(vec_path), "--corpus", str(docs_path), "--runtime", args.naive_runtime] + [a for d in domains for a in ("--domain", f"{d}={models[d]}")]
    nv = ServerProcess(nv_cmd, nv_port, ready_path="/health", log_path=tmp / "naive.log")
    res: dict[str, Any] = {"workload": work.source, "index": index_meta(idx_dir),
                           "vectors": "synthetic clustered unit vectors stamped with the model's space",
                           "domains": n_dom, "naive_runtime": args.naive_runtime, "levels": levels, "seconds_per_run": opts.seconds,
                           "max_requests_per_run": opts.requests, "rounds": opts.rounds}
    with qs:
        # Marginal memory of one more domain, measured alike on both sides: qswap's RSS with
        # one encoder registered and used vs with all of them (naive: first vs last model).
        qkeys = [f"{n}@{v}" for n, v in keys]
        qreq = search_requests(work.queries, qkeys)
        rss_q0 = qs.rss()
        register(qs, f"{keys[0][0]}-{keys[0][1]}")
        warm_up(qs.port, search_requests(work.queries, qkeys[:1]), concurrency=4, requests=64, duration_s=60)
        rss_q1 = qs.rss()
        for n, v in keys[1:]:
            register(qs, f"{n}-{v}")
        # Timed only once every encoder runs on the default (shared ONNX) runtime, as the naive
        # side's exports are all made before it starts.
        res["qswap_runtime_wait_s"] = wait_for_runtime(qs, ["base", *qkeys], "onnx-shared")
        warm_up(qs.port, qreq, concurrency=4, requests=64, duration_s=60)
        rss_q8 = qs.rss()
        _, enc_list = http_json("GET", qs.url("/v1/encoders"))
        adapter_bytes = [e.get("memory_bytes") for e in enc_list["encoders"] if e["key"] in qkeys]
        with nv:
            pre = [[json.dumps({"query": q, "domain": d, "k": 10}).encode() for d in domains] for q in work.queries]
            hdr = (("Content-Type", "application/json"),)

            def nreq(i: int) -> Request:
                return Request("POST", "/search", pre[i % len(pre)][i % n_dom], hdr, domains[i % n_dom])
            warm_up(nv.port, nreq, concurrency=4, requests=64, duration_s=60)
            _, nstats = http_json("GET", nv.url("/stats"))
            # Both warmed at the highest level timed, as `qswap bench peer` does: qswap builds its
            # mixed-batch runtimes (segment graph, single-threaded group session) at the first
            # batches that need them, and a timing must not include those builds.
            top = max(levels)
            warm_n = opts.settle_requests()
            res["qswap_settled"] = warm_until_settled(qs, qreq, concurrency=top, requests=warm_n)
            warm_up(nv.port, nreq, concurrency=top, requests=warm_n, duration_s=60)
            res["agreement"] = _agreement(qs, nv, work.queries, domains, 16 if quick else 64)
            res["servers"] = {"qswap": {"command": qs.command, "start_s": qs.start_seconds},
                              "naive": {"command": nv.command, "start_s": nv.start_seconds}}

            def time_levels() -> dict[str, dict[int, list[Any]]]:
                per: dict[str, dict[int, list[Any]]] = {"qswap": {}, "naive": {}}
                for c in levels:
                    arms = {"qswap": lambda c=c: opts.run(qs.port, qreq, c),
                            "naive": lambda c=c: opts.run(nv.port, nreq, c)}
                    got = interleaved(arms, rounds=opts.rounds, warmup=0)
                    for a, rs in got.items():
                        per[a][c] = rs
                    print(f"c={c}: qswap {[round(r.qps, 1) for r in got['qswap']]} naive "
                          f"{[round(r.qps, 1) for r in got['naive']]} qps", file=sys.stderr)
                return per

            # A timing during which qswap started a build is thrown away and run again.
            per, settled = time_settled([qs], time_levels)
            res["qswap_retimed"], res["qswap_built_during_timing"] = settled["retimed"], settled["built_during"]
            rss_q_end, rss_n_end = qs.rss(), nv.rss()
            pss_q_end, pss_n_end = qs.pss(), nv.pss()
    after = nstats["rss_after"]
    res["memory"] = {
        "qswap": {"rss_base_and_index": rss_q0, "rss_with_1_encoder": rss_q1, "rss_with_all_encoders": rss_q8,
                  "rss_end": rss_q_end, "pss_end": pss_q_end,
                  "per_domain_bytes": (rss_q8 - rss_q1) / max(n_dom - 1, 1),
                  "adapter_bytes_reported": adapter_bytes},
        "naive": {"rss_after_index": after["after_index"], "rss_after_domains": after,
                  "rss_end": rss_n_end, "pss_end": pss_n_end,
                  "per_domain_bytes": (after[f"after_{domains[-1]}"] - after[f"after_{domains[0]}"])
                  / max(n_dom - 1, 1),
                  "model_file_bytes": (models[domains[0]] / "model.safetensors").stat().st_size},
    }
    res["levels_detail"] = {}
    for c in levels:
        q, n = per["qswap"][c], per["naive"][c]
        p99 = lambda r: summarize(r.latencies_ms())["p99"]  # noqa: E731
        res["levels_detail"][str(c)] = {
            "qswap": {"qps_rounds": [r.qps for r in q], "latency_ms": summarize([x for r in q for x in r.latencies_ms()]),
                      "failed": sum(r.failed for r in q)},
            "naive": {"qps_rounds": [r.qps for r in n], "latency_ms": summarize([x for r in n for x in r.latencies_ms()]),
                      "failed": sum(r.failed for r in n)},
            "qps_ratio_qswap_over_naive": ratio_summary([r.qps for r in q], [r.qps for r in n]).to_dict(),
            "p99_ratio_naive_over_qswap": ratio_summary([p99(r) for r in n], [p99(r) for r in q]).to_dict(),
        }
    _write(dirs.writer, res, levels)
    dirs.clean_scratch()
    print(f"wrote {dirs.out}")
    return 0


def _write(w: Any, res: dict[str, Any], levels: list[int]) -> None:
    from qswap.bench.results import md_table
    from qswap.bench.plots import plot_bars, plot_lines
    d = res["levels_detail"]
    qps = {a: [sorted(d[str(c)][a]["qps_rounds"])[len(d[str(c)][a]["qps_rounds"]) // 2] for c in levels]
           for a in ("qswap", "naive")}
    bands = {a: ([min(d[str(c)][a]["qps_rounds"]) for c in levels], [max(d[str(c)][a]["qps_rounds"]) for c in levels])
             for a in ("qswap", "naive")}
    plot_lines(w.plot_path("qps.png"), levels, qps, xlabel="concurrent connections", ylabel="successful requests / s",
               title=f"{res['domains']} domains, mixed traffic: qswap vs one model per domain", logx=True, bands=bands)
    plot_lines(w.plot_path("p99.png"), levels, {a: [d[str(c)][a]["latency_ms"]["p99"] for c in levels]
                                                for a in ("qswap", "naive")},
               xlabel="concurrent connections", ylabel="p99 latency (ms)", title="p99 latency", logx=True, logy=True)
    m = res["memory"]
    mib = 2.0 ** 20
    plot_bars(w.plot_path("memory.png"), ["per domain", "whole process"],
              {"qswap": [m["qswap"]["per_domain_bytes"] / mib, m["qswap"]["rss_end"] / mib],
               "naive": [m["naive"]["per_domain_bytes"] / mib, m["naive"]["rss_end"] / mib]},
              ylabel="MiB (RSS)", title=f"Resident memory, {res['domains']} domains")
    rows = []
    for c in levels:
        x = d[str(c)]
        r, p = x["qps_ratio_qswap_over_naive"], x["p99_ratio_naive_over_qswap"]
        rows.append([c, qps["qswap"][levels.index(c)], qps["naive"][levels.index(c)],
                     f"**{r['median']:.2f}x** ({r['p25']:.2f}-{r['p75']:.2f}, range {r['min']:.2f}-{r['max']:.2f})",
                     x["qswap"]["latency_ms"]["p99"], x["naive"]["latency_ms"]["p99"],
                     f"**{p['median']:.2f}x** ({p['min']:.2f}-{p['max']:.2f})",
                     x["qswap"]["failed"] + x["naive"]["failed"]])
    table = md_table(["conc.", "qswap QPS", "naive QPS", "QPS ratio qswap/naive (IQR, range)", "qswap p99 ms",
                      "naive p99 ms", "p99 ratio naive/qswap (range)", "failed"], rows)
    ab = [b for b in m["qswap"]["adapter_bytes_reported"] if b]
    mem = md_table(["", "qswap", "naive"], [
        ["RSS added per extra domain (MiB)", m["qswap"]["per_domain_bytes"] / mib, m["naive"]["per_domain_bytes"] / mib],
        ["weights per domain (MiB): adapter (server's count) / full model file",
         (sum(ab) / len(ab) / mib) if ab else float("nan"), m["naive"]["model_file_bytes"] / mib],
        [f"RSS of the process, {res['domains']} domains, end (MiB)", m["qswap"]["rss_end"] / mib, m["naive"]["rss_end"] / mib],
        ["PSS at end (MiB)", (m["qswap"]["pss_end"] or 0) / mib, (m["naive"]["pss_end"] or 0) / mib],
    ])
    a = res["agreement"]
    runtime = res.get("naive_runtime", "torch")
    goals = []
    for c, target in ((min(levels), 1.0), (max(levels), 1.2)):
        r = d[str(c)]["qps_ratio_qswap_over_naive"]["median"]
        goals.append(f"QPS ratio at concurrency {c} = {r:.2f}x (target >= {target}x: {'met' if r >= target else '**missed**'})")
    share = m["qswap"]["per_domain_bytes"] / m["naive"]["per_domain_bytes"] if m["naive"]["per_domain_bytes"] else float("nan")
    goals.append(f"memory per extra domain, qswap / naive = {100 * share:.1f} % (target <= 5 %: "
                 f"{'met' if share <= 0.05 else '**missed**'})")
    md_runtime = ("Naive runtime: **one merged ONNX Runtime graph per domain** (the export qswap's `--backend onnx` "
                  "makes: LoRA merged, transformer fusions on, checked against torch; its own word-embedding table), "
                  "intra-op threads = all cores, no spinning (requests run concurrently in FastAPI's thread pool). "
                  "qswap: its default backend (one shared ONNX Runtime session, adapters bound per run)."
                  if runtime == "onnx" else "Naive runtime: one sentence-transformers (torch) model per domain.")
    md = (md_runtime + "\n\n" + "; ".join(goals) + ".\n\n"
          f"Workload: {res['workload']}; {res['index']['documents']:,} documents, **{res['vectors']}**; "
          f"both servers search them exactly (qswap flat fp32, naive faiss.IndexFlatIP). {res['domains']} domains, "
          "requests round-robin over them. Same answers: mean top-10 overlap "
          f"{a['mean_overlap_at_10']:.3f}, same top hit {a['top1_same']:.3f} over {a['pairs']} (query, domain) pairs.\n\n"
          f"Each level: {res['rounds']} rounds per server, alternating (A B B A ...), each at most "
          f"{res['max_requests_per_run']} requests or {res['seconds_per_run']:g} s, closed loop on 127.0.0.1. "
          "Ratios are per round pair: median, quartiles and range.\n\n"
          f"{table}\n### Memory\n\nPer extra domain: qswap = RSS growth from one registered and used encoder to "
          "all of them, divided by the extra ones; naive = RSS growth from the first loaded model to the last, "
          "likewise. RSS counts only resident pages: weights read lazily from a memory-mapped file are not all "
          "counted, which is why a naive domain can cost less RSS than its model file. The naive app shares one document index "
          "between domains (flattering it: per-domain fine-tuned models would each need their own re-embedded index).\n\n"
          f"{mem}")
    w.write(res, md)


def _domain(value: str) -> tuple[str, Path]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=MODEL_DIR, got {value!r}")
    return name, Path(path)


def main(argv: list[str] | None = None) -> int:
    """Serve the naive baseline (``python -m qswap.bench.naive_baseline ...``)."""
    p = argparse.ArgumentParser(prog="python -m qswap.bench.naive_baseline",
                                description="Serve the naive baseline: one full model per domain, FastAPI + FAISS.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8101)
    p.add_argument("--embeddings", type=Path, required=True, help=".npy (n_docs, dim) float32 document vectors")
    p.add_argument("--corpus", type=Path, default=None, help="JSONL whose line i is document i (for hit texts)")
    p.add_argument("--domain", type=_domain, action="append", required=True, metavar="NAME=MODEL_DIR")
    p.add_argument("--runtime", choices=RUNTIMES, default="onnx",
                   help="onnx: each domain's merged graph MODEL_DIR/onnx/model.onnx; torch: sentence-transformers")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all cores)")
    args = p.parse_args(argv)
    import uvicorn
    app = create_app(dict(args.domain), args.embeddings, args.corpus, runtime=args.runtime, threads=args.threads)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
