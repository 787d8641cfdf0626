"""``POST /v1/search``: resolve the encoder at admission, batch, answer with what served it."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from qswap.encoders import BASE_KEY
from qswap.errors import LimitExceededError, QswapError
from qswap.feedback.store import Impression
from qswap.server.registry.serving import Use
from qswap.server.traffic.experiments import interleave_hits
from qswap.server.traffic.impressions import client_of, contributor
from qswap.server.http.models import SearchRequest
from qswap.answers import SearchResponse
from qswap.server.registry.records import split_key
from qswap.server.http.rendering import render_search_async
from qswap.server.http.responses import ERRORS
from qswap.server.registry.lease import Lease
from qswap.server.serving.admission import Ticket
from qswap.server.serving.gate import Admission, search_admission

log = logging.getLogger("qswap.server")

router = APIRouter(tags=["search"])


@router.post("/v1/search", response_model=SearchResponse, responses=ERRORS,
             summary="Search with a chosen query encoder")
async def search(body: SearchRequest, request: Request, adm: Admission = Depends(search_admission)) -> Response:
    """Encode the queries with one encoder (named, by domain alias, or the default) and search.

    The encoder is resolved to an exact ``name@version`` when the request is admitted and held
    until the request is done: an alias switch meanwhile does not change what serves it.
    """
    t0 = time.perf_counter()
    state = adm.state
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
    encodings = await adm.bound_tokens(texts)   # when it tokenised: the jobs reuse them
    impression = rid = client = None
    if state.impressions is not None:   # capture on: the server's own id, bound to this client
        client = client_of(request, state.settings)
        impression, rid = state.impressions.issue(client)
    with state.registry.lease(body.encoder, body.domain) as lease:
        out, cand, arm, encodings = await _searches(adm, lease, body, texts, encodings, k + body.offset, request,
                                                    rid)
    key = lease.key
    exps = state.experiments
    name, version = (BASE_KEY, state.base_version) if key == BASE_KEY else split_key(key)
    ref = {"key": key, "name": name, "version": version, "forced": state.registry.forced(key)}
    timings = {"queue_ms": round(out.queue_s * 1000, 3), "encode_ms": round(out.encode_s * 1000, 3),
               "search_ms": round(out.search_s * 1000, 3)}
    flags = [bool(out.truncated[i] or cut[i]) for i in range(len(out.hits))]
    hits: list[list[Any]] = []
    teams: list[list[str] | None] = []
    experiment: list[dict[str, Any] | None] = [None] * len(out.hits)
    threshold = body.score_threshold
    for i, qhits in enumerate(out.hits):
        team: list[str] | None = None
        if cand is not None:
            qhits, team = interleave_hits(qhits, cand.hits[i], k + body.offset, f"{rid}:{i}")
            experiment[i] = {"id": arm.experiment, "mode": arm.mode, "candidate": arm.candidate}
        keep = [j for j in range(body.offset, len(qhits)) if threshold is None or qhits[j].score >= threshold]
        hits.append([qhits[j] for j in keep])
        teams.append([team[j] for j in keep] if team is not None else None)
    shown = [[h.id for h in q] for q in hits]
    if state.feedback is not None and rid is not None:
        exp = arm.experiment if cand is not None else None
        who = contributor(client, body.session)
        state.feedback.record([Impression(request_id=rid, qi=i, domain=body.domain, encoder=key, query=texts[i],
                                          ids=shown[i], teams=teams[i], experiment=exp, client=who)
                               for i in range(len(texts))])
        state.metrics.captured.inc(len(texts))
    if arm is not None and arm.mode == "shadow" and arm.control == key:
        # Off the response path, and only on an idle worker: live traffic never waits for it.
        # A background run: no client to lose, the request's deadline.
        exps.spawn_shadow(arm, shown, lambda: _candidate(Ticket(adm.remaining()), state, arm.candidate, texts, encodings,
                                                         k + body.offset, body, strict=True),
                          idle=state.batcher.pending == 0)
    n_trunc = sum(flags)
    state.metrics.child(state.metrics.queries, key).inc(len(texts))
    if n_trunc:
        state.metrics.truncated.inc(n_trunc)
    # The hot path answers with JSON written directly in the SearchResponse shape (a test checks
    # it against the model) instead of building pydantic objects for FastAPI to validate again;
    # texts, metadata and the whole answer are bounded there (qswap.server.http.rendering).
    payload, _ = await render_search_async(hits, flags, ref, timings, body.with_text,
                                           round((time.perf_counter() - t0) * 1000, 3), state.response_limits,
                                           experiment, impression)
    return Response(payload, media_type="application/json")


async def _searches(adm: Admission, lease: Lease, body: SearchRequest, texts: list[str], encodings: Any, k: int,
                    request: Request, rid: str | None) -> tuple[Any, Any, Any, Any]:
    """The control's search, and the candidate's when an interleave experiment assigns one
    (only to a captured search: ``rid`` is the server's impression id); the encodings every
    run of the queries shares (tokenised here once when an experiment runs them twice)."""
    state, key = adm.state, lease.key
    request.state.encoder = key
    exps = state.experiments
    arm = exps.assign(body.domain, rid) if exps is not None and rid is not None else None
    if arm is not None and arm.control == key and encodings is None:
        encodings = await asyncio.to_thread(state.tokenize, texts)   # the candidate's run reads them too
    if arm is not None and arm.mode == "interleave" and arm.control == key:
        # Both encoders run in the same batch (mixed-encoder batching): no second round trip.
        out, cand = await asyncio.gather(_run(adm, state, lease, texts, encodings, k, body),
                                         _candidate(adm, state, arm.candidate, texts, encodings, k, body))
        return out, cand, arm, encodings
    return await _run(adm, state, lease, texts, encodings, k, body), None, arm, encodings


async def _run(ticket: Ticket, state: Any, lease: Lease, texts: list[str], encodings: Any, k: int,
               body: SearchRequest) -> Any:
    """Search with a leased encoder; the batch job holds a share of the lease until it is done."""
    await state.prepare_encoder(lease.key)   # first use after start or eviction
    return await state.batcher.search(texts, lease.key, k, body.filter, body.with_text, on_done=lease.share(),
                                      ticket=ticket, encodings=encodings)


async def _candidate(ticket: Ticket, state: Any, ref: str, texts: list[str], encodings: Any, k: int,
                     body: SearchRequest, strict: bool = False) -> Any:
    """The experiment candidate's search; ``None`` (the control alone answers) when it cannot run,
    unless ``strict`` (shadow runs count the failure as skipped)."""
    try:
        lease = state.registry.lease(ref, use=Use.CANDIDATE)   # the gate may have changed its mind
    except QswapError:
        if strict:
            raise
        log.warning("experiment candidate not servable", extra={"encoder": ref})
        return None
    try:
        with lease:
            return await _run(ticket, state, lease, texts, encodings, k, body)
    except QswapError:
        if strict:
            raise
        return None
