"""Kind ``bias``: new values for bias vectors only (BitFit).

Same file and mechanism as ``partial`` (``adapter.safetensors``, substituted at call time), but
only parameters named ``*.bias`` are accepted, so a bias encoder stays a few hundred KiB.
"""

from __future__ import annotations

import torch

from qswap.encoders.kinds.base import Attached
from qswap.encoders.kinds.partial import PartialKind


class BiasKind(PartialKind):
    """Replaced bias vectors."""

    name = "bias"

    def allowed(self, param_name: str) -> bool:
        return param_name.endswith(".bias")

    def runtime_tensors(self, att: Attached) -> dict[str, torch.Tensor]:
        """Bias parameter name -> its new value (a runtime that wants deltas subtracts the base's)."""
        return dict(att.overrides)
