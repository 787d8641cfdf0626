"""The shared graph run on a batch's real tokens only: a padding-free ("packed") forward.

A batch of queries padded to its longest row computes every pad token through every layer
(1.3-1.6x the real tokens for batches of 4-32 short queries). Every layer of a BERT-family
encoder but attention is token-wise, so this graph runs on the batch's tokens laid end to end
as ONE row, ``inputs_embeds`` (1, T, d) with T the real tokens, and pads only inside attention:

- each self-attention block projects the packed tokens (LoRA product included: it is token-wise
  too), ``Gather`` s query, key and value to padded (B, L, d) (a pad slot takes any real token:
  the key padding mask hides it, and its output is never read), runs the same fused
  ``com.microsoft`` ``MultiHeadAttention`` node as the padded graph, and ``Gather`` s the real
  tokens back to (1, T, d);
- the pooled embedding is ``pooling @ hidden`` with ``pooling`` (B, T) a run-time input (mean:
  ``1/len`` over a row's own tokens; CLS: 1 on its first), then L2-normalised.

Inputs (:func:`packing` makes the run-time ones from the rows' lengths):

| input | shape | |
|---|---|---|
| ``inputs_embeds`` | (1, T, d) | the rows' word embeddings, end to end |
| ``position_ids`` | (1, T) | each token's position in its own row |
| ``token_index`` | (B, L) | which packed token fills each padded slot |
| ``attention_mask`` | (B, L) | the key padding mask |
| ``token_positions`` | (T,) | where each token sits in the padded (B * L) order |
| ``pooling`` | (B, T) | the pooling weights |

then the shared graph's adapter inputs (:class:`~qswap.encoders.runtime.shared_export.Slots`).

The *segment* variant (``segments=True``, file ``packed-segments.onnx``) is the segment graph of
:mod:`~qswap.encoders.runtime.shared_segments` on packed tokens: the factors of each encoder of
the batch, (E, r, in) / (E, out, r), and the routing of
:func:`~qswap.encoders.runtime.packing.segment_routing` over the packed tokens (``segment_tokens``
(E, M), ``segment_positions`` (T,)): a token, not a row, is what is routed to its encoder, so
neither the base projections nor the LoRA products compute a pad token.
"""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qswap.encoders.runtime.packing import packing
from qswap.encoders.runtime.shared_export import SEGMENTS_FORMAT, SharedEncoder, Slots, _FusedSelfAttention, _replace

log = logging.getLogger(__name__)

# Bump when the packed graph changes, so cached exports are rebuilt.
PACKED_FORMAT = 1
PACKED_MODEL_FILE = "packed.onnx"
PACKED_SEGMENTS_FILE = "packed-segments.onnx"
#: The packed graph's run-time inputs before the adapter inputs, in graph-input order.
PACKED_INPUTS = ("inputs_embeds", "position_ids", "token_index", "attention_mask", "token_positions", "pooling")


class _PackedSelfAttention(torch.nn.Module):
    """:class:`_FusedSelfAttention` on packed tokens: padded for the attention node only."""

    def __init__(self, fused: _FusedSelfAttention) -> None:
        super().__init__()
        self.fused = fused

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        f, v = self.fused, self.fused.inputs.values
        index, back = v["token_index"], v["token_positions"]
        bias = torch.cat([m.bias_input() for m in (f.query, f.key, f.value)])
        tokens = hidden_states[0]   # (T, d): one Gather, not one per projection
        q, k, val = (m(tokens)[index] for m in (f.query, f.key, f.value))   # (B, L, d) each
        out = torch.ops.qswap.multi_head_attention(q, k, val, bias, f.inputs.mask, f.heads, f.scale)
        # reshaped by a constant width: no Shape arithmetic per layer
        return out.reshape(-1, f.query.weight.shape[0])[back].unsqueeze(0), None


class PackedEncoder(SharedEncoder):
    """``(inputs_embeds, position_ids, token_index, attention_mask, token_positions, pooling,
    *adapter inputs) -> embedding`` (module docstring)."""

    def __init__(self, pooled: Any, slots: Slots, segments: bool = False) -> None:
        super().__init__(pooled, slots, segments)
        for name, mod in list(pooled.model.named_modules()):
            if isinstance(mod, _FusedSelfAttention):
                _replace(pooled.model, name, _PackedSelfAttention(mod))

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, token_index: torch.Tensor,
                attention_mask: torch.Tensor, token_positions: torch.Tensor, pooling: torch.Tensor,
                *adapter: torch.Tensor) -> torch.Tensor:
        self.inputs.values = {**dict(zip(self.names, adapter)), "token_index": token_index,
                              "token_positions": token_positions}
        self.inputs.mask = attention_mask.to(torch.int32)
        try:
            out = self.pooled.model(inputs_embeds=inputs_embeds, position_ids=position_ids,
                                    token_type_ids=torch.zeros_like(position_ids))
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            x = torch.matmul(pooling, hidden[0])
            return torch.nn.functional.normalize(x, dim=-1) if self.pooled.normalize else x
        finally:
            self.inputs.values, self.inputs.mask, self.inputs.taken = {}, None, {}


def first_position(pooled: Any) -> int:
    """Position id of a row's first token: ``padding_idx + 1`` where the model numbers positions
    after its padding index (RoBERTa family, :class:`PooledEncoder`), else 0."""
    return 0 if pooled.padding_idx is None else int(pooled.padding_idx) + 1


def export_packed(base: Any, out_dir: Path, *, optimize_for: str | None = "cpu", lora: Any = None,
                  own: dict[str, torch.Tensor] | None = None, model_file: str = PACKED_MODEL_FILE,
                  segments: bool = False, factors: str = "float32") -> dict[str, Any]:
    """Write the packed graph (``packed.onnx``) to ``out_dir``: the shared graph's layers and
    inputs (:func:`~qswap.encoders.runtime.shared_export.export_shared`, float32 factors) on packed
    tokens; with ``segments``, the segment graph's (module docstring); or, with ``own``, one
    encoder merged (base + ``own``, no adapter inputs: the graph
    :mod:`~qswap.encoders.runtime.onnx_export` writes, packed). Checked against the torch base on
    probe texts, as one packed batch, in reverse order, and row by row (the segment graph with the
    rows dealt over two encoders).

    Args:
        base: the base model (never changed: the graph is traced from a storage-sharing copy).
        out_dir: where the graph goes.
        optimize_for: ``"cpu"`` / ``"cuda"``: ONNX Runtime's transformer optimiser and bias folding.
        lora: the Linears that take LoRA factors; ``None``: every one.
        own: a merged encoder's tensors that differ from the base
            (:func:`~qswap.encoders.runtime.onnx_export.own_tensors`); its word embeddings, if it has
            its own, are the caller's to gather.
        model_file: the graph's file name.
        segments: the segment graph (not with ``own``).
        factors: the storage type of its LoRA factor inputs (the segment graph takes the pool's;
            :data:`qswap.encoders.pool.FACTOR_DTYPES`).

    Returns:
        Facts for the cache record: probe cosine, fused node counts, export seconds, and the
        ``first_position`` that :func:`packing` needs for this model.
    """
    import onnx
    from onnx import numpy_helper

    from qswap.encoders.runtime.export_digest import EMBEDDINGS_FILE, OPSET, OUTPUT
    from qswap.encoders.runtime.onnx_export import EXPORT_LOCK, _fuse, build_module, probe_inputs, word_embedding_name
    from qswap.encoders.runtime.shared_export import _fused_ops, find_slots, fold_biases, ort_input
    from qswap.encoders.pool import FACTOR_DTYPES
    from qswap.encoders.runtime.shared_export import adapter_axes
    from qswap.errors import IntegrityError

    if segments and own is not None:
        raise ValueError("a merged encoder has no segment graph")
    dtype = FACTOR_DTYPES[factors]
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    slots = find_slots(base.layout)
    if own is not None:
        lora = []   # merged: every Linear a plain projection, its bias a constant (inlined below)
    if lora is not None:
        slots = slots.only(lora)
    wname = word_embedding_name(base.model) if own else None
    table = (own[wname] if own and wname in own else base.word_embeddings()).detach().float().cpu().numpy()
    ref_module = build_module(base, own or {})   # the padded torch forward of the same weights
    with torch.no_grad():
        emb, mask = probe_inputs(base, table)
        ref = ref_module(torch.from_numpy(emb), torch.from_numpy(mask)).float().numpy()
    state = ref_module.model.state_dict()
    constants = {}
    if own is not None:   # the merged encoder's biases (a Linear without one adds zeros)
        for name, t in slots.base_inputs(base).items():
            constants[name] = state[name].detach().float() if name in state else t
    module = PackedEncoder(build_module(base, own or {}), slots, segments).eval()
    start = first_position(module.pooled)
    names = slots.segment_names() if segments else slots.input_names()
    runtime_names = [] if own is not None else names

    def feed(lengths: list[int], rows: np.ndarray, rank: int) -> dict[str, torch.Tensor]:
        packed = {"inputs_embeds": np.concatenate([emb[i, :n] for i, n in zip(rows, lengths)])[None]}
        packed.update(packing(lengths, base.spec.pooling, start))
        out = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in packed.items()}
        if segments:   # two encoders, so no shape is specialised to one
            out.update(slots.segment_inputs(base, lengths, True, dtype, rank, segments=2))
        else:
            out.update(constants or slots.base_inputs(base, dtype, rank))
        return out

    lengths = [int(n) for n in mask.sum(1)]
    trace = feed(lengths, np.arange(len(lengths)), 2)   # rank 2: no shape specialised to the rank
    args = tuple(trace[n] for n in (*PACKED_INPUTS, *names))
    axes: dict[str, dict[int, str]] = {
        "inputs_embeds": {1: "tokens"}, "position_ids": {1: "tokens"}, "token_index": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "sequence"}, "token_positions": {0: "tokens"},
        "pooling": {0: "batch", 1: "tokens"}, OUTPUT: {0: "batch"}, **adapter_axes(slots, segments)}
    if segments:
        axes["segment_positions"] = {0: "tokens"}
    path = out_dir / model_file
    with EXPORT_LOCK, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=[*PACKED_INPUTS, *names], output_names=[OUTPUT],
                          dynamic_axes=axes, opset_version=OPSET, do_constant_folding=True, dynamo=False,
                          custom_opsets={"com.microsoft": 1})
    if constants:   # a merged encoder's biases become constants, which the optimiser folds itself
        graph_model = onnx.load(str(path))
        for inp in list(graph_model.graph.input):
            if inp.name in constants:
                graph_model.graph.initializer.append(numpy_helper.from_array(constants[inp.name].numpy(), inp.name))
                graph_model.graph.input.remove(inp)
        onnx.save(graph_model, str(path))
    if optimize_for is not None:
        _fuse(path, base, use_gpu=optimize_for == "cuda")
        fold_biases(path)
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    cos = 1.0
    # The probe batch whole, reversed (other order, other pad slots), and row by row.
    for rows in (np.arange(len(lengths)), np.arange(len(lengths))[::-1], *([i] for i in range(len(lengths)))):
        rows = np.asarray(rows)
        got = sess.run(None, {k: ort_input(v) if k in names else v.numpy()
                              for k, v in feed([lengths[i] for i in rows], rows, 0).items()
                              if k in PACKED_INPUTS or k in runtime_names})[0]
        want = ref[rows]
        c = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        cos = min(cos, float(c.min()))
    if own and wname in own:   # the encoder's own word embeddings, gathered by the runtime
        np.save(out_dir / EMBEDDINGS_FILE, table)
    if cos < 0.99999:
        raise IntegrityError(f"packed ONNX export disagrees with torch (probe cosine {cos:.7f})",
                             "queries keep running on the padded graph; report this base model")
    return {"probe_min_cosine": cos, "fused": _fused_ops(path), "export_seconds": round(time.perf_counter() - t0, 3),
            "linear_slots": len(slots.linear), "norm_slots": len(slots.norm), "first_position": start,
            "own_word_embeddings": bool(own and wname in own), "own_tensors": len(own or {})}


def packed_digest(base: Any, variant: str, segments: bool = False, factors: str = "float32") -> str:
    """Content key of a packed export: its format, the shared graph's (and the segment graph's and
    its factor type, for that one), opset, variant and base space."""
    from qswap.encoders.runtime.export_digest import OPSET
    from qswap.encoders.runtime.shared_export import SHARED_FORMAT

    kind = f"packed{PACKED_FORMAT}|{SHARED_FORMAT}" + (f"|segments{SEGMENTS_FORMAT}|{factors}" if segments else "")
    return hashlib.sha256(f"{kind}|{OPSET}|{variant}|{base.space.fingerprint}".encode()).hexdigest()


def cached_packed(base: Any, directory: Path, variant: str, segments: bool = False,
                  factors: str = "float32") -> tuple[Path, int]:
    """The packed graph of ``base`` in ``directory`` (the segment graph, with ``factors``, in its
    ``-packed-segments`` sibling), exported once and reused while its digest holds, and the
    position id of a row's first token (:func:`packing`), from its record: a server that serves
    from the cache does not build the torch model to learn it."""
    from qswap.encoders.runtime.export_cache import cached_dir
    from qswap.encoders.runtime.onnx_export import release_freed_memory

    target = directory.with_name(directory.name + "-packed-segments") if segments else directory
    model_file = PACKED_SEGMENTS_FILE if segments else PACKED_MODEL_FILE
    digest = packed_digest(base, variant, segments, factors)

    def export(staging: Path) -> dict[str, Any]:
        facts = export_packed(base, staging, optimize_for=variant, model_file=model_file, segments=segments,
                              factors=factors)
        release_freed_memory()
        return {"digest": digest, "variant": variant, "space": base.space.fingerprint, "base": base.name, **facts}

    meta, exported = cached_dir(target, digest, model_file, export)
    if exported:
        log.info("exported the packed %s graph in %.1fs (probe cosine %.7f)", "segment" if segments else "base",
                 meta["export_seconds"], meta["probe_min_cosine"])
    return target / model_file, int(meta["first_position"])
