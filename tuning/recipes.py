"""Named training settings for ``qswap tune run --recipe`` (no torch import: the CLI parser reads them).

``cpu`` (the default) is what the lr x method sweep on Debian chose (``bench/results/tuning_sweep/``):
lr 5e-7 improved English and made no language significantly worse, while the paper's 5e-8 changed no
validation error count in the same budget; 4 epochs of 100 batches of 14. Its speed settings, bf16
autocast where the device multiplies bf16 natively (``auto``), the fused AdamW kernel and no dropout,
passed the Debian quality check against the previous fp32/dropout settings together
(``bench/results/tuning/e2e-speed/``, docs/tuning.md).
``paper`` is the adiabatic paper's own schedule and settings (hours on a CPU).
Explicit options (``--lr``, ``--batch-size``, ``--precision``, ...) override the recipe; the resolved
settings are recorded in the encoder's ``report.json`` (``recipe``).
"""

from __future__ import annotations

from typing import Any

RECIPES: dict[str, dict[str, Any]] = {
    "cpu": {"lr": 5e-7, "epoch_batches": 100, "max_epochs": 4, "patience": 2, "batch_size": 14,
            "precision": "auto", "fused": True, "dropout": False, "freeze_blocks": 0},
    "paper": {"lr": 5e-8, "epoch_batches": 1000, "max_epochs": 100, "patience": 10, "batch_size": 14,
              "precision": "fp32", "fused": False, "dropout": True, "freeze_blocks": 0},
}


def resolve(recipe: str, **given: Any) -> dict[str, Any]:
    """The recipe's settings, each replaced by the caller's where given (not ``None``).

    Args:
        recipe: a name of :data:`RECIPES`.
        given: explicit settings (``None`` means "the recipe's").

    Returns:
        Every setting of the recipe, overridden where given.
    """
    out = dict(RECIPES[recipe])
    out.update({k: v for k, v in given.items() if v is not None})
    return out


def describe(recipe: str) -> str:
    """One line of a recipe's settings, for ``--help``."""
    r = RECIPES[recipe]
    return (f"lr {r['lr']:g}, {r['max_epochs']} epochs of {r['epoch_batches']} batches of {r['batch_size']}, "
            f"patience {r['patience']}, precision {r['precision']}, fused optimiser {'on' if r['fused'] else 'off'}, "
            f"dropout {'on' if r['dropout'] else 'off'}, {r['freeze_blocks']} frozen blocks")
