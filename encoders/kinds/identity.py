"""Kind ``identity``: the base model itself, no adapter file."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qswap.encoders.kinds.base import AdapterKind, Attached, EncoderArtifact

if TYPE_CHECKING:
    from qswap.encoders.base import BaseEncoder


class IdentityKind(AdapterKind):
    """No tensors: rows of an identity encoder run the base weights (and share forwards with LoRA rows)."""

    name = "identity"
    files = ()

    def save(self, staging: Path, *, tensors: dict[str, torch.Tensor] | None,
             lora_dir: Path | None) -> None:
        return None

    def load(self, art: EncoderArtifact) -> None:
        return None

    def attach(self, art: EncoderArtifact, base: BaseEncoder) -> Attached:
        return Attached(kind=self.name)

    def runtime_tensors(self, att: Attached) -> dict[str, torch.Tensor]:
        """Nothing: the runtime's base weights."""
        return {}
