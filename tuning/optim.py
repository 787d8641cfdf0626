"""Optimisers, learning-rate schedules and batch-size scaling from the adiabatic paper.

- AdamW (the paper's default), Adamax with momentum (torch defaults) or without
  (beta1 = beta2 = 0, Table 20: keeps multilingual quality at higher rates), plain SGD;
- schedules (Table 19, t = optimiser step, T = planned steps): ``none``,
  ``L``: a0 (1 - t/T), ``Q``: a0 (1 - (t/T)^2), ``E0.95``: 0.95^t a0, ``E0.98``: 0.98^t a0;
- the square-root rule: lr proportional to sqrt(batch size) (Table 7).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from qswap.errors import InvalidInputError

from qswap.tuning.choices import LR_RULES, OPTIMIZERS, SCHEDULERS

PAPER_LR = 5e-8
PAPER_BATCH = 14


def sqrt_scaled_lr(batch_size: int, base_lr: float = PAPER_LR, base_batch: int = PAPER_BATCH) -> float:
    """Learning rate for ``batch_size`` by the square-root rule from ``base_lr`` at ``base_batch``.

    ``sqrt_scaled_lr(56)`` is 1e-7: the paper's Table 12 pairing with 5e-8 at batch 14.
    """
    if batch_size <= 0 or base_batch <= 0:
        raise InvalidInputError(f"batch sizes must be positive (got {batch_size}, {base_batch})",
                                "pass a batch size of at least 1")
    return base_lr * math.sqrt(batch_size / base_batch)


def make_optimizer(params: Iterable[torch.nn.Parameter], kind: str = "adamw", lr: float = PAPER_LR,
                   weight_decay: float = 0.01, momentum: bool = True, fused: bool = False) -> torch.optim.Optimizer:
    """Build the optimiser; ``momentum=False`` means beta1 = beta2 = 0 for Adamax (and AdamW)
    and no momentum for SGD. ``fused``: torch's fused kernel (AdamW, SGD; Adamax has none), one pass
    over each tensor per step instead of one per arithmetic operation (same update)."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise InvalidInputError("nothing to train: every parameter of the query tower is frozen",
                                "freeze fewer blocks or choose another method")
    if lr <= 0:
        raise InvalidInputError(f"learning rate must be positive, got {lr}", "the paper's default is 5e-8")
    betas = (0.9, 0.999) if momentum else (0.0, 0.0)
    if fused and kind not in ("adamw", "sgd"):
        raise InvalidInputError(f"torch has no fused {kind} optimiser", "drop --fused, or use adamw or sgd")
    impl = {"fused": True} if fused else {}
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, **impl)
    if kind == "adamax":
        return torch.optim.Adamax(params, lr=lr, weight_decay=weight_decay, betas=betas, **impl)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, momentum=0.9 if momentum else 0.0, **impl)
    raise InvalidInputError(f"unknown optimizer {kind!r}", f"use one of {', '.join(OPTIMIZERS)}")


def lr_factor(kind: str, step: int, total_steps: int) -> float:
    """Multiplier of the initial learning rate at optimiser step ``step`` (0-based) of ``total_steps``."""
    if kind == "none":
        return 1.0
    if kind in ("L", "Q"):
        frac = min(step / max(total_steps, 1), 1.0)
        return 1.0 - frac if kind == "L" else 1.0 - frac ** 2
    if kind in ("E0.95", "E0.98"):
        return float(kind[1:]) ** step
    raise InvalidInputError(f"unknown scheduler {kind!r}", f"use one of {', '.join(SCHEDULERS)}")


def make_scheduler(optimizer: torch.optim.Optimizer, kind: str,
                   total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR applying :func:`lr_factor`; call ``step()`` after each optimiser step."""
    lr_factor(kind, 0, total_steps)   # validate the name before building anything
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: lr_factor(kind, t, total_steps))
