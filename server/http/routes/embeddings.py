"""OpenAI-compatible routes: ``POST /v1/embeddings`` (and ``/embeddings``), ``GET /v1/models``.

``model`` chooses the tower per request: a domain alias or an encoder reference embeds with
that query encoder (resolved to ``name@version`` and held until the request is done, as in
search), the reserved ``qswap/documents`` with the frozen document tower. Token-id inputs
(what LangChain's ``OpenAIEmbeddings`` sends unless ``check_embedding_ctx_length=False``) are
refused with 400: they are ids of the client's tokenizer (tiktoken), not of this model's.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Request, Response

from qswap.encoders import BASE_KEY
from qswap.server.http.auth import require_search
from qswap.encoders.runtime.backend import runtime_of
from qswap.server.http.compat_models import DOCUMENTS_MODEL, MODEL_PATTERN, EmbeddingRequest, ModelList
from qswap.answers import EmbeddingResponse, ModelCard
from qswap.server.serving.embeddings import embed_texts, encode_vector, model_ref, texts_of
from qswap.server.registry.serving import Use
from qswap.server.http.rendering import json_bytes
from qswap.server.http.responses import OPENAI_ERRORS, ready_state
from qswap.server.serving.gate import Admission, search_admission
from qswap.server.state import ServerState

router = APIRouter(tags=["openai"])


async def answer(body: EmbeddingRequest, request: Request, adm: Admission) -> Response:
    """The embeddings answer of an admitted request (both routes, and the fast route's handler)."""
    texts = texts_of(body.input)
    out = await embed_texts(adm, texts, body.model, dimensions=body.dimensions,
                            on_key=lambda key: setattr(request.state, "encoder", key))
    n = sum(out.tokens)
    payload = {"object": "list",
               "data": [{"object": "embedding", "index": i, "embedding": encode_vector(v, body.encoding_format)}
                        for i, v in enumerate(out.vectors)],
               "model": out.model, "usage": {"prompt_tokens": n, "total_tokens": n}}
    # Plain JSON in the EmbeddingResponse shape (a test checks it against the model), as search does.
    return Response(json_bytes(payload), media_type="application/json")


_EMBED = dict(response_model=EmbeddingResponse, responses=OPENAI_ERRORS)   # auth: search_admission


@router.post("/v1/embeddings", summary="Embed texts (OpenAI-compatible): a query encoder or the documents",
             **_EMBED)
async def embeddings(body: EmbeddingRequest, request: Request, adm: Admission = Depends(search_admission)) -> Response:
    """Embed ``input`` with ``model``: a domain alias, an encoder (``name``, ``name@version``,
    ``base``), or ``qswap/documents`` (the frozen document tower, as the index embeds its
    documents). ``dimensions`` keeps a Matryoshka prefix, renormalised; ``encoding_format``
    ``base64`` sends little-endian float32. Same admission (429), deadline (504) and auth as search."""
    return await answer(body, request, adm)


@router.post("/embeddings", summary="Embed texts (OpenAI-compatible, for clients whose base URL has no /v1)",
             **_EMBED)
async def embeddings_unversioned(body: EmbeddingRequest, request: Request,
                                 adm: Admission = Depends(search_admission)) -> Response:
    """The same as ``POST /v1/embeddings``."""
    return await answer(body, request, adm)


def _card(state: ServerState, model_id: str, key: str, alias: bool = False) -> ModelCard:
    info = state.registry.info(key, state.base_version)
    runtime = runtime_of(state.backend, key)["runtime"] if state.backend is not None else None
    return ModelCard(id=model_id, created=int(info.registered_at or 0), kind="alias" if alias else info.kind,
                     encoder=key, dimensions=state.base.dim, guard_status=info.guard_status, runtime=runtime)


def _documents_card(state: ServerState) -> ModelCard:
    return ModelCard(id=DOCUMENTS_MODEL, created=0, kind="documents", encoder=DOCUMENTS_MODEL,
                     dimensions=state.base.dim)


@router.get("/v1/models", response_model=ModelList, responses=OPENAI_ERRORS, dependencies=[Depends(require_search)],
            summary="List what 'model' may name (OpenAI-compatible): document tower, encoders, aliases")
async def list_models(state: ServerState = Depends(ready_state)) -> ModelList:
    """The document tower, every servable encoder (guard passed, unguarded, or forced) and every alias."""
    reg = state.registry
    encoders = [_card(state, k, k) for k in [BASE_KEY, *reg.keys()]]
    # What the serving gate lets a request name: one still evaluated, or refused and not forced, answers 409.
    encoders = [c for c in encoders if reg.may_serve(c.encoder, Use.NAME)]
    cards = [_documents_card(state), *encoders]
    cards += [_card(state, domain, key, alias=True) for domain, key in sorted(reg.aliases().items())]
    return ModelList(data=cards)


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=OPENAI_ERRORS,
            dependencies=[Depends(require_search)], summary="Show one model id (OpenAI-compatible)")
async def get_model(model_id: str = Path(pattern=MODEL_PATTERN),
                    state: ServerState = Depends(ready_state)) -> ModelCard:
    """``model_id`` as ``POST /v1/embeddings`` reads it: an alias first, else an encoder reference."""
    if model_id == DOCUMENTS_MODEL:
        return _documents_card(state)
    ref = model_ref(state.registry, model_id)
    return _card(state, model_id, state.registry.resolve(**ref), alias="domain" in ref)
