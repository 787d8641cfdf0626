"""``qswap index build --ray``: the embedding step on a Ray cluster (Ray Data ``map_batches``
over an actor pool of frozen-tower embedders); everything else is :func:`build_index`.

Ingest, chunk files, resume, FAISS and the manifest are the local build's own code: only
the embedding of the missing chunks changes. The driver reads the texts of the chunks still
missing (length-sorted rows, as locally), Ray Data splits them into batches of
``batch_size`` texts, a pool of ``workers`` actors (each loads the model once; ``num_gpus``
per actor when asked) embeds them, and the driver writes each chunk atomically as soon as all
its rows are back. A build killed at any point resumes at the missing chunks, locally or on
Ray. Vectors agree with a local build to cosine >= 0.99999 (only batch padding differs).

This module does not import the model code (``qswap.index`` never embeds): the caller passes
``make_embed``, a picklable zero-argument callable that returns ``embed(texts)``; each actor
calls it once.
"""

from __future__ import annotations

import logging
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from qswap.atomic import atomic_stream
from qswap.errors import InvalidInputError
from qswap.index.build import INGEST, Embed, EmbedChunks, _chunk_path, build_index, missing_chunks
from qswap.index.config import IndexConfig
from qswap.index.checks import normalize_rows
from qswap.index.backends.faiss.embeddings import DTYPE
from qswap.index.backends.faiss.index import DocumentIndex
from qswap.space import EmbeddingSpace
from qswap.throughput import Throughput

log = logging.getLogger("qswap.index")


def init_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Connect to the Ray cluster at ``address`` (``auto``: the one started on this machine with
    ``ray start``), or start a local one (no dashboard, no usage stats)."""
    import os

    import ray
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not address:
        # A cluster started here inherits this environment. Ray Serve hands each request from
        # a replica's event loop to a user-code thread and routes on a loop of its own; on a
        # small, busy machine each such hop waits for a time slice (measured on 2 busy cores:
        # GET /healthz through Ray 9.6 -> 7.5 ms p50 without them). qswap's replicas never
        # block their event loop (model work runs on the batch thread), so both hops go.
        os.environ.setdefault("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "0")
        os.environ.setdefault("RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", "0")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)


class _EmbedActor:
    """One Ray Data actor: loads the frozen tower once, embeds batches of rows."""

    def __init__(self, make_embed: Callable[[], Embed], full_dim: int) -> None:
        self.embed = make_embed()
        self.full_dim = full_dim

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = [str(t) for t in batch["text"]]
        before = getattr(self.embed, "tokens_embedded", 0)
        e = normalize_rows(self.embed(texts), self.full_dim, "embed() output")
        if len(e) != len(texts):
            raise InvalidInputError(f"embed() returned {len(e)} rows for {len(texts)} texts",
                                    "the embed function must return one row per text")
        # The batch's token count rides on its first row (the driver sums the column).
        tokens = np.zeros(len(texts), dtype=np.int64)
        tokens[0] = getattr(self.embed, "tokens_embedded", 0) - before
        return {"row": np.asarray(batch["row"], dtype=np.int64), "emb": e.astype(DTYPE), "tokens": tokens}


def ray_embed_chunks(make_embed: Callable[[], Embed], *, workers: int = 1, gpus_per_worker: float = 0.0,
                     cpus_per_worker: float = 1.0) -> EmbedChunks:
    """An ``embed_chunks`` step for :func:`build_index` that runs on the connected Ray cluster."""
    if workers < 1:
        raise InvalidInputError(f"--workers must be at least 1, got {workers}", "e.g. --workers 2")
    if gpus_per_worker < 0:
        raise InvalidInputError(f"--gpus-per-worker must be >= 0, got {gpus_per_worker}", "e.g. --gpus-per-worker 1")

    def embed_chunks(staging: Path, n: int, embed: Embed, full_dim: int, batch_size: int, chunk_rows: int,
                     progress: bool) -> None:
        import ray

        missing, done_rows = missing_chunks(staging, n, full_dim, chunk_rows, resume_parts=False)
        todo = {k: (a, b) for k, a, b, _ in missing}
        if not todo:
            return
        con = sqlite3.connect(staging / INGEST)
        try:
            rows: list[int] = []
            texts: list[str] = []
            for a, b in todo.values():
                for r, t in con.execute(
                        "SELECT s.row, COALESCE(c.etext, c.text) FROM sorted s JOIN corpus c ON c.pos = s.pos "
                        "WHERE s.row >= ? AND s.row < ? ORDER BY s.row", (a, b)):
                    rows.append(int(r))
                    texts.append(t)
        finally:
            con.close()
        ds = ray.data.from_items([{"row": r, "text": t} for r, t in zip(rows, texts)])
        out = ds.map_batches(_EmbedActor, fn_constructor_args=(make_embed, full_dim), batch_size=batch_size,
                             batch_format="numpy", concurrency=workers, num_cpus=cpus_per_worker,
                             num_gpus=gpus_per_worker or None)
        buffers: dict[int, np.ndarray] = {}
        filled: dict[int, int] = {}
        from tqdm import tqdm
        bar = tqdm(total=n, initial=done_rows, unit="doc", desc="embedding (ray)", file=sys.stderr,
                   disable=not progress, dynamic_ncols=True, smoothing=0.1)
        meter = Throughput()
        try:
            for batch in out.iter_batches(batch_size=None, batch_format="numpy"):
                for r, e in zip(batch["row"], batch["emb"]):
                    k = int(r) // chunk_rows
                    a, b = todo[k]
                    buf = buffers.get(k)
                    if buf is None:
                        buf = buffers[k] = np.empty((b - a, full_dim), dtype=DTYPE)
                        filled[k] = 0
                    buf[int(r) - a] = e
                    filled[k] += 1
                    if filled[k] == b - a:   # complete: write it now, so a kill loses only open chunks
                        with atomic_stream(_chunk_path(staging, k)) as w:
                            w.write(memoryview(buffers.pop(k)).cast("B"))
                meter.add(len(batch["row"]), int(batch["tokens"].sum()))
                bar.set_postfix_str(meter.rates(), refresh=False)
                bar.update(len(batch["row"]))
        finally:
            bar.close()
        if progress:
            print(meter.summary("embedded (ray)"), file=sys.stderr)
        if buffers:
            raise InvalidInputError(f"Ray returned no embeddings for {len(buffers)} chunks",
                                    "rerun the build: it resumes at the missing chunks")

    return embed_chunks


def build_index_on_ray(corpus_path: Path, out_dir: Path, make_embed: Callable[[], Embed], space: EmbeddingSpace,
                       config: IndexConfig | None = None, *, workers: int = 1, gpus_per_worker: float = 0.0,
                       cpus_per_worker: float = 1.0, **kw: Any) -> DocumentIndex:
    """:func:`build_index` with the embedding on Ray (the caller has called ``ray.init``)."""
    step = ray_embed_chunks(make_embed, workers=workers, gpus_per_worker=gpus_per_worker,
                            cpus_per_worker=cpus_per_worker)

    def no_local_embedding(texts: list[str]) -> np.ndarray:
        raise AssertionError("the Ray build embeds on the cluster")

    return build_index(corpus_path, out_dir, no_local_embedding, space, config, embed_chunks=step, **kw)
