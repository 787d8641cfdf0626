"""Many query encoders over one base model in memory.

The base weights (for multilingual-e5-small, a 96M-parameter word-embedding matrix out of
118M) exist once. Each encoder adds only its own tensors:

- ``lora``: peft LoRA layers injected into a parameter-sharing view of the base; rows of
  different LoRA encoders (and identity rows, as peft's ``__base__``) share one forward pass
  through peft's per-row ``adapter_names``;
- ``bias`` / ``partial``: replacement tensors substituted at call time with
  ``torch.func.functional_call``, so no copy of the base is made; rows are grouped per encoder.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from qswap.encoders.artifact import EncoderArtifact
from qswap.encoders.base import BaseModel
from qswap.encoders.embedding import embed_batch, sorted_batches
from qswap.errors import ConflictError, InvalidInputError, NotFoundError

BASE_KEY = "base"   # the identity encoder every pool has: the base model itself


@dataclass
class _Entry:
    kind: str
    overrides: dict[str, torch.Tensor] = field(default_factory=dict)  # base param name -> tensor
    adapter: str | None = None   # internal peft adapter name (peft forbids '.' in names)
    nbytes: int = 0


def _sharing_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A structural copy of ``model`` whose parameters and buffers are the same tensors.

    peft rewrites the module tree it wraps; wrapping this copy leaves the base model (which
    also embeds documents) untouched while costing no weight memory.
    """
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


class EncoderPool:
    """Query encoders sharing one frozen :class:`BaseModel`; thread-safe."""

    def __init__(self, base: BaseModel) -> None:
        self.base = base
        self._module: torch.nn.Module = _sharing_copy(base.model)
        self._peft = None   # peft.PeftModel over self._module once a LoRA encoder is added
        self._entries: dict[str, _Entry] = {BASE_KEY: _Entry(kind="identity")}
        self._base_params = dict(base.model.named_parameters())
        self._ids = {id(p): n for n, p in self._base_params.items()}
        self._names: dict[str, str] = {n: n for n in self._base_params}  # base name -> name in forward module
        self._lock = threading.RLock()
        self._adapter_seq = 0

    # -- membership ---------------------------------------------------------------------------

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def kind(self, key: str) -> str:
        return self._entry(key).kind

    def memory_bytes(self, key: str) -> int:
        """Bytes this encoder adds on top of the shared base weights."""
        return self._entry(key).nbytes

    def add(self, art: EncoderArtifact) -> None:
        """Attach a verified encoder. Raises on a wrong space or an adapter that does not fit."""
        key = art.key
        self.base.space.require_same(art.manifest.embedding_space(), f"encoder {key}")
        with self._lock:
            if key in self._entries:
                raise ConflictError(f"encoder {key} is already loaded", "remove it first or use a new version")
            kind = art.manifest.kind
            if kind == "identity":
                entry = _Entry(kind="identity")
            elif kind in ("bias", "partial"):
                entry = self._overrides_entry(key, kind, art.overrides)
            else:
                entry = self._add_lora(key, art)
            self._entries[key] = entry

    def remove(self, key: str) -> None:
        """Detach an encoder and free its tensors."""
        if key == BASE_KEY:
            raise ConflictError("the base encoder cannot be removed", "remove a tuned encoder instead")
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                raise NotFoundError(f"encoder {key} is not loaded", "list loaded encoders first")
            if entry.adapter is not None and self._peft is not None:
                self._peft.delete_adapter(entry.adapter)
                if not any(e.adapter for e in self._entries.values()):
                    # peft cannot be left with zero adapters (its active adapter would dangle):
                    # go back to a plain parameter-sharing view of the base.
                    self._peft = None
                    self._module = _sharing_copy(self.base.model)
                    self._names = {n: n for n in self._base_params}

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise NotFoundError(f"encoder {key} is not loaded", "register it or use a loaded encoder") from None

    def _overrides_entry(self, key: str, kind: str, tensors: dict[str, torch.Tensor]) -> _Entry:
        if not tensors:
            raise InvalidInputError(f"encoder {key} ({kind}) has no tensors", "re-export the encoder")
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            ref = self._base_params.get(name)
            if ref is None:
                raise InvalidInputError(
                    f"encoder {key}: tensor {name!r} does not exist in base {self.base.name}",
                    "the adapter was made for another architecture; tune it on this base model")
            if tuple(t.shape) != tuple(ref.shape):
                raise InvalidInputError(
                    f"encoder {key}: tensor {name!r} has shape {tuple(t.shape)}, base has {tuple(ref.shape)}",
                    "the adapter was made for another architecture; tune it on this base model")
            out[name] = t.to(device=ref.device, dtype=ref.dtype)
        return _Entry(kind=kind, overrides=out, nbytes=sum(t.numel() * t.element_size() for t in out.values()))

    def _add_lora(self, key: str, art: EncoderArtifact) -> _Entry:
        from peft import LoraConfig, PeftModel, set_peft_model_state_dict

        cfg_dict = dict(art.lora_config or {})
        if cfg_dict.get("peft_type", "LORA") != "LORA":
            raise InvalidInputError(f"encoder {key}: adapter type {cfg_dict.get('peft_type')} is not LoRA",
                                    "only LoRA adapters are supported for kind 'lora'")
        cfg = LoraConfig.from_peft_type(**{k: v for k, v in cfg_dict.items()
                                            if k in LoraConfig.__dataclass_fields__})
        cfg.inference_mode = True
        self._adapter_seq += 1
        name = f"a{self._adapter_seq}"
        try:
            if self._peft is None:
                self._peft = PeftModel(self._module, cfg, adapter_name=name)
                self._peft.eval()
            else:
                self._peft.add_adapter(name, cfg)
            # Wrapping moves base tensors to new paths (``...query.base_layer.weight``).
            self._names = {self._ids[id(p)]: n for n, p in self._peft.named_parameters() if id(p) in self._ids}
            res = set_peft_model_state_dict(self._peft, art.lora_state or {}, adapter_name=name)
            missing = [k for k in res.missing_keys if ".lora_" in k and f".{name}." in k]
            if res.unexpected_keys or missing:
                raise InvalidInputError(
                    f"encoder {key}: LoRA weights do not match its config "
                    f"(unexpected {list(res.unexpected_keys)[:2]}, missing {missing[:2]})",
                    "the adapter was made for another architecture; tune it on this base model")
        except (ValueError, RuntimeError, KeyError) as e:
            if self._peft is not None and name in self._peft.peft_config:
                self._peft.delete_adapter(name)
            if isinstance(e, InvalidInputError):
                raise
            raise InvalidInputError(f"encoder {key}: LoRA adapter does not fit base {self.base.name}: "
                                    f"{str(e).splitlines()[0]}",
                                    "the adapter was made for another architecture; tune it on this base model") from None
        for p in self._peft.parameters():
            p.requires_grad_(False)
        nbytes = sum(t.numel() * t.element_size() for t in (art.lora_state or {}).values())
        return _Entry(kind="lora", adapter=name, nbytes=nbytes)

    # -- encoding -----------------------------------------------------------------------------

    def _forward_fn(self, entry: _Entry | None, adapter_names: list[str] | None) -> Callable[..., object]:
        module = self._peft if self._peft is not None else self._module
        extra = {"adapter_names": adapter_names} if self._peft is not None else {}
        if entry is not None and entry.overrides:
            params = {self._names[n]: t for n, t in entry.overrides.items()}
            return lambda **kw: torch.func.functional_call(module, params, (), {**kw, **extra}, tie_weights=False)
        return lambda **kw: module(**kw, **extra)

    def encode(self, texts: list[str], keys: list[str], batch_size: int = 64) -> np.ndarray:
        """Encode row ``i`` as a query with encoder ``keys[i]``; returns (n, dim) float32.

        LoRA and identity rows share forward passes; bias/partial rows run per encoder.
        """
        if len(texts) != len(keys):
            raise InvalidInputError(f"{len(texts)} texts but {len(keys)} encoder keys")
        out = np.empty((len(texts), self.base.dim), dtype=np.float32)
        if not texts:
            return out
        tok, spec, dev = self.base.tokenizer, self.base.spec, self.base.device
        with self._lock, torch.inference_mode():
            entries = [self._entry(k) for k in keys]
            groups: dict[str | None, list[int]] = {}
            for i, (k, e) in enumerate(zip(keys, entries)):
                groups.setdefault(k if e.overrides else None, []).append(i)
            for gkey, rows in groups.items():
                for pos, ids, mask in sorted_batches(tok, [texts[i] for i in rows], spec.query_prefix,
                                                     batch_size, dev):
                    idx = [rows[p] for p in pos]
                    names = [entries[i].adapter or "__base__" for i in idx]
                    fwd = self._forward_fn(self._entries[gkey] if gkey else None, names)
                    out[idx] = embed_batch(fwd, ids, mask, spec).float().cpu().numpy()
        return out

    def merged_state_dict(self, key: str) -> dict[str, torch.Tensor]:
        """The base state with this encoder's adapter applied (LoRA merged): for export."""
        with self._lock:
            entry = self._entry(key)
            state = {n: p.detach() for n, p in self.base.model.state_dict().items()}
            state.update(entry.overrides)
            if entry.adapter is not None:
                from peft.tuners.lora import LoraLayer
                for m in self._peft.modules():
                    if isinstance(m, LoraLayer) and entry.adapter in m.lora_A:
                        w = m.get_base_layer().weight
                        name = self._ids[id(w)]
                        state[name] = (w + m.get_delta_weight(entry.adapter)).detach()
            return state
