"""Random query encoders over a base: synthetic inputs for benchmarks and for tests of the
mechanics (they change the forward pass, so two encoders give different vectors; they carry
no quality).

- :func:`perturbed_encoder`: a ``bias`` (every bias) or ``partial`` (the last block) encoder
  whose tensors are the base's plus Gaussian noise.
- :func:`random_lora_encoder`: a LoRA adapter in peft's file format, ``lora_A`` as peft
  initialises it (uniform, bound ``1/sqrt(fan_in)``) and ``lora_B`` from N(0, ``scale``)
  instead of peft's zeros.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch

from qswap.encoders import BaseEncoder, save_encoder

#: Every Linear of a BERT layer.
ALL_LINEAR = ("query", "key", "value", "dense")


def perturbed_tensors(base: BaseEncoder, kind: Literal["bias", "partial"], scale: float,
                      seed: int) -> dict[str, torch.Tensor]:
    """The base's tensors an encoder of ``kind`` replaces, each plus ``scale`` x N(0, 1) noise.

    Args:
        base: the frozen base.
        kind: ``bias`` (every bias) or ``partial`` (every tensor of the last block).
        scale: the noise's standard deviation (3.0 ruins retrieval, 1e-4 changes nothing).
        seed: the noise's seed.

    Returns:
        Parameter name -> perturbed tensor.
    """
    last = f"encoder.layer.{base.model.config.num_hidden_layers - 1}."
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=g) for n, p in base.model.named_parameters()
            if (kind == "bias" and n.endswith(".bias")) or (kind == "partial" and n.startswith(last))}


def perturbed_encoder(base: BaseEncoder, out: Path, name: str, *, kind: Literal["bias", "partial"] = "bias",
                      scale: float = 0.02, seed: int = 0, version: str = "1",
                      guard: dict[str, Any] | None = None) -> Path:
    """Save a ``bias`` or ``partial`` encoder of :func:`perturbed_tensors`.

    Args:
        base: the frozen base.
        out: the encoder directory to write.
        name: the encoder's name.
        kind: ``bias`` or ``partial``.
        scale: the noise's standard deviation.
        seed: the noise's seed.
        version: the encoder's version.
        guard: a tuning guard record to write in the manifest (what it claims, not checked here).

    Returns:
        ``out``.
    """
    save_encoder(out, name=name, version=version, kind=kind, space=base.space,
                 tensors=perturbed_tensors(base, kind, scale, seed), guard=guard)
    return out


def random_lora_encoder(base: BaseEncoder, out: Path, name: str, *, rank: int = 4, seed: int = 0,
                        scale: float = 0.02, alpha: float | None = None, targets: tuple[str, ...] = ALL_LINEAR,
                        version: str = "1", training: dict[str, Any] | None = None) -> Path:
    """Save a LoRA encoder with random factors on the ``targets`` Linears of every layer.

    Args:
        base: the frozen base.
        out: the encoder directory to write.
        name: the encoder's name.
        rank: the LoRA rank.
        seed: the factors' seed.
        scale: standard deviation of ``lora_B``.
        alpha: peft's ``lora_alpha`` (the update is scaled by ``alpha / rank``); default ``rank``.
        targets: Linear module names adapted (peft's ``target_modules``).
        version: the encoder's version.
        training: what the manifest says about how it was made.

    Returns:
        ``out``.
    """
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    state = {}
    for n, m in base.model.named_modules():
        # peft's rule: a target names a module by its full name or a dotted suffix of it.
        if isinstance(m, torch.nn.Linear) and any(n == t or n.endswith("." + t) for t in targets):
            bound = 1.0 / m.in_features ** 0.5
            state[f"base_model.model.{n}.lora_A.weight"] = (torch.rand(rank, m.in_features, generator=g) * 2 - 1) * bound
            state[f"base_model.model.{n}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g) * scale
    with tempfile.TemporaryDirectory() as tmp:
        save_file(state, str(Path(tmp) / "adapter_model.safetensors"))
        (Path(tmp) / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else rank,
             "target_modules": list(targets)}))
        save_encoder(out, name=name, version=version, kind="lora", space=base.space, lora_dir=Path(tmp),
                     training=training)
    return out
