"""The contract every adapter kind fulfils, in the manner of peft's tuners.

An adapter kind (``identity``, ``bias``, ``partial``, ``lora``) knows how to

- **save** its files into an encoder directory and **load** them back (:meth:`AdapterKind.save`,
  :meth:`AdapterKind.load`), refusing what it cannot serve before anything big is allocated;
- **attach** an adapter to a base: validate every key and shape against the base and build the
  encoder's own tensors (:meth:`AdapterKind.attach`). Attaching is pure: it returns an
  :class:`Attached` and changes nothing, so the pool can bind it all-or-nothing (and detach it by
  dropping it). No kind ever writes into a base tensor;
- say what the encoder costs (:meth:`AdapterKind.nbytes`), what it changes in the base's state
  dict (:meth:`AdapterKind.merge`: for exporting merged weights), and which tensors a fast runtime
  binds per encoder (:meth:`AdapterKind.runtime_tensors`).

An :class:`Attached` speaks to the pool's forward through two generic mechanisms only:
``overrides`` (base parameters replaced at call time) and ``low_rank`` (``x @ A.T @ B.T`` added to
the output of a base ``nn.Linear``, per row). The pool never switches on the kind's name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from qswap.errors import IntegrityError, InvalidInputError

if TYPE_CHECKING:
    from qswap.encoders.base import BaseEncoder

# What an adapter file may hold: floating tensors only (an integer "bias" is a broken file).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SAFETENSORS_FLOAT = ("F32", "F16", "BF16", "F64")
# Half-precision LoRA storage is accepted when each factor rounds with at most this relative
# error (fp16 rounds to ~3e-4, bf16 to ~2e-3 of a factor's norm: README "Fast query path").
HALF_TOLERANCE = 5e-3
FOREIGN_HINT = "the adapter was made for another architecture; tune it on this base model"


class EncoderArtifact(Protocol):
    """What a kind reads and fills of a loaded encoder directory
    (:class:`qswap.encoders.artifact.EncoderArtifact`). Declared here, so the kinds do not import
    the artifact module that imports them."""

    path: Path
    overrides: dict[str, torch.Tensor]
    lora_config: dict[str, Any] | None
    lora_state: dict[str, torch.Tensor] | None

    @property
    def key(self) -> str: ...


@dataclass(frozen=True)
class LowRank:
    """One LoRA factor pair on a base ``nn.Linear``: ``out += (x @ a.T) @ b.T``.

    ``b`` already carries the LoRA scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA), so
    the torch forward, the merged weights and a fast runtime use the very same two tensors.
    """

    a: torch.Tensor   # (r, in_features)
    b: torch.Tensor   # (out_features, r), scaled

    def delta_weight(self) -> torch.Tensor:
        """``b @ a``: what merging adds to the layer's weight (out_features, in_features), computed
        in float32 at least (half-precision factors are a storage type, not a compute type)."""
        if self.a.dtype in (torch.float16, torch.bfloat16):
            return self.b.float() @ self.a.float()
        return self.b @ self.a

    def stored_as(self, dtype: torch.dtype, tolerance: float = HALF_TOLERANCE) -> LowRank | None:
        """These factors in ``dtype`` storage (new tensors), or ``None`` where rounding would move
        either factor by more than ``tolerance`` (relative Frobenius error: values beyond the
        type's range or lost below it)."""
        out = []
        for t in (self.a, self.b):
            h = t.detach().to(dtype)
            ref = t.detach().float()
            err = torch.linalg.vector_norm(h.float() - ref)
            if not bool(torch.isfinite(h).all()) or float(err) > tolerance * float(torch.linalg.vector_norm(ref)):
                return None
            out.append(h)
        return LowRank(a=out[0], b=out[1])


#: What a pool holds per adapter tensor beyond its data, measured per loaded encoder (CPython
#: 3.11, torch 2.13, glibc malloc; ``qswap bench encoder-memory``, bench/results/encoder_memory/):
#: the tensor's Python object and TensorImpl, and for a LoRA factor its layer's entry in the
#: forward hooks' tables. ~0.1 MiB for a LoRA adapter on every Linear of multilingual-e5-small,
#: counted so the memory budget holds what it says.
TENSOR_OBJECT_BYTES = 750


@dataclass
class Attached:
    """One encoder's adapter, validated against a base and held in its own tensors."""

    kind: str
    overrides: dict[str, torch.Tensor] = field(default_factory=dict)  # base parameter -> replacement
    low_rank: dict[str, LowRank] = field(default_factory=dict)        # base Linear module -> factors
    info: dict[str, Any] = field(default_factory=dict)                # kind-specific facts (rank, ...)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.overrides.values()) + [t for f in self.low_rank.values() for t in (f.a, f.b)]


class AdapterKind(ABC):
    """One adapter kind; subclasses live in ``qswap.encoders.kinds.<name>``."""

    name: ClassVar[str]
    files: ClassVar[tuple[str, ...]] = ()   # adapter files its manifest must list

    # -- files --------------------------------------------------------------------------------

    @abstractmethod
    def save(self, staging: Path, *, tensors: dict[str, torch.Tensor] | None,
             lora_dir: Path | None) -> None:
        """Write this kind's adapter files into ``staging`` (an encoder directory being built)."""

    @abstractmethod
    def load(self, art: EncoderArtifact) -> None:
        """Read ``art.path``'s adapter files into ``art`` after checking what needs no base
        (config fields and types, declared shapes and ranks against limits, finite values).

        Raises :class:`InvalidInputError` for an adapter qswap refuses to serve and
        :class:`IntegrityError` for a file that cannot be read.
        """

    # -- the pool -----------------------------------------------------------------------------

    @abstractmethod
    def attach(self, art: EncoderArtifact, base: BaseEncoder) -> Attached:
        """Validate ``art`` against ``base`` (every key, shape, dtype) and build its tensors.

        Pure: raises before anything is bound, and the result shares no storage with the base.
        """

    def nbytes(self, att: Attached) -> int:
        """Bytes this encoder adds on top of the shared base: the storages its tensors hold
        (a view holds all of its storage; the pool packs LoRA factors into one page-rounded
        block, :mod:`qswap.encoders.factor_blocks`), each counted once, and :data:`TENSOR_OBJECT_BYTES`
        per tensor."""
        seen: dict[int, int] = {}
        tensors = att.tensors()
        for t in tensors:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values()) + TENSOR_OBJECT_BYTES * len(tensors)

    def merge(self, att: Attached, base: BaseEncoder) -> dict[str, torch.Tensor]:
        """Base state-dict entries this encoder changes, as new tensors (base + adapter merged)."""
        params = dict(base.model.named_parameters())
        out = dict(att.overrides)
        for module, f in att.low_rank.items():
            w = params[f"{module}.weight"]
            out[f"{module}.weight"] = (w + f.delta_weight().to(w.dtype)).detach()
        return out

    @abstractmethod
    def runtime_tensors(self, att: Attached) -> dict[str, torch.Tensor]:
        """The tensors a fast runtime binds for this encoder (views, no copies); see each kind."""


# -- checks shared by the kinds ---------------------------------------------------------------

def require_finite(key: str, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse NaN/Inf anywhere: such an encoder would answer every search with garbage or fail."""
    for name, t in tensors.items():
        if t.dtype not in FLOAT_DTYPES:
            raise InvalidInputError(f"encoder {key}: tensor {name!r} has dtype {t.dtype}, not floating point",
                                    "save adapter tensors as float32, float16 or bfloat16")
        if not bool(torch.isfinite(t).all()):
            raise InvalidInputError(f"encoder {key}: tensor {name!r} contains NaN or Inf values",
                                    "the tuning diverged; retrain (e.g. with a lower learning rate)")


def read_safetensors_header(path: Path, key: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype, shape) from a safetensors file's header, without reading any tensor data."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for name in f.keys():
                s = f.get_slice(name)
                out[name] = (str(s.get_dtype()), tuple(int(d) for d in s.get_shape()))
            return out
    except (SafetensorError, OSError, ValueError) as e:
        raise IntegrityError(f"{path}: cannot read adapter of {key}: {str(e).splitlines()[0] if str(e) else e!r}",
                             "the adapter file is corrupt; re-export the encoder") from None


def check_header_dtypes(key: str, header: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    for name, (dtype, _) in header.items():
        if dtype not in SAFETENSORS_FLOAT:
            raise InvalidInputError(f"encoder {key}: tensor {name!r} has dtype {dtype}, not floating point",
                                    "save adapter tensors as float32, float16 or bfloat16")


def load_safetensors(path: Path, key: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, in fresh memory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise IntegrityError(f"{path}: cannot read adapter of {key}: {e}",
                             "the adapter file is corrupt; re-export the encoder") from None


def fresh_like(t: torch.Tensor, ref: torch.Tensor, base_storage: set[int]) -> torch.Tensor:
    """``t`` on ``ref``'s device and dtype, never sharing storage with a base tensor."""
    out = t.detach().to(device=ref.device, dtype=ref.dtype)
    if out.untyped_storage().data_ptr() in base_storage:
        out = out.clone()
    return out


def base_storage(base: BaseEncoder) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in list(base.model.parameters()) + list(base.model.buffers())}
