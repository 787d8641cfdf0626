"""A fixed-capacity, device-resident table of adapters: the heterogeneous batches of the GPU runtime.

Every encoder the gathered forward (:mod:`qswap.encoders.runtime.gathered`) serves occupies one
*slot* of preallocated tensors: its LoRA factors (zero-padded to the table's rank, so a layer it
does not adapt is exactly the base) and the biases it uses (the base's own for LoRA and identity
encoders, its own for bias encoders). A batch then carries one slot index per row, and each
layer gathers its rows' factors into batched tensors (the BGMV idea of punica and S-LoRA), so a
batch mixing 20 encoders is one forward and, on a GPU, one CUDA-graph replay.

The tensors are allocated once and only ever written in place: a captured graph reads whatever
the slots hold when it replays, so registering an encoder never recaptures. Slot 0 is the base
(key ``base``) and is never evicted; the others are reused least-recently-used first.

Layer families (``qkv``: the query/key/value Linears of a block fused into one, three parts;
``attn_out``, ``inter``, ``out``: one part each) hold per slot ``a`` (layers, parts, rank, in),
``b`` (layers, parts x out, parts, rank: block-diagonal over the parts, so the fused product of
the three parts' factors adds nothing across parts) and ``bias`` (layers, parts x out).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from qswap.encoders.kinds.base import Attached
from qswap.encoders.pool import BASE_KEY
from qswap.errors import InvalidInputError

#: Slots of a table by default (slot 0 is the base).
DEFAULT_CAPACITY = 64
#: LoRA rank a table holds by default; an encoder of a higher rank runs on the torch pool.
DEFAULT_MAX_RANK = 64
# Layers a pooled query embedding never depends on: their tensors are ignored, not refused.
UNREACHED = ("pooler.",)
# (family, parts): each block's Linear layers by their module path inside the block.
FAMILIES = {"qkv": ("attention.self.query", "attention.self.key", "attention.self.value"),
            "attn_out": ("attention.output.dense",), "inter": ("intermediate.dense",), "out": ("output.dense",)}
NORMS = {"attn_norm": "attention.output.LayerNorm", "out_norm": "output.LayerNorm"}
EMB_NORM = "embeddings.LayerNorm"


@dataclass(frozen=True)
class Place:
    """Where one base tensor of the forward lives in the table."""

    table: str      # family or norm name
    layer: int      # block index (-1: the embeddings' norm)
    part: int = 0   # query/key/value within ``qkv``


def layout(layers: int) -> dict[str, Place]:
    """Base module path -> its place in the table, for a BERT-family encoder of ``layers`` blocks."""
    out: dict[str, Place] = {EMB_NORM: Place("emb_norm", -1)}
    for i in range(layers):
        for fam, paths in FAMILIES.items():
            for p, path in enumerate(paths):
                out[f"encoder.layer.{i}.{path}"] = Place(fam, i, p)
        for norm, path in NORMS.items():
            out[f"encoder.layer.{i}.{path}"] = Place(norm, i)
    return out


def expressible(att: Attached, places: dict[str, Place], max_rank: int) -> str | None:
    """Why ``att`` cannot be served from a table (``None``: it can): a replaced weight matrix, a
    tensor outside the forward's layers, or a rank above ``max_rank``."""
    for name in att.overrides:
        if name.startswith(UNREACHED):
            continue
        module, _, leaf = name.rpartition(".")
        if leaf != "bias" or module not in places:
            return f"it replaces {name!r} (the table holds LoRA factors and biases only)"
    for module, f in att.low_rank.items():
        if (module + ".").startswith(UNREACHED):
            continue
        if module not in places or places[module].table not in FAMILIES:
            return f"it adapts {module!r}, which the gathered forward does not run"
        if f.a.shape[0] > max_rank:
            return f"its rank {f.a.shape[0]} is above the table's {max_rank}"
    return None


class AdapterTable:
    """The slots' tensors on ``device`` in ``dtype``, filled from the pool's attached adapters.

    Not thread-safe on its own: the backend holds one lock over writes and forwards.

    Args:
        model: the base model (its biases fill slot 0 and every LoRA encoder's slot).
        capacity: slots, the base's included (>= 2).
        max_rank: the largest LoRA rank a slot holds.
        dtype: the compute type of the forward (the factors are converted on writing).
        device: where the table lives.
    """

    def __init__(self, model: torch.nn.Module, capacity: int = DEFAULT_CAPACITY, max_rank: int = DEFAULT_MAX_RANK,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if capacity < 2:
            raise InvalidInputError(f"an adapter table needs at least 2 slots, got {capacity}",
                                    "the base takes one; e.g. 64")
        if max_rank < 1:
            raise InvalidInputError(f"max_rank must be >= 1, got {max_rank}", "e.g. 64")
        cfg = model.config
        self.layers, self.capacity, self.max_rank = int(cfg.num_hidden_layers), capacity, max_rank
        self.places = layout(self.layers)
        mods = dict(model.named_modules())
        self.dtype, self.device = dtype, torch.device(device)
        S, L, R = capacity, self.layers, max_rank
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.bias: dict[str, torch.Tensor] = {}
        for fam, paths in FAMILIES.items():
            first = mods[f"encoder.layer.0.{paths[0]}"]
            p, i, o = len(paths), first.in_features, first.out_features
            self.a[fam] = torch.zeros((S, L, p, R, i), dtype=dtype, device=self.device)
            self.b[fam] = torch.zeros((S, L, p * o, p, R), dtype=dtype, device=self.device)
            self.bias[fam] = torch.zeros((S, L, p * o), dtype=dtype, device=self.device)
        for norm, path in NORMS.items():
            self.bias[norm] = torch.zeros((S, L, mods[f"encoder.layer.0.{path}"].weight.shape[0]), dtype=dtype,
                                          device=self.device)
        self.bias["emb_norm"] = torch.zeros((S, mods[EMB_NORM].weight.shape[0]), dtype=dtype, device=self.device)
        # The base's biases, each tensor once: slot 0, and the start of every slot written.
        self._base_bias = {name: mods[name].bias for name in self.places if mods[name].bias is not None}
        self._slots: OrderedDict[str, int] = OrderedDict()   # key -> slot, least recently used first
        self._free = list(range(capacity - 1, 0, -1))
        self.writes = 0      # slots written (registrations and reloads after eviction)
        self.evictions = 0
        self._lock = threading.Lock()
        self._write(0, Attached(kind="identity"))

    # -- slots ----------------------------------------------------------------------------------

    def slot(self, key: str) -> int | None:
        """The slot ``key`` occupies now, or ``None``."""
        return 0 if key == BASE_KEY else self._slots.get(key)

    def keys(self) -> list[str]:
        """Keys in the table, least recently used first."""
        return list(self._slots)

    def nbytes(self) -> int:
        """Bytes of every slot's tensors together (allocated once)."""
        return sum(t.numel() * t.element_size() for d in (self.a, self.b, self.bias) for t in d.values())

    def assign(self, key: str, att: Attached, pinned: set[str] = frozenset()) -> int | None:
        """The slot of ``key``, written now if it has none (evicting the least recently used key
        not in ``pinned``); ``None`` when every slot is pinned."""
        if key == BASE_KEY:
            return 0
        with self._lock:
            s = self._slots.get(key)
            if s is not None:
                self._slots.move_to_end(key)
                return s
            if not self._free:
                victim = next((k for k in self._slots if k not in pinned), None)
                if victim is None:
                    return None
                self._free.append(self._slots.pop(victim))
                self.evictions += 1
            s = self._free.pop()
            self._write(s, att)
            self._slots[key] = s
            return s

    def release(self, key: str) -> None:
        """Free ``key``'s slot (its tensors are overwritten by the next write)."""
        with self._lock:
            s = self._slots.pop(key, None)
            if s is not None:
                self._free.append(s)

    # -- writing --------------------------------------------------------------------------------

    @torch.no_grad()
    def _write(self, s: int, att: Attached) -> None:
        """Slot ``s`` := the base's biases, then ``att``'s factors and biases (in place)."""
        for t in (*self.a.values(), *self.b.values(), *self.bias.values()):
            t[s].zero_()
        for name, bias in self._base_bias.items():
            self._put_bias(s, name, bias)
        for name, t in att.overrides.items():
            if not name.startswith(UNREACHED):
                self._put_bias(s, name.rpartition(".")[0], t)
        for module, f in att.low_rank.items():
            if (module + ".").startswith(UNREACHED):
                continue
            pl = self.places[module]
            r, o = f.a.shape[0], f.b.shape[0]
            self.a[pl.table][s, pl.layer, pl.part, :r].copy_(f.a.to(self.dtype))
            self.b[pl.table][s, pl.layer, pl.part * o:(pl.part + 1) * o, pl.part, :r].copy_(f.b.to(self.dtype))
        self.writes += 1

    def _put_bias(self, s: int, module: str, value: torch.Tensor) -> None:
        pl = self.places[module]
        v = value.detach().to(self.dtype)
        if pl.table == "emb_norm":
            self.bias["emb_norm"][s].copy_(v)
        elif pl.table in FAMILIES:
            o = v.shape[0]
            self.bias[pl.table][s, pl.layer, pl.part * o:(pl.part + 1) * o].copy_(v)
        else:
            self.bias[pl.table][s, pl.layer].copy_(v)

    # -- reading (inside the forward: no host synchronisation, fixed shapes) ---------------------

    def gather(self, slots: torch.Tensor, rank: int) -> dict[str, torch.Tensor]:
        """Each row's tensors: ``<family>.a`` (n, layers, parts x rank, in), ``<family>.b``
        (n, layers, parts x out, parts x rank) for ``rank`` > 0 (factors beyond a slot's own rank
        are zeros: exact), and every bias table as (n, layers, width) / (n, width)."""
        out = {f"{k}.bias": v.index_select(0, slots) for k, v in self.bias.items()}
        if rank > 0:
            n = slots.shape[0]
            for fam in FAMILIES:
                a = self.a[fam][:, :, :, :rank].index_select(0, slots)
                b = self.b[fam][..., :rank].index_select(0, slots)
                out[f"{fam}.a"] = a.reshape(n, self.layers, -1, a.shape[-1])
                out[f"{fam}.b"] = b.reshape(n, self.layers, b.shape[2], -1)
        return out
