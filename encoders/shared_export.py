"""Export the base ONCE to an ONNX graph whose adapters are run-time inputs.

Every ``nn.Linear`` the forward reaches (the pooler is never reached by pooling: it is left
out) computes ``x @ W.T + (b + dbias) + (x @ A.T) @ B.T`` and every ``nn.LayerNorm`` adds
``dbias`` to its bias, where, per adapted layer ``<m>``:

- ``<m>.lora_A`` (r, in) and ``<m>.lora_B`` (out, r): an encoder's LoRA factors in the pool's
  own layout (LoRA scaling folded into ``B``), so the runtime binds the pool's tensors without a
  copy (ONNX Runtime folds the transposes into its MatMuls); ``r`` is a dynamic axis, so each
  encoder binds its own rank (no zero padding to a maximum rank) and a layer it does not adapt
  binds rank 0;
- ``<m>.dbias`` (out,): the encoder's bias minus the base's (bias kind, LayerNorm biases
  included), zeros for other kinds.

So one session holds the base weights once, and an encoder is only its adapter tensors
(:mod:`qswap.encoders.shared`). Word embeddings stay outside, as for merged exports
(:mod:`qswap.encoders.onnx_export`): the caller gathers rows of the base matrix.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qswap.encoders.base import BaseEncoder
from qswap.encoders.onnx_export import EXPORT_LOCK, OPSET, OUTPUT, PooledEncoder, build_module, probe_cosine, probe_inputs
from qswap.errors import IntegrityError

# Bump when the shared graph changes, so cached exports are rebuilt.
SHARED_FORMAT = 1
SHARED_MODEL_FILE = "shared.onnx"
# Layers a query's pooled embedding never depends on (mean/CLS pooling of last_hidden_state).
UNREACHED = ("pooler",)


@dataclass(frozen=True)
class Slots:
    """The adapter inputs of a shared graph: which layers, in graph-input order."""

    linear: tuple[tuple[str, int, int], ...]   # (module, in_features, out_features)
    norm: tuple[tuple[str, int], ...]          # (module, normalized size)

    def input_names(self) -> list[str]:
        names: list[str] = []
        for m, _, _ in self.linear:
            names += [f"{m}.lora_A", f"{m}.lora_B", f"{m}.dbias"]
        names += [f"{m}.dbias" for m, _ in self.norm]
        return names

    def zeros(self, rank: int = 0) -> dict[str, np.ndarray]:
        """Inputs that leave the base unchanged (the identity encoder)."""
        out: dict[str, np.ndarray] = {}
        for m, i, o in self.linear:
            out[f"{m}.lora_A"] = np.zeros((rank, i), np.float32)
            out[f"{m}.lora_B"] = np.zeros((o, rank), np.float32)
            out[f"{m}.dbias"] = np.zeros((o,), np.float32)
        for m, d in self.norm:
            out[f"{m}.dbias"] = np.zeros((d,), np.float32)
        return out


def find_slots(model: torch.nn.Module) -> Slots:
    """Every Linear and LayerNorm of ``model`` a query's embedding depends on."""
    lin, norm = [], []
    for name, m in model.named_modules():
        if not name or name.split(".")[0] in UNREACHED:
            continue
        if isinstance(m, torch.nn.Linear):
            lin.append((name, m.in_features, m.out_features))
        elif isinstance(m, torch.nn.LayerNorm) and m.elementwise_affine and m.bias is not None:
            norm.append((name, int(np.prod(m.normalized_shape))))
    return Slots(tuple(lin), tuple(norm))


class _Inputs:
    """The adapter tensors of the forward being traced, read by the adapted layers."""

    values: dict[str, torch.Tensor] = {}


class _AdaptedLinear(torch.nn.Module):
    def __init__(self, lin: torch.nn.Linear, name: str, inputs: _Inputs) -> None:
        super().__init__()
        self.weight, self.bias, self.name, self.inputs = lin.weight, lin.bias, name, inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.inputs.values
        bias = v[f"{self.name}.dbias"] if self.bias is None else self.bias + v[f"{self.name}.dbias"]
        # Rank-r path last: its two small MatMuls run beside the big one.
        return torch.nn.functional.linear(x, self.weight, bias) \
            + torch.matmul(torch.matmul(x, v[f"{self.name}.lora_A"].t()), v[f"{self.name}.lora_B"].t())


class _AdaptedNorm(torch.nn.Module):
    def __init__(self, ln: torch.nn.LayerNorm, name: str, inputs: _Inputs) -> None:
        super().__init__()
        self.ln, self.name, self.inputs = ln, name, inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ln = self.ln
        return torch.nn.functional.layer_norm(x, ln.normalized_shape, ln.weight,
                                              ln.bias + self.inputs.values[f"{self.name}.dbias"], ln.eps)


class SharedEncoder(torch.nn.Module):
    """``(inputs_embeds, attention_mask, *adapter inputs) -> pooled embedding``."""

    def __init__(self, pooled: PooledEncoder, slots: Slots) -> None:
        super().__init__()
        self.pooled, self.slots, self.names = pooled, slots, slots.input_names()
        self.inputs = _Inputs()
        self.inputs.values = {}
        model = pooled.model
        for name, _, _ in slots.linear:
            _replace(model, name, _AdaptedLinear(model.get_submodule(name), name, self.inputs))
        for name, _ in slots.norm:
            _replace(model, name, _AdaptedNorm(model.get_submodule(name), name, self.inputs))

    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor,
                *adapter: torch.Tensor) -> torch.Tensor:
        self.inputs.values = dict(zip(self.names, adapter))
        try:
            return self.pooled(inputs_embeds, attention_mask)
        finally:
            self.inputs.values = {}


def _replace(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    *path, leaf = name.split(".")
    parent = model.get_submodule(".".join(path)) if path else model
    setattr(parent, leaf, new)


def shared_digest(base: BaseEncoder, variant: str) -> str:
    return hashlib.sha256(f"shared|{SHARED_FORMAT}|{OPSET}|{variant}|{base.space.fingerprint}".encode()).hexdigest()


def export_shared(base: BaseEncoder, out_dir: Path, *, optimize_for: str | None = None) -> dict[str, Any]:
    """Write ``shared.onnx`` to ``out_dir``; checked against the torch base on probe texts.

    ``optimize_for``: run ONNX Runtime's transformer fusions (``"cpu"``/``"cuda"``); off by
    default because the adapter Adds between the projections break its attention pattern (see
    README, "Fast query path"). Returns facts for the cache record.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pooled = build_module(base, {})
    slots = find_slots(pooled.model)
    module = SharedEncoder(pooled, slots).eval()
    table = base.model.get_input_embeddings().weight.detach().float().cpu().numpy()
    emb, mask = probe_inputs(base, table)
    dev = base.device
    # Trace with rank 2 so no shape is specialised to the rank, then check rank 0 below.
    trace = {k: torch.from_numpy(v).to(dev) for k, v in slots.zeros(rank=2).items()}
    args = (torch.from_numpy(emb).to(dev), torch.from_numpy(mask).to(dev), *[trace[n] for n in slots.input_names()])
    axes: dict[str, dict[int, str]] = {"inputs_embeds": {0: "batch", 1: "sequence"},
                                       "attention_mask": {0: "batch", 1: "sequence"}, OUTPUT: {0: "batch"}}
    for i, (m, _, _) in enumerate(slots.linear):
        axes[f"{m}.lora_A"] = {0: f"r{i}"}
        axes[f"{m}.lora_B"] = {1: f"r{i}"}
    path = out_dir / SHARED_MODEL_FILE
    with EXPORT_LOCK, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=["inputs_embeds", "attention_mask", *slots.input_names()],
                          output_names=[OUTPUT], dynamic_axes=axes, opset_version=OPSET,
                          do_constant_folding=True, dynamo=False)
        ref = module(*args).float().cpu().numpy()
    fused: dict[str, int] = {}
    if optimize_for is not None:
        from qswap.encoders.onnx_export import _fuse
        fused = _fuse(path, base, use_gpu=optimize_for == "cuda")
    cos = probe_cosine(path, emb, mask, ref, extra=slots.zeros(rank=0))
    if cos < 0.99999:
        raise IntegrityError(f"shared ONNX export disagrees with torch (probe cosine {cos:.7f})",
                             "encoders keep running on torch; report this base model")
    return {"probe_min_cosine": cos, "fused": fused, "export_seconds": round(time.perf_counter() - t0, 3),
            "linear_slots": len(slots.linear), "norm_slots": len(slots.norm)}
