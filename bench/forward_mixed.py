"""``qswap bench forward --mixed-only``: batches of queries that mix encoders, per group vs one segment call.

For each batch size (``--mixed-batches``) the arms run side by side, interleaved per round:

- ``merged 1-encoder``: every row with one LoRA encoder on its own merged export
  (:class:`qswap.encoders.runtime.onnx.OnnxBackend`): what a one-model server runs;
- ``shared 1-encoder``: the same rows on the shared graph (one bound call);
- ``groups k=K``: rows spread round-robin over K LoRA encoders, one ONNX Runtime call per
  encoder group, side by side on the single-threaded second session (``mix="groups"``);
- ``segments k=K``: the same batch as ONE call of the segment graph, each encoder's factors
  copied once into the call's buffers (``mix="segments"``; an encoder still in its slot from the
  last call is not copied again, which is what a fixed mix measures) and ``segments k=K cold``,
  the same with every slot emptied before each call (what a call whose encoders all changed pays);
- ``auto k=K``: ``mix="auto"``, segments only when the groups are small
  (:func:`qswap.encoders.runtime.shared_run.segment_groups`);
- ``hot k=K`` (K up to :data:`qswap.encoders.runtime.hot.FEW_DOMAINS_HOT`): every one of the K
  encoders hot, the batch run as one call per encoder group, each on that encoder's own merged
  session, one after another (what a server whose K encoders are all hot runs).

Every encoder is a LoRA of ``--adapter-rank`` on every Linear layer with factors in the server's
storage type. Each batch size runs on two sets of queries (``--mixed-lengths``): ``fixed``, the
benchmark's fixed-length ones (one length bucket, nothing for packing to remove), and ``real``
(``N real-length queries``), a new draw of the Debian bench queries each round, the same for
every arm of the round. Answers: per-row cosine of segments against per group and against the
torch pool.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from qswap.bench.data.encoders import random_lora_encoder
from qswap.encoders import EncoderPool, load_encoder
from qswap.encoders.base import BaseEncoder


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def run(base: BaseEncoder, queries: list[str], *, threads: int, rank: int, encoders: list[int], batches: list[int],
        reps: int, settle: float, spin: bool, cache: Path, timed_arms: Callable[..., Any],
        spread: Callable[[list[float]], dict[str, float]],
        progress: Callable[[int, str], tuple[Any, Any]], real: list[str] | None = None,
        fixed: bool = True) -> dict[str, Any]:
    """Measure the mixed-batch arms; returns a dict for ``results.json["mixed"]``. ``queries``: the
    fixed-length texts (timed if ``fixed``); ``real``: texts of real lengths to draw batches from."""
    from qswap.bench.stats import interleaved, percentile, ratio_summary
    from qswap.encoders.runtime.hot import FEW_DOMAINS_HOT
    from qswap.encoders.runtime.onnx import OnnxBackend
    from qswap.encoders.runtime.shared import SharedBackend
    from qswap.factors import SERVING_FACTORS

    tmp = tempfile.TemporaryDirectory(prefix="qswap-bench-mixed-")
    root = Path(tmp.name)
    pool = EncoderPool(base, factor_dtype=SERVING_FACTORS)
    keys = []
    for i in range(max(encoders)):
        pool.add(load_encoder(random_lora_encoder(base, root / f"l{i}", f"l{i}", rank=rank, seed=100 + i), base.space))
        keys.append(f"l{i}@1")
    groups = SharedBackend(pool, cache, threads=threads, spin=spin, mix="groups")
    for k in keys:
        groups.prepare(k)
    if not groups.wait(keys[0], timeout=1800):
        raise RuntimeError(f"shared export failed: {groups.error(keys[0])}")
    # Built after the export is cached, so the two backends do not export it at once.
    segments = SharedBackend(pool, cache, threads=threads, spin=spin, mix="segments")
    auto = SharedBackend(pool, cache, threads=threads, spin=spin, mix="auto")
    merged = OnnxBackend(pool, cache, threads=threads, spin=spin)
    for k in keys:
        segments.prepare(k)
    if not segments.wait(keys[0], timeout=1800):
        raise RuntimeError(f"shared export failed: {segments.error(keys[0])}")
    for k in keys:
        auto.prepare(k)
    hot_ks = [k for k in encoders if 1 < k <= FEW_DOMAINS_HOT]
    for k in keys[:max([1, *hot_ks])]:
        merged.prepare(k)
    if not auto.wait(keys[0], timeout=1800):
        raise RuntimeError(f"shared export failed: {auto.error(keys[0])}")
    for k in keys[:max([1, *hot_ks])]:
        if not merged.wait(k, timeout=1800):
            raise RuntimeError(f"merged export failed: {merged.error(k)}")
    n_max = max(batches)
    texts = [queries[i % len(queries)] for i in range(n_max)]
    mixes = {k: [keys[i % k] for i in range(n_max)] for k in encoders}
    big = max(encoders)
    if big > 1:   # build every backend's mixed-batch machinery before timing
        groups.encode(texts, mixes[big])        # the second session
        segments.encode(texts, mixes[big])      # the segment graph
        if not segments.segments_ready(wait=1800):   # exported once; auto's build then loads it
            raise RuntimeError("the segment graph was not built")
        auto.encode(texts[:2], keys[:2])                              # tiny groups: segments
        auto.encode(texts[:4], [keys[0], keys[0], keys[1], keys[1]])  # bigger ones: side by side
        side_by_side = groups.groups_side_by_side(wait=1800)   # never with one thread: groups run in turn
        if (threads > 1 and not (side_by_side and auto.groups_side_by_side(wait=1800))
                or not auto.segments_ready(wait=1800)):
            raise RuntimeError("the side-by-side session or the segment graph was not built")
    per_group = groups.encode(texts, mixes[big])
    by_encoder = segments.encode(texts, mixes[big])
    torch_ref = pool.encode(texts, mixes[big])
    cosine = {"segments vs groups": _cos(by_encoder, per_group), "segments vs torch": _cos(by_encoder, torch_ref),
              "groups vs torch": _cos(per_group, torch_ref)}
    rng = np.random.default_rng(0)
    warmup = 2
    cases: dict[str, list[list[str]]] = {}
    for n in batches:
        if fixed:
            cases[str(n)] = [texts[:n]]
        if real:
            cases[f"{n} real-length"] = [[real[i] for i in rng.choice(len(real), n, replace=len(real) < n)]
                                         for _ in range(reps + warmup)]
    out_tokens: dict[str, dict[str, float]] = {}
    for name, draws in cases.items():
        if name.endswith("real-length"):
            out_tokens[name] = _token_figures(base, draws, big)
    if real:   # the largest real-length draw: rows of many lengths, packed
        draw = cases[f"{n_max} real-length"][0]
        cosine["segments vs torch (real lengths)"] = _cos(segments.encode(draw, mixes[big]),
                                                          pool.encode(draw, mixes[big]))

    def cold(ks: list[str]) -> Callable[[list[str]], np.ndarray]:
        def fn(t: list[str]) -> np.ndarray:
            runner = segments._segments[1] if segments._segments is not None else None
            for k in keys if runner is not None else ():
                runner.discard(k)   # every slot emptied: each encoder's factors copied again
            return segments.encode(t, ks[:len(t)])
        return fn

    def arm(backend: Any, ks: list[str]) -> Callable[[list[str]], np.ndarray]:
        return lambda t: backend.encode(t, ks[:len(t)])
    fns: dict[str, Callable[[list[str]], np.ndarray]] = {
        "merged 1-encoder": lambda t: merged.encode(t, [keys[0]] * len(t)),
        "shared 1-encoder": arm(groups, mixes[1] if 1 in mixes else [keys[0]] * n_max)}
    for k in encoders:
        if k > 1:
            fns[f"groups k={k}"] = arm(groups, mixes[k])
            fns[f"segments k={k}"] = arm(segments, mixes[k])
            if k == big:
                fns[f"segments k={k} cold"] = cold(mixes[k])
            fns[f"auto k={k}"] = arm(auto, mixes[k])
            if k in hot_ks:
                fns[f"hot k={k}"] = arm(merged, mixes[k])
    out: dict[str, Any] = {"rank": rank, "factors": SERVING_FACTORS, "encoders": encoders, "threads": threads,
                           "cosine": cosine, "ms": {}, "ratios": {}, "real_tokens": out_tokens}
    bar, tick = progress(reps * len(fns) * len(cases), "mixed batches")
    for n, draws in cases.items():
        t = interleaved(timed_arms(fns, draws, settle), reps, warmup=warmup, on_round=tick)

        def ratio(a: str, b: str) -> dict[str, float]:
            rs = ratio_summary(t[a], t[b])
            return {"median": rs.median, "p10": percentile(rs.ratios, 10), "p90": percentile(rs.ratios, 90),
                    "n": rs.n}
        out["ms"][n] = {name: spread([x * 1000 for x in v]) for name, v in t.items()}
        r: dict[str, Any] = {"shared 1-encoder / merged 1-encoder": ratio("shared 1-encoder", "merged 1-encoder")}
        for k in encoders:
            if k > 1:
                r[f"groups k={k} / shared 1-encoder"] = ratio(f"groups k={k}", "shared 1-encoder")
                r[f"segments k={k} / groups k={k}"] = ratio(f"segments k={k}", f"groups k={k}")
                r[f"segments k={k} / shared 1-encoder"] = ratio(f"segments k={k}", "shared 1-encoder")
                if k == big:
                    r[f"segments k={k} cold / groups k={k}"] = ratio(f"segments k={k} cold", f"groups k={k}")
                r[f"auto k={k} / groups k={k}"] = ratio(f"auto k={k}", f"groups k={k}")
                if k in hot_ks:
                    r[f"hot k={k} / segments k={k}"] = ratio(f"hot k={k}", f"segments k={k}")
                    r[f"hot k={k} / shared 1-encoder"] = ratio(f"hot k={k}", "shared 1-encoder")
        out["ratios"][n] = r
    bar.close()
    runner = segments._segments[1] if segments._segments is not None else None
    out["segment_buffers_mb"] = round(runner.nbytes() / 2**20, 1) if runner is not None else 0.0
    for b in (groups, segments, auto, merged):
        b.close()
    tmp.cleanup()
    return out


def _token_figures(base: BaseEncoder, draws: list[list[str]], k: int) -> dict[str, float]:
    """Of real-length batches spread round-robin over ``k`` encoders: tokens per query, and the
    tokens the segment call's batched LoRA products compute (every encoder's block padded to the
    fullest) over the real ones."""
    per_query, padded = [], []
    for texts in draws:
        encs = base.tokenizer.encode_batch([base.spec.query_prefix + t for t in texts])
        n = np.array([sum(e.attention_mask) for e in encs])   # the tokenizer pads a batch to its longest
        counts = np.bincount(np.arange(len(n)) % k, weights=n)
        per_query.append(n.mean())
        padded.append(len(counts) * counts.max() / n.sum())
    return {"tokens per query": float(np.mean(per_query)), "LoRA tokens / real": float(np.mean(padded))}


def summary_lines(m: dict[str, Any]) -> list[str]:
    """Markdown for the mixed-batch arms."""
    from qswap.bench.results import md_table

    lines = [f"## Mixed batches: ms per batch (LoRA r={m['rank']} on every Linear, {m['factors']} factors, "
             f"{m['threads']} threads)", ""]
    for n, arms in m["ms"].items():
        lines += [f"### {n} queries", "",
                  md_table(["arm", "median", "p10", "p90", "n"],
                           [[k, f"{v['median']:.1f}", f"{v['p10']:.1f}", f"{v['p90']:.1f}", v["n"]]
                            for k, v in arms.items()]),
                  md_table(["paired ratio", "median", "p10", "p90", "rounds"],
                           [[k, f"{v['median']:.3f}", f"{v['p10']:.3f}", f"{v['p90']:.3f}", v["n"]]
                            for k, v in m["ratios"][n].items()])]
    for n, f in m.get("real_tokens", {}).items():
        lines += [f"{n} queries: {f['tokens per query']:.1f} tokens per query on average; at k={max(m['encoders'])} "
                  f"the segment call's batched LoRA products compute {f['LoRA tokens / real']:.2f}x the real tokens.", ""]
    lines += ["Min cosine per row on the largest mix: " + ", ".join(f"{k} {v:.7f}" for k, v in m["cosine"].items())
              + f". Segment call buffers after the runs: {m['segment_buffers_mb']} MB.",
              "", "## Goals (this run)", ""]
    lines += [f"- {k}: {'yes' if v else '**no**'}" for k, v in goals(m).items()]
    return lines + [""]


def goals(m: dict[str, Any]) -> dict[str, bool]:
    """Issue 32's mixed-batch target (within 10 % of the 1-encoder batch) per arm, and equal answers."""
    out: dict[str, bool] = {}
    for n, r in m["ratios"].items():
        for name, v in r.items():
            if name.endswith("/ shared 1-encoder"):
                out[f"{n} queries, {name.split(' /')[0]} <= 1.10x shared 1-encoder"] = v["median"] <= 1.10
    out["segments equal groups per row (cosine >= 0.9999)"] = m["cosine"]["segments vs groups"] >= 0.9999
    return out
