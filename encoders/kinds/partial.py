"""Kind ``partial``: replacement values for some base parameters (a partially tuned tower).

File: ``adapter.safetensors``, base parameter name -> tensor of the base's shape. The pool
substitutes them at call time (``torch.func.functional_call``); the base keeps its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qswap.encoders.kinds.base import (FOREIGN_HINT, AdapterKind, Attached, EncoderArtifact, base_storage,
                                       check_header_dtypes, fresh_like, load_safetensors, read_safetensors_header, require_finite)
from qswap.errors import InvalidInputError

if TYPE_CHECKING:
    from qswap.encoders.base import BaseEncoder

TENSOR_FILE = "adapter.safetensors"


class PartialKind(AdapterKind):
    """Replaced base tensors; any base parameter may be replaced, with its own shape."""

    name = "partial"
    files = (TENSOR_FILE,)

    def allowed(self, param_name: str) -> bool:
        """Whether this kind may replace the base parameter ``param_name``."""
        return True

    def save(self, staging: Path, *, tensors: dict[str, torch.Tensor] | None,
             lora_dir: Path | None) -> None:
        from safetensors.torch import save_file

        if not tensors:
            raise InvalidInputError(f"a {self.name} encoder needs tensors", "pass the tuned tensors to save")
        for n in tensors:
            if not self.allowed(n):
                raise InvalidInputError(f"a {self.name} encoder cannot hold tensor {n!r}",
                                        "save other tensors as kind 'partial'")
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                  str(staging / TENSOR_FILE), metadata={"kind": self.name})

    def load(self, art: EncoderArtifact) -> None:
        key, f = art.key, art.path / TENSOR_FILE
        check_header_dtypes(key, read_safetensors_header(f, key))
        tensors = load_safetensors(f, key)
        if not tensors:
            raise InvalidInputError(f"encoder {key} ({self.name}) has no tensors", "re-export the encoder")
        bad = [n for n in tensors if not self.allowed(n)]
        if bad:
            raise InvalidInputError(f"encoder {key}: a {self.name} encoder cannot hold tensor {bad[0][:160]!r}",
                                    f"a {self.name} encoder holds only bias vectors; save it as kind 'partial'")
        require_finite(key, tensors)
        art.overrides = tensors

    def attach(self, art: EncoderArtifact, base: BaseEncoder) -> Attached:
        key = art.key
        if not art.overrides:
            raise InvalidInputError(f"encoder {key} ({self.name}) has no tensors", "re-export the encoder")
        params = dict(base.model.named_parameters())
        for name, t in art.overrides.items():
            ref = params.get(name)
            if ref is None:
                raise InvalidInputError(f"encoder {key}: tensor {name[:160]!r} does not exist in base {base.name}",
                                        FOREIGN_HINT)
            if not self.allowed(name):
                raise InvalidInputError(f"encoder {key}: a {self.name} encoder cannot hold tensor {name!r}",
                                        "save it as kind 'partial'")
            if tuple(t.shape) != tuple(ref.shape):
                raise InvalidInputError(
                    f"encoder {key}: tensor {name!r} has shape {tuple(t.shape)}, base has {tuple(ref.shape)}",
                    FOREIGN_HINT)
        # Checked again here: an artifact may be built in memory, not only by load().
        require_finite(key, art.overrides)
        storage = base_storage(base)
        out = {n: fresh_like(t, params[n], storage) for n, t in art.overrides.items()}
        return Attached(kind=self.name, overrides=out)

    def runtime_tensors(self, att: Attached) -> dict[str, torch.Tensor]:
        """Base parameter name -> its replacement value."""
        return dict(att.overrides)
