"""The epoch loop of adiabatic tuning: fixed-size epochs, validation, early stopping.

Paper defaults (appendix E): an epoch is 1000 batches of 14; after each epoch the
validation loss and the validation error count (pairs whose positive is not closer than
the negative) are measured; the model counts as improved only if *both* decreased below
the best so far; training stops after 10 consecutive idle epochs; the best epoch's
weights are kept (epoch 0 is the untuned base: if nothing improves, nothing changes).
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from qswap.encoders.precision import autocast_context, check_precision
from qswap.errors import InvalidInputError
from qswap.tuning.losses import LossInput
from qswap.tuning.losses.similarity import pairwise_similarity, rowwise_similarity
from qswap.tuning.methods import QueryTower
from qswap.tuning.optim import PAPER_BATCH, PAPER_LR, make_optimizer, make_scheduler
from qswap.tuning.queries import QueryTokens


@dataclass
class TrainConfig:
    """Optimisation settings; defaults are the adiabatic paper's."""

    lr: float = PAPER_LR
    batch_size: int = PAPER_BATCH
    epoch_batches: int = 1000
    max_epochs: int = 100
    patience: int = 10
    optimizer: str = "adamw"
    momentum: bool = True
    weight_decay: float = 0.01
    scheduler: str = "none"
    seed: int = 0
    dropout: bool = True        # train mode during steps (as sentence-transformers' fit)
    precision: str = "fp32"     # "bf16": forward passes (training and validation) under bf16 autocast
    fused: bool = False         # the optimiser's fused kernel: one pass over each tensor per step

    def validate(self) -> "TrainConfig":
        for name in ("batch_size", "epoch_batches", "max_epochs", "patience"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"{name} must be >= 1, got {getattr(self, name)}", "give a positive number")
        check_precision(self.precision)
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EncodedSet:
    """Samples in index form: query texts, positive and negative rows of ``docs``."""

    queries: list[str]
    pos: np.ndarray            # (n,) row of each query's (first) positive
    neg: np.ndarray            # (n, H) rows of its negatives, -1 where it has fewer than H
    docs: torch.Tensor         # (n_docs, dim) frozen document embeddings

    def __len__(self) -> int:
        return len(self.queries)

    def batch(self, idx: Sequence[int]) -> tuple[list[str], torch.Tensor, torch.Tensor | None,
                                                 torch.Tensor | None, torch.Tensor]:
        """(query texts, positives, negatives, negative mask, positive ids) of rows ``idx``."""
        idx = np.asarray(idx)
        dev = self.docs.device        # every tensor of a batch lives where the documents do
        pos_rows = torch.as_tensor(self.pos[idx], device=dev)
        p = self.docs[pos_rows]
        if self.neg.shape[1] == 0:
            return [self.queries[i] for i in idx], p, None, None, pos_rows
        neg_rows = self.neg[idx]
        mask = torch.as_tensor(neg_rows >= 0, device=dev)
        n = self.docs[torch.as_tensor(np.maximum(neg_rows, 0), device=dev)]
        return [self.queries[i] for i in idx], p, n, mask, pos_rows


@dataclass
class EpochRecord:
    epoch: int
    train_loss: float | None
    val_loss: float
    val_errors: int
    val_pairs: int
    lr: float
    improved: bool
    seconds: float


@dataclass
class TrainResult:
    history: list[EpochRecord]
    best_epoch: int
    stopped: str                 # "patience" | "max_epochs"
    steps: int
    wall_seconds: float
    seconds_per_step: float
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["history"] = [asdict(h) for h in self.history]
        return d


class EarlyStopping:
    """Counts idle epochs; an epoch improves only if loss *and* errors beat the best so far."""

    def __init__(self, patience: int, best_loss: float, best_errors: int) -> None:
        self.patience = patience
        self.best_loss = best_loss
        self.best_errors = best_errors
        self.best_epoch = 0
        self.idle = 0

    def update(self, epoch: int, loss: float, errors: int) -> bool:
        """Record one validation; True if it is the new best."""
        if loss < self.best_loss and errors < self.best_errors:
            self.best_loss, self.best_errors, self.best_epoch, self.idle = loss, errors, epoch, 0
            return True
        self.idle += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.idle >= self.patience


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch (dropout, LoRA init) for a reproducible run."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _batches(n: int, size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Endless stream of batches from reshuffled passes; no batch repeats a sample."""
    while True:
        order = rng.permutation(n)
        for s in range(0, n - size + 1, size):
            yield order[s:s + size]


def _metric_of(loss_fn: Any) -> str:
    while hasattr(loss_fn, "inner"):
        loss_fn = loss_fn.inner
    if hasattr(loss_fn, "metric"):
        return loss_fn.metric
    return getattr(getattr(loss_fn, "contrastive", None), "metric", "cos")


def count_errors(x: LossInput, metric: str) -> tuple[int, int]:
    """(errors, pairs): pairs whose positive is not closer than the negative.

    Negatives are the hard negatives when the batch has any, else the other in-batch positives.
    """
    s_pos = rowwise_similarity(x.q, x.p, metric)
    mask = x.negatives_mask()
    if mask is not None and bool(mask.any()):
        s_neg = rowwise_similarity(x.q.unsqueeze(1), x.n, metric)
        err = (s_neg >= s_pos.unsqueeze(1)) & mask
        return int(err.sum()), int(mask.sum())
    s = pairwise_similarity(x.q, x.p, metric)
    b = x.q.shape[0]
    valid = ~torch.eye(b, dtype=torch.bool, device=x.q.device)
    if x.pos_ids is not None:
        valid &= x.pos_ids.view(1, -1) != x.pos_ids.view(-1, 1)
    err = (s >= s_pos.unsqueeze(1)) & valid
    return int(err.sum()), int(valid.sum())


def validate(tower: QueryTower, loss_fn: Callable[[LossInput], torch.Tensor], data: EncodedSet,
             batch_size: int, tokens: QueryTokens | None = None,
             precision: str = "fp32") -> tuple[float, int, int]:
    """(mean loss, errors, pairs) over fixed, in-order batches of the validation set.

    ``tokens``: the run's token memo (default: a new one); ``precision``: as in training.
    """
    tokens = tokens or tower.tokens()
    was_training = tower.model.training
    tower.model.eval()
    total_loss, total_n, errors, pairs = 0.0, 0, 0, 0
    metric = _metric_of(loss_fn)
    try:
        with torch.inference_mode():
            # Batches of batch_size..2*batch_size-1 rows: no short last batch, whose in-batch
            # loss would not be comparable with the others.
            for idx in np.array_split(np.arange(len(data)), max(1, len(data) // batch_size)):
                texts, p, n, mask, pos_ids = data.batch(idx)
                with autocast_context(p.device, precision):
                    q = tower.embed_ids(*tokens.batch(texts, p.device))
                x = LossInput(q.float(), p, n, mask, pos_ids)
                total_loss += float(loss_fn(x)) * len(idx)
                total_n += len(idx)
                e, pr = count_errors(x, metric)
                errors, pairs = errors + e, pairs + pr
    finally:
        tower.model.train(was_training)
    return total_loss / max(total_n, 1), errors, pairs


def train(tower: QueryTower, loss_fn: Callable[[LossInput], torch.Tensor], train_set: EncodedSet,
          val_set: EncodedSet, cfg: TrainConfig, progress: bool = True,
          tokens: QueryTokens | None = None) -> TrainResult:
    """Tune ``tower`` in place; on return it holds the best epoch's weights.

    ``tokens``: the run's token memo (default: a new one); every query is tokenised once.
    """
    cfg.validate()
    if len(train_set) < cfg.batch_size:
        raise InvalidInputError(f"{len(train_set)} training samples are fewer than one batch of {cfg.batch_size}",
                                "use more data or a smaller --batch-size")
    if len(val_set) == 0:
        raise InvalidInputError("the validation set is empty", "give a validation size of at least 1")
    seed_everything(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    params = [p for _, p in tower.trainable_parameters()]
    opt = make_optimizer(params, cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.momentum, fused=cfg.fused)
    tokens = tokens or tower.tokens()
    tokens.ids(train_set.queries + val_set.queries)   # once, before the clock of the first step
    dev = train_set.docs.device
    sched = make_scheduler(opt, cfg.scheduler, cfg.max_epochs * cfg.epoch_batches)
    best_state = tower.trainable_state()
    t0 = time.perf_counter()
    v_loss, v_err, v_pairs = validate(tower, loss_fn, val_set, cfg.batch_size, tokens, cfg.precision)
    history = [EpochRecord(0, None, v_loss, v_err, v_pairs, cfg.lr, False, time.perf_counter() - t0)]
    stopper = EarlyStopping(cfg.patience, v_loss, v_err)
    stream = _batches(len(train_set), cfg.batch_size, rng)
    steps, step_seconds, stopped = 0, 0.0, "max_epochs"
    for epoch in range(1, cfg.max_epochs + 1):
        e0 = time.perf_counter()
        tower.model.train(cfg.dropout)
        lr_now = opt.param_groups[0]["lr"]
        running, bar = 0.0, _progress_bar(cfg.epoch_batches, epoch) if progress else None
        for b in range(cfg.epoch_batches):
            s0 = time.perf_counter()
            texts, p, n, mask, pos_ids = train_set.batch(next(stream))
            with autocast_context(dev, cfg.precision):
                q = tower.embed_ids(*tokens.batch(texts, dev))
            loss = loss_fn(LossInput(q.float(), p, n, mask, pos_ids))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            steps += 1
            step_seconds += time.perf_counter() - s0
            running += float(loss.detach())
            if bar is not None:
                bar.update(1)
                if b % 10 == 0 or b == cfg.epoch_batches - 1:
                    bar.set_postfix(loss=f"{running / (b + 1):.4f}", best_val_err=stopper.best_errors)
        v_loss, v_err, v_pairs = validate(tower, loss_fn, val_set, cfg.batch_size, tokens, cfg.precision)
        improved = stopper.update(epoch, v_loss, v_err)
        if improved:
            best_state = tower.trainable_state()
        history.append(EpochRecord(epoch, running / cfg.epoch_batches, v_loss, v_err, v_pairs, lr_now,
                                   improved, time.perf_counter() - e0))
        if bar is not None:
            bar.set_postfix(loss=f"{running / cfg.epoch_batches:.4f}", val_loss=f"{v_loss:.4f}",
                            val_err=v_err, idle=stopper.idle)
            bar.close()
        if stopper.should_stop:
            stopped = "patience"
            break
    tower.load_trainable_state(best_state)
    tower.model.eval()
    return TrainResult(history=history, best_epoch=stopper.best_epoch, stopped=stopped, steps=steps,
                       wall_seconds=time.perf_counter() - t0,
                       seconds_per_step=step_seconds / max(steps, 1), config=cfg.to_dict())


def _progress_bar(total: int, epoch: int):
    from tqdm import tqdm
    return tqdm(total=total, desc=f"epoch {epoch}", unit="batch", file=sys.stderr, leave=False,
                dynamic_ncols=True)
