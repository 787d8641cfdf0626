"""Table and plot of the lr x method sweep: ``python table.py RUN_DIR... > table.md``.

Each RUN_DIR is an encoder directory written by ``qswap tune run`` (sweep.sh); everything comes
from its report.json: the training history, the held-out English test queries and the de/fr/it
cross-lingual cells (nDCG@10, per-query Wilcoxon signed-rank + Holm: the guard's test), and the
guard's verdict.
"""
import json
import sys
from pathlib import Path

from qswap.atomic import atomic_write_json
from qswap.bench.provenance import run_meta
from qswap.plotting import pyplot, save_figure

LANGS = ("en", "de", "fr", "it")


def row(run: Path) -> dict:
    r = json.loads((run / "report.json").read_text())
    t, cfg = r["training"], r["config"]
    cells = {c["query_lang"]: c["metrics"]["ndcg_at_10"] for c in r["evaluation"]["multilingual"]["cells"]}
    checks = {c["lang"]: c for c in r["guard"]["checks"] if c.get("against", "base") == "base"}
    return {"run": run.name, "method": cfg["method"]["kind"], "lr": t["config"]["lr"],
            "best_epoch": t["best_epoch"], "steps": t["steps"], "s_per_step": t["seconds_per_step"],
            "train_s": t["wall_seconds"], "total_s": r["wall_seconds_total"], "kind": r["encoder"]["kind"],
            "ndcg": {lg: cells[lg] for lg in LANGS if lg in cells},
            "tests": {lg: {k: checks[lg][k] for k in ("n", "delta", "p_holm", "verdict", "wins", "losses")}
                      for lg in LANGS if lg in checks},
            "guard": "passed" if r["guard"]["passed"] else "refused"}


def cell(x: dict, lg: str) -> str:
    n, t = x["ndcg"].get(lg), x["tests"].get(lg)
    if n is None or t is None:
        return "-"
    mark = {"improved": " ↑", "worsened": " **↓**"}.get(t["verdict"], "")
    return f"{n['tuned'] - n['base']:+.4f} (p {t['p_holm']:.2g}){mark}"


def main(runs: list[Path]) -> None:
    rows = sorted((row(r) for r in runs), key=lambda x: (x["method"], x["lr"]))
    # The standard results file (bench/results.py): provenance of this table's run, rows under "results".
    # The runs themselves were made by sweep.sh: record their commit and load in meta when committing.
    atomic_write_json(Path("results.json"), {"benchmark": "tuning_sweep", "meta": run_meta(),
                                             "results": {"runs": rows}})
    base = rows[0]["ndcg"]
    print("base nDCG@10: " + ", ".join(f"{lg} {base[lg]['base']:.4f}" for lg in LANGS if lg in base) + "\n")
    print("| method | lr | best epoch | steps | s/step | run wall (s) | saved as | Δ nDCG@10 en (held-out) | de | fr | it | guard |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['method']} | {x['lr']:g} | {x['best_epoch']} | {x['steps']} | {x['s_per_step']:.2f} | "
              f"{x['total_s']:.0f} | {x['kind']} | " + " | ".join(cell(x, lg) for lg in LANGS) + f" | {x['guard']} |")
    plt = pyplot()
    fig, axes = plt.subplots(1, len(LANGS), figsize=(4 * len(LANGS), 3.4), sharey=True)
    for ax, lg in zip(axes, LANGS):
        for method in sorted({x["method"] for x in rows}):
            xs = [x for x in rows if x["method"] == method and lg in x["ndcg"]]
            ax.plot([x["lr"] for x in xs], [x["ndcg"][lg]["tuned"] - x["ndcg"][lg]["base"] for x in xs],
                    marker="o", label=method)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(f"{lg} queries" + (" (trained)" if lg == "en" else ""))
        ax.set_xlabel("learning rate")
    axes[0].set_ylabel("Δ nDCG@10 vs base")
    axes[-1].legend()
    save_figure(fig, Path("sweep.png"))


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]])
