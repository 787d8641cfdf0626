"""Text -> embedding mechanics shared by the frozen base, query encoders and tuning.

The numpy parts (token batches, padding) serve the ONNX runtimes too, which run without torch:
torch is imported by the functions that make tensors, not by the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
from tokenizers import Tokenizer

from qswap.encoders.pooling import pool

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class BaseSpec:
    """How a base model turns text into an embedding (beyond its weights and tokenizer)."""

    pooling: str = "mean"
    query_prefix: str = ""
    document_prefix: str = ""
    normalize: bool = True
    max_length: int = 512


def tokenize_batch(tokenizer: Tokenizer, texts: list[str], prefix: str,
                   device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenise ``prefix + text`` for each text; pads to the longest row, truncates at max length."""
    import torch

    encs = tokenizer.encode_batch([prefix + t for t in texts])
    ids = torch.tensor([e.ids for e in encs], dtype=torch.long, device=device)
    mask = torch.tensor([e.attention_mask for e in encs], dtype=torch.long, device=device)
    return ids, mask


def embed_batch(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                spec: BaseSpec, **forward_kwargs) -> torch.Tensor:
    """Forward, pool and (optionally) L2-normalise. Differentiable: tuning calls it with grad."""
    import torch

    out = model(input_ids=input_ids, attention_mask=attention_mask, **forward_kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    x = pool(hidden, attention_mask, spec.pooling)
    return torch.nn.functional.normalize(x, dim=-1) if spec.normalize else x


def padded_splits(widths: list[int], max_rows: int, call_tokens: int | None = None,
                  attention_dim: int | None = None) -> list[tuple[int, int]]:
    """Where to cut rows sorted longest first into forward calls: ranges ``(lo, hi)``.

    Without ``call_tokens``: consecutive runs of ``max_rows``. With it, the cuts that minimise
    the tokens computed (rows x the call's longest row, padding included) plus ``call_tokens``
    per call, the fixed cost of one call counted in tokens (exact dynamic programme over the
    cut points; a batch is at most a few hundred rows).

    Args:
        widths: token counts, non-increasing.
        max_rows: rows per call at most.
        call_tokens: what one more call costs, in tokens of compute.
        attention_dim: for packed calls (:mod:`qswap.encoders.runtime.packed_export`), the model's
            hidden size ``d``: a call then computes its real tokens, and pads only attention, whose
            scores cost ``rows x longest^2 / (6 d)`` tokens (``2 L d`` multiply-adds per padded slot
            against ``12 d^2`` per token in the linear layers). So short queries go in one call, and a
            long row among them gets a call of its own.

    Returns:
        Ranges covering every row in order.
    """
    n = len(widths)
    if call_tokens is None:
        return [(s, min(s + max_rows, n)) for s in range(0, n, max_rows)]
    best = [0.0] + [float("inf")] * n   # best[i]: cost of rows [0, i)
    cut = [0] * (n + 1)
    real = np.concatenate([[0], np.cumsum(widths)]).tolist() if attention_dim else []
    for i in range(1, n + 1):
        for lo in range(max(0, i - max_rows), i):
            # widths[lo]: the range's longest row
            work = real[i] - real[lo] + (i - lo) * widths[lo] ** 2 / (6 * attention_dim) if attention_dim \
                else (i - lo) * widths[lo]
            c = best[lo] + work + call_tokens
            if c < best[i]:
                best[i], cut[i] = c, lo
    out, i = [], n
    while i > 0:
        out.append((cut[i], i))
        i = cut[i]
    return out[::-1]


def token_lengths(encodings: list[Any]) -> list[int]:
    """Each encoding's real tokens (prefix and special tokens included, padding not): what a
    text costs a forward pass. The attention mask, not the ids: the tokenizer pads every row
    of a call to its longest."""
    return [sum(e.attention_mask) for e in encodings]


def pad_id(tokenizer: Tokenizer) -> int:
    """The id the tokenizer pads with (0 when it has no padding set)."""
    padding = tokenizer.padding
    return int(padding["pad_id"]) if padding else 0


def padded_rows(encodings: list[Any], rows: list[int], width: int, pad: int = 0,
                unpadded: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, attention_mask)`` int64 arrays of ``encodings[rows]``, each row cut or padded
    to ``width``. Encodings tokenised apart (each request on its own, in the server's tokens stage)
    are not padded to one another's length, so every row is written into a ``pad``-filled array.
    ``unpadded``: the encodings carry no padding (:func:`unpadded`), so each row's mask is ones
    over its length and is not copied from the encodings."""
    ids = np.full((len(rows), width), pad, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    if not rows:
        return ids, mask
    # One flat copy and one scatter rather than a numpy assignment per row: a document window of
    # thousands of rows spends its Python time here, on the thread beside the one launching kernels.
    seqs = [encodings[i].ids for i in rows]
    n = np.fromiter((min(len(x), width) for x in seqs), dtype=np.int64, count=len(rows))
    total = int(n.sum())
    at = np.arange(width) < n[:, None]
    ids[at] = np.fromiter(chain.from_iterable(x[:width] for x in seqs), dtype=np.int64, count=total)
    if unpadded:
        mask[at] = 1
    else:
        masks = [encodings[i].attention_mask for i in rows]
        mask[at] = np.fromiter(chain.from_iterable(x[:width] for x in masks), dtype=np.int64, count=total)
    return ids, mask


def unpadded(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of ``tokenizer`` that truncates as it does but pads nothing: a window of documents
    tokenised at once would otherwise be padded to its longest text, row by row, before being cut
    into batches of similar lengths (each row's real length is then ``len(encoding)``)."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_padding()
    return copy


def length_buckets(tokenizer: Tokenizer, texts: list[str], prefix: str, batch_size: int,
                   encodings: list[Any] | None = None, lengths_out: list[int] | None = None,
                   call_tokens: int | None = None,
                   attention_dim: int | None = None) -> Iterator[tuple[list[int], np.ndarray, np.ndarray]]:
    """Tokenise once, then yield ``(indices, input_ids, attention_mask)`` int64 numpy batches
    grouped by real token length, longest first; each batch is cut to its own longest row.
    ``encodings``: the texts' encodings when the caller already has them (then not re-tokenised;
    they need not be padded to one another).
    ``lengths_out`` receives every text's token count once tokenised (before the first batch).
    ``call_tokens``: split where padding would cost more than another call (:func:`padded_splits`);
    None: batches of ``batch_size``; ``attention_dim``: the calls are packed (:func:`padded_splits`)."""
    encs = encodings if encodings is not None else tokenizer.encode_batch([prefix + t for t in texts])
    lengths = token_lengths(encs)
    if lengths_out is not None:
        lengths_out.extend(lengths)
    pad = pad_id(tokenizer)
    order = sorted(range(len(texts)), key=lambda i: -lengths[i])
    for lo, hi in padded_splits([lengths[i] for i in order], batch_size, call_tokens, attention_dim):
        idx = order[lo:hi]
        ids, mask = padded_rows(encs, idx, max(lengths[i] for i in idx), pad)
        yield idx, ids, mask


def sorted_batches(tokenizer: Tokenizer, texts: list[str], prefix: str, batch_size: int,
                   device: torch.device | str = "cpu", lengths_out: list[int] | None = None,
                   encodings: list[Any] | None = None) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """:func:`length_buckets` as torch tensors on ``device`` (``encodings``: see there)."""
    import torch

    for idx, ids, mask in length_buckets(tokenizer, texts, prefix, batch_size, encodings=encodings,
                                         lengths_out=lengths_out):
        yield idx, torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)


def encode_texts(forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 tokenizer: Tokenizer, texts: list[str], prefix: str, batch_size: int,
                 device: torch.device, dim: int, progress: bool = False,
                 desc: str = "embedding") -> np.ndarray:
    """Encode ``texts`` in length-sorted batches under ``torch.inference_mode``.

    ``forward(ids, mask)`` returns pooled embeddings; the result keeps the input order.
    """
    import torch

    out = np.empty((len(texts), dim), dtype=np.float32)
    bar = None
    lengths: list[int] = []
    batches = sorted_batches(tokenizer, texts, prefix, batch_size, device, lengths)
    if progress and texts:
        from itertools import chain

        from tqdm import tqdm
        first = next(batches)   # tokenises everything: the token total is known from here
        batches = chain([first], batches)
        # Counted in tokens, not documents: batches come longest first, so a documents-per-second
        # rate starts far too slow and the first ETA was hours for a 13-minute step.
        bar = tqdm(total=sum(lengths), desc=desc, unit="tok", unit_scale=True, smoothing=0.05)
    done = 0
    with torch.inference_mode():
        for idx, ids, mask in batches:
            out[idx] = forward(ids, mask).float().cpu().numpy()
            if bar is not None:
                done += len(idx)
                bar.set_postfix_str(f"{done}/{len(texts)} docs", refresh=False)
                bar.update(int(mask.sum()))
    if bar is not None:
        bar.close()
    return out
