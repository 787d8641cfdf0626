"""Optimisers, the paper's schedulers (Table 19) and the square-root batch rule."""

from __future__ import annotations

import pytest
import torch

from qswap.errors import InvalidInputError
from qswap.tuning.optim import lr_factor, make_optimizer, make_scheduler, sqrt_scaled_lr


def test_sqrt_rule_matches_the_papers_pairing():
    assert sqrt_scaled_lr(56) == pytest.approx(1e-7)          # Table 12: batch 56 at 1e-7
    assert sqrt_scaled_lr(14) == pytest.approx(5e-8)
    assert sqrt_scaled_lr(28, base_lr=2e-8) == pytest.approx(2e-8 * 2 ** 0.5)


@pytest.mark.parametrize("kind,t,expected", [
    ("none", 7, 1.0), ("L", 25, 0.75), ("Q", 50, 0.75), ("E0.95", 2, 0.95 ** 2), ("E0.98", 3, 0.98 ** 3),
    ("L", 200, 0.0),
])
def test_scheduler_factors(kind, t, expected):
    assert lr_factor(kind, t, 100) == pytest.approx(expected)


def test_scheduler_drives_the_optimizer():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = make_optimizer([p], "adamw", lr=1e-3)
    sched = make_scheduler(opt, "L", total_steps=4)
    lrs = []
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(2)
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1e-3, 0.75e-3, 0.5e-3])


def test_adamax_without_momentum_has_zero_betas():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = make_optimizer([p], "adamax", lr=1e-3, momentum=False)
    assert isinstance(opt, torch.optim.Adamax) and opt.param_groups[0]["betas"] == (0.0, 0.0)
    # beta1 = beta2 = 0: the step is lr * g / |g|, a sign step
    p.grad = torch.tensor([4.0, -0.5])
    opt.step()
    assert p.detach().tolist() == pytest.approx([-1e-3, 1e-3], rel=1e-4)


def test_bad_optimizer_settings_are_named_errors():
    p = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(InvalidInputError):
        make_optimizer([p], "lion")
    with pytest.raises(InvalidInputError):
        make_optimizer([torch.nn.Parameter(torch.zeros(1), requires_grad=False)])
    with pytest.raises(InvalidInputError):
        lr_factor("cosine", 0, 10)
