"""Search answers as JSON bytes, bounded: what one request may make the server send.

A hit's text is cut at ``max_hit_text_chars`` and its metadata dropped (``{}``) beyond
``max_hit_metadata_bytes``; either sets the hit's ``truncated``. The whole answer is written
query by query and refused (:class:`ResponseTooLargeError`, 422) as soon as it passes
``max_response_bytes``, so memory stays bounded by the limit, not by what was asked. Large
answers are rendered off the event loop (:func:`render_search_async`) so that ``/healthz``
and other requests keep being answered meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

import orjson

from qswap.errors import LimitExceededError

# Answers whose texts alone exceed this are rendered on a worker thread, not on the event loop.
OFF_LOOP_CHARS = 64 * 1024
OFF_LOOP_HITS = 512   # ... or that hold this many hits (their metadata is unknown until rendered)
_HIT_OVERHEAD = 96   # bytes of a hit besides its id, text and metadata


class ResponseTooLargeError(LimitExceededError):
    """The answer would exceed ``max_response_bytes``."""


@dataclass(frozen=True)
class ResponseLimits:
    """Per-hit and per-answer bounds (from the server settings)."""

    text_chars: int
    metadata_bytes: int
    total_bytes: int


# One encoder for every call: json.dumps with any non-default argument builds a new
# JSONEncoder per call, and an answer of k hits makes ~3k calls (a tenth of the event loop's
# time under load). It holds no state between calls, so threads may share it.
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def json_bytes(obj: Any) -> bytes:
    """``obj`` (JSON types: dicts with string keys, lists, strings, numbers) as compact UTF-8 JSON.

    For answers made of many floats (embeddings): orjson writes a 384-float vector in a tenth
    of the time ``json.dumps`` takes (~50 against ~540 us), time the event loop otherwise takes
    from every request. The same values as ``json.dumps`` (shortest round-trip digits; small
    numbers without an exponent), except that a non-finite float is ``null``, which is JSON.
    """
    return orjson.dumps(obj)


def _score(x: float) -> str:
    x = float(x)
    return repr(x) if math.isfinite(x) else "null"


def render_search(hits: Sequence[Sequence[Any]], query_truncated: Sequence[bool], encoder: dict[str, Any],
                  timings: dict[str, float], with_text: bool, took_ms: float,
                  limits: ResponseLimits, experiments: Sequence[dict[str, Any] | None] | None = None,
                  impression: str | None = None) -> tuple[bytes, int]:
    """The ``SearchResponse`` JSON of a search, within ``limits``.

    Args:
        hits: per query, its hits (objects with ``id``, ``score``, ``text``, ``metadata``).
        query_truncated: per query, whether the query itself was cut.
        encoder: the encoder reference every result names.
        timings: queue/encode/search milliseconds of the batch.
        with_text: whether hits carry their texts.
        took_ms: the request's time so far.
        limits: the bounds to apply.
        experiments: per query, the interleaving experiment it took part in (None: none).
        impression: the impression id to send feedback with (None: capture is off).

    Returns:
        The UTF-8 JSON body and the number of hits that were cut.

    Raises:
        ResponseTooLargeError: the answer would pass ``limits.total_bytes``.
    """
    head = f'"encoder":{_dumps(encoder)},"timings":{_dumps(timings)}'
    metas: dict[int, tuple[str, bool]] = {}   # one serialisation per document (hits share dicts)
    out: list[bytes] = [b'{"results":[']
    size = len(out[0])
    cut = 0
    for qi, qhits in enumerate(hits):
        parts = []
        for h in qhits:
            truncated = False
            text = "null"
            if with_text and h.text is not None:
                t = h.text
                if len(t) > limits.text_chars:
                    t, truncated = t[:limits.text_chars], True
                text = _dumps(t)
            m = h.metadata or {}
            meta = metas.get(id(m))
            if meta is None:
                s = _dumps(m)
                big = len(s) > limits.metadata_bytes or (4 * len(s) > limits.metadata_bytes
                                                         and len(s.encode()) > limits.metadata_bytes)
                meta = metas[id(m)] = ("{}", True) if big else (s, False)
            truncated = truncated or meta[1]
            cut += truncated
            parts.append(f'{{"id":{_dumps(h.id)},"score":{_score(h.score)},"text":{text},'
                         f'"metadata":{meta[0]},"truncated":{"true" if truncated else "false"}}}')
        exp = experiments[qi] if experiments is not None else None
        piece = ((',' if qi else '') + f'{{"hits":[{",".join(parts)}],{head},'
                 f'"truncated":{"true" if query_truncated[qi] else "false"},'
                 f'"experiment":{"null" if exp is None else _dumps(exp)}}}').encode()
        size += len(piece)
        if size > limits.total_bytes:
            raise ResponseTooLargeError(
                f"the answer exceeds {limits.total_bytes} bytes (the server's max_response_bytes)",
                "ask for fewer hits (k) or queries per request, or with_text: false")
        out.append(piece)
    out.append(f'],"took_ms":{_score(took_ms)},"impression":{_dumps(impression)}}}'.encode())
    return b"".join(out), cut


async def render_search_async(hits: Sequence[Sequence[Any]], *args: Any) -> tuple[bytes, int]:
    """:func:`render_search`, on a worker thread when the texts are large (the event loop stays free).

    Args:
        hits: as for :func:`render_search`; the other arguments follow it in its order.

    Returns:
        What :func:`render_search` returns.
    """
    chars = sum(len(h.text or "") + _HIT_OVERHEAD for q in hits for h in q)
    if chars > OFF_LOOP_CHARS or chars > OFF_LOOP_HITS * _HIT_OVERHEAD:
        return await asyncio.to_thread(render_search, hits, *args)
    return render_search(hits, *args)
