"""What each extra query encoder costs in memory, by kind, over a real base."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

from qswap.encoders.artifact import load_encoder, save_encoder
from qswap.encoders.base import BaseEncoder
from qswap.encoders.pool import EncoderPool


def _lora_dir(base: BaseEncoder, out: Path, rank: int) -> Path:
    from peft import LoraConfig, get_peft_model
    targets = ["query", "key", "value", "dense"]
    m = get_peft_model(copy.deepcopy(base.model), LoraConfig(r=rank, lora_alpha=rank, target_modules=targets))
    m.save_pretrained(str(out))
    return out


def memory_by_kind(base: BaseEncoder, lora_rank: int = 32) -> list[dict[str, object]]:
    """Bytes each encoder kind adds to a pool over ``base`` (the base itself is counted once).

    Kinds as tuning writes them: ``bias`` (every bias), ``partial`` (every transformer block,
    embedding block frozen: the paper's default), ``lora`` (rank ``lora_rank`` on all dense layers).
    """
    base_bytes = sum(p.numel() * p.element_size() for p in base.model.parameters())
    params = dict(base.model.named_parameters())
    kinds = {
        "bias": {n: p.detach().clone() for n, p in params.items() if n.endswith(".bias")},
        "partial": {n: p.detach().clone() for n, p in params.items() if n.startswith("encoder.")},
    }
    rows: list[dict[str, object]] = [{"kind": "base (shared, once)", "bytes": base_bytes}]
    pool = EncoderPool(base)
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        for kind, tensors in kinds.items():
            save_encoder(t / kind, name=kind, version="1", kind=kind, space=base.space, tensors=tensors)
        save_encoder(t / "lora", name="lora", version="1", kind="lora", space=base.space,
                     lora_dir=_lora_dir(base, t / "peft", lora_rank))
        for kind in ("lora", "bias", "partial"):
            pool.add(load_encoder(t / kind, base.space))
            b = pool.memory_bytes(f"{kind}@1")
            rows.append({"kind": kind if kind != "lora" else f"lora r={lora_rank}", "bytes": b,
                         "fraction_of_base": b / base_bytes})
    del kinds
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows
