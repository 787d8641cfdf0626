"""Per-row low-rank deltas on the ``nn.Linear`` layers of one module tree (the torch LoRA path).

Forward hooks on the adapted layers add ``(x[rows] @ A.T) @ B.T`` to the rows of each encoder,
so rows of many LoRA encoders (and of the base) share one forward pass. The hooks live on the
pool's parameter-sharing copy of the base, never on the base model that embeds documents; they
read tensors, never write a parameter. A layer keeps its hook only while some encoder adapts it.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator

import torch

from qswap.encoders.kinds.base import FOREIGN_HINT, LowRank
from qswap.errors import ConflictError, InvalidInputError


class LowRankDeltas:
    """The LoRA factors of every attached encoder, keyed by layer; not thread-safe (the pool locks)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._modules = {n: m for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
        self._factors: dict[str, dict[str, LowRank]] = {}   # layer -> encoder key -> factors
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._rows: dict[str, torch.Tensor] | None = None  # encoder key -> row indices of this forward
        self._n = 0

    def add(self, key: str, factors: dict[str, LowRank]) -> None:
        """Bind ``key``'s factors; checks every layer first, so a refusal binds nothing."""
        for layer, f in factors.items():
            m = self._modules.get(layer)
            if m is None:
                raise InvalidInputError(f"encoder {key}: no Linear layer {layer!r} in the base", FOREIGN_HINT)
            if f.a.ndim != 2 or f.a.shape[1] != m.in_features or tuple(f.b.shape) != (m.out_features, f.a.shape[0]):
                raise InvalidInputError(f"encoder {key}: LoRA factors of {layer!r} do not fit the layer", FOREIGN_HINT)
            if key in self._factors.get(layer, {}):
                raise ConflictError(f"encoder {key} is already bound to {layer!r}", "remove it first")
        for layer, f in factors.items():
            self._factors.setdefault(layer, {})[key] = f
            if layer not in self._hooks:
                self._hooks[layer] = self._modules[layer].register_forward_hook(functools.partial(self._hook, layer))

    def remove(self, key: str) -> None:
        """Unbind ``key``; layers no encoder adapts any more lose their hook."""
        for layer in [lay for lay, per in self._factors.items() if key in per]:
            del self._factors[layer][key]
            if not self._factors[layer]:
                del self._factors[layer]
                self._hooks.pop(layer).remove()

    def keys(self) -> set[str]:
        return {k for per in self._factors.values() for k in per}

    @contextmanager
    def rows(self, keys: list[str], device: torch.device) -> Iterator[None]:
        """During the block, row ``i`` of each forward gets encoder ``keys[i]``'s deltas."""
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(k, []).append(i)
        # Only encoders bound to some layer (not the base, not a bias-only encoder); checked per
        # encoder of this batch, not by listing every bound one (a forward's cost must not grow
        # with the number of attached encoders).
        groups = {k: v for k, v in groups.items() if any(k in per for per in self._factors.values())}
        self._rows = {k: torch.tensor(v, dtype=torch.long, device=device) for k, v in groups.items()}
        self._n = len(keys)
        try:
            yield
        finally:
            self._rows = None

    def _hook(self, layer: str, module: torch.nn.Module, args: tuple[torch.Tensor, ...],
              out: torch.Tensor) -> torch.Tensor | None:
        if not self._rows:
            return None
        x = args[0]
        for key, idx in self._rows.items():
            f = self._factors[layer].get(key)
            if f is None:
                continue
            if f.a.dtype != x.dtype:   # half-precision storage: compute in the activations' type
                f = LowRank(a=f.a.to(x.dtype), b=f.b.to(x.dtype))
            if len(idx) == self._n:   # the whole batch is one encoder: no gather/scatter
                return out + (x @ f.a.T) @ f.b.T
            out = out.index_add(0, idx, ((x.index_select(0, idx) @ f.a.T) @ f.b.T).to(out.dtype))
        return out
