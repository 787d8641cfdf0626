"""The GPU query backend (``--backend cuda``): heterogeneous adapter batches as CUDA-graph replays.

Every encoder the table can hold (LoRA up to its rank, bias encoders, the base) is a slot of a
device-resident :class:`~qswap.encoders.runtime.adapter_table.AdapterTable`; a batch is tokenised
once on the CPU, sorted by length, cut into buckets of at most 64 rows, and each bucket is one
replay of a captured graph of the gathered forward (:mod:`qswap.encoders.runtime.gathered`,
:mod:`qswap.encoders.runtime.buckets`), whatever mix of encoders its rows ask for. Registering an
encoder writes its slot (``prepare``) and captures nothing; when the table is full the least
recently used encoder gives its slot up and is written back on its next batch.

Encoders the table cannot express (a ``partial`` encoder replacing weight matrices, a LoRA rank
above the table's) run on the torch pool, as on ``--backend torch``.

``precision``: ``fp32`` (the torch pool's answers to cosine >= 0.99999), ``fp16`` or ``bf16``
(weights and activations in half precision; what they change is measured by ``qswap bench gpu``).
On a machine without CUDA the same buckets run eagerly (the CPU twin tested in ``make test``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from qswap.encoders.pool import EncoderPool
from qswap.encoders.runtime.adapter_table import DEFAULT_CAPACITY, DEFAULT_MAX_RANK, AdapterTable, expressible
from qswap.encoders.runtime.buckets import BATCH_BUCKETS, BucketRunner
from qswap.encoders.runtime.gathered import GatheredForward
from qswap.errors import InvalidInputError

log = logging.getLogger("qswap.encoders")

#: Table slots by default on a CPU (on a GPU: DEFAULT_CAPACITY, about 1 GiB at fp16 for e5-small).
CPU_CAPACITY = 8
#: Query precisions of the cuda backend.
CUDA_PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class CudaBackend:
    """Query forwards of ``pool``'s encoders through the gathered forward; thread-safe.

    Args:
        pool: the encoders (and the base, on the device queries run on).
        precision: ``fp32``, ``fp16`` or ``bf16``.
        capacity: table slots, the base's included (default 64 on a GPU, 8 on a CPU).
        max_rank: the largest LoRA rank served from the table.
        graphs: capture CUDA graphs (default: when the base is on a CUDA device).
    """

    name = "cuda"
    encode_flagged = None   # the server's tokenizer flags truncation

    def __init__(self, pool: EncoderPool, precision: str = "fp32", capacity: int | None = None,
                 max_rank: int = DEFAULT_MAX_RANK, graphs: bool | None = None) -> None:
        if precision not in CUDA_PRECISIONS:
            raise InvalidInputError(f"unknown precision {precision!r} for the cuda backend",
                                    f"use one of {', '.join(CUDA_PRECISIONS)}")
        self.pool = pool
        self.base = pool.base
        self.precision = precision
        dev = self.base.device
        if capacity is None:   # a CPU twin's table is host memory: keep it small there
            capacity = DEFAULT_CAPACITY if dev.type == "cuda" else CPU_CAPACITY
        self.table = AdapterTable(self.base.model, capacity, max_rank, CUDA_PRECISIONS[precision], dev)
        self.forward = GatheredForward(self.base.model, self.base.spec, self.table)
        tok = self.base.tokenizer
        pad = tok.padding["pad_id"] if tok.padding else self.forward.pad
        limit = tok.truncation["max_length"] if tok.truncation else self.base.spec.max_length
        self.runner = BucketRunner(self.forward, dev, pad, limit, max_rank, graphs)
        self._why: dict[str, str | None] = {}   # key -> why the table cannot serve it (None: it can)
        self._rank: dict[str, int] = {}
        self._lock = threading.Lock()

    # -- the registry's calls ---------------------------------------------------------------------

    def _check(self, key: str) -> str | None:
        if key not in self._why:
            att = self.pool.attached(key)
            why = expressible(att, self.table.places, self.table.max_rank)
            if why is not None:
                log.info("encoder %s runs on the torch pool: %s", key, why)
            self._why[key] = why
            self._rank[key] = max((f.a.shape[0] for f in att.low_rank.values()), default=0)
        return self._why[key]

    def count_rows(self, keys: list[str]) -> None:
        """Every encoder runs in the same gathered forward: nothing to adapt."""

    def prepare(self, key: str) -> None:
        """Write ``key``'s slot now (no graph is captured); an encoder the table cannot hold
        runs on the torch pool."""
        with self._lock:
            if self._check(key) is None:
                self.table.assign(key, self.pool.attached(key))

    def discard(self, key: str) -> None:
        """Free ``key``'s slot."""
        with self._lock:
            self.table.release(key)
            self._why.pop(key, None)
            self._rank.pop(key, None)

    def ready(self, key: str) -> bool:
        """Every loaded encoder is served at once (table or pool)."""
        return key in self.pool

    def error(self, key: str) -> str | None:
        return None

    def memory_bytes(self, key: str) -> int:
        """Nothing per encoder: the table is allocated once (:meth:`AdapterTable.nbytes`)."""
        return 0

    def building(self) -> list[str]:
        """Nothing in the background: a bucket is captured in line with the batch that needs it."""
        return []

    def builds_started(self) -> dict[str, int]:
        """None: nothing is built in the background."""
        return {}

    def runtime(self, key: str) -> str:
        """``cuda-graph`` (captured buckets), ``gathered`` (the same buckets run eagerly) or ``torch``."""
        with self._lock:
            if key in self.pool and self._check(key) is None:
                return "cuda-graph" if self.runner.graphs else "gathered"
        return "torch"

    def close(self) -> None:
        with self._lock:
            self.runner.close()

    # -- encoding ---------------------------------------------------------------------------------

    def encode(self, texts: list[str], keys: list[str], encodings: list[Any] | None = None) -> np.ndarray:
        """Row ``i`` embedded as a query by encoder ``keys[i]``: (n, dim) float32, input order
        (``encodings``: the texts' tokenizer encodings when the caller has them: not redone)."""
        if len(texts) != len(keys):
            raise InvalidInputError(f"{len(texts)} texts but {len(keys)} encoder keys")
        out = np.empty((len(texts), self.base.dim), dtype=np.float32)
        if not texts:
            return out
        prefix = self.base.spec.query_prefix
        encs = encodings if encodings is not None else self.base.tokenizer.encode_batch([prefix + t for t in texts])
        ids = [e.ids[:sum(e.attention_mask)] for e in encs]
        with self._lock:
            order = list(dict.fromkeys(keys))   # first appearance: a deterministic slot order
            for k in order:
                self.pool.attached(k)   # NotFoundError for an unknown key, before anything runs
            pinned = set(order)
            slot: dict[str, int | None] = {}
            for k in order:
                slot[k] = self.table.assign(k, self.pool.attached(k), pinned) if self._check(k) is None else None
            on_table = [i for i, k in enumerate(keys) if slot[k] is not None]
            # Longest first, cut into the largest bucket: rows of similar length share a bucket.
            on_table.sort(key=lambda i: -len(ids[i]))
            step = BATCH_BUCKETS[-1]
            for s in range(0, len(on_table), step):
                rows = on_table[s:s + step]
                rank = max(self._rank[keys[i]] for i in rows)
                out[rows] = self.runner.run([ids[i] for i in rows], [slot[keys[i]] for i in rows], rank)
        rest = [i for i, k in enumerate(keys) if slot[k] is None]
        if rest:
            out[rest] = self.pool.encode([texts[i] for i in rest], [keys[i] for i in rest],
                                         encodings=[encs[i] for i in rest])
        return out
