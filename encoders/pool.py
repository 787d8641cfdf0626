"""Many query encoders over one base model in memory.

The base weights (for multilingual-e5-small, a 96M-parameter word-embedding matrix out of
118M) exist once. Each encoder adds only its own tensors, built by its kind's plugin
(:mod:`qswap.encoders.kinds`) in fresh memory after every key and shape was checked against the
base. The pool binds them through two mechanisms, whatever the kind:

- ``low_rank`` factors (LoRA): forward hooks on the layers of a parameter-sharing view of the
  base add each row's own deltas (:mod:`qswap.encoders.lowrank`), so rows of different LoRA
  encoders and of the base share one forward pass;
- ``overrides`` (bias / partial): replacement tensors substituted at call time with
  ``torch.func.functional_call``; rows are grouped per encoder.

Nothing is ever written into a base tensor, and attaching is all-or-nothing: a refused encoder
(including one whose probe queries embed to NaN/Inf) leaves the pool exactly as it was.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch

from qswap.encoders.artifact import EncoderArtifact
from qswap.encoders.base import BaseEncoder
from qswap.encoders.embedding import embed_batch, sorted_batches
from qswap.encoders.kinds import AdapterKind, Attached, get_kind
from qswap.encoders.lowrank import LowRankDeltas
from qswap.encoders.factor_blocks import pack
from qswap.errors import ConflictError, InvalidInputError, NotFoundError
from qswap.factors import FACTOR_NAMES
from qswap.names import BASE_KEY   # the identity encoder every pool has: the base model itself

# Storage types of LoRA factors (EncoderPool(factor_dtype=...)).
FACTOR_DTYPES = {name: getattr(torch, name) for name in FACTOR_NAMES}
# Queries every new encoder must embed to finite vectors before it is accepted: finite adapter
# values can still overflow a forward (a LoRA factor of 1e30, a bias of 3e38).
_PROBES = ("a", "search the index for a python library about chess and music")


@dataclass
class _Entry:
    kind: AdapterKind
    attached: Attached
    nbytes: int


def _sharing_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A structural copy of ``model`` whose parameters and buffers are the same tensors.

    The LoRA hooks go on this copy, so the base model (which also embeds documents) never runs
    them, while costing no weight memory.
    """
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


class EncoderPool:
    """Query encoders sharing one frozen :class:`BaseEncoder`; thread-safe.

    ``factor_dtype``: storage type of LoRA factors (``float32``, ``float16``, ``bfloat16``;
    compute stays float32): half precision halves a LoRA encoder's bytes. A factor that would
    not round within :data:`~qswap.encoders.kinds.base.HALF_TOLERANCE` (values beyond the type's
    range) keeps float32, and that encoder reports it in :meth:`attached` ``info["factors"]``.
    """

    def __init__(self, base: BaseEncoder, factor_dtype: str = "float32") -> None:
        if factor_dtype not in FACTOR_DTYPES:
            raise InvalidInputError(f"unknown LoRA factor dtype {factor_dtype!r}",
                                    f"use one of {', '.join(FACTOR_DTYPES)}")
        self.base = base
        self.factor_dtype = factor_dtype
        self._torch: tuple[torch.nn.Module, LowRankDeltas] | None = None   # see _module
        identity = get_kind("identity")
        self._entries: dict[str, _Entry] = {BASE_KEY: _Entry(identity, Attached(kind=identity.name), 0)}
        self._lock = threading.RLock()

    @property
    def _module(self) -> torch.nn.Module:
        """The sharing copy of the base that torch forwards run through, made (with the base's
        torch module) on the first torch forward or attach: a server serving from cached ONNX
        exports needs neither."""
        return self._torch_parts()[0]

    @property
    def _deltas(self) -> LowRankDeltas:
        """The LoRA hooks on :attr:`_module`."""
        return self._torch_parts()[1]

    def _torch_parts(self) -> tuple[torch.nn.Module, LowRankDeltas]:
        parts = self._torch
        if parts is None:
            model = self.base.model   # built outside the pool's lock: membership calls do not wait on it
            with self._lock:
                if self._torch is None:
                    module = _sharing_copy(model)
                    self._torch = (module, LowRankDeltas(module))
                parts = self._torch
        return parts

    # -- membership ---------------------------------------------------------------------------

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def memory_bytes(self, key: str) -> int:
        """Bytes this encoder adds on top of the shared base weights."""
        return self._entry(key).nbytes

    def attached(self, key: str) -> Attached:
        """The encoder's validated adapter (its kind, tensors and facts); treat as read-only."""
        return self._entry(key).attached

    def runtime_tensors(self, key: str) -> dict[str, torch.Tensor]:
        """The tensors a fast runtime binds for ``key`` (see each kind's ``runtime_tensors``)."""
        e = self._entry(key)
        return e.kind.runtime_tensors(e.attached)

    def add(self, art: EncoderArtifact) -> None:
        """Attach a verified encoder, all-or-nothing.

        Raises :class:`SpaceMismatchError` for another base, :class:`ConflictError` for a loaded
        key, :class:`InvalidInputError` for an adapter that does not fit the base (nothing changes).
        """
        key = art.key
        self.base.space.require_same(art.manifest.embedding_space(), f"encoder {key}")
        kind = get_kind(art.manifest.kind)
        if key in self._entries:
            raise ConflictError(f"encoder {key} is already loaded", "remove it first or use a new version")
        attached = self._store(kind.attach(art, self.base))   # validates and builds; binds nothing
        with self._lock:
            if key in self._entries:
                raise ConflictError(f"encoder {key} is already loaded", "remove it first or use a new version")
            self._deltas.add(key, attached.low_rank)   # checks every layer before binding any
            self._entries[key] = _Entry(kind, attached, kind.nbytes(attached))
            try:
                finite = bool(np.isfinite(self.encode(list(_PROBES), [key] * len(_PROBES))).all())
            except BaseException:
                self._unbind(key)
                raise
            if not finite:
                self._unbind(key)
                raise InvalidInputError(f"encoder {key} embeds queries to NaN/Inf: its adapter's values overflow "
                                        "the forward pass", "the tuning diverged; retrain (e.g. with a lower "
                                                            "learning rate)")

    def _store(self, att: Attached) -> Attached:
        """``att`` with its LoRA factors in the pool's storage type, where every factor rounds
        within tolerance (all or none: one encoder's factors share one type), packed into one
        block of their own (:func:`~qswap.encoders.factor_blocks.pack`: what they cost is what is counted)."""
        dtype = FACTOR_DTYPES[self.factor_dtype]
        if not att.low_rank:
            return att
        if dtype == torch.float32:
            return replace(att, low_rank=pack(att.low_rank))
        half = {m: f.stored_as(dtype) for m, f in att.low_rank.items()}
        if any(f is None for f in half.values()):
            return replace(att, low_rank=pack(att.low_rank), info={**att.info, "factors": "float32"})
        return replace(att, low_rank=pack(half), info={**att.info, "factors": self.factor_dtype})

    def remove(self, key: str) -> None:
        """Detach an encoder and free its tensors."""
        if key == BASE_KEY:
            raise ConflictError("the base encoder cannot be removed", "remove a tuned encoder instead")
        with self._lock:
            if key not in self._entries:
                raise NotFoundError(f"encoder {key} is not loaded", "list loaded encoders first")
            self._unbind(key)

    def _unbind(self, key: str) -> None:
        self._entries.pop(key, None)
        self._deltas.remove(key)

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise NotFoundError(f"encoder {key} is not loaded", "register it or use a loaded encoder") from None

    # -- encoding -----------------------------------------------------------------------------

    def _forward_fn(self, overrides: dict[str, torch.Tensor]) -> Callable[..., object]:
        module = self._module
        if overrides:
            return lambda **kw: torch.func.functional_call(module, overrides, (), kw, tie_weights=False)
        return module

    def encode(self, texts: list[str], keys: list[str], batch_size: int = 64,
               encodings: list[Any] | None = None) -> np.ndarray:
        """Encode row ``i`` as a query with encoder ``keys[i]``; returns (n, dim) float32.

        LoRA and identity rows share forward passes; bias/partial rows run per encoder.
        ``encodings``: the texts' tokenizer encodings (query prefix included) when the caller
        has them, so they are not tokenised again.
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
                groups.setdefault(k if e.attached.overrides else None, []).append(i)
            for gkey, rows in groups.items():
                fwd = self._forward_fn(self._entries[gkey].attached.overrides if gkey else {})
                encs = [encodings[i] for i in rows] if encodings is not None else None
                for pos, ids, mask in sorted_batches(tok, [texts[i] for i in rows], spec.query_prefix,
                                                     batch_size, dev, encodings=encs):
                    idx = [rows[p] for p in pos]
                    with self._deltas.rows([keys[i] for i in idx], dev):
                        out[idx] = embed_batch(fwd, ids, mask, spec).float().cpu().numpy()
        return out

    def merged_state_dict(self, key: str) -> dict[str, torch.Tensor]:
        """The base state with this encoder's adapter applied (LoRA merged): for export.

        Entries the encoder does not change are the base's own tensors (same storage).
        """
        with self._lock:
            e = self._entry(key)
            state = {n: p.detach() for n, p in self.base.model.state_dict().items()}
            state.update(e.kind.merge(e.attached, self.base))
            return state
