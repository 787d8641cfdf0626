"""The query forward of a BERT-family base with each row's adapter gathered from a table.

One function of fixed-shape tensors (token ids, attention mask, one table slot per row), written
for CUDA graphs: no host synchronisation, no shape that depends on the data, no Python branch on
a tensor's value. Each Linear computes ``x @ W.T + (x @ A_row.T) @ B_row.T + bias_row`` with the
row's factors and bias gathered from the :class:`~qswap.encoders.runtime.adapter_table.AdapterTable`
(a batched matrix product per layer, not a loop over encoders), each LayerNorm adds its row's
bias, attention is ``scaled_dot_product_attention`` (fused kernels on a GPU). Query, key and value
run as one Linear of the three weights.

The same function runs eagerly on the CPU (the twin that ``make test`` checks against the torch
pool) and inside captured graphs on a GPU (:mod:`qswap.encoders.runtime.buckets`). In half
precision the weights and activations are fp16/bf16 (matrix products accumulate in fp32 in
cuBLAS and SDPA), LayerNorm statistics, pooling and normalisation run in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qswap.encoders.embedding import BaseSpec
from qswap.encoders.pooling import pool
from qswap.encoders.runtime.adapter_table import EMB_NORM, FAMILIES, NORMS, AdapterTable
from qswap.errors import InvalidInputError

#: Model types whose module layout and embeddings the gathered forward implements.
SUPPORTED = ("bert", "xlm-roberta", "roberta", "electra")
# Position ids counted from the padding id over non-padding tokens (RoBERTa's scheme).
_ROBERTA_POSITIONS = ("xlm-roberta", "roberta")


def check_supported(model: torch.nn.Module) -> None:
    """Raise :class:`InvalidInputError` unless the gathered forward computes ``model`` exactly."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED:
        raise InvalidInputError(f"the cuda backend runs {', '.join(SUPPORTED)} encoders, not {cfg.model_type!r}",
                                "use --backend torch for this model")
    if getattr(cfg, "position_embedding_type", "absolute") != "absolute":
        raise InvalidInputError(f"the cuda backend needs absolute position embeddings, not "
                                f"{cfg.position_embedding_type!r}", "use --backend torch for this model")
    if getattr(cfg, "embedding_size", cfg.hidden_size) != cfg.hidden_size:
        raise InvalidInputError("the cuda backend needs embeddings as wide as the hidden states",
                                "use --backend torch for this model")


class GatheredForward:
    """The base's weights in the forward's layout and type, and the forward itself.

    Args:
        model: the frozen base (its tensors are used as they are in fp32, copied in half precision).
        spec: pooling and normalisation.
        table: the adapter table the rows' slots index.
    """

    def __init__(self, model: torch.nn.Module, spec: BaseSpec, table: AdapterTable) -> None:
        check_supported(model)
        from transformers.activations import ACT2FN

        cfg = model.config
        self.spec, self.table, self.dtype = spec, table, table.dtype
        self.heads = int(cfg.num_attention_heads)
        self.eps = float(cfg.layer_norm_eps)
        self.act = ACT2FN[cfg.hidden_act]
        self.pad = int(cfg.pad_token_id if cfg.pad_token_id is not None else 0)
        self.roberta_positions = cfg.model_type in _ROBERTA_POSITIONS
        dev, dt = table.device, table.dtype
        m = dict(model.named_modules())

        def w(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=dev, dtype=dt)

        emb = model.embeddings
        self.word = w(emb.word_embeddings.weight)
        self.position = w(emb.position_embeddings.weight)
        self.token_type = w(emb.token_type_embeddings.weight[0])
        self.emb_norm = w(m[EMB_NORM].weight)
        self.linear: dict[str, list[torch.Tensor]] = {fam: [] for fam in FAMILIES}
        self.norm: dict[str, list[torch.Tensor]] = {n: [] for n in NORMS}
        for i in range(table.layers):
            for fam, paths in FAMILIES.items():
                ws = [m[f"encoder.layer.{i}.{p}"].weight for p in paths]
                self.linear[fam].append(w(torch.cat(ws)) if len(ws) > 1 else w(ws[0]))
            for n, path in NORMS.items():
                self.norm[n].append(w(m[f"encoder.layer.{i}.{path}"].weight))

    def _linear(self, x: torch.Tensor, fam: str, i: int, g: dict[str, torch.Tensor]) -> torch.Tensor:
        y = torch.matmul(x, self.linear[fam][i].t())
        a = g.get(f"{fam}.a")
        if a is not None:   # rows' low-rank deltas; rank 0 (no LoRA row in the batch) skips them
            t = torch.bmm(x, a[:, i].transpose(1, 2))
            y = torch.baddbmm(y, t, g[f"{fam}.b"][:, i].transpose(1, 2))
        return y + g[f"{fam}.bias"][:, i].unsqueeze(1)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 (layer_norm upcasts half inputs); the row's bias added after.
        return F.layer_norm(x, (x.shape[-1],), weight, None, self.eps) + bias.unsqueeze(1)

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor, rank: int) -> torch.Tensor:
        """Pooled (and normalised, per the spec) fp32 embeddings of ``ids`` (n, L) under ``mask``,
        row ``i`` with the adapter of table slot ``slots[i]``; ``rank``: the LoRA rank gathered
        (0: none, else at least every row's own rank)."""
        n, length = ids.shape
        g = self.table.gather(slots, rank)
        if self.roberta_positions:
            real = ids.ne(self.pad).to(torch.long)
            pos = torch.cumsum(real, dim=1) * real + self.pad
        else:
            pos = torch.arange(length, device=ids.device).unsqueeze(0)
        x = self.word[ids] + self.position[pos] + self.token_type
        x = self._norm(x, self.emb_norm, g["emb_norm.bias"])
        keep = mask.to(torch.bool)[:, None, None, :]   # (n, 1, 1, L): keys a query may attend to
        h = x.shape[-1]
        hd = h // self.heads
        for i in range(self.table.layers):
            qkv = self._linear(x, "qkv", i, g).view(n, length, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=keep)
            a = a.transpose(1, 2).reshape(n, length, h)
            x = self._norm(self._linear(a, "attn_out", i, g) + x, self.norm["attn_norm"][i], g["attn_norm.bias"][:, i])
            f = self.act(self._linear(x, "inter", i, g))
            x = self._norm(self._linear(f, "out", i, g) + x, self.norm["out_norm"][i], g["out_norm.bias"][:, i])
        v = pool(x.float(), mask, self.spec.pooling)
        return F.normalize(v, dim=-1) if self.spec.normalize else v
