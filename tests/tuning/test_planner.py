"""Cost formulas and Algorithm 1 on the tiny BERT (2 blocks, hidden 32, FFN 64)."""

from __future__ import annotations

import pytest

from qswap.errors import InvalidInputError
from qswap.tuning.methods import MethodConfig, lora_parameters
from qswap.tuning.planner import (FULL_TO_LORA_BUDGET, choose_method, cost, format_plan, make_plan,
                                  measure_step_seconds, method_cost)

# per block: 4 attention dense (32x32 + 32) + LayerNorm 64 + FFN in (32x64 + 64) + out (64x32 + 32) + LayerNorm 64
BLOCK = 4 * (32 * 32 + 32) + 64 + (32 * 64 + 64) + (64 * 32 + 32) + 64
N = 2 * BLOCK


def test_cost_formula():
    assert cost(10, 10, 10, 1000) == 6 * 10 * 1000
    assert cost(10, 4, 4, 1000) == 2 * 10 * 1000 + 4 * 4 * 1000      # block freezing form


def test_method_costs_by_hand(tiny_base):
    m = tiny_base.model
    full = method_cost(m, MethodConfig("full"))
    assert (full.n_forward, full.n_backward, full.n_updated) == (N, N, N)
    assert full.flops_per_token == 6 * N
    frozen1 = method_cost(m, MethodConfig("partial", freeze_blocks=1))
    assert (frozen1.n_forward, frozen1.n_backward, frozen1.n_updated) == (N, BLOCK, BLOCK)
    od = method_cost(m, MethodConfig("partial", freeze_output_dense=True))
    assert od.n_updated == N - 2 * 64 * 32
    bias = method_cost(m, MethodConfig("bias"))
    assert bias.n_updated == 2 * (4 * 32 + 32 + 64 + 32 + 32) and bias.n_backward == N
    # LoRA r on every dense layer: r (in + out) each: 4 x 64r + 96r + 96r per block
    assert lora_parameters(m, 4) == 2 * (4 * 64 + 96 + 96) * 4
    lora = method_cost(m, MethodConfig("lora", lora_rank=4))
    assert lora.n_updated == 3584 and lora.n_forward == N + 3584


def test_algorithm_1_threshold():
    assert choose_method(FULL_TO_LORA_BUDGET) == "full"
    assert choose_method(FULL_TO_LORA_BUDGET * 1.01) == "lora"


def test_plan_buys_data_with_the_budget(tiny_base):
    p = make_plan(6e12, tiny_base, tokens_per_query=10, batch_size=5, epoch_batches=100, doc_tokens=1e6)
    assert p.method == "full" and p.lora_rank is None
    assert p.tokens == pytest.approx((6e12 - 2 * N * 1e6) / (6 * N))
    assert p.batches == pytest.approx(p.tokens / 10 / 5)
    assert p.epochs == pytest.approx(p.batches / 100)
    big = make_plan(1e18, tiny_base)
    assert big.method == "lora" and big.lora_rank == 32    # 128 is not low rank for hidden 32
    with pytest.raises(InvalidInputError):
        make_plan(1e3, tiny_base, doc_tokens=1e6)


def test_measured_step_time_gives_the_wall_time(tiny_base):
    s = measure_step_seconds(tiny_base, MethodConfig("full"), batch_size=4, tokens_per_query=8, steps=1)
    assert 0 < s < 30
    p = make_plan(1e12, tiny_base, seconds_per_step=s)
    assert p.wall_seconds == pytest.approx(s * p.batches)
    text = format_plan(p)
    assert "full fine-tuning" in text and "expected wall" in text
