"""The packed graph's run-time routing inputs (numpy only: a server that serves from cached
exports computes them without importing torch). The graph: :mod:`qswap.encoders.runtime.packed_export`."""

from __future__ import annotations

import re
from typing import Any

import numpy as np


def packing(lengths: list[int] | np.ndarray, pooling: str = "mean", first_position: int = 0) -> dict[str, np.ndarray]:
    """The packed graph's routing inputs for rows of ``lengths`` real tokens, in that order.

    Args:
        lengths: each row's real tokens (>= 1).
        pooling: ``mean`` or ``cls``.
        first_position: the position id of a row's first token (0 for BERT; ``padding_idx + 1``
            for RoBERTa-family models, which number positions after the padding index).

    Returns:
        ``position_ids`` (1, T), ``token_index`` (B, L), ``attention_mask`` (B, L) int64,
        ``token_positions`` (T,), ``pooling`` (B, T) float32.
    """
    n = np.asarray(lengths, dtype=np.int64)
    rows, width, total = len(n), int(n.max()), int(n.sum())
    start = np.concatenate([[0], np.cumsum(n)[:-1]])
    slot = np.arange(width)
    real = slot < n[:, None]                                      # (B, L)
    row_of = np.repeat(np.arange(rows), n)                        # (T,)
    pos = np.arange(total) - start[row_of]                        # each token's place in its row
    # A pad slot reads its row's first token: any real token would do (masked as a key, never read back).
    index = np.where(real, start[:, None] + slot, start[:, None])
    weights = np.zeros((rows, total), dtype=np.float32)
    if pooling == "mean":
        weights[row_of, np.arange(total)] = (1.0 / n)[row_of]
    elif pooling == "cls":
        weights[np.arange(rows), start] = 1.0
    else:
        raise ValueError(f"unknown pooling {pooling!r}")
    return {"position_ids": (pos + first_position)[None, :], "token_index": index,
            "attention_mask": real.astype(np.int64), "token_positions": row_of * width + pos, "pooling": weights}


def packed_inputs(table: np.ndarray, ids: np.ndarray, mask: np.ndarray, pooling: str,
                  start: int = 0) -> dict[str, np.ndarray]:
    """The packed graph's run-time inputs for a padded batch (``ids``, ``mask`` (n, L) int64, each
    row's real tokens first): the rows' real tokens gathered from the word-embedding ``table``
    end to end, and :func:`packing` of their lengths."""
    real = mask.astype(bool)
    feed = packing(real.sum(1), pooling, start)
    feed["inputs_embeds"] = np.take(table, ids[real], axis=0)[None]
    return feed


def graph_inputs(table: np.ndarray, ids: np.ndarray, mask: np.ndarray, pooling: str,
                 first_position: int | None) -> dict[str, np.ndarray]:
    """A query graph's run-time inputs for a padded batch: :func:`packed_inputs` for a packed graph
    (``first_position`` its rows' first position id), else the padded graph's ``inputs_embeds``
    (the rows' word embeddings from ``table``) and ``attention_mask`` (``first_position`` None)."""
    if first_position is not None:
        return packed_inputs(table, ids, mask, pooling, first_position)
    return {"inputs_embeds": np.take(table, ids, axis=0), "attention_mask": mask}


def packable(layout: Any) -> bool:
    """Whether a base's queries can run packed: every layer's self-attention is a BERT-family block
    (``query``/``key``/``value`` Linears, which the graph fuses into one attention node that sees
    each row's own tokens only). Any other attention would attend across the packed rows, so such
    a base keeps the padded graph. Read from its :class:`~qswap.encoders.layout.BaseLayout`
    (no torch model needed)."""
    names = {n for n, _, _, _ in layout.linear}
    blocks = {n.rsplit(".", 1)[0] for n in names if n.endswith(".query")}
    triples = {b for b in blocks if f"{b}.key" in names and f"{b}.value" in names}
    layers = {m.group(1) for n in names if (m := re.match(r"^(.*\.layer\.\d+)\.", n))}
    return bool(triples) and len(triples) == len(layers)


def segment_routing(segment: np.ndarray | list[int], segments: int, lengths: np.ndarray | list[int],
                    packed: bool) -> dict[str, np.ndarray]:
    """The segment graph's routing inputs, row ``i`` with encoder ``segment[i]`` of ``segments``
    and ``lengths[i]`` tokens, the tokens indexed as one axis: end to end (``packed``) or in rows
    of ``max(lengths)`` (padded, every row that wide).

    Returns:
        ``segment_tokens`` (E, M): the tokens of each encoder's rows, M the largest encoder's token
        count (a smaller one is padded with its first token: its product is never read);
        ``segment_positions``: where each token's product sits in that (E * M) order, (T,) packed,
        (n, L) padded. Both have the shape of what their Gather gives, so the graph reshapes
        nothing by a shape it reads at run time.
    """
    segment = np.asarray(segment, dtype=np.int64)
    n = np.asarray(lengths, dtype=np.int64)
    if not packed:
        n = np.full(len(segment), n.max(), dtype=np.int64)
    of = np.repeat(segment, n)                                      # each token's encoder
    # Stable: each encoder's tokens keep their order, one encoder's after another's.
    order = np.argsort(of, kind="stable")
    counts = np.bincount(of, minlength=segments)
    width = int(counts.max())
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])          # each encoder's first in ``order``
    slot = np.arange(width)
    # A slot past an encoder's own tokens reads its first one (0 for an encoder with none).
    pick = np.where(slot < counts[:, None], first[:, None] + slot, first[:, None])
    tokens = order[np.minimum(pick, len(order) - 1)]
    positions = np.empty_like(order)
    seg = of[order]
    positions[order] = seg * width + np.arange(len(order)) - first[seg]
    return {"segment_tokens": tokens, "segment_positions": positions if packed else positions.reshape(len(n), -1)}
