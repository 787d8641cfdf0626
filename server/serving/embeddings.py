"""Embedding texts for the OpenAI- and TEI-compatible routes: one path for both.

Both towers embed through the cost gate (:mod:`qswap.server.serving.gate`) and the
micro-batcher: a query encoder (a domain alias or an encoder reference, leased like a
search's) shares forward passes with searches; the frozen document tower
(:data:`DOCUMENTS_MODEL`, the function that embeds the index's documents) runs batches of its
own on the same worker. Either way a request is bounded in tokens, split into token slices
that other requests interleave with, dropped at its deadline and dropped when its client goes
away, with the same 422/429/504 answers as search.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from qswap.errors import InvalidInputError, LimitExceededError
from qswap.matryoshka import truncate
from qswap.server.http.compat_models import DOCUMENTS_MODEL, token_ids_given
from qswap.server.serving.gate import Admission

#: Tokenising this many inputs or more leaves the event loop (the bulk lane's low-priority thread
#: does it; /v1/embeddings and the TEI routes).
TOKENIZE_INLINE = 64


@dataclass
class Embedded:
    """Vectors of one request and what made them."""

    vectors: np.ndarray      # (n, dims) float32, unit length
    model: str               # name@version, 'base' or 'qswap/documents'
    tokens: list[int]        # tokens the model read, per input
    truncated: list[bool]    # inputs cut to the model's max tokens


def texts_of(value: Any) -> list[str]:
    """The texts of an ``input`` / ``inputs`` field (a string or a list of strings).

    Args:
        value: the validated field.

    Returns:
        The texts, in order.

    Raises:
        InvalidInputError: the field holds token ids (tiktoken's, not this model's vocabulary).
    """
    if token_ids_given(value):
        raise InvalidInputError(
            "input holds token ids; this server embeds text (token ids from the client's tokenizer are not "
            "this model's vocabulary)",
            "send the texts themselves: with LangChain, OpenAIEmbeddings(..., check_embedding_ctx_length=False)")
    return [value] if isinstance(value, str) else list(value)


def model_ref(registry: Any, model: str) -> dict[str, str]:
    """How a ``model`` id resolves: a domain alias of that name first, else an encoder reference.

    Args:
        registry: the server's encoder registry.
        model: the id the client sent.

    Returns:
        Keyword arguments for ``registry.resolve`` / ``registry.acquire``.
    """
    return {"domain": model} if model in registry.aliases() else {"encoder": model}


def _read(encodings: list[Any]) -> tuple[list[int], list[bool]]:
    """Tokens per input (as answered in ``usage``) and which inputs the tokenizer cut."""
    return [len(e.ids) for e in encodings], [bool(e.overflowing) for e in encodings]


async def embed_texts(adm: Admission, texts: list[str], model: str, *, dimensions: int | None = None,
                      on_key: Callable[[str], None] | None = None, refuse_truncated: bool = False) -> Embedded:
    """Embed ``texts`` with ``model`` (alias, encoder reference, or ``qswap/documents``).

    Args:
        adm: the request's pass through the cost gate (its server, deadline and token bound).
        texts: the inputs (at most ``max_embedding_inputs``).
        model: a domain alias (checked first), an encoder reference, or :data:`DOCUMENTS_MODEL`.
        dimensions: keep this many leading coordinates and renormalise (Matryoshka).
        on_key: called with the resolved key before any work (the route logs it).
        refuse_truncated: refuse inputs longer than the model's max tokens instead of cutting them.

    Returns:
        The vectors, the resolved model and the token counts.
    """
    state = adm.state
    s = state.settings
    if len(texts) > s.max_embedding_inputs:
        raise LimitExceededError(f"{len(texts)} inputs in one request; the limit is {s.max_embedding_inputs}",
                                 "split the inputs over several requests (LangChain: chunk_size)")
    dim = state.base.dim
    if dimensions is not None and dimensions > dim:
        raise LimitExceededError(f"dimensions={dimensions} exceeds the model's {dim}",
                                 f"ask for at most {dim} dimensions")
    documents = model == DOCUMENTS_MODEL
    # Bounded before the tokenizer reads a huge request; tokenised once: the job reuses them.
    encodings = await adm.bound_tokens(texts, documents=documents)
    if encodings is None:
        encodings = state.tokenize(texts, documents) if len(texts) < TOKENIZE_INLINE else \
            await state.batcher.low_priority(state.tokenize, texts, documents)
    tokens, cut = _read(encodings) if len(texts) < TOKENIZE_INLINE else \
        await state.batcher.low_priority(_read, encodings)
    if refuse_truncated and any(cut):
        raise LimitExceededError(f"input {cut.index(True)} is longer than the model's max tokens",
                                 "shorten it, or send truncate=true")
    if documents:
        key = DOCUMENTS_MODEL
        if on_key is not None:
            on_key(key)
        done = await state.batcher.embed(texts, key, ticket=adm, tokens=tokens, documents=True)
    else:
        with state.registry.lease(**model_ref(state.registry, model)) as lease:
            key = lease.key
            if on_key is not None:
                on_key(key)
            await state.prepare_encoder(key)   # first use after start or eviction
            done = await state.batcher.embed(texts, key, on_done=lease.share(), ticket=adm, tokens=tokens,
                                             encodings=encodings)
    out = done.vectors
    state.metrics.child(state.metrics.embedded, key).inc(len(texts))
    if dimensions is not None and dimensions < dim:
        out = truncate(out, dimensions)
    return Embedded(out, key, tokens, cut)


def encode_vector(v: np.ndarray, encoding_format: str) -> list[float] | str:
    """One embedding as OpenAI sends it: floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")
    return v.tolist()
