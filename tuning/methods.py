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
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from qswap.encoders import BaseEncoder, embed_batch, tokenize_batch
from qswap.encoders.embedding import encode_texts
from qswap.errors import InvalidInputError

if TYPE_CHECKING:
    from qswap.tuning.queries import QueryTokens

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

    @property
    def method(self) -> "TuningMethod":
        """The plugin of ``kind``; :class:`InvalidInputError` for an unknown method."""
        try:
            return METHODS[self.kind]
        except (KeyError, TypeError):
            raise InvalidInputError(f"unknown tuning method {self.kind!r}", f"use one of {', '.join(METHODS)}") from None

    def validate(self) -> "MethodConfig":
        method = self.method
        if not method.freezes and (self.freeze_output_dense or self.freeze_blocks):
            raise InvalidInputError(
                f"--freeze-output-dense / --freeze-blocks apply to method 'partial', not {self.kind!r}",
                "drop the option or use --method partial")
        if self.freeze_blocks < 0:
            raise InvalidInputError(f"freeze_blocks must be >= 0, got {self.freeze_blocks}", "give a block count")
        method.validate(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def trainable_names(model: torch.nn.Module, cfg: MethodConfig) -> list[str]:
    """Names of the base parameters that train under ``cfg`` (empty for LoRA: it adds its own)."""
    cfg.validate()
    return [name for name, _ in model.named_parameters() if not _is_pooler(name) and cfg.method.trains(name, cfg)]


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

    def __init__(self, base: BaseEncoder, cfg: MethodConfig) -> None:
        self.base = base
        self.cfg = cfg.validate()
        names = set(trainable_names(base.model, cfg))
        if not cfg.method.adds_parameters and not names:
            raise InvalidInputError(f"method {cfg.kind!r} leaves nothing to train in {base.name}",
                                    "freeze fewer blocks or choose another method")
        params = dict(base.model.named_parameters())
        shared = [p for n, p in params.items() if n not in names] + list(base.model.buffers())
        model = copy.deepcopy(base.model, {id(t): t for t in shared})
        for n, p in model.named_parameters():
            p.requires_grad_(n in names)
        model = cfg.method.wrap(model, base, cfg)
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
        return self.embed_ids(*tokenize_batch(self.base.tokenizer, texts, self.base.spec.query_prefix,
                                              self.base.device))

    def embed_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Query embeddings with grad from token ids (:meth:`tokens` tokenises each text once)."""
        return embed_batch(self.model, input_ids, attention_mask, self.base.spec)

    def tokens(self) -> "QueryTokens":
        """A token memo for this tower's queries (its tokenizer and query prefix)."""
        from qswap.tuning.queries import QueryTokens
        return QueryTokens(self.base.tokenizer, self.base.spec.query_prefix)

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
        return self.cfg.method.tuned_tensors(self)

    def export(self, workdir: Path | None = None) -> ExportedAdapter:
        """The adapter for ``save_encoder``; LoRA writes peft's directory under ``workdir``."""
        return self.cfg.method.export(self, workdir)


# -- the methods ------------------------------------------------------------------------------

class TuningMethod:
    """How one tuning method picks, wraps, exports and counts parameters; the base class is
    "train some base tensors and export them as an encoder of kind ``exports``"."""

    name: ClassVar[str]
    exports: ClassVar[str] = "partial"      # the encoder kind written (qswap.encoders.kinds.KINDS)
    freezes: ClassVar[bool] = False         # accepts --freeze-blocks / --freeze-output-dense
    adds_parameters: ClassVar[bool] = False  # trains new tensors instead of base ones
    ranked: ClassVar[bool] = False          # has a rank (the planner chooses one)

    def validate(self, cfg: MethodConfig) -> None:
        """Refuse options this method cannot use."""

    def trains(self, name: str, cfg: MethodConfig) -> bool:
        """Whether base parameter ``name`` trains."""
        raise NotImplementedError

    def wrap(self, model: torch.nn.Module, base: BaseEncoder, cfg: MethodConfig) -> torch.nn.Module:
        """The trainable model around the tower's copy of the base."""
        return model

    def tuned_tensors(self, tower: QueryTower) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in tower.trainable_parameters()}

    def export(self, tower: QueryTower, workdir: Path | None) -> ExportedAdapter:
        tensors = {n: t.to("cpu").clone() for n, t in self.tuned_tensors(tower).items()}
        return ExportedAdapter(kind=self.exports, tensors=tensors,
                               stats={**tower.parameter_counts(), "exported_tensors": len(tensors)})

    def counts(self, model: torch.nn.Module, cfg: MethodConfig, params: dict[str, int]) -> tuple[int, int, int]:
        """(N_F, N_B, N_U) over the non-embedding ``params`` (name -> size): see the planner."""
        n = sum(params.values())
        # Back-propagation runs through every block from the first trainable one up.
        active = sum(v for k, v in params.items() if (block_of(k) or 0) >= cfg.freeze_blocks)
        updated = sum(params[k] for k in trainable_names(model, cfg) if k in params)
        return n, active, updated


class PartialMethod(TuningMethod):
    name = "partial"
    freezes = True

    def trains(self, name: str, cfg: MethodConfig) -> bool:
        b = block_of(name)
        if is_embedding(name) or b is None or b < cfg.freeze_blocks:
            return False
        return not (cfg.freeze_output_dense and _FFN_OUT_WEIGHT.search(name))


class FullMethod(TuningMethod):
    name = "full"

    def trains(self, name: str, cfg: MethodConfig) -> bool:
        return True

    def counts(self, model: torch.nn.Module, cfg: MethodConfig, params: dict[str, int]) -> tuple[int, int, int]:
        n = sum(params.values())
        return n, n, n


class BiasMethod(TuningMethod):
    name = "bias"
    exports = "bias"

    def trains(self, name: str, cfg: MethodConfig) -> bool:
        return name.endswith(".bias") and not is_embedding(name)

    def export(self, tower: QueryTower, workdir: Path | None) -> ExportedAdapter:
        base = dict(tower.base.model.named_parameters())
        tensors = {n: t.to("cpu").clone() for n, t in self.tuned_tensors(tower).items()}
        tensors = {n: t for n, t in tensors.items() if not torch.equal(t, base[n].detach().cpu())}
        if not tensors:
            raise InvalidInputError("bias tuning changed no bias tensor", "train longer or with a larger learning rate")
        return ExportedAdapter(kind=self.exports, tensors=tensors,
                               stats={**tower.parameter_counts(), "exported_tensors": len(tensors)})

    def counts(self, model: torch.nn.Module, cfg: MethodConfig, params: dict[str, int]) -> tuple[int, int, int]:
        # Gradients must reach the first block's biases: back-propagation runs through all.
        n = sum(params.values())
        return n, n, sum(v for k, v in params.items() if k.endswith(".bias"))


class LoraMethod(TuningMethod):
    name = "lora"
    exports = "lora"
    adds_parameters = True
    ranked = True

    def validate(self, cfg: MethodConfig) -> None:
        from qswap.encoders.kinds import MAX_RANK
        if not 1 <= cfg.lora_rank <= MAX_RANK:
            raise InvalidInputError(f"LoRA rank must be in 1..{MAX_RANK}, got {cfg.lora_rank}",
                                    "32 or 128 are good defaults")

    def trains(self, name: str, cfg: MethodConfig) -> bool:
        return False

    def wrap(self, model: torch.nn.Module, base: BaseEncoder, cfg: MethodConfig) -> torch.nn.Module:
        from peft import LoraConfig, get_peft_model
        targets = cfg.lora_targets or default_lora_targets(base.model)
        lcfg = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha or cfg.lora_rank,
                          lora_dropout=cfg.lora_dropout, target_modules=targets, bias="none")
        try:
            return get_peft_model(model, lcfg)
        except ValueError as e:
            raise InvalidInputError(f"LoRA targets do not fit {base.name}: {str(e).splitlines()[0]}",
                                    "name nn.Linear modules of the model, e.g. query,value") from None

    def tuned_tensors(self, tower: QueryTower) -> dict[str, torch.Tensor]:
        from peft.tuners.lora import LoraLayer
        out = {}
        for m in tower.model.modules():
            if isinstance(m, LoraLayer):
                w = m.get_base_layer().weight
                out[tower._base_names[id(w)]] = (w + m.get_delta_weight("default")).detach()
        return out

    def export(self, tower: QueryTower, workdir: Path | None) -> ExportedAdapter:
        d = Path(tempfile.mkdtemp(prefix="lora-", dir=workdir))
        tower.model.save_pretrained(str(d))
        return ExportedAdapter(kind=self.exports, lora_dir=d, stats=tower.parameter_counts())

    def counts(self, model: torch.nn.Module, cfg: MethodConfig, params: dict[str, int]) -> tuple[int, int, int]:
        n = sum(params.values())
        extra = lora_parameters(model, cfg.lora_rank, cfg.lora_targets)
        return n + extra, n + extra, extra


def lora_parameters(model: torch.nn.Module, rank: int, targets: list[str] | None = None) -> int:
    """Parameters LoRA of ``rank`` adds on ``targets`` (default: every dense layer in the blocks)."""
    names = set(targets or default_lora_targets(model))
    return sum(rank * (m.in_features + m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n in names)


METHODS: dict[str, TuningMethod] = {m.name: m for m in (PartialMethod(), BiasMethod(), LoraMethod(), FullMethod())}
