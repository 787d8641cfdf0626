"""Export the base ONCE to an ONNX graph whose adapters are run-time inputs, fused.

Every ``nn.Linear`` the forward reaches (the pooler is never reached by pooling: it is left
out) computes ``x @ W.T + (x @ A.T) @ B.T + bias`` and every ``nn.LayerNorm`` takes its bias
as an input, where, per adapted layer ``<m>``:

- ``<m>.lora_A`` (r, in) and ``<m>.lora_B`` (out, r): an encoder's LoRA factors in the pool's
  own layout (LoRA scaling folded into ``B``) and storage type (``float32``, or ``float16`` /
  ``bfloat16``: the graph casts them to float32 before its MatMuls), so the runtime binds the
  pool's tensors without a copy; ``r`` is a dynamic axis, so each encoder binds its own rank (no
  zero padding to a maximum rank) and a layer it does not adapt binds rank 0;
- ``<m>.bias`` (out,): the bias the encoder uses, float32 (the base's own for LoRA and
  identity encoders, shared by all of them; the encoder's for the bias kind, LayerNorm biases
  included).

The graph is then fused so that ONNX Runtime runs what it runs for a merged encoder: attention
is ONE ``com.microsoft`` ``MultiHeadAttention`` node per layer, fed with projections that already
include the LoRA product and with the query/key/value biases (emitted at export time through
the attention interface of ``transformers``: the contrib op's pattern matcher never has to see
through the adapter Adds), and ONNX Runtime's transformer optimiser then fuses residual Add +
LayerNorm into ``SkipLayerNormalization`` and the GELU into ``Gelu``; :func:`fold_biases` moves
each layer's bias Add into those nodes (``SkipLayerNormalization``'s bias input, ``BiasGelu``),
which the optimiser's own matchers only do for constant biases.

So one session holds the base weights once, and an encoder is only its adapter tensors
(:mod:`qswap.encoders.runtime.shared`).

The *segment* variant (``segments=True``, file ``segments.onnx``) takes the LoRA factors of
several encoders at once, ``<m>.lora_A`` (E, r, in) and ``<m>.lora_B`` (E, out, r), and routes
each row's tokens to its encoder's (:func:`~qswap.encoders.runtime.packing.segment_routing`), so one call serves rows of any mix of LoRA
encoders (:mod:`qswap.encoders.runtime.shared_segments`); the biases are the base's, fused as
above. Word embeddings stay outside, as for merged exports
(:mod:`qswap.encoders.runtime.onnx_export`): the caller gathers rows of the base matrix.
"""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qswap.encoders.base import BaseEncoder
from qswap.encoders.layout import BaseLayout
from qswap.encoders.pool import FACTOR_DTYPES
from qswap.encoders.runtime.export_cache import cached_dir
from qswap.encoders.runtime.export_digest import OPSET, OUTPUT
from qswap.encoders.runtime.packing import segment_routing
from qswap.encoders.runtime.onnx_export import (EXPORT_LOCK, PooledEncoder, _fuse, build_module, probe_cosine,
                                        probe_inputs, release_freed_memory)
from qswap.errors import IntegrityError, InvalidInputError

log = logging.getLogger(__name__)

# Bump when the shared graph changes, so cached exports are rebuilt.
SHARED_FORMAT = 2
# Bump when the segment graph changes (its routing inputs), so cached segment exports are rebuilt.
SEGMENTS_FORMAT = 3
SHARED_MODEL_FILE = "shared.onnx"
SEGMENTS_MODEL_FILE = "segments.onnx"
# The segment graph's token-routing inputs (:func:`~qswap.encoders.runtime.packing.segment_routing`).
SEGMENT_INDEX = ("segment_tokens", "segment_positions")
# Layers a query's pooled embedding never depends on (mean/CLS pooling of last_hidden_state).
UNREACHED = ("pooler",)


@dataclass(frozen=True)
class Slots:
    """The adapter inputs of a shared graph: which layers, in graph-input order."""

    linear: tuple[tuple[str, int, int], ...]   # (module, in_features, out_features)
    norm: tuple[tuple[str, int], ...]          # (module, normalized size)
    # Linears without LoRA inputs (only their bias): plain base projections in the graph
    plain: frozenset[str] = frozenset()

    def only(self, lora: Any) -> "Slots":
        """These slots with LoRA inputs on the Linears ``lora`` (module names) only: the others
        plain, the base projection and its bias input (a graph for encoders that adapt only
        ``lora``, without the rank-0 adapter nodes of the rest)."""
        keep = set(lora)
        return Slots(self.linear, self.norm, frozenset(m for m, _, _ in self.linear if m not in keep))

    def input_names(self) -> list[str]:
        names: list[str] = []
        for m, _, _ in self.linear:
            names += [f"{m}.bias"] if m in self.plain else [f"{m}.lora_A", f"{m}.lora_B", f"{m}.bias"]
        names += [f"{m}.bias" for m, _ in self.norm]
        return names

    def segment_names(self) -> list[str]:
        """The segment graph's inputs after the token embeddings and mask: the token routing,
        then the shared graph's (the factors with an encoder axis in front)."""
        return [*SEGMENT_INDEX, *self.input_names()]

    def base_inputs(self, base: BaseEncoder, dtype: torch.dtype = torch.float32,
                    rank: int = 0) -> dict[str, torch.Tensor]:
        """Inputs that compute the base itself (the identity encoder): rank-``rank`` zero factors
        of ``dtype`` and the base's own biases (the model's tensors, not copies; read without
        building the torch module, :meth:`BaseEncoder.tensor`)."""
        out: dict[str, torch.Tensor] = {}
        biases = set(base.layout.bias_names())
        for m, i, o in self.linear:
            if m not in self.plain:
                out[f"{m}.lora_A"] = torch.zeros((rank, i), dtype=dtype)
                out[f"{m}.lora_B"] = torch.zeros((o, rank), dtype=dtype)
            name = f"{m}.bias"
            out[name] = base.tensor(name).detach() if name in biases else torch.zeros(o)
        for m, _ in self.norm:
            out[f"{m}.bias"] = base.tensor(f"{m}.bias").detach()
        return out

    def segment_inputs(self, base: BaseEncoder, lengths: list[int], packed: bool, dtype: torch.dtype = torch.float32,
                       rank: int = 0, segments: int = 1) -> dict[str, torch.Tensor]:
        """:meth:`base_inputs` in the segment graph's layout, rows of ``lengths`` tokens (end to end
        if ``packed``, else padded to the longest) dealt over ``segments`` encoders (all the base):
        the routing, factors (E, rank, in) / (E, out, rank), the base's biases."""
        rows = len(lengths)
        out: dict[str, torch.Tensor] = {
            k: torch.from_numpy(v) for k, v in
            segment_routing(np.arange(rows) * segments // rows, segments, lengths, packed).items()}
        for name, t in self.base_inputs(base, dtype, rank).items():
            out[name] = t.unsqueeze(0).expand(segments, *t.shape).contiguous() if ".lora_" in name else t
        return out


def find_slots(layout: BaseLayout) -> Slots:
    """Every Linear and LayerNorm of a base (its :attr:`BaseEncoder.layout`) a query's embedding depends on."""
    return Slots(tuple((n, i, o) for n, i, o, _ in layout.linear if n.split(".")[0] not in UNREACHED),
                 tuple((n, size) for n, size in layout.norm if n.split(".")[0] not in UNREACHED))


class _Inputs:
    """The graph inputs of the forward being traced, read by the adapted layers and attention."""

    segments = False   # adapter inputs per encoder, rows routed by SEGMENT_INDEX (the segment graph)
    values: dict[str, torch.Tensor] = {}
    mask: torch.Tensor | None = None     # (n, L) int32 key padding mask, cast once per forward
    # id(activation) -> (it, its rows per segment): query/key/value share one Gather; the
    # activation is kept so that its id is not reused within the forward
    taken: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def segment(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """(n, L, width) or packed (1, T, width) -> (E, M, width): each encoder's tokens (padded to
        the largest encoder's) as one matrix; one Gather, and reshapes of constant shape."""
        if id(x) not in self.taken:
            self.taken[id(x)] = x, x.reshape(-1, width)[self.values["segment_tokens"]]
        return self.taken[id(x)][1]

    def unsegment(self, y: torch.Tensor, width: int) -> torch.Tensor:
        """(E, M, width) -> (n, L, width) padded, (T, width) packed, in token order: each token's own
        product, padding dropped; one Gather (its indices give the shape: no Shape/Reshape pair per
        Linear; a packed (T, width) adds to a (1, T, width) projection by broadcasting)."""
        return y.reshape(-1, width)[self.values["segment_positions"]]


class _AdaptedLinear(torch.nn.Module):
    def __init__(self, lin: torch.nn.Linear, name: str, inputs: _Inputs, plain: bool = False) -> None:
        super().__init__()
        self.weight, self.name, self.inputs, self.plain = lin.weight, name, inputs, plain
        self.bias_in_attention = False   # query/key/value: MultiHeadAttention adds their biases

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.inputs.values
        y = torch.matmul(x, self.weight.t())
        if self.plain:   # no LoRA inputs: the base projection only
            return y if self.bias_in_attention else y + v[f"{self.name}.bias"]
        a, b = v[f"{self.name}.lora_A"], v[f"{self.name}.lora_B"]
        if a.dtype != torch.float32:   # half-precision storage, float32 compute (a Cast in the graph)
            a, b = a.float(), b.float()
        if self.inputs.segments:   # per encoder: a (E, r, in), b (E, out, r); the base's bias
            xs = self.inputs.segment(x, self.weight.shape[1])
            low = torch.matmul(torch.matmul(xs, a.transpose(1, 2)), b.transpose(1, 2))
            y = y + self.inputs.unsegment(low, self.weight.shape[0])
            return y if self.bias_in_attention else y + v[f"{self.name}.bias"]
        # Projection, then the rank-r path, then the bias: the bias Add comes last so that
        # fold_biases finds it right before the Gelu / residual Add it belongs to.
        y = y + torch.matmul(torch.matmul(x, a.t()), b.t())
        return y if self.bias_in_attention else y + v[f"{self.name}.bias"]

    def bias_input(self) -> torch.Tensor:
        return self.inputs.values[f"{self.name}.bias"]


class _AdaptedNorm(torch.nn.Module):
    def __init__(self, ln: torch.nn.LayerNorm, name: str, inputs: _Inputs) -> None:
        super().__init__()
        self.ln, self.name, self.inputs = ln, name, inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ln, bias = self.ln, self.inputs.values[f"{self.name}.bias"]
        return torch.nn.functional.layer_norm(x, ln.normalized_shape, ln.weight, bias, ln.eps)


@torch.library.custom_op("qswap::multi_head_attention", mutates_args=())
def _multi_head_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor,
                          heads: int, scale: float) -> torch.Tensor:
    """Eager attention in torch over (n, L, hidden) projections; ONE ``com.microsoft``
    ``MultiHeadAttention`` node in an exported graph (:func:`_mha_symbolic`)."""
    n, length, hidden = q.shape
    q, k, v = (t + bias[i * hidden:(i + 1) * hidden] for i, t in enumerate((q, k, v)))
    q, k, v = (t.reshape(n, length, heads, hidden // heads).transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = scores.masked_fill(mask[:, None, None, :] == 0, torch.finfo(scores.dtype).min)
    out = torch.matmul(torch.softmax(scores, dim=-1), v)
    return out.transpose(1, 2).reshape(n, length, hidden).contiguous()


@_multi_head_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor,
      heads: int, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


def _mha_symbolic(g: Any, q: Any, k: Any, v: Any, bias: Any, mask: Any, heads: Any, scale: Any) -> Any:
    from torch.onnx import symbolic_helper as sh

    return g.op("com.microsoft::MultiHeadAttention", q, k, v, bias, mask,
                num_heads_i=sh._get_const(heads, "i", "heads"), scale_f=sh._get_const(scale, "f", "scale"))


torch.onnx.register_custom_op_symbolic("qswap::multi_head_attention", _mha_symbolic, OPSET)


class _FusedSelfAttention(torch.nn.Module):
    """A BERT-family self-attention module (``query``/``key``/``value`` Linear children) as ONE
    ``MultiHeadAttention`` node: the projections (LoRA product included) go in as they are, the
    three biases as the node's bias input, the key padding mask as its mask. No reshapes or
    transposes around it: those, with their shape arithmetic, were ~400 of the graph's nodes."""

    def __init__(self, attn: torch.nn.Module, inputs: _Inputs) -> None:
        super().__init__()
        self.query, self.key, self.value, self.inputs = attn.query, attn.key, attn.value, inputs
        self.heads = int(attn.num_attention_heads)
        self.scale = float(getattr(attn, "scaling", attn.attention_head_size ** -0.5))
        for m in (self.query, self.key, self.value):
            m.bias_in_attention = True

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        bias = torch.cat([m.bias_input() for m in (self.query, self.key, self.value)])
        out = torch.ops.qswap.multi_head_attention(self.query(hidden_states), self.key(hidden_states),
                                                   self.value(hidden_states), bias, self.inputs.mask,
                                                   self.heads, self.scale)
        return out, None


def _is_self_attention(mod: torch.nn.Module) -> bool:
    """A BERT-family encoder self-attention block this module knows how to fuse."""
    return (all(isinstance(getattr(mod, p, None), _AdaptedLinear) for p in ("query", "key", "value"))
            and hasattr(mod, "num_attention_heads") and hasattr(mod, "attention_head_size")
            and not getattr(mod, "is_decoder", False) and not getattr(mod, "is_cross_attention", False))


class SharedEncoder(torch.nn.Module):
    """``(inputs_embeds, attention_mask, *adapter inputs) -> pooled embedding``."""

    def __init__(self, pooled: PooledEncoder, slots: Slots, segments: bool = False) -> None:
        super().__init__()
        self.pooled, self.slots = pooled, slots
        self.names = slots.segment_names() if segments else slots.input_names()
        self.inputs = _Inputs()
        self.inputs.values, self.inputs.taken = {}, {}
        self.inputs.segments = segments
        model = pooled.model
        adapted: dict[str, _AdaptedLinear] = {}
        for name, _, _ in slots.linear:
            adapted[name] = _AdaptedLinear(model.get_submodule(name), name, self.inputs, plain=name in slots.plain)
            _replace(model, name, adapted[name])
        for name, _ in slots.norm:
            _replace(model, name, _AdaptedNorm(model.get_submodule(name), name, self.inputs))
        # Self-attention blocks of BERT-family bases become MultiHeadAttention nodes; any other
        # attention stays as the model computes it (correct, unfused).
        for name, mod in list(model.named_modules()):
            if _is_self_attention(mod):
                _replace(model, name, _FusedSelfAttention(mod, self.inputs))

    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor,
                *adapter: torch.Tensor) -> torch.Tensor:
        self.inputs.values = dict(zip(self.names, adapter))
        self.inputs.mask = attention_mask.to(torch.int32)
        try:
            return self.pooled(inputs_embeds, attention_mask)
        finally:
            self.inputs.values, self.inputs.mask, self.inputs.taken = {}, None, {}


def _replace(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    *path, leaf = name.split(".")
    parent = model.get_submodule(".".join(path)) if path else model
    setattr(parent, leaf, new)


def shared_digest(base: BaseEncoder, variant: str, factors: str = "float32", segments: bool = False) -> str:
    """Content key of a shared export: format, opset, variant (cpu/cuda), factor dtype, base
    space, and whether it is the segment graph."""
    kind = f"segments{SEGMENTS_FORMAT}" if segments else "shared"
    return hashlib.sha256(f"{kind}|{SHARED_FORMAT}|{OPSET}|{variant}|{factors}|{base.space.fingerprint}"
                          .encode()).hexdigest()


def fold_biases(path: Path) -> dict[str, int]:
    """Move bias Adds (a graph-input bias after a projection) into the fused node that follows.

    ONNX Runtime's optimiser folds a projection's bias into ``BiasGelu`` / the bias input of
    ``SkipLayerNormalization`` only when the bias is a constant; here it is an adapter input
    (a bias encoder binds its own). Rewrites ``Gelu(Add(x, bias))`` to ``BiasGelu(x, bias)``,
    ``FastGelu(Add(x, bias))`` to ``FastGelu(x, bias)`` and ``SkipLayerNormalization(Add(x, bias),
    skip, g, b)`` to ``SkipLayerNormalization(x, skip, g, b, bias)``, in place. Returns how many
    of each were folded.
    """
    import onnx

    model = onnx.load(str(path))
    graph = model.graph
    biases = {i.name for i in graph.input if i.name.endswith(".bias")}
    producer = {o: n for n in graph.node for o in n.output}
    uses: dict[str, int] = {}
    for n in graph.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1

    def bias_add(name: str) -> tuple[Any, str, str] | None:
        add = producer.get(name)
        if add is None or add.op_type != "Add" or uses.get(name, 0) != 1:
            return None
        for j in (0, 1):
            if add.input[j] in biases:
                return add, add.input[1 - j], add.input[j]
        return None

    folded = {"BiasGelu": 0, "FastGelu": 0, "SkipLayerNormalization": 0}
    drop: list[Any] = []
    for node in list(graph.node):
        if node.op_type in ("Gelu", "FastGelu") and len(node.input) == 1:
            hit = bias_add(node.input[0])
            if hit is None:
                continue
            add, x, bias = hit
            if node.op_type == "Gelu":
                node.op_type = "BiasGelu"
            del node.input[:]
            node.input.extend([x, bias])
            drop.append(add)
            folded[node.op_type] += 1
        elif node.op_type == "SkipLayerNormalization" and len(node.input) == 4:
            for idx in (0, 1):
                hit = bias_add(node.input[idx])
                if hit is not None:
                    add, x, bias = hit
                    rest = list(node.input)
                    del node.input[:]
                    node.input.extend([x, rest[1 - idx], rest[2], rest[3], bias])
                    drop.append(add)
                    folded["SkipLayerNormalization"] += 1
                    break
    for add in drop:
        graph.node.remove(add)
    onnx.save(model, str(path))
    return {k: v for k, v in folded.items() if v}


def export_shared(base: BaseEncoder, out_dir: Path, *, factors: str = "float32",
                  optimize_for: str | None = "cpu", segments: bool = False, lora: Any = None) -> dict[str, Any]:
    """Write ``shared.onnx`` (``segments.onnx``) to ``out_dir``; checked against the torch base on probe texts.

    Args:
        base: the base model (never changed: the graph is traced from a storage-sharing copy).
        out_dir: where the graph goes.
        factors: storage type of the LoRA factor inputs (:data:`qswap.encoders.pool.FACTOR_DTYPES`).
        optimize_for: ``"cpu"`` / ``"cuda"`` runs ONNX Runtime's transformer optimiser (skip layer
            norm, GELU) and :func:`fold_biases`; ``None`` keeps the graph as exported (attention is
            a ``MultiHeadAttention`` node either way).
        segments: LoRA factors per encoder, tokens routed to them (module docstring).
        lora: the Linears (module names) that take LoRA factors; ``None``: every one. The others
            are plain base projections (their bias still an input).

    Returns:
        Facts for the cache record: probe cosine, fused node counts, export seconds, slot counts.
    """
    t0 = time.perf_counter()
    if factors not in FACTOR_DTYPES:
        raise InvalidInputError(f"unknown LoRA factor dtype {factors!r}", f"use one of {', '.join(FACTOR_DTYPES)}")
    dtype = FACTOR_DTYPES[factors]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pooled = build_module(base, {})
    slots = find_slots(base.layout)
    if lora is not None:
        slots = slots.only(lora)
    module = SharedEncoder(pooled, slots, segments).eval()
    names = slots.segment_names() if segments else slots.input_names()
    table = base.word_embeddings().detach().float().cpu().numpy()
    emb, mask = probe_inputs(base, table)

    def inputs(rows: int, rank: int, length: int = mask.shape[1]) -> dict[str, torch.Tensor]:
        if segments:   # two encoders when tracing, so no shape is specialised to one
            return slots.segment_inputs(base, [length] * rows, False, dtype, rank, segments=2 if rank else 1)
        return slots.base_inputs(base, dtype, rank)
    feed = inputs(len(mask), 2)
    dev = base.device
    # Trace with rank 2 so no shape is specialised to the rank, then check rank 0 below.
    args = (torch.from_numpy(emb).to(dev), torch.from_numpy(mask).to(dev), *[feed[n].to(dev) for n in names])
    path = out_dir / (SEGMENTS_MODEL_FILE if segments else SHARED_MODEL_FILE)
    with EXPORT_LOCK, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=["inputs_embeds", "attention_mask", *names],
                          output_names=[OUTPUT], dynamic_axes=_dynamic_axes(slots, segments),
                          opset_version=OPSET, do_constant_folding=True, dynamo=False,
                          custom_opsets={"com.microsoft": 1})
        ref = module(*args).float().cpu().numpy()
    if optimize_for is not None:
        _fuse(path, base, use_gpu=optimize_for == "cuda")
        fold_biases(path)
    fused = _fused_ops(path)
    cos = probe_cosine(path, emb, mask, ref,
                       extra=lambda rows, length: {n: ort_input(t) for n, t in inputs(rows, 0, length).items()})
    if cos < 0.99999:
        raise IntegrityError(f"shared ONNX export disagrees with torch (probe cosine {cos:.7f})",
                             "encoders keep running on torch; report this base model")
    return {"probe_min_cosine": cos, "fused": fused, "factors": factors,
            "export_seconds": round(time.perf_counter() - t0, 3),
            "linear_slots": len(slots.linear), "norm_slots": len(slots.norm)}


def _dynamic_axes(slots: Slots, segments: bool) -> dict[str, dict[int, str]]:
    """The export's dynamic axes: batch and sequence, and :func:`adapter_axes`."""
    axes: dict[str, dict[int, str]] = {"inputs_embeds": {0: "batch", 1: "sequence"},
                                       "attention_mask": {0: "batch", 1: "sequence"}, OUTPUT: {0: "batch"}}
    axes.update(adapter_axes(slots, segments))
    if segments:
        axes["segment_positions"] = {0: "batch", 1: "sequence"}
    return axes


def adapter_axes(slots: Slots, segments: bool) -> dict[str, dict[int, str]]:
    """The adapter inputs' dynamic axes: each layer's rank, and for the segment graph the encoder
    axis of the factors and of ``segment_tokens`` (``segment_positions`` is the caller's: padded
    rows or packed tokens)."""
    axes: dict[str, dict[int, str]] = {}
    for i, (m, _, _) in enumerate(slots.linear):
        if m in slots.plain:
            continue
        if segments:   # one rank per layer (the batch's encoders' largest), one row per encoder
            axes[f"{m}.lora_A"] = {0: "segments", 1: f"r{i}"}
            axes[f"{m}.lora_B"] = {0: "segments", 2: f"r{i}"}
        else:
            axes[f"{m}.lora_A"] = {0: f"r{i}"}
            axes[f"{m}.lora_B"] = {1: f"r{i}"}
    if segments:
        axes["segment_tokens"] = {0: "segments", 1: "segment_tokens"}
    return axes


def _fused_ops(path: Path) -> dict[str, int]:
    """How many nodes of each fused (``com.microsoft``) op the graph at ``path`` holds."""
    import onnx

    out: dict[str, int] = {}
    for n in onnx.load(str(path), load_external_data=False).graph.node:
        if n.domain == "com.microsoft":
            out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


def ort_input(t: torch.Tensor, cuda: bool = False) -> Any:
    """An ``OrtValue`` over a CPU tensor's memory (no copy; a device copy with ``cuda``).

    Args:
        t: a CPU tensor (float32, float16 or bfloat16: numpy has no bfloat16, so its bits go
            in as int16 with the ONNX element type set).
        cuda: put the value on the first CUDA device.

    Returns:
        The ``onnxruntime.OrtValue``.
    """
    import onnxruntime as ort
    from onnx import TensorProto

    if t.dtype == torch.bfloat16:   # a CPU value on any device: ONNX Runtime copies it per run
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(t.detach().view(torch.int16).numpy(),
                                                               TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(t.detach().numpy(), *(("cuda", 0) if cuda else ("cpu", 0)))


def cached_shared(base: BaseEncoder, directory: Path, variant: str, factors: str, segments: bool = False) -> Path:
    """The shared (``segments=False``) or segment graph of ``base`` under ``directory`` (the
    segment graph in its ``-segments`` sibling), exported once and reused while its digest holds."""
    target = directory.with_name(directory.name + "-segments") if segments else directory
    digest = shared_digest(base, variant, factors, segments=segments)
    model_file = SEGMENTS_MODEL_FILE if segments else SHARED_MODEL_FILE

    def export(staging: Path) -> dict[str, Any]:
        facts = export_shared(base, staging, factors=factors, optimize_for=variant, segments=segments)
        release_freed_memory()
        return {"digest": digest, "variant": variant, "space": base.space.fingerprint, "base": base.name, **facts}

    meta, exported = cached_dir(target, digest, model_file, export)
    if exported:
        log.info("exported the %s base graph in %.1fs (probe cosine %.7f)", model_file.split(".")[0],
                 meta["export_seconds"], meta["probe_min_cosine"])
    return target / model_file
