"""What an encoder is on the shared graph: its adapter inputs, and what they and a session cost.

An encoder served by :class:`qswap.encoders.runtime.shared.SharedBackend` is only the tensors
:func:`adapter_inputs` picks from the pool (bound as they are, no copy); the constants here are
what the runtime holds per such tensor beyond the pool's bytes, so the memory budget counts it.
"""

from __future__ import annotations

from typing import Any

import torch

from qswap.encoders.pool import FACTOR_DTYPES, EncoderPool
from qswap.encoders.runtime.shared_export import UNREACHED, Slots

#: What the shared runtime holds per loaded encoder beyond the pool's tensors, per object
#: (CPython 3.11, ONNX Runtime 1.32, glibc malloc; ``qswap bench encoder-memory``,
#: bench/results/encoder_memory/): an OrtValue over one of the encoder's own tensors (with the
#: numpy view under it, and the segment runner's view of a factor), and one graph input bound in
#: an IOBinding (each session that runs the encoder keeps one binding of all ~240 inputs: an
#: unbound feed costs ~2.5 ms per call, shared_run.py). ~0.25 MiB for a LoRA adapter on every
#: Linear of multilingual-e5-small, counted so the memory budget holds what it says.
VALUE_BYTES = 800
BOUND_BYTES = 310


def adapter_inputs(pool: EncoderPool, key: str, slots: Slots) -> dict[str, torch.Tensor] | None:
    """The shared graph's adapter inputs for encoder ``key``, or ``None`` if it cannot express it.

    The one place that reads an encoder's tensors for the shared runtime, through its kind's
    ``runtime_tensors``: ``<module>.lora_A`` / ``.lora_B`` (scaling folded into B, in the pool's
    factor storage type) and ``<param>.bias`` (the bias the encoder uses) are the pool's own
    tensors, bound as they are (no copy). Anything else (a replaced weight matrix), or factors
    kept in another type than the pool's (they did not round within tolerance), is not
    expressible: ``None``.
    """
    tensors = pool.runtime_tensors(key)
    lin = {m for m, _, _ in slots.linear}
    norm = {m for m, _ in slots.norm}
    dtype = FACTOR_DTYPES[pool.factor_dtype]
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if module.split(".")[0] in UNREACHED:
            continue   # the pooler never reaches a pooled query embedding ("dense" targets match it)
        if leaf in ("lora_A", "lora_B") and module in lin and t.dtype == dtype:
            out[name] = t.detach()
        elif leaf == "bias" and (module in lin or module in norm) and t.dtype == torch.float32:
            out[name] = t.detach()
        else:
            return None
    return out


def session_weight_bytes(base: Any) -> int:
    """The weights one session of the shared (or segment) graph holds: the base without its word
    embeddings (gathered outside the graph), float32."""
    return (base.layout.parameters - base.word_embeddings().numel()) * 4
