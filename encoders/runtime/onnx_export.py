"""Export one query encoder (base + adapter, merged) to an ONNX graph without its word embeddings.

The graph takes ``inputs_embeds`` (n, L, d) float32 and ``attention_mask`` (n, L) int64 and
returns the pooled (and, if the base normalises, L2-normalised) embedding (n, d). The
word-embedding lookup stays outside: the caller gathers rows of the ONE shared base matrix
(96M parameters for multilingual-e5-small), so N exported encoders cost N x their
transformer weights, not N x the base. Position and token-type embeddings stay inside (small).

An encoder whose adapter changes the word-embedding matrix itself (a ``partial`` encoder
over ``embeddings.word_embeddings.weight``, a LoRA on the embedding) gets its own matrix
saved next to the graph (``word_embeddings.npy``, memory-mapped when loaded).
"""

from __future__ import annotations

import copy
import inspect
import logging
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from qswap.encoders.base import BaseEncoder
from qswap.encoders.embedding import tokenize_batch
from qswap.encoders.pooling import pool
from qswap.errors import IntegrityError
from qswap.encoders.runtime.export_digest import EMBEDDINGS_FILE, INPUTS, MODEL_FILE, OPSET, OUTPUT

log = logging.getLogger(__name__)

# torch.onnx.export keeps global tracing state: two exports at once (the shared graph and a
# merged one, from two background threads) corrupt each other.
EXPORT_LOCK = threading.Lock()
# An export must reproduce the torch forward it came from this closely on probe texts, or it
# is refused (the torch path keeps serving). fp32 graphs reach 0.9999999 in practice.
MIN_PROBE_COSINE = 0.99999
_PROBES = ("a", "search the index for a python library", "chess puzzle game with levels for linux",
           "the quick brown fox jumps over the lazy dog while the network server answers a query")


class PooledEncoder(torch.nn.Module):
    """``(inputs_embeds, attention_mask) -> pooled embedding``: what the ONNX graph computes."""

    def __init__(self, model: torch.nn.Module, pooling: str, normalize: bool) -> None:
        super().__init__()
        self.model = model
        self.pooling = pooling
        self.normalize = normalize
        emb = getattr(model, "embeddings", None)
        # RoBERTa-family models number positions from the padding index, counting only real
        # tokens; from inputs_embeds they would count pads too. Computing them from the mask
        # keeps the exact torch positions whichever side the tokenizer pads.
        self.padding_idx = getattr(emb, "padding_idx", None) \
            if "position_ids" in inspect.signature(model.forward).parameters else None

    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, torch.Tensor] = {}
        if self.padding_idx is not None:
            kwargs["position_ids"] = torch.cumsum(attention_mask, dim=1) * attention_mask + self.padding_idx
        out = self.model(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        x = pool(hidden, attention_mask, self.pooling)
        return torch.nn.functional.normalize(x, dim=-1) if self.normalize else x


def word_embedding_name(model: torch.nn.Module) -> str:
    """State-dict name of the model's input word-embedding matrix."""
    weight = model.get_input_embeddings().weight
    for name, p in model.named_parameters():
        if p is weight:
            return name
    raise IntegrityError("the base model's word embeddings are not among its parameters",
                         "use a standard Hugging Face encoder as base")


def own_tensors(base: BaseEncoder, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` that are not the base's own storage (the adapter's effect)."""
    ref = base.model.state_dict()
    out = {}
    for name, t in state.items():
        r = ref.get(name)
        if r is None or r.data_ptr() != t.data_ptr() or r.shape != t.shape:
            out[name] = t
    return out


def _set_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    mod = model.get_submodule(".".join(path)) if path else model
    if leaf in mod._parameters:
        mod._parameters[leaf] = torch.nn.Parameter(value.detach(), requires_grad=False)
    elif leaf in mod._buffers:
        mod._buffers[leaf] = value.detach()
    else:
        raise IntegrityError(f"tensor {name!r} is not in the base model", "the adapter does not fit this base")


def build_module(base: BaseEncoder, own: dict[str, torch.Tensor]) -> PooledEncoder:
    """A :class:`PooledEncoder` over a storage-sharing copy of the base with ``own`` substituted.

    The copy shares every base tensor (no weight memory), its word embeddings are replaced by
    a 1-row placeholder so they can never end up in the graph, and attention is the eager
    implementation: its plain MatMul/Softmax pattern is what ONNX Runtime fuses.
    """
    memo = {id(t): t for t in list(base.model.parameters()) + list(base.model.buffers())}
    model = copy.deepcopy(base.model, memo)
    for name, t in own.items():
        _set_tensor(model, name, t)
    dim = model.get_input_embeddings().weight.shape[1]
    model.set_input_embeddings(torch.nn.Embedding(1, dim, device=base.device))
    try:
        model.set_attn_implementation("eager")
    except (AttributeError, ValueError) as e:   # older/other models: keep their default
        log.debug("eager attention unavailable (%s); exporting the default implementation", e)
    model.eval()
    return PooledEncoder(model, base.spec.pooling, base.spec.normalize).eval()


def probe_inputs(base: BaseEncoder, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Padded probe batch (embeddings gathered from ``table``, mask) from fixed query texts."""
    ids, mask = tokenize_batch(base.tokenizer, list(_PROBES), base.spec.query_prefix)
    return np.ascontiguousarray(table[ids.numpy()], dtype=np.float32), mask.numpy()


def export_onnx(base: BaseEncoder, own: dict[str, torch.Tensor], out_dir: Path, *,
                optimize_for: str | None = "cpu") -> dict[str, Any]:
    """Write ``model.onnx`` (and ``word_embeddings.npy`` if the adapter owns one) to ``out_dir``.

    ``own``: tensors that differ from the base (:func:`own_tensors`). ``optimize_for``:
    ``"cpu"``/``"cuda"`` runs ONNX Runtime's transformer fusions (attention, skip layer
    norm, bias GELU) on the saved graph, ``None`` leaves it as exported. The export is
    checked against the torch forward on probe texts (cosine >= ``MIN_PROBE_COSINE``) and
    raises :class:`IntegrityError` if it disagrees. Returns facts for the cache record.
    """
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wname = word_embedding_name(base.model)
    module = build_module(base, own)
    table = own[wname] if wname in own else base.model.get_input_embeddings().weight
    table_np = table.detach().float().cpu().numpy()
    if wname in own:
        np.save(out_dir / EMBEDDINGS_FILE, table_np)
    emb, mask = probe_inputs(base, table_np)
    dev = base.device
    args = (torch.from_numpy(emb).to(dev), torch.from_numpy(mask).to(dev))
    path = out_dir / MODEL_FILE
    axes = {"inputs_embeds": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
            OUTPUT: {0: "batch"}}
    with EXPORT_LOCK, warnings.catch_warnings(), torch.no_grad():
        # The tracer warns about Python-level shape checks in transformers; the dynamic-axes
        # check below (other batch and length than traced) is what proves the graph general.
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=list(INPUTS), output_names=[OUTPUT],
                          dynamic_axes=axes, opset_version=OPSET, do_constant_folding=True, dynamo=False)
        ref = module(*args).float().cpu().numpy()
    fused: dict[str, int] = {}
    if optimize_for is not None:
        fused = _fuse(path, base, use_gpu=optimize_for == "cuda")
    cos = probe_cosine(path, emb, mask, ref)
    if cos < MIN_PROBE_COSINE:
        raise IntegrityError(f"ONNX export disagrees with torch (probe cosine {cos:.7f})",
                             "the encoder keeps running on torch; report this model/adapter")
    return {"probe_min_cosine": cos, "fused": fused, "export_seconds": round(time.perf_counter() - t0, 3),
            "own_word_embeddings": wname in own, "own_tensors": len(own)}


def _fuse(path: Path, base: BaseEncoder, use_gpu: bool) -> dict[str, int]:
    """Apply ONNX Runtime's BERT fusions in place; keep the plain graph if they fail."""
    cfg = base.model.config
    try:
        from onnxruntime.transformers.optimizer import optimize_model
        _quiet_optimizer_logs()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = optimize_model(str(path), model_type="bert", num_heads=int(cfg.num_attention_heads),
                                 hidden_size=int(cfg.hidden_size), opt_level=0, use_gpu=use_gpu)
        stats = {k: int(v) for k, v in opt.get_fused_operator_statistics().items() if v}
        opt.save_model_to_file(str(path))
        return stats
    except Exception as e:   # the optimiser is best effort: any failure leaves a valid plain graph
        log.warning("ONNX Runtime fusion skipped for %s: %s", base.name, e)
        return {}


def _quiet_optimizer_logs() -> None:
    """The optimiser's modules log every fusion at INFO under bare names (``fusion_utils``...)."""
    import sys

    for name in list(logging.root.manager.loggerDict):
        mod = sys.modules.get(name)
        if "onnxruntime" in str(getattr(mod, "__file__", "")):
            logging.getLogger(name).setLevel(logging.WARNING)


def probe_cosine(path: Path, emb: np.ndarray, mask: np.ndarray, ref: np.ndarray,
                 extra: dict[str, Any] | Callable[[int, int], dict[str, Any]] | None = None) -> float:
    """Minimum row cosine between the graph at ``path`` (CPU) and ``ref`` on the probe batch.

    Runs the batch whole and row by row at each row's own length, so a graph whose batch or
    sequence size was frozen at trace time fails here. ``extra``: more graph inputs (adapters),
    or a function of the batch size and sequence length giving them (per-row or per-token inputs).
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    fixed = extra or {}
    feed = extra if callable(extra) else lambda rows, length: fixed
    outs = [sess.run(None, {"inputs_embeds": emb, "attention_mask": mask, **feed(*mask.shape)})[0]]
    rows = []
    for i in range(len(mask)):
        n = int(mask[i].sum())
        rows.append(sess.run(None, {"inputs_embeds": emb[i:i + 1, :n], "attention_mask": mask[i:i + 1, :n],
                              **feed(1, n)})[0])
    outs.append(np.concatenate(rows))
    return min(float(_cosine(o, ref).min()) for o in outs)


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return (a * b).sum(axis=1)


def release_freed_memory() -> None:
    """Hand the heap an export freed back to the OS (glibc keeps it otherwise); call it after
    :func:`export_onnx` or :func:`~qswap.encoders.runtime.shared_export.export_shared`
    returns.

    The optimiser's passes hold several copies of the graph; in a server, whose export runs
    in-process, ~500 MB of them stayed resident after the export of multilingual-e5-small
    (1,377 vs 881 MB RSS after ``malloc_trim``). No-op where glibc is absent.
    """
    import gc

    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Return the free pages of every malloc arena to the OS (glibc ``malloc_trim``; no-op
    elsewhere), without a garbage collection: cheap enough to call after each encoder load.

    glibc keeps freed heap pages resident: an encoder load frees its file's float32 copies and
    validation temporaries (~10 MB for a LoRA r=16 adapter of multilingual-e5-small), an eviction
    its objects, and with load/evict churn the holes they leave add up in RSS
    (bench/results/scale/).
    """
    import ctypes
    import ctypes.util

    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
        except OSError:   # no loadable C library: nothing to trim
            libc = None
        _LIBC = libc if libc is not None and hasattr(libc, "malloc_trim") else False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None   # the C library once looked up (False: none with malloc_trim)
