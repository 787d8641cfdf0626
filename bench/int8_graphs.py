"""int8 versions of an exported fp32 ONNX graph (ONNX Runtime dynamic quantisation), and
queries through them: the bench library behind ``qswap bench embed``'s int8 document arms,
``qswap bench forward``'s int8 query arms and ``qswap bench bf16-quality --int8``.

Weights are stored as int8 (per tensor or per output channel); activations are quantised per
call (uint8, one scale per tensor), and the int8 products run on VNNI / AMX where the CPU has
them. qswap serves none of these graphs: they are measured, against the fp32 graph, to decide.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

#: int8 schemes of :func:`quantized_graph`: (weight scales per channel, which MatMuls are quantised).
#: ``dynamic``: per-tensor scales, every op the quantiser knows (MatMul, the fused Attention nodes);
#: ``selective``: per-tensor, only the feed-forward up-projections; ``per-channel``: per-channel
#: scales, every MatMul and the fused Attention nodes' projections (QAttention); ``per-channel-ffn-out-fp32``:
#: the same with the feed-forward down-projections (whose inputs, after GELU, have the widest range) kept fp32.
INT8_SCHEMES = ("dynamic", "selective", "per-channel", "per-channel-ffn-out-fp32")


def quantized_graph(fp32_graph: Path, out_dir: Path, scheme: str) -> Path:
    """ONNX Runtime dynamic int8 quantisation of the fused fp32 graph by ``scheme``
    (:data:`INT8_SCHEMES`); written once to ``out_dir/int8-<scheme>.onnx`` and reused."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    import onnx

    if scheme not in INT8_SCHEMES:
        raise ValueError(f"unknown int8 scheme {scheme!r}")
    out = out_dir / f"int8-{scheme}.onnx"
    if out.exists():
        return out
    per_channel = scheme.startswith("per-channel")
    kw: dict[str, Any] = {"op_types_to_quantize": ["MatMul", "Attention"]} if per_channel else {}
    if scheme in ("selective", "per-channel-ffn-out-fp32"):
        model = onnx.load(str(fp32_graph), load_external_data=False)
        inits = {i.name: tuple(i.dims) for i in model.graph.initializer}

        def weight(n: Any) -> tuple[int, ...]:
            return next((inits[x] for x in n.input if len(inits.get(x, ())) == 2), ())
        if scheme == "selective":   # up-projections: weight (d, ff) with ff > d
            kw["nodes_to_quantize"] = [n.name for n in model.graph.node if n.op_type == "MatMul"
                                       and weight(n) and weight(n)[1] > weight(n)[0]]
        else:                       # every node but the down-projections: weight (ff, d)
            kw["nodes_to_exclude"] = [n.name for n in model.graph.node if n.op_type == "MatMul"
                                      and weight(n) and weight(n)[0] > weight(n)[1]]
    # The fused graph's com.microsoft ops defeat shape inference: tell the quantiser the type.
    quantize_dynamic(str(fp32_graph), str(out), weight_type=QuantType.QInt8, per_channel=per_channel,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT}, **kw)
    return out


#: query arm name (``qswap bench forward --backends``) -> int8 scheme (:data:`INT8_SCHEMES`).
ARMS = {"ort-int8": "per-channel", "ort-int8-ffn32": "per-channel-ffn-out-fp32"}


def graph_encoder(base: Any, session: Any, first_position: int = 0) -> Callable[[list[str]], np.ndarray]:
    """Queries through one ONNX Runtime session of a merged graph: the base's tokenizer and query
    prefix, rows padded to the call's longest (a packed graph gets their real tokens, rows starting
    at position ``first_position``: :mod:`qswap.encoders.runtime.packing`), word embeddings gathered from the base matrix
    (what :class:`qswap.encoders.runtime.onnx.OnnxBackend` does for a batch of equal keys)."""
    from qswap.encoders.runtime.packing import graph_inputs

    table = base.model.get_input_embeddings().weight.detach().float().cpu().numpy()
    tok, prefix = base.tokenizer, base.spec.query_prefix
    # A packed graph (the CPU's merged export: qswap.encoders.runtime.packed_export) takes the real tokens.
    packed = any(i.name == "token_index" for i in session.get_inputs())

    def encode(texts: list[str]) -> np.ndarray:
        encs = tok.encode_batch([prefix + t for t in texts])
        width = max(sum(e.attention_mask) for e in encs)
        ids = np.array([e.ids[:width] for e in encs], dtype=np.int64)
        mask = np.array([e.attention_mask[:width] for e in encs], dtype=np.int64)
        feed = graph_inputs(table, ids, mask, base.spec.pooling, first_position if packed else None)
        return session.run(None, feed)[0]
    return encode


def int8_arms(base: Any, fp32_graph: Path, work: Path, names: list[str], *, threads: int,
              spin: bool) -> tuple[dict[str, Callable[[list[str]], np.ndarray]], dict[str, Any]]:
    """The ``names`` arms (keys of :data:`ARMS`) over ``fp32_graph``, quantised into ``work``;
    returns ``(encoders, facts)``, facts per arm: scheme, graph MB, seconds to quantise."""
    import time

    from qswap.encoders.runtime.export_cache import read_meta
    from qswap.encoders.runtime.onnx import make_session

    fns, facts = {}, {}
    start = int(read_meta(fp32_graph.parent).get("first_position", 0))   # a packed graph's (packing)
    for name in names:
        t = time.perf_counter()
        path = quantized_graph(fp32_graph, work, ARMS[name])
        facts[name] = {"scheme": ARMS[name], "quantize_seconds": round(time.perf_counter() - t, 2),
                       "model_file_mb": round(path.stat().st_size / 2**20, 1), "model_file_bytes": path.stat().st_size}
        fns[name] = graph_encoder(base, make_session(path, threads, ["CPUExecutionProvider"], spin), start)
    return fns, facts
