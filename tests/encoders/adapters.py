"""Builders of real adapters (peft LoRA, bias, partial) over a tiny base, for tests."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from qswap.encoders import BaseModel, save_encoder


def make_lora(base: BaseModel, out: Path, name: str, seed: int, r: int = 4,
              targets: tuple[str, ...] = ("query", "value"), version: str = "1") -> Path:
    """A LoRA encoder saved in peft's format with non-zero random B (so it changes outputs)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base.model),
                           LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    tmp = out.parent / f".peft-{name}-{seed}"
    model.save_pretrained(str(tmp))
    save_encoder(out, name=name, version=version, kind="lora", space=base.space, lora_dir=tmp)
    return out


def make_overrides(base: BaseModel, out: Path, name: str, kind: str, seed: int,
                   version: str = "1") -> Path:
    """A bias (all biases) or partial (last block) encoder with perturbed tensors."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    last = f"encoder.layer.{base.model.config.num_hidden_layers - 1}."
    for n, p in base.model.named_parameters():
        if (kind == "bias" and n.endswith(".bias")) or (kind == "partial" and n.startswith(last)):
            tensors[n] = p.detach() + 0.1 * torch.randn(p.shape, generator=g)
    save_encoder(out, name=name, version=version, kind=kind, space=base.space, tensors=tensors)
    return out
