"""Builders of real adapters (peft LoRA, bias, partial) over a tiny base, for tests."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path

import torch

from qswap.bench.data.encoders import perturbed_encoder, random_lora_encoder
from qswap.encoders import BaseEncoder


def random_peft_lora(base: BaseEncoder, seed: int, r: int = 4, targets: tuple[str, ...] = ("query", "value")):
    """A peft LoRA model over a copy of ``base`` with non-zero random B (so it changes outputs)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base.model),
                           LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets)))
    add_noise_((p for n, p in model.named_parameters() if "lora_B" in n), 0.2)
    return model


def add_noise_(params: Iterable[torch.Tensor], scale: float, seed: int | None = None) -> None:
    """Add Gaussian noise of standard deviation ``scale`` to tensors in place (seeded when ``seed`` is given)."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=g))


def noisy(tensors: dict[str, torch.Tensor], scale: float, seed: int) -> dict[str, torch.Tensor]:
    """Copies of ``tensors`` plus seeded Gaussian noise: the tensors of a random bias / partial encoder."""
    g = torch.Generator().manual_seed(seed)
    return {n: t.detach() + scale * torch.randn(t.shape, generator=g) for n, t in tensors.items()}


def make_lora(base: BaseEncoder, out: Path, name: str, seed: int, r: int = 4,
              targets: tuple[str, ...] = ("query", "value"), version: str = "1") -> Path:
    """A LoRA encoder saved in peft's format with non-zero random B (so it changes outputs)."""
    return random_lora_encoder(base, out, name, rank=r, seed=seed, scale=0.2, alpha=2 * r, targets=targets,
                               version=version)


def make_overrides(base: BaseEncoder, out: Path, name: str, kind: str, seed: int,
                   version: str = "1") -> Path:
    """A bias (all biases) or partial (last block) encoder with perturbed tensors."""
    return perturbed_encoder(base, out, name, kind=kind, scale=0.1, seed=seed, version=version)


def lora_parts(base: BaseEncoder, seed: int = 0, r: int = 4,
               targets: tuple[str, ...] = ("query", "value")) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config, state) of a real peft LoRA with non-zero B, as peft's save_pretrained writes them."""
    import json
    import tempfile

    from safetensors.torch import load_file

    model = random_peft_lora(base, seed, r, targets)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return (json.loads((Path(tmp) / "adapter_config.json").read_text()),
                load_file(str(Path(tmp) / "adapter_model.safetensors")))


def write_raw_encoder(base: BaseEncoder, out: Path, name: str, kind: str, files: dict[str, bytes],
                      manifest_files: dict[str, str] | None = None) -> Path:
    """An encoder directory written byte by byte, with a manifest whose checksums match: for
    adapters that qswap's own writer would refuse (what an attacker or another tool uploads).
    ``manifest_files`` replaces the manifest's file list (checksums of hostile names)."""
    import hashlib
    import json
    import time

    out.mkdir(parents=True)
    for fname, data in files.items():
        (out / fname).write_bytes(data)
    listed = manifest_files if manifest_files is not None else \
        {f: hashlib.sha256(d).hexdigest() for f, d in files.items()}
    (out / "manifest.json").write_text(json.dumps({
        "name": name, "version": "1", "kind": kind, "space": base.space.to_dict(), "files": listed,
        "training": None, "guard": None, "created_at": time.time(), "qswap_version": "0"}))
    return out


def write_lora(base: BaseEncoder, out: Path, name: str, config: object,
               state: dict[str, torch.Tensor]) -> Path:
    """A LoRA encoder directory from any config object and state (valid checksums, any content)."""
    import json

    from safetensors.torch import save

    return write_raw_encoder(base, out, name, "lora", {
        "adapter_config.json": json.dumps(config).encode(),
        "adapter_model.safetensors": save({k: v.contiguous() for k, v in state.items()})})


def write_tensors(base: BaseEncoder, out: Path, name: str, kind: str, tensors: dict[str, torch.Tensor]) -> Path:
    """A bias/partial encoder directory holding exactly ``tensors`` (no checks)."""
    from safetensors.torch import save

    return write_raw_encoder(base, out, name, kind,
                             {"adapter.safetensors": save({k: v.contiguous() for k, v in tensors.items()})})
