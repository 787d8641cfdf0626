"""The tuning report: ``report.json`` (everything), ``report.md`` (the summary) and PNGs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from qswap.atomic import atomic_write_bytes, atomic_write_json
from qswap.tuning.run_report import RunReport

LEARNING_CURVES = "learning_curves.png"
HEATMAP = "language_matrix.png"


def plot_learning_curves(history: list[dict[str, Any]], best_epoch: int, path: Path) -> Path:
    """Train and validation loss (left axis) and validation errors (right axis) per epoch."""
    from qswap.plotting import pyplot, save_figure
    plt = pyplot()

    epochs = [h["epoch"] for h in history]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    tr = [(h["epoch"], h["train_loss"]) for h in history if h["train_loss"] is not None]
    if tr:
        ax.plot(*zip(*tr), label="train loss", color="tab:blue", alpha=0.6)
    ax.plot(epochs, [h["val_loss"] for h in history], label="validation loss", color="tab:blue", marker="o", ms=3)
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    ax2.plot(epochs, [h["val_errors"] for h in history], label="validation errors", color="tab:red",
             marker="s", ms=3)
    ax2.set_ylabel("validation errors")
    ax.axvline(best_epoch, color="gray", ls="--", lw=1, label=f"best epoch {best_epoch}")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="upper right")
    return save_figure(fig, path)


def _pct(v: Any) -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{100 * v:+.2f}%"


def _num(v: Any) -> str:
    if v is None:
        return "n/a"
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def _sig(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def _comparison_md(title: str, cmp: dict[str, Any]) -> list[str]:
    out = [f"### {title}", "", "| metric | base | tuned | improvement I |", "|---|---|---|---|"]
    for name, m in cmp["metrics"].items():
        out.append(f"| {name} | {_num(m['base'])} | {_num(m['tuned'])} | {_pct(m['improvement'])} |")
    if cmp.get("z_tests"):
        out += ["", "| errors (Z-test) | base | tuned | total | Z | verdict |", "|---|---|---|---|---|---|"]
        for name, z in cmp["z_tests"].items():
            out.append(f"| {name} | {z['errors_base']} | {z['errors_tuned']} | {z['total']} | "
                       f"{z['z']:+.2f} | {z['change']} |")
    return out + [""]


def render_markdown(report: RunReport) -> str:
    """The human summary of a tuning report."""
    enc, tr, g = report.encoder, report.training, report.guard
    out = [f"# Tuning report: {enc.name}@{enc.version}", "",
           f"- base: `{report.base.name}` (space {report.base.fingerprint})",
           f"- encoder kind: `{enc.kind}`; method `{report.method['kind']}`; "
           f"loss `{report.loss.get('loss')}`",
           f"- data: {report.data['source']}; splits {report.data['splits']}",
           f"- training: best epoch {tr['best_epoch']} of {len(tr['history']) - 1}, stopped by {tr['stopped']}, "
           f"{tr['steps']} steps, {tr['seconds_per_step'] * 1000:.1f} ms/step, wall {tr['wall_seconds']:.1f} s",
           f"- guard: {'passed' if g.passed else '**FAILED**'} ({len(g.checks)} checks)", ""]
    if tr["best_epoch"] == 0:
        out += ["No epoch improved both validation loss and validation errors: the encoder is the "
                "base model (kind `identity`).", ""]
    out += [f"![learning curves]({LEARNING_CURVES})", ""]
    ev = report.evaluation
    if "test" in ev:
        out += _comparison_md("Test split (own candidates)", ev["test"])
    if "retrieval" in ev:
        out += _comparison_md("Test split (full corpus retrieval)", ev["retrieval"])
    if "multilingual" in ev:
        c = ev["multilingual"]["counts"]
        out += ["### Languages (query x document)", "",
                f"{c['improved']} of {c['pairs']} pairs significantly improved, {c['worsened']} significantly "
                f"worsened ({ev['multilingual']['metric']}).", "", f"![language matrix]({HEATMAP})", "",
                "| query | document | I | Z | verdict |", "|---|---|---|---|---|"]
        for cell in ev["multilingual"]["cells"]:
            m = ev["multilingual"]["metric"]
            z = cell["z_tests"].get(m, {})
            out.append(f"| {cell['query_lang']} | {cell['doc_lang']} | {_pct(cell['metrics'][m]['improvement'])} | "
                       f"{z.get('z', 0):+.2f} | {z.get('change', 'n/a')} |")
        out.append("")
    if g.checks:
        out += ["### Guard (sentinel sets)", "",
                f"Decided by {g.test or 'the pooled Z-test'} at alpha {g.alpha or 0.05}; the pooled PND Z is "
                "reported, not decisive.", "",
                "| sentinel | n | nDCG@10 base | nDCG@10 tuned | wins/losses | p (Holm) | sign p | PND Z | verdict |",
                "|---|---|---|---|---|---|---|---|---|"]
        for c in g.checks:
            z = c.pnd.z if c.pnd is not None else None
            out.append(f"| {c.name} | {c.n} | {_num(c.before)} | {_num(c.after)} | {c.wins}/{c.losses} | "
                       f"{_sig(c.p_holm)} | {_sig(c.sign_p_value)} | {'n/a' if z is None else f'{z:+.2f}'} | "
                       f"{'**regressed**' if c.degraded else c.verdict} |")
        out.append("")
    layers = report.layers
    if layers and layers["changed_tensors"]:
        out += ["### Most changed layers", "", f"{layers['changed_tensors']} of {layers['compared_tensors']} "
                "tunable tensors changed.", "", "| criterion | layer | value |", "|---|---|---|"]
        for crit, rows in layers["most_changed"].items():
            for r in rows:
                out.append(f"| {crit} | {r['layer']} | {r[crit]:.6g} |")
        out.append("")
    return "\n".join(out)


def write_report(report: RunReport, folder: Path) -> list[Path]:
    """Write report.json, report.md and the learning-curve PNG into ``folder``; returns the files."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / "report.json", json.loads(json.dumps(report.to_dict(), default=_jsonable)))
    atomic_write_bytes(folder / "report.md", render_markdown(report).encode())
    files = [folder / "report.json", folder / "report.md",
             plot_learning_curves(report.training["history"], report.training["best_epoch"],
                                  folder / LEARNING_CURVES)]
    if (folder / HEATMAP).exists():
        files.append(folder / HEATMAP)
    return files


def _jsonable(o: Any) -> Any:
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"cannot serialise {type(o).__name__}")
