"""What names one ONNX export and keys its cache: file names, format and opset, content digest.

Kept apart from the exporter (:mod:`qswap.encoders.runtime.onnx_export`, which needs torch) so
that a process serving from cached exports can find and check them without importing torch.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Bump when the exported graph changes, so cached exports are rebuilt.
EXPORT_FORMAT = 1
OPSET = 17
MODEL_FILE = "model.onnx"
EMBEDDINGS_FILE = "word_embeddings.npy"
INPUTS = ("inputs_embeds", "attention_mask")
OUTPUT = "embedding"


def encoder_digest(base: Any, own: dict[str, torch.Tensor], variant: str) -> str:
    """Content hash of an encoder export: base space, the adapter's tensors, export format.

    Args:
        base: the :class:`~qswap.encoders.base.BaseEncoder` (its space's fingerprint is hashed).
        own: the encoder's tensors that differ from the base (``{}`` for the base itself: then
            torch is not imported).
        variant: ``"<provider>-fused"`` or ``"plain"``.

    Returns:
        The hex digest an export's record must carry to be reused.
    """
    h = hashlib.sha256(f"{EXPORT_FORMAT}|{OPSET}|{variant}|{base.space.fingerprint}".encode())
    if own:
        import torch

        for name in sorted(own):
            t = own[name].detach().to("cpu").contiguous()
            h.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
