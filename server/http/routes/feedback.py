"""Learning from traffic: ``POST /v1/feedback`` and the online experiments on domain aliases.

Both need capture on (``--feedback-dir``). Feedback names the ``impression`` id the search
answered with and must come from the client it was issued to (the same bearer token, or the
same address without one: :mod:`qswap.server.traffic.impressions`), at most ``feedback_rate``
a second per anonymous address (:mod:`qswap.server.traffic.ratelimit`); starting, stopping,
promoting and rolling back experiments are admin routes. Feedback and experiment reads run on
their own bounded admission (429 beyond it), never on the event loop or the threads admin
routes use (:mod:`qswap.server.traffic.admission`).
"""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Depends, Path, Request

from qswap.errors import ConflictError, InvalidInputError, NotFoundError
from qswap.feedback.experiment import Experiment, ExperimentList
from qswap.feedback.interleave import Interleaving
from qswap.feedback.store import Feedback
from qswap.server.http.auth import require_admin, require_search
from qswap.answers import FeedbackRecorded
from qswap.server.http.models import NAME_PATTERN, ExperimentStart, FeedbackRequest
from qswap.server.traffic.impressions import client_of
from qswap.server.http.responses import ERRORS, ready_state
from qswap.server.state import ServerState

router = APIRouter(tags=["feedback"])


async def capturing_state(state: ServerState = Depends(ready_state)) -> ServerState:
    """The ready state of a server that captures feedback (a dependency of the feedback and
    experiment routes).

    Args:
        state: the ready state.

    Returns:
        The state, whose ``feedback`` and ``experiments`` are set.

    Raises:
        ConflictError: (409) the server runs without ``--feedback-dir``.
    """
    if state.feedback is None:
        raise ConflictError("feedback capture is off on this server",
                            "start the server with --feedback-dir DIR (it stores query text)")
    return state


async def feedback_rate(request: Request, state: ServerState = Depends(capturing_state)) -> None:
    """Hold each anonymous client (an address) to ``feedback_rate`` (a dependency of ``POST
    /v1/feedback``: it runs before the body is validated and the impression id checked, so a flood
    is refused for less). A bearer token is an application the operator trusts, relaying its
    users' feedback (each its own ``session``): its rate is the application's to bound.

    Raises:
        OverloadedError: (429, after a pause of its Retry-After) the client is over its rate.
    """
    client = client_of(request, state.settings)
    if client.startswith("token:"):
        return
    try:
        await state.feedback_limit.admit(client)
    except Exception:
        state.metrics.feedback.labels(result="refused").inc()
        raise


@router.post("/v1/feedback", response_model=FeedbackRecorded, responses=ERRORS,
             dependencies=[Depends(require_search), Depends(feedback_rate)],
             summary="Report clicks or judgements on a search")
async def feedback(body: FeedbackRequest, request: Request,
                   state: ServerState = Depends(capturing_state)) -> FeedbackRecorded:
    """Record what the user did with one captured search's results.

    ``impression`` is the search answer's; it counts only from the client that searched (the
    same bearer token, or without one the same address). ``clicks`` (ids clicked; ``[]``: seen,
    nothing clicked) or ``grades`` (id -> grade); every id must be among the hits that search
    showed. Neither is 400; an unknown, expired or foreign impression is 404; a second feedback
    on the same result list is 409; more than the server's ``feedback_rate`` a second from one
anonymous address, or too many feedback requests at once, are 429. On an
    interleaved search the clicks credit the encoder that contributed the clicked documents,
    and the answer says which won.
    """
    store, exps = state.feedback, state.experiments
    if body.clicks is None and body.grades is None:
        raise InvalidInputError("the feedback holds neither clicks nor grades",
                                "send 'clicks' (the ids clicked, [] for none) or 'grades'")
    key = state.impressions.verify(body.impression, client_of(request, state.settings))
    if key is None:   # checked on the loop: a forged or foreign id costs no store work
        state.metrics.feedback.labels(result="refused").inc()
        raise NotFoundError("no captured search with this impression id for this client",
                            "send the 'impression' of a search answered while capture was on, with the same "
                            "credentials as the search")

    def record() -> int | None:
        imp = store.impression(key, body.query_index)
        given = list(body.clicks or [])
        clicks = given if body.grades is None else [d for d, g in body.grades.items() if g > 0]
        shown = Interleaving(imp.ids, imp.teams) if imp.teams is not None else None
        outcome = exps.credit_feedback(imp.experiment, shown, clicks)
        store.add_feedback(key, body.query_index, Feedback(given, body.grades), outcome,
                           exps.evidence_cap(imp.experiment))
        if outcome is not None:
            exps.after_outcome(imp.domain)
        return outcome

    try:
        outcome = await state.feedback_admission.run(record)
    except Exception:
        state.metrics.feedback.labels(result="refused").inc()
        raise
    state.metrics.feedback.labels(result="recorded").inc()
    return FeedbackRecorded(impression=body.impression, query_index=body.query_index, outcome=outcome)


@router.post("/v1/experiments", response_model=Experiment, status_code=201, responses=ERRORS,
             dependencies=[Depends(require_admin)], tags=["experiments"],
             summary="Start an online comparison on a domain alias")
async def start_experiment(body: ExperimentStart, state: ServerState = Depends(capturing_state)) -> Experiment:
    """Compare ``candidate`` with what the domain alias serves, on ``fraction`` of its searches.

    ``shadow`` runs the candidate off the response path when the server is idle and records
    top-k overlap; ``interleave`` shows a team-draft interleaving and credits clicks. One
    running experiment per domain; the candidate's guard must have passed on its own (a
    forced encoder is refused, 409). Auto-promotion counts at most ``max_per_client`` decided
    feedbacks per client and needs ``min_clients`` distinct clients.
    """
    return await asyncio.to_thread(state.experiments.start, body.domain, body.candidate, body.mode, body.fraction,
                                   body.auto_promote_alpha, body.min_decided, body.min_clients,
                                   body.max_per_client)


@router.get("/v1/experiments", response_model=ExperimentList, responses=ERRORS,
            dependencies=[Depends(require_search)], tags=["experiments"], summary="List experiments")
async def list_experiments(state: ServerState = Depends(capturing_state)) -> ExperimentList:
    return ExperimentList(experiments=await state.feedback_admission.run(state.experiments.list))


@router.get("/v1/experiments/{domain}", response_model=Experiment, responses=ERRORS,
            dependencies=[Depends(require_search)], tags=["experiments"], summary="Show a domain's experiment")
async def get_experiment(domain: str = Path(pattern=NAME_PATTERN),
                         state: ServerState = Depends(capturing_state)) -> Experiment:
    """Impressions, wins, losses, ties, the counted evidence and its sign test's p-value, shadow
    overlap and latency."""
    return await state.feedback_admission.run(lambda: state.experiments.get(domain))


@router.post("/v1/experiments/{domain}/{action}", response_model=Experiment, responses=ERRORS,
             dependencies=[Depends(require_admin)], tags=["experiments"],
             summary="Stop an experiment, promote its candidate, or roll a promotion back")
async def experiment_action(action: Literal["stop", "promote", "rollback"],
                            domain: str = Path(pattern=NAME_PATTERN),
                            state: ServerState = Depends(capturing_state)) -> Experiment:
    """``stop``: no more traffic takes part (the record stays). ``promote``: point the domain at the
    candidate (atomic alias switch); refused (409) unless the candidate's guard passed on its own
    (a forced encoder is never promoted), or when the alias changed during the experiment.
    ``rollback``: point the domain back at the encoder it served before the promotion."""
    return await asyncio.to_thread(getattr(state.experiments, action), domain)
