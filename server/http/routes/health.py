"""Liveness, readiness, Prometheus metrics and a description of what is served."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from qswap import __version__
from qswap.server.http.auth import require_metrics, require_search
from qswap.errors import NotReadyError
from qswap.server.http.errors import error_body_of
from qswap.server.http.models import ErrorBody
from qswap.answers import Health, Ready, ServerInfo
from qswap.server.http.responses import ERRORS, ready_state, state_of
from qswap.server.state import ServerState

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness: the process answers")
async def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Ready, responses={503: {"model": ErrorBody, "description": "not ready"}},
            summary="Readiness: index and default encoder loaded")
async def readyz(request: Request) -> Ready | JSONResponse:
    state = state_of(request)
    if not state.ready:
        # Unauthenticated: the reason (paths, document ids) is in the server log, not here.
        detail = "failed to load (the server log says why)" if state.load_error else "loading"
        status, body, headers = error_body_of(NotReadyError(detail, "retry shortly; the server is loading"
                                                            if not state.load_error else
                                                            "fix the configuration and restart the server"))
        return JSONResponse(body, status_code=status, headers=headers)
    reg = state.registry
    return Ready(ready=True, default_encoder=reg.default_key(), index_documents=state.index.count,
                 encoders_loaded=sum(1 for k in reg.keys() if reg.is_loaded(k)) + 1,
                 warming=state.backend.building() if state.backend is not None else [])


@router.get("/metrics", summary="Prometheus metrics", dependencies=[Depends(require_metrics)],
            responses={**ERRORS, 200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
async def metrics(request: Request) -> Response:
    data, ctype = state_of(request).metrics.render()
    return Response(content=data, media_type=ctype)


@router.get("/v1/info", response_model=ServerInfo, responses=ERRORS,
            dependencies=[Depends(require_search)], summary="What is served: model, space, index, limits")
async def info(state: ServerState = Depends(ready_state)) -> ServerInfo:
    s = state.settings
    return ServerInfo(version=__version__, model=state.base.name, space=state.base.space.to_dict(),
                      index=state.index.info(), default_encoder=state.registry.default_key(),
                      backend=s.backend, admin=s.admin_mode,
                      limits={"max_k": s.max_k, "max_queries": s.max_queries, "max_query_chars": s.max_query_chars,
                              "max_body_bytes": s.max_body_bytes, "max_upload_bytes": s.max_upload_bytes,
                              "max_documents": s.max_documents,
                              "max_query_tokens": int((state.base.tokenizer.truncation or {}).get(
                                  "max_length", state.base.spec.max_length))})
