"""Print the per-language markdown table of an analyze.py JSON (used for RESULTS.md)."""
import json
import sys


def pct(v):
    return f"{100 * v:+.1f}%"


for path in sys.argv[1:]:
    a = json.load(open(path))
    print(f"\n`{path}`\n")
    print("| query lang | n | PND errors base → tuned | I | Z (pooled) | sig. | paired t (per query) | MRR base → tuned (I) "
          "| RR wins/losses, sign p | nDCG@10 base → tuned (I) | R@1 | R@10 | R@100 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for lang, c in a.items():
        p, m, n, r = c["pnd_errors"], c["mrr"], c["ndcg_at_10"], c["recall"]
        sig = ("improved" if p["z_pooled"] < 0 else "**worsened**") if p["significant_pooled"] else "n.s."
        rk = lambda k: f"{r[k]['base']:.3f} → {r[k]['tuned']:.3f} ({pct(r[k]['I'])})"
        print(f"| {lang} | {c['queries']} | {p['base']} → {p['tuned']} / {c['pairs']} | {pct(p['I'])} | {p['z_pooled']:+.2f} | {sig} "
              f"| {p['t_paired_per_query']:+.2f} | {m['base']:.4f} → {m['tuned']:.4f} ({pct(m['I'])}) "
              f"| {m['rr_wins']}/{m['rr_losses']}, p={m['sign_test_p']:.2g} "
              f"| {n['base']:.4f} → {n['tuned']:.4f} ({pct(n['I'])}) | {rk('1')} | {rk('10')} | {rk('100')} |")
