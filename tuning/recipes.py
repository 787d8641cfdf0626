"""Named training settings for ``qswap tune run --recipe`` (no torch import: the CLI parser reads them).

``cpu`` (the default) is what the lr x method sweep on Debian chose (``bench/results/tuning_sweep/``):
lr 5e-7 improved English and made no language significantly worse, while the paper's 5e-8 changed no
validation error count in the same budget; 4 epochs of 100 batches of 14. Its speed settings, bf16
autocast where the device multiplies bf16 natively (``auto``), the fused AdamW kernel and no dropout,
passed the Debian quality check against the previous fp32/dropout settings together
(``bench/results/tuning/e2e-speed/``, docs/tuning.md).
``paper`` is the adiabatic paper's own schedule and settings (hours on a CPU).
``gpu`` (the default on a CUDA device) is ``cpu`` resolved for a GPU (:func:`resolve` with a
:class:`DeviceSpec`): fp32 instead of bf16 autocast (on an H200, bf16 autocast took 0.0328 s per step
of 14 queries, fp32 0.0245: the steps are launch-bound, and autocast adds casts), and a batch sized
to the device's memory (:func:`device_batch`) with the same queries per epoch (fewer, larger steps)
and the learning rate scaled by the square-root rule. Whether it keeps the ``cpu`` recipe's quality
is what ``qswap bench gpu``'s tuning phase measures (the guard's paired test).
Explicit options (``--lr``, ``--batch-size``, ``--precision``, ...) override the recipe; the resolved
settings are recorded in the encoder's ``report.json`` (``recipe``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

RECIPES: dict[str, dict[str, Any]] = {
    "cpu": {"lr": 5e-7, "epoch_batches": 100, "max_epochs": 4, "patience": 2, "batch_size": 14,
            "precision": "auto", "fused": True, "dropout": False, "freeze_blocks": 0},
    "gpu": {"lr": 5e-7, "epoch_batches": 100, "max_epochs": 4, "patience": 2, "batch_size": "auto",
            "precision": "auto", "fused": True, "dropout": False, "freeze_blocks": 0},
    "paper": {"lr": 5e-8, "epoch_batches": 1000, "max_epochs": 100, "patience": 10, "batch_size": 14,
              "precision": "fp32", "fused": False, "dropout": True, "freeze_blocks": 0},
}
#: The batch the ``cpu`` recipe's learning rate and epoch length were chosen for.
BASE_BATCH = 14


@dataclass(frozen=True)
class DeviceSpec:
    """What a recipe needs to know of the device it trains on.

    ``fast_bf16``: the device multiplies bf16 natively (AMX / AVX-512-BF16 / tensor cores).
    ``memory_gib``: the accelerator's memory (0 for a CPU).
    """

    kind: str                 # "cpu" or "cuda"
    name: str = ""
    fast_bf16: bool = False
    memory_gib: float = 0.0


def device_spec(device: str | None = None) -> DeviceSpec:
    """The :class:`DeviceSpec` of ``device`` (default: CUDA when present, else the CPU)."""
    import torch

    from qswap.encoders.precision import has_fast_bf16

    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(dev.index or 0)
        return DeviceSpec("cuda", p.name, has_fast_bf16(dev), round(p.total_memory / 2**30, 1))
    return DeviceSpec(dev.type, "cpu", has_fast_bf16(dev))


def default_recipe(spec: DeviceSpec) -> str:
    """``gpu`` on a CUDA device, ``cpu`` elsewhere."""
    return "gpu" if spec.kind == "cuda" else "cpu"


def device_batch(spec: DeviceSpec) -> int:
    """Queries per step on ``spec``: 14 on a CPU and on GPUs under 16 GiB, 28 up to 40 GiB, 56 above
    (each step's activations for 56 queries, their positives and negatives, fit a few GiB)."""
    if spec.kind != "cuda":
        return BASE_BATCH
    return BASE_BATCH * (4 if spec.memory_gib >= 40 else 2 if spec.memory_gib >= 16 else 1)


def resolve(recipe: str, spec: DeviceSpec | None = None, **given: Any) -> dict[str, Any]:
    """The recipe's settings for the device ``spec``, each replaced by the caller's where given
    (not ``None``).

    ``precision: auto`` becomes fp32 on a CUDA device (bf16 autocast measured slower there) and
    bf16 on a CPU that multiplies bf16 natively, else fp32. ``batch_size: auto`` becomes
    :func:`device_batch`; the epoch then keeps the recipe's queries per epoch and the learning
    rate follows the square-root rule from batch 14 (``lr_rule: sqrt``), unless given.

    Args:
        recipe: a name of :data:`RECIPES`.
        spec: the device (default: a CPU without native bf16).
        given: explicit settings (``None`` means "the recipe's").

    Returns:
        Every setting of the recipe, resolved for the device and overridden where given.
    """
    spec = spec or DeviceSpec("cpu")
    out = dict(RECIPES[recipe])
    out["lr_rule"] = "none"
    if out["batch_size"] == "auto" and given.get("batch_size") is None:
        batch = device_batch(spec)
        out["batch_size"] = batch
        out["epoch_batches"] = max(1, math.ceil(out["epoch_batches"] * BASE_BATCH / batch))
        out["lr_rule"] = "sqrt"
    out.update({k: v for k, v in given.items() if v is not None})
    if out["batch_size"] == "auto":
        out["batch_size"] = device_batch(spec)
    if out["precision"] == "auto":
        out["precision"] = "bf16" if spec.kind == "cpu" and spec.fast_bf16 else "fp32"
    return out


def describe(recipe: str) -> str:
    """One line of a recipe's settings, for ``--help``."""
    r = RECIPES[recipe]
    epoch = (f"{r['epoch_batches']} batches of {r['batch_size']}" if r["batch_size"] != "auto"
             else f"{r['epoch_batches'] * BASE_BATCH:,} queries in batches sized to the GPU")
    return (f"lr {r['lr']:g}, {r['max_epochs']} epochs of {epoch}, "
            f"patience {r['patience']}, precision {r['precision']}, fused optimiser {'on' if r['fused'] else 'off'}, "
            f"dropout {'on' if r['dropout'] else 'off'}, {r['freeze_blocks']} frozen blocks")
