"""Compute planning: the cost formulas and Algorithm 1 of the compute-optimal paper.

Cost of tuning on D tokens, with N_F, N_B, N_U the non-embedding parameters used in the
forward pass, back-propagated through, and updated::

    C = 2 N_F D + 2 N_B D + 2 N_U D        (full fine-tuning: 6 N_F D;
                                             block freezing: 2 N_F D + 4 N_B D)

Algorithm 1: at a budget up to 9.06e16 FLOP full fine-tuning is optimal, above it LoRA
(rank 32 or 128 are the paper's good defaults; it finds 128 optimal overall). The paper
also picks the model size from its Pythia fits (figure 6); here the base model is given,
so N is fixed and the budget buys data. With a frozen text tower D counts query tokens;
embedding the documents once costs ``2 N_F D_docs`` and is taken from the budget first.
The wall time comes from a step time measured on this machine.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from qswap.errors import InvalidInputError
from qswap.tuning.methods import METHODS, MethodConfig, is_embedding

FULL_TO_LORA_BUDGET = 9.06e16
LORA_RANK = 128
SMALL_LORA_RANK = 32


@dataclass(frozen=True)
class MethodCost:
    """Parameter counts of one method and its FLOP per training token."""

    method: str
    n_forward: int
    n_backward: int
    n_updated: int

    @property
    def flops_per_token(self) -> int:
        return 2 * self.n_forward + 2 * self.n_backward + 2 * self.n_updated


def cost(n_forward: int, n_backward: int, n_updated: int, tokens: float) -> float:
    """``C = 2 N_F D + 2 N_B D + 2 N_U D``."""
    return 2.0 * (n_forward + n_backward + n_updated) * tokens


def _non_embedding(model: torch.nn.Module) -> dict[str, int]:
    return {n: p.numel() for n, p in model.named_parameters()
            if not is_embedding(n) and not n.startswith("pooler.")}


def method_cost(model: torch.nn.Module, cfg: MethodConfig) -> MethodCost:
    """N_F, N_B, N_U of a tuning method on ``model``."""
    cfg.validate()
    return MethodCost(cfg.kind, *cfg.method.counts(model, cfg, _non_embedding(model)))


def choose_method(budget: float) -> str:
    """Algorithm 1: ``full`` up to 9.06e16 FLOP, ``lora`` above."""
    return "full" if budget <= FULL_TO_LORA_BUDGET else "lora"


def choose_rank(model: torch.nn.Module) -> int:
    """The paper's rank: 128 (its overall optimum), 32 where 128 is not low rank for the model."""
    hidden = int(getattr(getattr(model, "config", None), "hidden_size", 1024))
    return LORA_RANK if LORA_RANK <= hidden // 4 else SMALL_LORA_RANK


@dataclass
class Plan:
    budget: float
    base: str
    method: str
    lora_rank: int | None
    n_non_embedding: int
    flops_per_token: int
    doc_flops: float
    tokens: float
    queries: float
    batches: float
    epochs: float
    tokens_per_query: int
    batch_size: int
    epoch_batches: int
    seconds_per_step: float | None = None
    wall_seconds: float | None = None
    alternative: dict[str, Any] | None = None

    def set_step_time(self, seconds: float, alternative_seconds: float | None = None) -> None:
        """Expected wall times from measured seconds per step (of the plan's method, and of
        the adiabatic alternative)."""
        self.seconds_per_step, self.wall_seconds = seconds, seconds * self.batches
        if alternative_seconds is not None and self.alternative is not None:
            self.alternative["seconds_per_step"] = alternative_seconds
            self.alternative["wall_seconds"] = alternative_seconds * self.alternative["batches"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_plan(budget: float, base: Any, *, tokens_per_query: int = 16, batch_size: int = 14,
              epoch_batches: int = 1000, doc_tokens: float = 0.0,
              seconds_per_step: float | None = None) -> Plan:
    """Method, data quantity and rank for ``budget`` FLOP on ``base`` (Algorithm 1)."""
    if budget <= 0:
        raise InvalidInputError(f"budget must be positive, got {budget}", "give FLOP, e.g. 1e16")
    if tokens_per_query < 1 or batch_size < 1:
        raise InvalidInputError("tokens per query and batch size must be >= 1", "give positive numbers")
    model = base.model
    method = choose_method(budget)
    rank = choose_rank(model) if METHODS[method].ranked else None
    mc = method_cost(model, MethodConfig(kind=method, lora_rank=rank or 1))
    n = sum(_non_embedding(model).values())
    doc_flops = 2.0 * n * doc_tokens
    left = budget - doc_flops
    if left <= 0:
        raise InvalidInputError(f"embedding the documents once ({doc_flops:.3g} FLOP) uses the whole budget",
                                "raise the budget or embed fewer documents")
    tokens = left / mc.flops_per_token
    queries = tokens / tokens_per_query
    batches = queries / batch_size
    plan = Plan(budget=budget, base=base.name, method=method, lora_rank=rank, n_non_embedding=n,
                flops_per_token=mc.flops_per_token, doc_flops=doc_flops, tokens=tokens, queries=queries,
                batches=batches, epochs=batches / epoch_batches, tokens_per_query=tokens_per_query,
                batch_size=batch_size, epoch_batches=epoch_batches)
    adiabatic = method_cost(model, MethodConfig(kind="partial"))
    plan.alternative = {"method": "partial", "flops_per_token": adiabatic.flops_per_token,
                        "tokens": left / adiabatic.flops_per_token,
                        "batches": left / adiabatic.flops_per_token / tokens_per_query / batch_size}
    if seconds_per_step is not None:
        plan.set_step_time(seconds_per_step)
    return plan


def measure_step_seconds(base: Any, cfg: MethodConfig, batch_size: int = 14, tokens_per_query: int = 16,
                         steps: int = 3) -> float:
    """Seconds of one training step (forward, backward, AdamW step) of the query tower here.

    Synthetic queries of ``tokens_per_query`` tokens and random frozen document embeddings:
    a step's cost does not depend on the text.
    """
    from qswap.tuning.losses import LossInput, TripletMarginLoss
    from qswap.tuning.methods import QueryTower
    from qswap.tuning.optim import make_optimizer

    tower = QueryTower(base, cfg)
    tower.model.train()
    opt = make_optimizer([p for _, p in tower.trainable_parameters()], "adamw", 1e-8)
    loss_fn = TripletMarginLoss()
    word = next((w for w in ("data", "the", "a") if base.tokenizer.token_to_id(w) is not None), "a")
    # Special tokens ([CLS], [SEP], prefix) take a few of the tokens; close enough for timing.
    text = " ".join([word] * max(1, tokens_per_query - 2))
    g = torch.Generator().manual_seed(0)
    p = torch.nn.functional.normalize(torch.randn(batch_size, base.dim, generator=g), dim=-1).to(base.device)
    n = torch.nn.functional.normalize(torch.randn(batch_size, 1, base.dim, generator=g), dim=-1).to(base.device)

    def step() -> None:
        loss = loss_fn(LossInput(tower.embed([text] * batch_size), p, n))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()  # warm-up: allocations, kernel selection
    if base.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if base.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def format_plan(plan: Plan) -> str:
    """Human-readable lines for ``qswap tune plan``."""
    lines = [
        f"budget            {plan.budget:.3g} FLOP on {plan.base} "
        f"(N = {plan.n_non_embedding / 1e6:.2f}M non-embedding parameters)",
        f"method            {'full fine-tuning' if plan.method == 'full' else 'LoRA'} "
        f"(Algorithm 1: {'<=' if plan.method == 'full' else '>'} {FULL_TO_LORA_BUDGET:.3g} FLOP)",
        f"LoRA rank         {plan.lora_rank if plan.lora_rank else '-'}",
        f"cost per token    {plan.flops_per_token:.3g} FLOP (2 N_F + 2 N_B + 2 N_U)",
    ]
    if plan.doc_flops:
        lines.append(f"documents, once   {plan.doc_flops:.3g} FLOP (2 N_F D_docs, frozen text tower)")
    lines += [
        f"data quantity     D = {plan.tokens:.3g} query tokens = {plan.queries:.3g} queries of "
        f"{plan.tokens_per_query} tokens = {plan.batches:.3g} batches of {plan.batch_size} "
        f"({plan.epochs:.3g} epochs of {plan.epoch_batches} batches)",
    ]
    if plan.wall_seconds is not None:
        lines.append(f"expected wall     {_duration(plan.wall_seconds)} "
                     f"({plan.seconds_per_step * 1000:.1f} ms per step measured here)")
    if plan.alternative:
        a = plan.alternative
        wall = (f", {_duration(a['wall_seconds'])} ({a['seconds_per_step'] * 1000:.1f} ms per step)"
                if a.get("wall_seconds") is not None else "")
        lines.append(f"adiabatic default partial (embeddings frozen): {a['flops_per_token']:.3g} FLOP/token, "
                     f"{a['tokens']:.3g} tokens = {a['batches']:.3g} batches for the same budget{wall}")
    return "\n".join(lines)


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"
