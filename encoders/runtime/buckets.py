"""Static shapes for the gathered forward: (batch x length x rank) buckets, captured as CUDA graphs.

A CUDA graph replays a fixed sequence of kernels on fixed buffers, so every batch is padded up
to a bucket: rows to the next of :data:`BATCH_BUCKETS` (padding rows use the base's slot and
attend to one token), tokens to the next of :data:`LENGTH_BUCKETS` (masked: they change no real
row), the LoRA rank gathered to the next of :func:`rank_buckets` (zero factors: exact). Each
bucket owns its input buffers (ids, mask, slots) and output, and is captured once, the first
time a batch needs it, sharing one memory pool with the other buckets; a batch then costs one
copy in (ids, mask and slots packed in one pinned host buffer), one replay, one copy out. The table's tensors are read inside the graph, so a
newly written slot is served by every captured bucket without recapturing.

Without a GPU (or with ``graphs=False``) the very same buckets, buffers and forward run eagerly:
the CPU twin that ``make test`` checks.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: Rows of a bucket: a batch is padded up to the next; a larger one is cut into these.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
#: Tokens of a bucket (capped at the model's maximum length, which is always a bucket).
LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512)

log = logging.getLogger("qswap.encoders")

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def rank_buckets(max_rank: int) -> tuple[int, ...]:
    """LoRA ranks gathered: 0 (no LoRA row), powers of two from 8, and ``max_rank`` itself."""
    out = [0] + [r for r in (8, 16, 32, 64, 128, 256) if r < max_rank]
    return tuple(out + [max_rank])


def length_buckets(max_length: int) -> tuple[int, ...]:
    """:data:`LENGTH_BUCKETS` below ``max_length``, then ``max_length``."""
    return tuple([b for b in LENGTH_BUCKETS if b < max_length] + [max_length])


def bucket_of(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= ``value`` (``value`` must not exceed the largest)."""
    i = bisect.bisect_left(buckets, value)
    if i == len(buckets):
        raise ValueError(f"{value} is above the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass
class _Bucket:
    packed: torch.Tensor   # (2 * rows * length + rows,) int64 on the device: ids, mask, slots
    host: torch.Tensor     # the same layout on the host (pinned on a GPU): one copy in per batch
    ids: torch.Tensor      # views of ``packed``
    mask: torch.Tensor
    slots: torch.Tensor
    out: torch.Tensor | None = None
    graph: Any = None   # torch.cuda.CUDAGraph


class BucketRunner:
    """Runs ``forward`` on padded, fixed-shape buckets; one call at a time (the caller locks).

    Args:
        forward: ``forward(ids, mask, slots, rank) -> (rows, dim)`` without host synchronisation.
        device: where the buffers live.
        pad_id: the tokenizer's padding id.
        max_length: the longest tokenised text.
        max_rank: the adapter table's rank.
        graphs: capture CUDA graphs (default: on a CUDA device); False runs the buckets eagerly.
    """

    def __init__(self, forward: Forward, device: torch.device, pad_id: int, max_length: int, max_rank: int,
                 graphs: bool | None = None) -> None:
        self.forward = forward
        self.device = torch.device(device)
        self.pad_id = pad_id
        self.lengths = length_buckets(max_length)
        self.ranks = rank_buckets(max_rank)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.captures = 0   # buckets set up (captured as graphs on a GPU)
        self.replays = 0    # batches run
        self.failed_captures = 0
        self._buckets: dict[tuple[int, int, int], _Bucket] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.graphs else None

    def shape(self, rows: int, length: int, rank: int) -> tuple[int, int, int]:
        """The bucket (rows, tokens, rank) a batch of ``rows`` texts of at most ``length`` tokens
        with LoRA ranks up to ``rank`` runs in; ``rows`` at most ``BATCH_BUCKETS[-1]``."""
        return (bucket_of(rows, BATCH_BUCKETS), bucket_of(max(length, 1), self.lengths),
                bucket_of(rank, self.ranks))

    def buckets(self) -> list[tuple[int, int, int]]:
        """Buckets set up so far."""
        return list(self._buckets)

    def run(self, ids: list[list[int]], slots: list[int], rank: int) -> np.ndarray:
        """Embeddings of the token id lists ``ids`` (unpadded, each within the maximum length),
        row ``i`` with table slot ``slots[i]``; (rows, dim) float32."""
        n, longest = len(ids), max(len(r) for r in ids)
        key = self.shape(n, longest, rank)
        b, length, _ = key
        bucket = self._buckets.get(key) or self._setup(key)
        # The host buffer is reused: the previous batch's copy in has finished (its answer was read).
        flat = bucket.host.numpy()
        host_ids = flat[:b * length].reshape(b, length)
        host_mask = flat[b * length:2 * b * length].reshape(b, length)
        host_ids.fill(self.pad_id)
        host_mask.fill(0)
        host_mask[n:, 0] = 1   # a padding row attends to one token: no empty softmax, no NaN
        for i, row in enumerate(ids):
            host_ids[i, :len(row)] = row
            host_mask[i, :len(row)] = 1
        host_slots = flat[2 * b * length:]
        host_slots.fill(0)
        host_slots[:n] = slots
        with torch.inference_mode():
            bucket.packed.copy_(bucket.host, non_blocking=bucket.host.is_pinned())
            if bucket.graph is not None:
                bucket.graph.replay()
            else:
                bucket.out = self.forward(bucket.ids, bucket.mask, bucket.slots, key[2])
            self.replays += 1
            return bucket.out[:n].float().cpu().numpy()

    def _setup(self, key: tuple[int, int, int]) -> _Bucket:
        b, length, rank = key
        dev = self.device
        size = 2 * b * length + b
        packed = torch.zeros(size, dtype=torch.long, device=dev)
        host = torch.zeros(size, dtype=torch.long, pin_memory=dev.type == "cuda")
        bucket = _Bucket(packed=packed, host=host, ids=packed[:b * length].view(b, length),
                         mask=packed[b * length:2 * b * length].view(b, length), slots=packed[2 * b * length:])
        bucket.ids.fill_(self.pad_id)
        bucket.mask[:, 0] = 1
        if self.graphs:
            try:
                self._capture(bucket, rank)
            except RuntimeError as e:   # a capture the driver refuses: this bucket runs eagerly
                log.warning("CUDA graph capture of bucket %s failed, running it eagerly: %s", key, e)
                bucket.graph, bucket.out = None, None
                self.failed_captures += 1
        self._buckets[key] = bucket
        self.captures += 1
        return bucket

    def _capture(self, bucket: _Bucket, rank: int) -> None:
        # Warm up on a side stream (lazy initialisations, cuBLAS handles), then capture.
        with torch.inference_mode():
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.forward(bucket.ids, bucket.mask, bucket.slots, rank)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA work (a document upsert) does not break the capture.
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                bucket.out = self.forward(bucket.ids, bucket.mask, bucket.slots, rank)
        bucket.graph = graph

    def close(self) -> None:
        """Drop every bucket (and its graph)."""
        self._buckets.clear()
