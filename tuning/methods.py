"""The trainable query tower: which tensors of a copy of the base may change, and export.

Methods (adiabatic paper; compute-optimal paper):

- ``partial`` (default): everything but the embedding block trains (the paper's best
  option for keeping multilingual quality); ``freeze_output_dense`` also freezes
  ``output.dense.weight`` of every block (extends the safe lr range), ``freeze_blocks``
  the first k blocks (block freezing). Exports the trainable tensors (kind ``partial``).
- ``bias``: only bias vectors outside the embedding block (BitFit). Exports the biases
  that changed (kind ``bias``).
- ``lora``: peft LoRA on every dense layer of the blocks (or ``lora_targets``). Exports
  peft's ``save_pretrained`` directory (kind ``lora``).
- ``full``: every tensor, embeddings included. Exports all tensors (kind ``partial``).

The tower is a copy of ``base.model`` that *shares* every frozen tensor with it (the base
also embeds documents and must never change), so only trainable tensors take new memory.
"""

from __future__ import annotations

import copy
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qswap.encoders import BaseModel, embed_batch, tokenize_batch
from qswap.encoders.embedding import encode_texts
from qswap.errors import InvalidInputError

METHODS = ("partial", "bias", "lora", "full")
_BLOCK = re.compile(r"(?:^|\.)(?:layer|layers|block|blocks)\.(\d+)\.")
_FFN_OUT_WEIGHT = re.compile(r"(?:^|\.)(?:layer|layers|block|blocks)\.\d+\.output\.dense\.weight$")


def block_of(name: str) -> int | None:
    """Index of the transformer block a parameter belongs to, or None (embeddings, pooler)."""
    m = _BLOCK.search(name)
    return int(m.group(1)) if m else None


def is_embedding(name: str) -> bool:
    """Parameters of the embedding block: word/position/token-type embeddings and their LayerNorm."""
    return name.startswith("embeddings.") or ".embeddings." in name


def _is_pooler(name: str) -> bool:
    # Pooled output heads are unused by mean/cls pooling of the last hidden state.
    return name.startswith("pooler.")


@dataclass
class MethodConfig:
    """How the query tower is tuned; see the module docstring."""

    kind: str = "partial"
    freeze_output_dense: bool = False
    freeze_blocks: int = 0
    lora_rank: int = 32
    lora_alpha: float | None = None        # default: equal to the rank (scaling 1)
    lora_dropout: float = 0.0
    lora_targets: list[str] | None = None  # default: every nn.Linear inside the blocks

    def validate(self) -> "MethodConfig":
        if self.kind not in METHODS:
            raise InvalidInputError(f"unknown tuning method {self.kind!r}", f"use one of {', '.join(METHODS)}")
        if self.kind != "partial" and (self.freeze_output_dense or self.freeze_blocks):
            raise InvalidInputError(
                f"--freeze-output-dense / --freeze-blocks apply to method 'partial', not {self.kind!r}",
                "drop the option or use --method partial")
        if self.freeze_blocks < 0:
            raise InvalidInputError(f"freeze_blocks must be >= 0, got {self.freeze_blocks}", "give a block count")
        if self.kind == "lora" and self.lora_rank < 1:
            raise InvalidInputError(f"LoRA rank must be >= 1, got {self.lora_rank}", "32 or 128 are good defaults")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def trainable_names(model: torch.nn.Module, cfg: MethodConfig) -> list[str]:
    """Names of the base parameters that train under ``cfg`` (empty for LoRA: it adds its own)."""
    cfg.validate()
    out = []
    for name, _ in model.named_parameters():
        if cfg.kind == "lora" or _is_pooler(name):
            continue
        if cfg.kind == "full":
            out.append(name)
        elif cfg.kind == "bias":
            if name.endswith(".bias") and not is_embedding(name):
                out.append(name)
        else:
            b = block_of(name)
            if is_embedding(name) or b is None or b < cfg.freeze_blocks:
                continue
            if cfg.freeze_output_dense and _FFN_OUT_WEIGHT.search(name):
                continue
            out.append(name)
    return out


def default_lora_targets(model: torch.nn.Module) -> list[str]:
    """Full names of every ``nn.Linear`` inside the transformer blocks ("all dense layers")."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and block_of(n + ".") is not None]


@dataclass
class ExportedAdapter:
    """What :func:`qswap.encoders.save_encoder` needs for one tuned tower."""

    kind: str
    tensors: dict[str, torch.Tensor] | None = None
    lora_dir: Path | None = None
    stats: dict[str, Any] = field(default_factory=dict)


class QueryTower:
    """A trainable copy of the base model used as the query encoder."""

    def __init__(self, base: BaseModel, cfg: MethodConfig) -> None:
        self.base = base
        self.cfg = cfg.validate()
        names = set(trainable_names(base.model, cfg))
        if cfg.kind != "lora" and not names:
            raise InvalidInputError(f"method {cfg.kind!r} leaves nothing to train in {base.name}",
                                    "freeze fewer blocks or choose another method")
        params = dict(base.model.named_parameters())
        shared = [p for n, p in params.items() if n not in names] + list(base.model.buffers())
        model = copy.deepcopy(base.model, {id(t): t for t in shared})
        for n, p in model.named_parameters():
            p.requires_grad_(n in names)
        if cfg.kind == "lora":
            from peft import LoraConfig, get_peft_model
            targets = cfg.lora_targets or default_lora_targets(base.model)
            lcfg = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha or cfg.lora_rank,
                              lora_dropout=cfg.lora_dropout, target_modules=targets, bias="none")
            try:
                model = get_peft_model(model, lcfg)
            except ValueError as e:
                raise InvalidInputError(f"LoRA targets do not fit {base.name}: {str(e).splitlines()[0]}",
                                        "name nn.Linear modules of the model, e.g. query,value") from None
        self.model = model
        self._base_names = {id(p): n for n, p in params.items()}

    # -- parameters ---------------------------------------------------------------------------

    def trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """A detached copy of every trainable tensor (a best-epoch snapshot)."""
        return {n: p.detach().clone() for n, p in self.trainable_parameters()}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.trainable_parameters():
                p.copy_(state[n])

    def parameter_counts(self) -> dict[str, int]:
        trainable = sum(p.numel() for _, p in self.trainable_parameters())
        total = sum(p.numel() for p in self.base.model.parameters())
        return {"trainable": trainable, "base_total": total}

    # -- encoding -----------------------------------------------------------------------------

    def embed(self, texts: list[str]) -> torch.Tensor:
        """Query embeddings with grad (training forward)."""
        ids, mask = tokenize_batch(self.base.tokenizer, texts, self.base.spec.query_prefix, self.base.device)
        return embed_batch(self.model, ids, mask, self.base.spec)

    def encode(self, texts: list[str], batch_size: int = 64, progress: bool = False) -> np.ndarray:
        """Query embeddings for evaluation (eval mode, no grad), float32 (n, dim)."""
        was_training = self.model.training
        self.model.eval()
        try:
            return encode_texts(lambda i, m: embed_batch(self.model, i, m, self.base.spec),
                                self.base.tokenizer, texts, self.base.spec.query_prefix, batch_size,
                                self.base.device, self.base.dim, progress, "encoding queries")
        finally:
            self.model.train(was_training)

    # -- export -------------------------------------------------------------------------------

    def tuned_tensors(self) -> dict[str, torch.Tensor]:
        """Base parameter name -> tuned tensor, for every tensor the tuning can change
        (LoRA: merged weights of the adapted layers)."""
        if self.cfg.kind != "lora":
            return {n: p.detach() for n, p in self.trainable_parameters()}
        from peft.tuners.lora import LoraLayer
        out = {}
        for m in self.model.modules():
            if isinstance(m, LoraLayer):
                w = m.get_base_layer().weight
                out[self._base_names[id(w)]] = (w + m.get_delta_weight("default")).detach()
        return out

    def export(self, workdir: Path | None = None) -> ExportedAdapter:
        """The adapter for ``save_encoder``; LoRA writes peft's directory under ``workdir``."""
        if self.cfg.kind == "lora":
            d = Path(tempfile.mkdtemp(prefix="lora-", dir=workdir))
            self.model.save_pretrained(str(d))
            return ExportedAdapter(kind="lora", lora_dir=d, stats=self.parameter_counts())
        base = dict(self.base.model.named_parameters())
        tensors = {n: t.to("cpu").clone() for n, t in self.tuned_tensors().items()}
        if self.cfg.kind == "bias":
            tensors = {n: t for n, t in tensors.items() if not torch.equal(t, base[n].detach().cpu())}
            if not tensors:
                raise InvalidInputError("bias tuning changed no bias tensor",
                                        "train longer or with a larger learning rate")
        kind = "bias" if self.cfg.kind == "bias" else "partial"
        return ExportedAdapter(kind=kind, tensors=tensors,
                               stats={**self.parameter_counts(), "exported_tensors": len(tensors)})
