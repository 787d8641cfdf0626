"""The encoder deployment of ``qswap serve --ray``: query encoders as Ray Serve multiplexed models.

Each replica of the encoder deployment holds the base model and the configured query backend
(the shared fast runtime by default) and loads encoders on demand: Ray Serve routes a call made
with ``multiplexed_model_id=name@version`` to a replica that already holds that encoder, or to
one that loads it (``@serve.multiplexed``, at most ``--max-encoders-per-replica`` per replica
in Ray Serve's LRU; an encoder the LRU drops is detached from the replica's pool unless it is
pinned: default or aliased).

Calls that arrive together, from any ingress replica and for any encoders this replica holds,
are encoded in one mixed forward pass (``@serve.batch``, sized in rows, no waiting window: a
batch takes what queued while the previous one ran), so mixed-encoder batching survives the
hop from the ingress. This module holds the replica's logic; the Ray Serve class that wraps it
is built in :mod:`qswap.server.ray.serve`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import numpy as np

from qswap.encoders import BASE_KEY
from qswap.server.config import ServerSettings
from qswap.server.ray.registry import SharedRegistry
from qswap.server.registry.lease import Lease

log = logging.getLogger("qswap.server")

#: What one encoder call returns: the vectors (float32, one row per text) and per-text
#: truncation flags (the tokenizer cut the text).
Encoded = tuple[np.ndarray, list[bool]]


def set_threads(threads: int | None) -> None:
    """Use ``threads`` torch/FAISS threads in this replica (Ray sets OMP_NUM_THREADS to the
    actor's ``num_cpus``, 1 by default).

    Args:
        threads: the thread count, or None to keep Ray's.
    """
    if threads:
        import faiss
        import torch
        torch.set_num_threads(threads)
        faiss.omp_set_num_threads(threads)


def _unload(registry: SharedRegistry, key: str) -> None:
    try:
        registry.unload(key)
    except Exception:  # noqa: BLE001 - never fail an eviction
        log.exception("unloading an evicted encoder failed")


class EncoderCore:
    """One encoder replica: base model, backend, the shared registry (read side), counters.

    Args:
        settings: the server settings (model, device, backend, state dir, default encoder).
        threads: torch/FAISS threads of this replica (None: Ray's).
    """

    def __init__(self, settings: ServerSettings, threads: int | None = None) -> None:
        from qswap.server.state import load_served_base, prepare_base, served_runtime
        set_threads(threads)
        self.settings = settings
        base = load_served_base(settings)   # as the single-process server's
        self.base = base
        self.pool, self.backend = served_runtime(settings, base)   # as the single-process server's
        self.registry = SharedRegistry(state_dir=settings.state_dir, pool=self.pool, space=base.space,
                                       backend=self.backend, default_encoder=settings.default_encoder,
                                       memory_budget=settings.encoder_memory_bytes)
        self.registry.load_state()   # shared lock on the state dir, as every replica
        prepare_base(self.backend, base)
        self.registry.start_polling()
        self.stats = {"requests": 0, "rows": 0, "batches": 0, "loads": 0}

    async def load(self, key: str) -> Lease | None:
        """Load ``key`` here (the body of the replica's ``@serve.multiplexed`` loader).

        Args:
            key: an exact ``name@version``, or ``base``.

        Returns:
            the lease Ray Serve's LRU keeps for it (None for ``base``, always loaded): dropping
            it (an LRU eviction) detaches the encoder, once.
        """
        if key == BASE_KEY:
            return None
        if not self.registry.is_loaded(key):
            self.stats["loads"] += 1
            await asyncio.to_thread(self.registry.ensure_loaded, key)
        registry = self.registry   # not self: the lease must not keep the replica alive
        return Lease(key, lambda: _unload(registry, key), release_on_collect=True)

    def lease(self, key: str) -> Lease:
        """Hold ``key`` for one call (NotFoundError if it was deleted meanwhile)."""
        self.stats["requests"] += 1
        if key == BASE_KEY:
            return Lease(key, lambda: None)   # always loaded, never deleted
        return self.registry.lease(encoder=key)

    def encode_rows(self, texts: list[str], keys: list[str]) -> Encoded:
        """Encode a mixed batch (one row per text, ``keys[i]`` encodes ``texts[i]``). Blocking.

        Args:
            texts: the query texts (without the model's query prefix).
            keys: the encoder of each text.

        Returns:
            the vectors and the truncation flags.
        """
        for key in set(keys):   # dropped by the LRU between the loader and this batch
            if not self.registry.is_loaded(key):
                self.registry.ensure_loaded(key)
        self.stats["batches"] += 1
        self.stats["rows"] += len(texts)
        self.backend.count_rows(keys)   # what this replica serves decides its hot encoders
        # Tokenised once here: the backend encodes these encodings, the flags are read from them.
        encs = self.base.tokenizer.encode_batch([self.base.spec.query_prefix + t for t in texts])
        return (np.asarray(self.backend.encode(texts, keys, encodings=encs), dtype=np.float32),
                [bool(e.overflowing) for e in encs])

    def replica_stats(self, replica: str) -> dict[str, Any]:
        """This replica's counters and loaded encoders (for operators, tests and benchmarks)."""
        reg = self.registry
        return {"replica": replica, "deployment": "encoder", "pid": os.getpid(), **self.stats,
                "resident": sorted(k for k in reg.keys() if reg.is_loaded(k)),
                "registered": reg.keys(), "aliases": reg.aliases(), "registry_reloads": reg.reloads}


def split_rows(items: list[tuple[list[str], str]]) -> tuple[list[str], list[str], list[int]]:
    """Flatten calls ``(texts, key)`` into rows: texts, keys and each call's row count.

    Args:
        items: the calls of one batch.

    Returns:
        the texts, the key of each text, and the number of rows of each call.
    """
    texts = [t for ts, _ in items for t in ts]
    keys = [k for ts, k in items for _ in ts]
    return texts, keys, [len(ts) for ts, _ in items]


def rows_of(items: list[tuple[list[str], str]]) -> int:
    """Rows in a batch of calls (Ray Serve's ``batch_size_fn``: a batch is sized in rows)."""
    return sum(len(ts) for ts, _ in items)
