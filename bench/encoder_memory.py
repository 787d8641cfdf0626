"""``qswap bench encoder-memory``: what a loaded LoRA encoder costs in one process, stage by stage.

In one process, the pool (float16 factors, as a server stores them) and the shared ONNX Runtime
backend over the base, as a server runs them. Two encoders are first run through everything (the
shared session, the group session, the segment graph), so what they cost once is not counted.
Then ``--encoders`` random LoRA r=16 adapters (every Linear) are loaded one by one, and after
each stage the live heap (glibc ``mallinfo2``: in-use bytes, after a garbage collection) is read
(the backend's float32 copies of half-precision factors are mappings of their own, not in it:
capped at ``WIDE_BYTES`` and counted once per server, not per encoder):

- **attach**: ``EncoderPool.add`` (the factors in their own packed mapping, not in the heap; the
  tensor objects, the forward hooks' entries);
- **prepare**: the backend's OrtValues over the encoder's own inputs;
- **run**: a first call on the shared session (its ``IOBinding`` of the graph's inputs);
- **segments**: a small mixed batch (one segment call: the runner's views of the factors);
- **groups**: a larger mixed batch (per group, on the single-threaded session: a second binding).

Per encoder, the heap growth plus the packed factors' bytes is set against what the pool and the
backend count for it (``memory_bytes``, what the memory budget adds up), and per object (tensor,
own input, bound input) against the constants the count uses. Finally every encoder is removed
and what stays in the heap is read.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
from typing import Any

from qswap.bench.fixtures import MODEL, load_space_base, lora_encoders
from qswap.bench.load_options import ByMode, RunDirs
from qswap.bench.results import md_table

NAME = "encoder_memory"
ENCODERS = ByMode(30, 4)
STAGES = ("attach", "prepare", "run", "segments", "groups")
QUERIES = ["what is the capital of france", "a python library for chess"]
KIB = 1024.0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _live_heap() -> int:
    """In-use heap bytes (glibc: small blocks and mmapped ones), after a garbage collection."""
    gc.collect()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return int(m.uordblks + m.hblkhd)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``qswap bench encoder-memory``."""
    p.add_argument("--encoders", type=int, default=None, help=f"encoders loaded ({ENCODERS.describe()})")
    p.add_argument("--model", default=MODEL, help=f"bundled base name or model directory (default {MODEL})")


def _stages(pool: Any, backend: Any, art: Any) -> tuple[str, dict[str, int]]:
    """Load one encoder stage by stage; its key and the heap growth of each stage."""
    from qswap.encoders import BASE_KEY
    out: dict[str, int] = {}
    before = _live_heap()
    pool.add(art)
    key = art.key
    steps = (("prepare", lambda: backend.prepare(key)),
             ("run", lambda: backend.encode(QUERIES, [key, key])),
             ("segments", lambda: backend.encode(QUERIES * 2, [key, BASE_KEY] * 2)),
             ("groups", lambda: backend.encode(QUERIES * 4, [key, BASE_KEY] * 4)))
    now = _live_heap()
    out["attach"] = now - before
    for name, step in steps:
        step()
        before, now = now, _live_heap()
        out[name] = now - before
    return key, out


def run(args: argparse.Namespace) -> int:
    """``qswap bench encoder-memory``."""
    import tempfile
    from pathlib import Path

    from qswap.encoders import BASE_KEY, EncoderPool, load_encoder
    from qswap.encoders.kinds.base import TENSOR_OBJECT_BYTES
    from qswap.encoders.runtime import shared as shared_mod
    from qswap.encoders.runtime.shared import SharedBackend, adapter_inputs

    n = args.encoders or ENCODERS.pick(args.quick)
    dirs = RunDirs.create(NAME, args.quick, args.out)
    base = load_space_base(args.model)
    names = [(f"s{i}", "1") for i in range(n + 2)]
    root = lora_encoders(base, names, rank=16, tag="scale")   # the scale benchmark's cache
    arts = [load_encoder(root / f"{a}-{v}", base.space) for a, v in names]
    pool = EncoderPool(base, "float16")
    with tempfile.TemporaryDirectory() as cache:
        backend = SharedBackend(pool, Path(cache), threads=2, group_workers=2)
        try:
            if not backend.wait(timeout=900):
                raise SystemExit(f"qswap: error: the shared export failed: {backend.error(BASE_KEY)}")
            backend.prepare(BASE_KEY)
            _stages(pool, backend, arts.pop())   # the first: sessions, segment graph, buffers
            if not (backend.groups_side_by_side(wait=300) and backend.segments_ready(wait=600)):
                raise SystemExit("qswap: error: the group session or the segment graph was not built")
            _stages(pool, backend, arts.pop())   # a second, on the sessions and buffers built
            start = _live_heap()
            per: list[dict[str, int]] = []
            keys = []
            for art in arts:
                key, grown = _stages(pool, backend, art)
                keys.append(key)
                per.append(grown)
                print(f"  {key}: {sum(grown.values()) / KIB:.0f} KiB heap", file=sys.stderr)
            end = _live_heap()
            factors = pool.attached(keys[0]).tensors()
            packed = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in factors}.values())
            own = len(adapter_inputs(pool, keys[0], backend.slots))
            graph_inputs = len(backend._base_inputs) + 2
            counted_pool = pool.memory_bytes(keys[0])
            counted_backend = backend.memory_bytes(keys[0])
            for k in keys:
                pool.remove(k)
                backend.discard(k)
            left = _live_heap() - start
        finally:
            backend.close()
    stage = {s: sum(p[s] for p in per) / len(per) for s in STAGES}
    heap = (end - start) / len(per)
    res = {"model": args.model, "encoders": len(per), "rank": 16, "factors": "float16", "tensors": len(factors),
           "own_inputs": own, "graph_inputs": graph_inputs, "packed_bytes": packed, "stage_heap_bytes": stage,
           "heap_per_encoder_bytes": heap, "measured_per_encoder_bytes": heap + packed,
           "counted_pool_bytes": counted_pool, "counted_backend_bytes": counted_backend,
           "heap_left_after_removing_all_bytes": left,
           "per_object": {"tensor": stage["attach"] / len(factors),
                          "own_input": (stage["prepare"] + stage["segments"]) / own,
                          "bound_input": (stage["run"] + stage["groups"]) / (2 * graph_inputs)},
           "constants": {"TENSOR_OBJECT_BYTES": TENSOR_OBJECT_BYTES, "VALUE_BYTES": shared_mod.VALUE_BYTES,
                         "BOUND_BYTES": shared_mod.BOUND_BYTES}}
    measured, counted = res["measured_per_encoder_bytes"], counted_pool + counted_backend
    rows = [[s, stage[s] / KIB] for s in STAGES] + [["heap, all stages", heap / KIB],
                                                     ["packed factors (own mapping)", packed / KIB],
                                                     ["**measured per encoder**", measured / KIB],
                                                     ["**counted per encoder** (pool + backend)", counted / KIB]]
    objs = [["tensor (attach / tensors)", res["per_object"]["tensor"], "TENSOR_OBJECT_BYTES", TENSOR_OBJECT_BYTES],
            ["own input (prepare + segments / own inputs)", res["per_object"]["own_input"], "VALUE_BYTES",
             shared_mod.VALUE_BYTES],
            ["bound input (run + groups / 2 sessions x graph inputs)", res["per_object"]["bound_input"],
             "BOUND_BYTES", shared_mod.BOUND_BYTES]]
    md = (f"{len(per)} random LoRA r=16 encoders on every Linear of {args.model} ({len(factors)} factor tensors, "
          f"{own} own inputs, {graph_inputs} graph inputs bound per session), float16 factors, loaded one by one "
          f"into one process's pool and shared ONNX Runtime backend (2 threads; group session and segment graph "
          f"built first). Live heap growth per encoder (glibc mallinfo2, in-use bytes), mean over the encoders:\n\n"
          + md_table(["stage", "KiB per encoder"], rows)
          + f"\nCounted / measured: **{counted / measured:.3f}**. After removing every encoder, "
          f"{left / KIB:.0f} KiB stay in the heap ({left / len(per) / KIB:.1f} KiB per encoder).\n\n"
          + md_table(["per object", "bytes measured", "constant", "bytes counted"], objs))
    dirs.writer.write(res, md)
    dirs.clean_scratch()
    print(md)
    print(f"wrote {dirs.out}")
    return 0
