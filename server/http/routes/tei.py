"""TEI-compatible routes with the encoder in the path: ``/tei/{encoder}/embed`` and ``/info``.

Text Embeddings Inference clients (LlamaIndex's ``TextEmbeddingsInference``, Haystack's) send
no model name, so the base URL names it: ``http://host:8000/tei/<alias or encoder>``.
``prompt_name: "passage"`` embeds with the frozen document tower instead.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Path, Request, Response

from qswap import __version__
from qswap.server.http.auth import require_search
from qswap.answers import TeiInfo
from qswap.server.http.compat_models import DOCUMENTS_MODEL, TeiEmbedRequest
from qswap.server.serving.embeddings import embed_texts, model_ref, texts_of
from qswap.server.http.models import REF_PATTERN
from qswap.server.http.responses import ERRORS, ready_state, request_timeout
from qswap.server.state import ServerState

router = APIRouter(tags=["tei"])


@router.post("/tei/{encoder}/embed", response_model=list[list[float]], responses=ERRORS,
             dependencies=[Depends(require_search)], summary="Embed texts (TEI-compatible) with the encoder in the path")
async def tei_embed(body: TeiEmbedRequest, request: Request, encoder: str = Path(pattern=REF_PATTERN),
                    timeout_s: float = Depends(request_timeout), state: ServerState = Depends(ready_state)) -> Response:
    """``encoder`` is a domain alias or an encoder reference. Inputs longer than the model's
    max tokens are refused (422) unless ``truncate`` is true. Vectors are unit length whatever
    ``normalize`` says (every qswap encoder normalises)."""
    texts = texts_of(body.inputs)
    model = DOCUMENTS_MODEL if body.prompt_name == "passage" else encoder
    out = await embed_texts(state, texts, model, timeout_s=timeout_s, dimensions=body.dimensions,
                            on_key=lambda key: setattr(request.state, "encoder", key),
                            refuse_truncated=not body.truncate)
    return Response(json.dumps(out.vectors.tolist(), separators=(",", ":")).encode(), media_type="application/json")


@router.get("/tei/{encoder}/info", response_model=TeiInfo, responses=ERRORS, dependencies=[Depends(require_search)],
            summary="What the TEI route of this encoder serves")
async def tei_info(encoder: str = Path(pattern=REF_PATTERN), state: ServerState = Depends(ready_state)) -> TeiInfo:
    reg = state.registry
    key = reg.resolve(**model_ref(reg, encoder))
    s = state.settings
    max_len = int((state.base.tokenizer.truncation or {}).get("max_length", state.base.spec.max_length))
    return TeiInfo(model_id=key, model_sha=state.base_version, model_type={"embedding": {
                   "pooling": state.base.spec.pooling}}, max_concurrent_requests=s.max_pending,
                   max_input_length=max_len, max_batch_tokens=s.max_batch * max_len, max_batch_requests=s.max_batch,
                   max_client_batch_size=s.max_embedding_inputs, version=__version__)

