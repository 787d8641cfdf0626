"""``POST /v1/search``: resolve the encoder at admission, batch, answer with what served it."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Depends, Request, Response

from qswap.encoders import BASE_KEY
from qswap.server.auth import require_search
from qswap.server.errors import LimitExceededError
from qswap.server.models import SearchRequest, SearchResponse
from qswap.server.registry import split_key
from qswap.server.responses import ERRORS, request_timeout, state_of

router = APIRouter(tags=["search"])


@router.post("/v1/search", response_model=SearchResponse, responses=ERRORS,
             dependencies=[Depends(require_search)], summary="Search with a chosen query encoder")
async def search(body: SearchRequest, request: Request, timeout_s: float = Depends(request_timeout)) -> Response:
    """Encode the queries with one encoder (named, by domain alias, or the default) and search.

    The encoder is resolved to an exact ``name@version`` when the request is admitted and held
    until the request is done: an alias switch meanwhile does not change what serves it.
    """
    t0 = time.perf_counter()
    state = state_of(request)
    state.require_ready()
    s = state.settings
    texts = body.texts()
    if len(texts) > s.max_queries:
        raise LimitExceededError(f"{len(texts)} queries in one request; the limit is {s.max_queries}",
                                 "split the queries over several requests")
    k = body.k if "k" in body.model_fields_set else min(body.k, s.max_k)   # the default fits any limit
    if k > s.max_k:
        raise LimitExceededError(f"k={k} exceeds the limit {s.max_k}", f"ask for at most {s.max_k} hits")
    if body.offset > s.max_k:
        raise LimitExceededError(f"offset={body.offset} exceeds the limit {s.max_k}",
                                 f"page through at most {s.max_k} hits past the first ones")
    cut = [len(t) > s.max_query_chars for t in texts]
    texts = [t[:s.max_query_chars] for t in texts]
    reg = state.registry
    key = reg.acquire(body.encoder, body.domain)
    request.state.encoder = key
    submitted = False
    try:
        await state.prepare_encoder(key)   # first use after start or eviction
        submitted = True   # from here the batcher releases the reference, exactly once
        out = await state.batcher.search(texts, key, k + body.offset, body.filter, body.with_text,
                                         on_done=lambda: reg.release(key), timeout_s=timeout_s)
    finally:
        if not submitted:
            reg.release(key)
    name, version = (BASE_KEY, state.base_version) if key == BASE_KEY else split_key(key)
    ref = {"key": key, "name": name, "version": version}
    timings = {"queue_ms": round(out.queue_s * 1000, 3), "encode_ms": round(out.encode_s * 1000, 3),
               "search_ms": round(out.search_s * 1000, 3)}
    results = []
    n_trunc = 0
    threshold = body.score_threshold
    for i, hits in enumerate(out.hits):
        hits = [h for h in hits[body.offset:] if threshold is None or h.score >= threshold]
        truncated = bool(out.truncated[i] or cut[i])
        n_trunc += truncated
        results.append({"hits": [{"id": h.id, "score": float(h.score), "text": h.text if body.with_text else None,
                                  "metadata": h.metadata or {}} for h in hits],
                        "encoder": ref, "truncated": truncated, "timings": timings})
    state.metrics.queries.labels(encoder=key).inc(len(texts))
    if n_trunc:
        state.metrics.truncated.inc(n_trunc)
    # The hot path answers with plain dicts in the SearchResponse shape (a test checks them
    # against the model) instead of building pydantic objects for FastAPI to validate again:
    # after a forward pass the caches are cold and that round trip costs ~0.1-0.2 ms a request.
    payload = {"results": results, "took_ms": round((time.perf_counter() - t0) * 1000, 3)}
    return Response(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode(),
                    media_type="application/json")
