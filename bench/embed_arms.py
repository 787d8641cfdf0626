"""``qswap bench embed`` arms: document-embedding runtimes and precisions side by side.

On the same documents (the first ``--docs`` of a Debian BEIR corpus), in one process, rounds
alternating the arms' order:

- ``gemm fp32`` / ``gemm bf16``: a 2048x2048 matrix product on the same threads (torch), the
  roofline the cores give;
- ``torch fp32 (before)``: ``BaseEncoder.encode_documents`` (torch eager, batches of 64), what
  every document was embedded with before the document tower moved to
  :class:`~qswap.encoders.runtime.documents.DocumentEncoder`;
- ``torch bf16 autocast (before)``: the same under ``--precision bf16`` before (autocast);
- ``onnx fp32 (default)``, ``torch fp32 (reference)``, ``torch bf16``: the document encoder at each
  runtime/precision (token-budget batches, producer thread; bf16: Linear layers in bf16);
- ``onnx int8 dynamic`` / ``onnx int8 selective``: ONNX Runtime's dynamic quantisation of the
  fused graph (all MatMuls; only the feed-forward up-projections), measured to show why int8 is
  not offered;
- Infinity (``--infinity``): its ONNX Runtime (``optimum``) engine, its fastest on CPU, on the same weights,
  in its own virtualenv (:mod:`qswap.bench.infinity_peer`).

Per arm: docs/s, tokens/s, effective GFLOP/s (model arithmetic of the real tokens) and its
fraction of the fp32 / bf16 roofline; quality against torch fp32: min and mean cosine and
recall@10 of the fp32 top-10 over these documents for real queries in en/de/fr/it (the bar:
min cosine >= 0.9999 and recall@10 >= 0.995).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from qswap.bench.int8_graphs import quantized_graph
from qswap.bench.results import md_table

LANGS = ("en", "de", "fr", "it")
BAR = {"min_cosine": 0.9999, "recall_at_10": 0.995}


def read_corpus(beir: Path, n: int) -> tuple[list[str], list[str]]:
    """(ids, texts) of the first ``n`` documents of ``beir/corpus.jsonl``."""
    ids, texts = [], []
    with open(beir / "corpus.jsonl", encoding="utf-8") as f:
        for line in f:
            if len(ids) >= n:
                break
            if line.strip():
                r = json.loads(line)
                title = r.get("title") or ""
                ids.append(r["_id"])
                texts.append(f"{title}\n{r['text']}" if title else r["text"])
    return ids, texts


def read_queries(beir: Path, per_lang: int) -> dict[str, list[str]]:
    """Up to ``per_lang`` query texts per language present in ``beir``."""
    out = {}
    for lang in LANGS:
        p = beir / f"queries-{lang}.jsonl"
        if p.is_file():
            with open(p, encoding="utf-8") as f:
                out[lang] = [json.loads(line)["text"] for line, _ in zip(f, range(per_lang))]
    return out


def model_flops(base: Any, lengths: list[int]) -> float:
    """Arithmetic (FLOP) of the transformer on documents of these real token lengths."""
    cfg = base.model.config
    d, ff, layers = int(cfg.hidden_size), int(cfg.intermediate_size), int(cfg.num_hidden_layers)
    per_token = 2 * layers * (4 * d * d + 2 * d * ff)
    return float(sum(per_token * n + layers * 4 * n * n * d for n in lengths))


def gemm_gflops(dtype: str, threads: int, seconds: float = 1.5) -> float:
    """GFLOP/s of a 2048x2048 matrix product in ``dtype`` on ``threads`` torch threads."""
    import torch
    torch.set_num_threads(threads)
    t = torch.bfloat16 if dtype == "bf16" else torch.float32
    a, b = torch.randn(2048, 2048).to(t), torch.randn(2048, 2048).to(t)
    torch.matmul(a, b)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.matmul(a, b)
        reps += 1
    return 2 * 2048 ** 3 * reps / (time.perf_counter() - t0) / 1e9


_RSS_CHILD = """
import re, sys
from qswap.cli import main
rc = main(sys.argv[1:])
# VmHWM: this process's own peak (ru_maxrss would carry the forking parent's peak across exec).
hwm = re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())
print("MAXRSS_KB", hwm.group(1), flush=True)
sys.exit(rc)
"""


def build_rss(texts: list[str], sizes: list[int], model: str, work: Path) -> dict[str, Any]:
    """Peak RSS of ``qswap index build`` (a child process each) on corpora of ``sizes`` documents.

    The corpora cycle through ``texts`` cut to their first 12 words (distinct ids and a counter
    in each text), so the build's memory, not the model's arithmetic, dominates the time.
    """
    import subprocess
    out: dict[str, Any] = {}
    short = [" ".join(t.split()[:12]) for t in texts]
    for n in sizes:
        corpus = work / f"rss-{n}.jsonl"
        with open(corpus, "w", encoding="utf-8") as f:
            for i in range(n):
                f.write(json.dumps({"id": f"r{i}", "text": f"{short[i % len(short)]} {i}"}) + "\n")
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", _RSS_CHILD, "index", "build", str(corpus), "--out",
                            str(work / f"rss-idx-{n}"), "--model", model, "--no-progress"],
                           capture_output=True, text=True)
        secs = time.perf_counter() - t0
        kb = [int(line.split()[1]) for line in r.stdout.splitlines() if line.startswith("MAXRSS_KB")]
        out[str(n)] = ({"peak_rss_mib": kb[0] / 1024, "seconds": secs, "docs_per_s": n / secs} if r.returncode == 0
                       and kb else {"error": (r.stderr or r.stdout).strip().splitlines()[-1:]})
        shutil.rmtree(work / f"rss-idx-{n}", ignore_errors=True)
        corpus.unlink()
    return out


def quality(ref: np.ndarray, got: np.ndarray, queries: np.ndarray) -> dict[str, float]:
    """Cosine of each document to its reference, and recall@10 of the reference's top-10."""
    cos = (ref * got).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1))
    k = min(10, len(ref))
    top_ref = np.argsort(-(queries @ ref.T), axis=1)[:, :k]
    top_got = np.argsort(-(queries @ got.T), axis=1)[:, :k]
    rec = np.mean([len(set(a) & set(b)) / k for a, b in zip(top_ref, top_got)])
    return {"min_cosine": float(cos.min()), "mean_cosine": float(cos.mean()), "recall_at_10": float(rec)}


def passes(q: dict[str, float]) -> bool:
    """Whether a quality record meets :data:`BAR`."""
    return q["min_cosine"] >= BAR["min_cosine"] and q["recall_at_10"] >= BAR["recall_at_10"]


def run_arms(args: Any, dirs: Any) -> int:
    """Measure every arm (see the module docstring) and write the results."""
    import torch

    from qswap.bench.fixtures import debian_dir
    from qswap.bench.plots import plot_bars
    from qswap.encoders import load_base
    from qswap.encoders.runtime.documents import DocumentEncoder, machine_threads

    threads = args.threads or machine_threads()
    torch.set_num_threads(threads)
    beir = args.beir or debian_dir()
    ids, texts = read_corpus(beir, args.docs)
    n = len(texts)
    base = load_base(args.model)
    pre = base.spec.document_prefix
    lengths = [sum(e.attention_mask) for e in base.tokenizer.encode_batch([pre + t for t in texts])]
    tokens, flops = int(sum(lengths)), model_flops(base, lengths)
    qtexts = read_queries(beir, args.queries_per_lang)
    queries = base.encode_queries([q for qs in qtexts.values() for q in qs], batch_size=64)

    encs = {"onnx fp32 (default)": DocumentEncoder(base, threads=threads),
            "torch fp32 (reference)": DocumentEncoder(base, runtime="torch", threads=threads),
            "torch bf16": DocumentEncoder(base, precision="bf16", threads=threads)}
    arms: dict[str, Callable[[list[str]], np.ndarray]] = {
        "torch fp32 (before)": lambda t: base.encode_documents(t, batch_size=64),
        "torch bf16 autocast (before)": lambda t: base.encode_documents(t, batch_size=64, precision="bf16"),
        **{name: e.encode for name, e in encs.items()}}
    if not args.no_int8:
        from qswap.encoders.runtime.onnx import make_session
        from qswap.encoders.runtime.export_digest import MODEL_FILE
        fp32 = encs["onnx fp32 (default)"]
        fp32.encode(texts[:2])   # exports (or loads) the fused graph
        graph = fp32.cache_dir / "base" / base.space.fingerprint / MODEL_FILE
        for name, scheme in (("onnx int8 dynamic", "dynamic"), ("onnx int8 selective", "selective")):
            q = DocumentEncoder(base, threads=threads)
            q.encode(texts[:2])
            # Same batching and producer as the default arm, only the graph differs.
            q._session = make_session(quantized_graph(graph, dirs.tmp, scheme), threads, ["CPUExecutionProvider"])
            arms[name] = q.encode
    for f in arms.values():   # warm-up: sessions, exports, autocast caches
        f(texts[:32])
    roof = {"fp32": [], "bf16": []}
    times: dict[str, list[float]] = {a: [] for a in arms}
    vecs: dict[str, np.ndarray] = {}
    for r in range(max(1, args.rounds)):
        for dt in roof:
            roof[dt].append(gemm_gflops(dt, threads))
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for a in order:
            t0 = time.perf_counter()
            vecs[a] = arms[a](texts)
            s = time.perf_counter() - t0
            times[a].append(s)
            print(f"round {r + 1} {a}: {n / s:.1f} docs/s, {tokens / s:,.0f} tok/s, load {os.getloadavg()[0]:.1f}",
                  file=sys.stderr)
    peak = {dt: float(np.median(v)) for dt, v in roof.items()}
    ref = vecs["torch fp32 (before)"]
    res: dict[str, Any] = {"documents": n, "tokens": tokens, "mean_tokens": tokens / n, "model_gflop": flops / 1e9,
                           "threads": threads, "beir": str(beir), "queries": {k: len(v) for k, v in qtexts.items()},
                           "quality_bar": BAR, "roofline_gflops": peak, "roofline_rounds": roof, "arms": {}}
    for a, t in times.items():
        s = float(np.median(t))
        q = quality(ref, vecs[a], queries)
        dt = "bf16" if "bf16" in a else "fp32"
        res["arms"][a] = {"seconds": t, "docs_per_s": n / s, "tokens_per_s": tokens / s, "gflops": flops / s / 1e9,
                          "roofline": dt, "fraction_of_roofline": flops / s / 1e9 / peak[dt], **q,
                          "passes_bar": passes(q)}
    if args.infinity:
        from qswap.bench.infinity_peer import run_infinity
        inf = run_infinity(base.path, [pre + t for t in texts], dirs.tmp / "infinity", ["optimum"],
                           64, threads)
        res["infinity"] = {}
        for eng, rec in inf.items():
            if eng == "install_error":
                res["infinity"]["install_error"] = rec
                continue
            if "error" in rec:
                res["infinity"][eng] = rec
                continue
            v = rec.pop("vectors")
            q = quality(ref, v, queries) if v.shape == ref.shape else {"error": f"shape {v.shape}"}
            res["infinity"][eng] = {**rec, **q, "passes_bar": passes(q) if "min_cosine" in q else False}
    if args.rss_docs:
        rss_model = args.rss_model or args.model
        if rss_model == "tiny":
            from qswap.bench.tiny_model import make_tiny_model
            rss_model = str(make_tiny_model(dirs.tmp / "tiny-model"))
        res["build_rss"] = build_rss(texts, args.rss_docs, rss_model, dirs.tmp)
        res["build_rss_model"] = args.rss_model or args.model
    base_rate = res["arms"]["torch fp32 (before)"]["docs_per_s"]
    rows = []
    for a, rec in res["arms"].items():
        rows.append([a, f"{rec['docs_per_s']:.1f}", f"{rec['tokens_per_s']:,.0f}", f"{rec['docs_per_s'] / base_rate:.2f}",
                     f"{rec['gflops']:.0f}", f"{rec['fraction_of_roofline']:.0%} of {rec['roofline']}",
                     f"{rec['min_cosine']:.6f}", f"{rec['recall_at_10']:.4f}", "yes" if rec["passes_bar"] else "**no**"])
    inf_md = ""
    for eng, rec in (res.get("infinity") or {}).items():
        if eng == "install_error":
            inf_md += f"\nInfinity could not be installed: {rec}\n"
        elif "error" in rec:
            inf_md += f"\nInfinity engine {eng} failed: {rec['error']}\n"
        else:
            rows.append([f"infinity {rec.get('version', '')} {eng}", f"{rec['docs_per_s']:.1f}",
                         f"{tokens / rec['seconds']:,.0f}", f"{rec['docs_per_s'] / base_rate:.2f}",
                         f"{flops / rec['seconds'] / 1e9:.0f}", "-", f"{rec.get('min_cosine', float('nan')):.6f}",
                         f"{rec.get('recall_at_10', float('nan')):.4f}", "yes" if rec.get("passes_bar") else "**no**"])
    for size, rec in (res.get("build_rss") or {}).items():
        inf_md += (f"\nPeak RSS of `qswap index build` of {int(size):,} short documents ({res['build_rss_model']}): "
                   + (f"{rec['peak_rss_mib']:.0f} MiB ({rec['docs_per_s']:.0f} docs/s whole build)" if "peak_rss_mib"
                      in rec else f"failed: {rec['error']}") + "\n")
    labels = [r[0] for r in rows]
    plot_bars(dirs.writer.plot_path("docs_per_s.png"), labels, {"docs/s": [float(r[1]) for r in rows]},
              ylabel="documents/s", title=f"embedding {n:,} Debian documents on {threads} threads")
    md = (f"{n:,} Debian documents ({tokens:,} tokens, {tokens / n:.0f} mean; {flops / 1e12:.2f} TFLOP of model "
          f"arithmetic), {args.model}, {threads} threads; median of {args.rounds} rounds, arms alternating. "
          f"GEMM roofline (2048², torch): fp32 {peak['fp32']:.0f} GFLOP/s, bf16 {peak['bf16']:.0f} GFLOP/s. "
          f"Quality against torch fp32 (before); recall@10 of its top-10 among these documents for "
          f"{sum(len(v) for v in qtexts.values())} queries ({', '.join(qtexts)}). "
          f"Bar: min cosine >= {BAR['min_cosine']}, recall@10 >= {BAR['recall_at_10']}.\n\n"
          + md_table(["arm", "docs/s", "tokens/s", "x before", "GFLOP/s", "of roofline", "min cosine",
                      "recall@10", "passes bar"], rows) + inf_md)
    print(md)
    dirs.writer.write(res, md)
    shutil.rmtree(dirs.tmp / "infinity", ignore_errors=True)
    dirs.clean_scratch()
    print(f"wrote {dirs.out}")
    return 0
