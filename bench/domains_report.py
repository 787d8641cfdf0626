"""Tables and plots of ``qswap bench domains`` (from its results dict only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qswap.bench.plots import plot_lines
from qswap.bench.results import md_table
from qswap.plotting import pyplot, save_figure

BASE = "base"
GENERAL = "general"


def _verdict(r: dict[str, Any]) -> str:
    return "better" if r["better"] else "worse" if r["worse"] else "n.s."


def _cell(r: dict[str, Any]) -> str:
    mark = "**" if r["better"] else "*" if r["worse"] else ""
    return f"{mark}{r['mean_after']:.4f}{mark} ({r['delta']:+.4f})"


def _encoders(res: dict[str, Any]) -> list[str]:
    s = res["setup"]
    main = s["sizes"][-1]
    return [f"{d}-{main}" for d in s["domains"]] + [f"{GENERAL}-{main}"]


def matrix_table(res: dict[str, Any], lang: str) -> str:
    """Encoder x domain nDCG@10 (delta vs base) in ``lang``; bold: better, italics: worse (Holm)."""
    s = res["setup"]
    mean, mx = res["quality"]["mean_ndcg"], res["quality"]["matrix"][lang]
    rows = [[BASE] + [f"{mean[f'{BASE}|{d}|{lang}']:.4f}" if f"{BASE}|{d}|{lang}" in mean else "-"
                      for d in s["domains"]]]
    for enc in _encoders(res):
        rows.append([enc] + [_cell(mx[f"{enc}|{d}"]) if f"{enc}|{d}" in mx else "-" for d in s["domains"]])
    return md_table(["encoder \\ domain"] + s["domains"], rows)


def curve_table(res: dict[str, Any]) -> str:
    """Per size, domain and language: base, own-domain encoder, general encoder, and the tests."""
    s = res["setup"]
    mean = res["quality"]["mean_ndcg"]
    rows = []
    for n in s["sizes"]:
        for key, r in res["quality"]["curve"][str(n)].items():
            dom, lang = key.split("|")
            own, gen, vs = r["own_vs_base"], r["general_vs_base"], r["own_vs_general"]
            rows.append([n, dom, lang, own["n"], f"{mean[f'{BASE}|{dom}|{lang}']:.4f}",
                         f"{own['mean_after']:.4f} ({own['delta']:+.4f})", f"{own['p_holm']:.2g} {_verdict(own)}",
                         f"{gen['mean_after']:.4f} ({gen['delta']:+.4f})", f"{gen['p_holm']:.2g} {_verdict(gen)}",
                         f"{vs['delta']:+.4f}", f"{vs['p_holm']:.2g} {_verdict(vs)}"])
    return md_table(["train queries", "domain", "lang", "queries", "base", "domain enc.", "vs base (Holm)",
                     "general", "vs base (Holm)", "domain - general", "p (Holm)"], rows)


def power_table(res: dict[str, Any]) -> str:
    """Impressions to decide, interleaving vs A/B on click-through, per domain encoder."""
    pw = res["power"]
    rows = []
    for dom, r in pw["domains"].items():
        i, a, q = r["interleave"], r["ab_ctr"], r["ab_over_interleave"]

        def f(x: Any) -> str:
            return f"{x:,.0f}" if x is not None else "undecided"

        def x(v: Any) -> str:
            return f"{v:.1f}x" if v is not None else "-"
        rows.append([dom, f"{r['p_candidate_wins']:.3f} / {r['p_base_wins']:.3f}",
                     f"{r['ctr_base']:.4f} / {r['ctr_candidate']:.4f}",
                     f"{f(i['median'])} / {f(i['at_power'])} ({i['decided']}/{i['runs']})",
                     f"{f(a['median'])} / {f(a['at_power'])} ({a['decided']}/{a['runs']})",
                     f"{x(q['median'])} / {x(q['at_power'])}"])
    return md_table(["domain", "interleave P(win) / P(loss)", "CTR base / domain enc.",
                     f"interleave median / {pw['power']:.0%} (decided)", f"A/B median / {pw['power']:.0%} (decided)",
                     "A/B / interleave"], rows)


def latency_markdown(lat: dict[str, Any]) -> str:
    """The mixed-traffic section: p50 / p99 of mixed domains vs the base, and the target."""
    return "\n".join([
        "## Mixed traffic", "",
        f"All domains round-robin through their aliases vs the base alone, same texts, concurrency "
        f"{lat['concurrency']}: p50 {lat['latency_ms']['mixed']['p50']:.2f} vs {lat['latency_ms']['base']['p50']:.2f} ms "
        f"(x{lat['p50_ratio']:.3f}, target <= {lat['target_p50_ratio']}: "
        f"{'met' if lat['p50_ratio'] <= lat['target_p50_ratio'] else 'missed'}), p99 x{lat['p99_ratio']:.3f}.", ""])


def markdown(res: dict[str, Any]) -> str:
    s, lat, reg = res["setup"], res["latency"], res["registration"]
    def why(v: dict[str, Any]) -> str:
        parts = [f"{w}: {', '.join(v[w])}" for w in ("regressed", "insufficient_evidence") if v.get(w)]
        return f" ({'; '.join(parts)})" if parts else ""
    verdicts = ", ".join(f"{k} {v['verdict']}{why(v)}" for k, v in reg.items() if k != "aliases")
    held = "; ".join(f"{d}: " + ", ".join(f"{lang} {n}" for lang, n in v.items()) for d, v in s["held_out"].items())
    out = [f"Domains (Debian sections): {', '.join(s['domains'])}. Corpus: {s['documents']:,} documents "
           f"({s['distractors']:,} distractors), one index. Held-out queries per domain: {held}. "
           f"Training sizes per domain: {', '.join(map(str, s['sizes']))} (`qswap tune run`, default recipe"
           f"{' + ' + s['tune_args'] if s['tune_args'] else ''}); the general encoder: the union of the domains' "
           f"training sets of that size.", "",
           f"Guard (server, {s['sentinel_n']} queries per domain x language sentinel): {verdicts}.", "",
           f"## Encoder x domain, nDCG@10 of held-out English queries (size {s['sizes'][-1]})", "",
           "Delta against the base in brackets; **bold**: significantly better, *italics*: significantly worse "
           "(Wilcoxon signed-rank, Holm over the matrix).", "", matrix_table(res, "en"), ""]
    for lang in s["langs"][1:]:
        out += [f"### {lang} queries of the same domains", "", matrix_table(res, lang), ""]
    out += ["## Learning curve: own-domain and general encoders against the base and each other", "",
            "Holm over domain x language within each size and comparison.", "", curve_table(res), "",
            latency_markdown(lat),
            f"## Interleaving vs A/B at {res['power']['power']:.0%} power", "",
            f"Base vs each domain encoder on its held-out English queries, cascade user; looks at "
            f"{res['power']['min_decided']} x 2^j impressions, {res['power']['looks']} looks (Bonferroni); "
            f"undecided experiments count as never deciding.", "", power_table(res), "",
            "## Time per phase (s)", "", md_table(["phase", "seconds"], list(res["phases_seconds"].items()))]
    return "\n".join(out) + "\n"


def heatmap(path: Path, res: dict[str, Any]) -> Path:
    """The encoder x domain matrix (English): colour = nDCG@10 delta vs base, text = nDCG@10."""
    import numpy as np
    plt = pyplot()
    s = res["setup"]
    encs, doms = _encoders(res), s["domains"]
    mx, mean = res["quality"]["matrix"]["en"], res["quality"]["mean_ndcg"]
    delta = np.array([[mx[f"{e}|{d}"]["delta"] for d in doms] for e in encs])
    lim = max(1e-3, float(np.abs(delta).max()))
    fig, ax = plt.subplots(figsize=(1.6 * len(doms) + 3, 0.7 * (len(encs) + 1) + 1.5))
    im = ax.imshow(delta, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    for i, e in enumerate(encs):
        for j, d in enumerate(doms):
            r = mx[f"{e}|{d}"]
            mark = " +" if r["better"] else " -" if r["worse"] else ""
            ax.text(j, i, f"{r['mean_after']:.3f}{mark}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(doms)), [f"{d}\n(base {mean[f'{BASE}|{d}|en']:.3f})" for d in doms])
    ax.set_yticks(range(len(encs)), encs)
    ax.set_xlabel("held-out queries of domain")
    ax.set_ylabel("query encoder")
    ax.set_title("nDCG@10 by encoder and domain (colour: change vs base; +/- significant, Holm)")
    fig.colorbar(im, ax=ax, label="nDCG@10 - base")
    return save_figure(fig, path)


def learning_curve_plot(path: Path, res: dict[str, Any]) -> Path:
    """nDCG@10 change vs base on each domain's English queries, by training queries per domain."""
    s = res["setup"]
    series = {}
    for d in s["domains"]:
        series[f"{d} encoder"] = [res["quality"]["curve"][str(n)][f"{d}|en"]["own_vs_base"]["delta"] for n in s["sizes"]]
        series[f"general on {d}"] = [res["quality"]["curve"][str(n)][f"{d}|en"]["general_vs_base"]["delta"]
                                     for n in s["sizes"]]
    return plot_lines(path, s["sizes"], series, xlabel="training queries per domain", ylabel="nDCG@10 - base (en)",
                      title="Own-domain vs general encoder, by labelled queries", logx=True)
