"""The phases of ``qswap bench gpu``, one process each: ``python -m qswap.bench.gpu_phases PHASE CONFIG``.

Each phase saves ``<out>/phases/<phase>.json`` after every measurement (atomically), so a phase
killed by its time budget keeps what it measured; a failing measurement records its error and the
phase goes on. ``CONFIG`` is the JSON the parent wrote (model folder, BEIR folder, work folder,
sizes, the phase's deadline). Heavy imports happen inside the phases.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

from qswap.atomic import atomic_write_json
from qswap.bench.results import to_json
from qswap.bench.stats import timed_ms

LORA_TARGETS = ("query", "key", "value", "dense")


class Recorder:
    """A phase's results, saved after every ``put``."""

    def __init__(self, out: Path, name: str, deadline: float) -> None:
        self.path = out / "phases" / f"{name}.json"
        self.deadline = deadline
        self.data: dict[str, Any] = {"status": "running"}
        self.save()

    def put(self, key: str, value: Any) -> Any:
        self.data[key] = value
        self.save()
        return value

    def save(self) -> None:
        atomic_write_json(self.path, to_json(self.data))

    def left(self) -> float:
        return self.deadline - time.time()

    def guard(self, key: str, fn: Callable[[], Any], need_s: float = 0.0) -> Any:
        """``fn()`` stored under ``key``; an exception (or too little time left) is stored instead."""
        if self.left() < need_s:
            return self.put(key, {"skipped": f"{self.left():.0f} s left of the phase budget, {need_s:.0f} needed"})
        t = time.time()
        try:
            return self.put(key, fn())
        except Exception as e:   # noqa: BLE001 - a failure is a result here
            tail = traceback.format_exc().strip().splitlines()[-8:]
            self.put(key, {"error": f"{type(e).__name__}: {e}"[:600], "traceback": tail,
                           "after_s": round(time.time() - t, 1)})
            return None


# ------------------------------------------------------------------------------------ helpers

def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], Any], reps: int, warm: int = 3) -> float:
    """Median wall time of ``fn()`` in ms (device synchronised around each call)."""
    return round(statistics.median(timed_ms(lambda _: fn(), reps, warm, sync)), 4)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-30)


def texts_and_queries(cfg: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(documents, queries): the BEIR folder's (queries of every language, shuffled), or synthetic."""
    import random
    rng = random.Random(0)
    if cfg.get("beir"):
        from qswap.beir import available_languages, read_corpus, read_queries
        beir = Path(cfg["beir"])
        corpus = read_corpus(beir)
        docs = [corpus[i].text for i in list(corpus)[:cfg["docs"]]]
        qs: list[str] = []
        for lang in available_languages(beir) or [None]:
            qs += list(read_queries(beir, lang).values())
        rng.shuffle(qs)
        return docs, qs
    words = ("chess game music audio network server python library debian search index physics data tool "
             "video editor compiler terminal font graphics database client").split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 120))) for _ in range(cfg["docs"])]
    return docs, [" ".join(rng.choice(words) for _ in range(rng.randint(2, 9))) for _ in range(2000)]


def make_encoders(model: str, root: Path, n_lora: int, ranks: tuple[int, ...]) -> list[Path]:
    """``n_lora`` random LoRA encoders (ranks cycling through ``ranks``, every Linear), two bias
    encoders and one partial encoder, made on a CPU copy of the base (written once per folder)."""
    from qswap.bench.data.encoders import perturbed_encoder, random_lora_encoder
    from qswap.encoders import load_base
    made: list[Any] = []

    def base() -> Any:
        if not made:
            made.append(load_base(model, device="cpu"))
        return made[0]
    dirs = []
    for i in range(n_lora):
        d = root / f"l{i}"
        if not d.exists():
            random_lora_encoder(base(), d, f"l{i}", rank=ranks[i % len(ranks)], seed=i, scale=0.02, targets=LORA_TARGETS)
        dirs.append(d)
    for name, kind, seed in (("b0", "bias", 100), ("b1", "bias", 101), ("p0", "partial", 200)):
        d = root / name
        if not d.exists():
            perturbed_encoder(base(), d, name, kind=kind, scale=0.02, seed=seed)
        dirs.append(d)
    return dirs


def pool_of(base: Any, dirs: list[Path], factors: str = "float32") -> Any:
    from qswap.encoders import EncoderPool, load_encoder
    pool = EncoderPool(base, factor_dtype=factors)
    for d in dirs:
        pool.add(load_encoder(d, base.space))
    return pool


def device_name() -> str:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------ phases

def phase_env(rec: Recorder, cfg: dict[str, Any]) -> None:
    import platform

    import torch
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                            "cores": len(os.sched_getaffinity(0)), "commit": cfg.get("commit")}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=list(torch.cuda.get_device_capability(0)),
                    memory_gib=round(p.total_memory / 2**30, 1), gpus=torch.cuda.device_count())
    quota = Path("/sys/fs/cgroup/cpu.max")   # a CPU quota caps the cores tokenisation can use
    if quota.is_file():
        info["cgroup_cpu_max"] = quota.read_text().strip()
    rec.put("machine", info)
    import importlib.metadata as md
    vers = {}
    for d in ("qswap", "transformers", "tokenizers", "numpy", "onnxruntime", "sentence-transformers", "faiss-cpu",
              "faiss-gpu-cu12", "fastapi", "pydantic", "uvicorn"):
        try:
            vers[d] = md.version(d)
        except md.PackageNotFoundError:
            vers[d] = None
    rec.put("packages", vers)
    from qswap.tuning.recipes import default_recipe, device_spec, resolve
    spec = device_spec()
    rec.put("recipe", {"device": spec.__dict__, "default": default_recipe(spec),
                       "resolved": resolve(default_recipe(spec), spec)})


def phase_twin(rec: Recorder, cfg: dict[str, Any]) -> None:
    """The cuda backend against the torch pool (fp32 reference on the CPU): mixed batches of 1, 4
    and 20 encoders, every kind; on a GPU at fp32, fp16 and bf16, on a CPU the eager twin at fp32."""
    import torch

    from qswap.encoders import BASE_KEY, load_base
    from qswap.encoders.runtime.backend import TorchBackend
    from qswap.encoders.runtime.cuda import CudaBackend

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rec.put("device", device_name())
    ref_base = load_base(cfg["model"], device="cpu")
    dirs = make_encoders(cfg["model"], Path(cfg["work"]) / "encoders", 16, tuple(cfg["ranks"]))
    ref = TorchBackend(pool_of(ref_base, dirs))
    base = ref_base if dev == "cpu" else load_base(cfg["model"], device=dev)
    pool = ref.pool if dev == "cpu" else pool_of(base, dirs)
    keys = [k for k in pool.keys() if k != BASE_KEY] + [BASE_KEY]
    _, qs = texts_and_queries({**cfg, "docs": 0})
    sets = {1: ["l2@1"], 4: ["l0@1", "l3@1", "b0@1", "p0@1"], 20: keys}
    for precision in (("fp32", "fp16", "bf16") if dev == "cuda" else ("fp32",)):
        def arm(precision: str = precision) -> dict[str, Any]:
            be = CudaBackend(pool, precision=precision, capacity=32, max_rank=64)
            out: dict[str, Any] = {}
            for n, ks in sets.items():
                rows = max(2 * n, 16)
                texts, row_keys = qs[:rows], [ks[i % len(ks)] for i in range(rows)]
                c = cosines(be.encode(texts, row_keys), ref.encode(texts, row_keys))
                out[f"{n} encoders"] = {"rows": rows, "min_cosine": float(c.min()), "mean_cosine": float(c.mean())}
            out["graphs"] = be.runner.graphs
            out["buckets"] = be.runner.captures
            return out
        rec.guard(f"cuda backend {precision} vs torch fp32 (CPU)", arm)


def phase_query(rec: Recorder, cfg: dict[str, Any]) -> None:
    """Encode latency: one query with a LoRA r=32 encoder, 32 queries over 20 encoders vs the base."""
    from qswap.encoders import BASE_KEY, load_base
    from qswap.encoders.runtime.backend import TorchBackend
    from qswap.encoders.runtime.cuda import CudaBackend

    rec.put("device", device_name())
    base = load_base(cfg["model"])
    ranks = tuple(cfg["ranks"]) if cfg["quick"] else (32, 8, 16, 64)   # l0: rank 32 (quick: a tiny model's)
    dirs = make_encoders(cfg["model"], Path(cfg["work"]) / "encoders-q", 17, ranks)
    pool = pool_of(base, dirs, "float16")   # the server's default factor storage
    keys = [f"l{i}@1" for i in range(17)] + ["b0@1", "b1@1", BASE_KEY]   # 20 encoders the table serves
    _, qs = texts_and_queries({**cfg, "docs": 0})
    reps = cfg["reps"]
    arms = [("cuda " + p, lambda p=p: CudaBackend(pool, precision=p)) for p in ("fp16", "bf16", "fp32")]
    arms.append(("torch fp32 (eager, the previous GPU path)", lambda: TorchBackend(pool)))
    for name, make in arms:
        def arm(make: Callable[[], Any] = make) -> dict[str, Any]:
            be = make()
            mixed = [keys[i % 20] for i in range(32)]
            out = {f"one query LoRA r={ranks[0]} ms": median_ms(lambda: be.encode(qs[:1], ["l0@1"]), reps),
                   "32 queries base ms": median_ms(lambda: be.encode(qs[:32], [BASE_KEY] * 32), reps),
                   "32 queries over 20 encoders ms": median_ms(lambda: be.encode(qs[:32], mixed), reps),
                   "256 queries one LoRA ms": median_ms(lambda: be.encode(qs[:256], ["l0@1"] * 256), max(5, reps // 4))}
            out["20 encoders / base"] = round(out["32 queries over 20 encoders ms"] / out["32 queries base ms"], 3)
            if hasattr(be, "runner"):
                out["buckets captured"] = be.runner.captures
                # Where one query's time goes: the graph alone against the whole call.
                be.encode(qs[:1], ["l0@1"])
                one = [bk for key, bk in be.runner._buckets.items() if key[0] == 1 and key[2] >= ranks[0]]
                if one and one[0].graph is not None:
                    out["one query: graph replay only ms"] = median_ms(one[0].graph.replay, reps)
                    be.encode(qs[:1], [BASE_KEY])
                    base_one = [bk for key, bk in be.runner._buckets.items() if key[0] == 1 and key[2] == 0]
                    if base_one and base_one[0].graph is not None:
                        out["one query base: graph replay only ms"] = median_ms(base_one[0].graph.replay, reps)
                out["one query: tokenise ms"] = median_ms(lambda: be.base.tokenizer.encode_batch(qs[:1]), reps)
            return out
        rec.guard(name, arm, need_s=15)


def phase_docs(rec: Recorder, cfg: dict[str, Any]) -> None:
    """Documents per second and quality against fp32 (min cosine, recall@10 of the fp32 top-10),
    qswap's runtimes beside sentence-transformers on the same weights."""
    import torch

    from qswap.encoders import load_base
    from qswap.encoders.runtime.documents import QUALITY_BAR, DocumentEncoder

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rec.put("device", device_name())
    docs, qs = texts_and_queries(cfg)
    base = load_base(cfg["model"], device=dev)
    qv = base.encode_queries(qs[:cfg["quality_queries"]])
    ref: dict[str, np.ndarray] = {}

    def top10(v: np.ndarray) -> np.ndarray:
        return np.argsort(-(qv @ v.T), axis=1)[:, :10]

    def timed(name: str, embed: Callable[[list[str]], np.ndarray]) -> dict[str, Any]:
        embed(docs[:cfg["warm"]])
        # Twice: the first pass over the corpus meets batch shapes the warm-up did not (kernel
        # choices, allocator growth), a cost a corpus pays once; the second is the steady rate.
        runs = []
        for _ in range(2):
            sync()
            t = time.perf_counter()
            v = np.asarray(embed(docs), dtype=np.float32)
            sync()
            runs.append(time.perf_counter() - t)
        s = runs[1]
        out: dict[str, Any] = {"docs": len(docs), "first pass s": round(runs[0], 3), "seconds": round(s, 3),
                               "docs_per_s": round(len(docs) / s, 1)}
        if not ref:
            ref["v"], ref["top"] = v, top10(v)
            out["reference"] = True
        else:
            c = cosines(v, ref["v"])
            got = top10(v)
            recall = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, ref["top"])]))
            out.update(min_cosine=float(c.min()), recall_at_10=recall,
                       passes_bar=bool(c.min() >= QUALITY_BAR["min_cosine"] and recall >= QUALITY_BAR["recall_at_10"]))
        return out

    arms: list[tuple[str, Callable[[], Callable[[list[str]], np.ndarray]]]] = [
        ("qswap cuda fp32 (reference)", lambda: DocumentEncoder(base, "fp32", runtime="cuda")),
        ("qswap cuda fp16", lambda: DocumentEncoder(base, "fp16", runtime="cuda")),
        ("qswap cuda bf16", lambda: DocumentEncoder(base, "bf16", runtime="cuda")),
        ("qswap torch fp32 (the previous GPU path)", lambda: DocumentEncoder(base, "fp32", runtime="torch"))]
    for prec, bs in (("fp32", 256), ("fp16", 256), ("fp16", 1024)):
        arms.append((f"sentence-transformers {prec} batch {bs}", lambda prec=prec, bs=bs: _st_embed(cfg, dev, prec, bs)))
    for name, make in arms:
        rec.guard(name, lambda name=name, make=make: timed(name, make()), need_s=10)
    rec.guard("where the cuda runtime's time goes", lambda: _docs_split(base, docs), need_s=10)


def _docs_split(base: Any, docs: list[str]) -> dict[str, Any]:
    """The cuda document runtime's two halves apart: tokenising and cutting batches (the producer
    thread's work, on the CPU's cores) and the GPU forward of those batches (one in flight)."""
    from qswap.encoders.runtime.documents import DocumentEncoder, _batches
    out: dict[str, Any] = {"docs": len(docs)}
    for precision in ("fp32", "fp16"):
        enc = DocumentEncoder(base, precision, runtime="cuda")
        enc.encode(docs[:256])   # the runtime is made, kernels warmed
        t = time.perf_counter()
        batches = [b for s in range(0, len(docs), enc.window) for b in _batches(enc, docs[s:s + enc.window], s)]
        tok = time.perf_counter() - t
        out["tokenise + cut batches s"] = round(tok, 3)
        out["tokenise docs/s"] = round(len(docs) / tok, 1)
        sync()
        t = time.perf_counter()
        pending = None
        for _, ids, mask, _ in batches:
            nxt = enc._gpu.submit(ids, mask)
            if pending is not None:
                pending()
            pending = nxt
        if pending is not None:
            pending()
        sync()
        fwd = time.perf_counter() - t
        out[f"{precision} forward only s"] = round(fwd, 3)
        out[f"{precision} forward only docs/s"] = round(len(docs) / fwd, 1)
        out["padded tokens"] = int(sum(b[1].size for b in batches))
        out["batches"] = len(batches)
    return out


def _st_embed(cfg: dict[str, Any], dev: str, precision: str, batch: int) -> Callable[[list[str]], np.ndarray]:
    from sentence_transformers import SentenceTransformer

    from qswap.encoders import load_base
    spec = load_base(cfg["model"], device="cpu").spec
    m = SentenceTransformer(cfg["model"], device=dev)
    if precision == "fp16":
        m = m.half()
    return lambda texts: m.encode([spec.document_prefix + t for t in texts], batch_size=batch,
                                  normalize_embeddings=True, convert_to_numpy=True)


def phase_search(rec: Recorder, cfg: dict[str, Any]) -> None:
    """The index build on the GPU, then encode + search in process (4 and 20 LoRA domains, batches
    of 1 and 128), and exact flat top-k: torch on the GPU against FAISS on the CPU's cores."""
    import torch

    from qswap.encoders import load_base
    from qswap.encoders.runtime.cuda import CudaBackend
    from qswap.index import open_index
    from qswap.index.backends.faiss.torch_flat import TorchFlat

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rec.put("device", device_name())
    idx = Path(cfg["work"]) / "index"
    if cfg.get("beir"):
        cmd = [sys.executable, "-m", "qswap.cli", "index", "build", cfg["beir"], "--out", str(idx), "--model",
               cfg["model"], "--no-progress"]
        # The build must finish for the search, serve and tune phases to run: most of the budget.
        rec.guard("index build", lambda: _run(cmd, rec.left() - 15), need_s=30)
    if not (idx / "manifest.json").exists():
        rec.put("search", {"skipped": "no index"})
    else:
        base = load_base(cfg["model"], device=dev)
        index = open_index(idx, read_only=True)
        dirs = make_encoders(cfg["model"], Path(cfg["work"]) / "encoders-s", 20, (16, 32))
        pool = pool_of(base, dirs[:20], "float16")
        _, qs = texts_and_queries({**cfg, "docs": 0})
        be = CudaBackend(pool, precision="fp16")
        for domains in (4, 20):
            keys = [f"l{i}@1" for i in range(domains)]

            def arm(keys: list[str] = keys) -> dict[str, Any]:
                out = {}
                for batch in (1, 128):
                    ks = [keys[i % len(keys)] for i in range(batch)]
                    ms = median_ms(lambda: index.search(be.encode(qs[:batch], ks), 10, with_text=False),
                                   cfg["reps"] if batch == 1 else max(5, cfg["reps"] // 5))
                    out[f"batch {batch} ms"] = ms
                    out[f"batch {batch} queries/s"] = round(batch / ms * 1e3, 1)
                return out
            rec.guard(f"encode + search, {domains} LoRA domains (cuda fp16, in process, no HTTP)", arm, need_s=10)
    rng = np.random.default_rng(0)
    n = cfg["flat_rows"]
    x = rng.standard_normal((n, 384)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = x[rng.integers(0, n, 128)]

    def flat() -> dict[str, Any]:
        import faiss
        fi = faiss.IndexFlatIP(384)
        fi.add(x)
        tf = TorchFlat(x, np.arange(n), dev)
        (ts, ti), (fs, fid) = tf.search(q, 10), fi.search(q, 10)
        # Summation order differs (GPU GEMM vs FAISS's BLAS): ids may swap only where scores tie.
        differ = ti != fid
        return {"rows": n, "dim": 384, "queries": 128, "same_ids": bool(not differ.any()),
                "same_ids_up_to_ties": bool(np.all(np.abs(ts - fs)[differ] <= 1e-5)) if differ.any() else True,
                "max_score_diff": float(np.abs(ts - fs).max()), "device": dev,
                "faiss cpu ms": median_ms(lambda: fi.search(q, 10), 10),
                "torch ms": median_ms(lambda: tf.search(q, 10), 20)}
    rec.guard("exact flat top-10 of 128 queries", flat, need_s=10)


def _run(cmd: list[str], timeout: float) -> dict[str, Any]:
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 5))
    return {"command": shlex.join(cmd), "exit": p.returncode, "wall_s": round(time.time() - t, 1),
            "stderr_tail": p.stderr.strip().splitlines()[-6:]}


def phase_tune(rec: Recorder, cfg: dict[str, Any]) -> None:
    """``qswap tune run`` end to end with the device's default recipe, its phases and its guard."""
    import torch
    rec.put("device", device_name())
    idx, beir, work = Path(cfg["work"]) / "index", cfg.get("beir"), Path(cfg["work"])
    if not beir or not (idx / "manifest.json").exists():
        rec.put("e2e", {"skipped": "needs --beir and the index the search phase builds"})
        return
    from qswap.beir import available_languages
    langs = available_languages(Path(beir)) or ["en"]
    langs = sorted(langs, key=lambda lg: lg != "en")   # train on English, the others are sentinels
    out = work / "tuned"
    cmd = [sys.executable, "-m", "qswap.cli", "tune", "run", "--allow-identity", "--beir", beir, "--lang", langs[0], "--index", str(idx),
           "--base", cfg["model"], "--method", "partial", "--negatives", "3", "--mine", "index",
           "--device", "cuda" if torch.cuda.is_available() else "cpu", "--quiet", "--out", str(out),
           "--cache-dir", str(work / "tune-cache"), "--eval-langs", ",".join(langs),
           *(["--val-size", "20", "--test-size", "40", "--epoch-batches", "2", "--max-epochs", "1"] if cfg["quick"]
             else ["--val-size", "400", "--test-size", "1000"])]
    for lg in langs[1:]:
        cmd += ["--sentinel", f"{lg}=beir:{beir}:{lg}"]

    def e2e() -> dict[str, Any]:
        res = _run(cmd, rec.left() - 5)
        rep = out / "report.json"
        if res["exit"] == 0 and rep.is_file():
            r = json.loads(rep.read_text())
            tr = r.get("training", {})
            res.update(phases_s=r.get("phases"), total_s=r.get("wall_seconds_total"), steps=tr.get("steps"),
                       seconds_per_step=tr.get("seconds_per_step"), recipe=r.get("recipe"),
                       guard_passed=(r.get("guard") or {}).get("passed"))
        return res
    rec.guard("e2e", e2e, need_s=40)


def _phase_serve(rec: Recorder, cfg: dict[str, Any]) -> None:
    from qswap.bench.gpu_serve import phase_serve
    rec.put("device", device_name())
    root = Path(cfg["work"]) / "encoders-s"
    make_encoders(cfg["model"], root, 20, (16, 32))
    phase_serve(rec, cfg, root, texts_and_queries({**cfg, "docs": 0})[1])


PHASES: dict[str, Callable[[Recorder, dict[str, Any]], None]] = {
    "env": phase_env, "twin": phase_twin, "query": phase_query, "docs": phase_docs, "search": phase_search,
    "serve": _phase_serve, "tune": phase_tune}


def main(argv: list[str]) -> int:
    name, cfg = argv[0], json.loads(Path(argv[1]).read_text())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rec = Recorder(Path(cfg["out"]), name, float(cfg["deadline"]))
    try:
        PHASES[name](rec, cfg)
        rec.put("status", "ok")
    except SystemExit:
        rec.put("status", "stopped at the phase budget")
        raise
    except Exception as e:   # noqa: BLE001 - recorded, the next phase runs
        rec.data["traceback"] = traceback.format_exc().strip().splitlines()[-10:]
        rec.put("status", f"failed: {type(e).__name__}: {e}"[:600])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
