"""Named training schedules for ``qswap tune run --recipe`` (no torch import: the CLI parser reads them).

``cpu`` (the default) is what the lr x method sweep on Debian chose (``bench/results/tuning_sweep/``):
lr 5e-7 improved English and made no language significantly worse, while the paper's 5e-8 changed no
validation error count in the same budget; 4 epochs of 100 batches keep a 10,000-document English run
within about 10 minutes on 2 CPU cores. ``paper`` is the adiabatic paper's own schedule (hours on a CPU).
Explicit ``--lr/--epoch-batches/--max-epochs/--patience`` override the recipe.
"""

from __future__ import annotations

RECIPES: dict[str, dict[str, float]] = {
    "cpu": {"lr": 5e-7, "epoch_batches": 100, "max_epochs": 4, "patience": 2},
    "paper": {"lr": 5e-8, "epoch_batches": 1000, "max_epochs": 100, "patience": 10},
}


def resolve(recipe: str, **given: float | None) -> dict[str, float]:
    """The recipe's values, each replaced by the caller's where given (not ``None``)."""
    out = dict(RECIPES[recipe])
    out.update({k: v for k, v in given.items() if v is not None})
    return out
