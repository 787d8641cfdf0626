"""TEI-compatible routes with the encoder in the path: ``/tei/{encoder}/...``.

Text Embeddings Inference clients (``huggingface_hub.InferenceClient``, LlamaIndex's
``TextEmbeddingsInference``, Haystack's) send no model name, so the base URL names it:
``http://host:8000/tei/<alias or encoder>``. Under it: ``POST /`` and ``POST /embed`` (vectors),
``GET /info``, ``GET /health``, ``POST /tokenize`` and ``POST /decode``, read as TEI reads them
(unknown fields ignored, ``null`` for an optional field is its default, either truncation side).
``prompt_name: "passage"`` (or ``"document"``) embeds with the frozen document tower instead.
``/embed_all`` (one vector per token) is not served: qswap's forward passes pool inside the graph.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Request, Response
from tokenizers import Tokenizer

from qswap import __version__
from qswap.errors import LimitExceededError
from qswap.server.http.auth import require_search
from qswap.answers import TeiInfo, TeiToken
from qswap.server.http.compat_models import DOCUMENTS_MODEL, TeiDecodeRequest, TeiEmbedRequest, TeiTokenizeRequest
from qswap.server.http.models import REF_PATTERN
from qswap.server.http.rendering import json_bytes
from qswap.server.http.responses import TEI_ERRORS, ready_state
from qswap.server.serving.embeddings import TOKENIZE_INLINE, embed_texts, model_ref, texts_of
from qswap.server.serving.gate import Admission, search_admission
from qswap.server.state import ServerState

router = APIRouter(tags=["tei"])

_ENCODER = Path(pattern=REF_PATTERN, description="a domain alias or an encoder reference")


def _max_tokens(tok: Tokenizer, fallback: int) -> int:
    return int((tok.truncation or {}).get("max_length", fallback))


def keep_tail(tok: Tokenizer, texts: list[str], prefix: str, max_tokens: int) -> list[str]:
    """TEI's ``truncation_direction: left``: cut each too-long text at its start, so that what is
    left (after ``prefix``, which always stays) fits ``max_tokens`` with the special tokens.

    Args:
        tok: the base model's tokenizer (its own settings are not changed).
        texts: the inputs.
        prefix: the prompt prepended when embedding (``"query: "``, ...).
        max_tokens: the model's limit, special tokens and prefix included.

    Returns:
        The texts, each cut at a token boundary where it was too long (the rest unchanged).
    """
    left = Tokenizer.from_str(tok.to_str())
    n_prefix = len(tok.encode(prefix, add_special_tokens=False).ids) if prefix else 0
    left.enable_truncation(max_length=max(2, max_tokens - n_prefix), direction="left")
    out = []
    for text, enc in zip(texts, left.encode_batch(texts)):
        starts = [s for (s, _), special in zip(enc.offsets, enc.special_tokens_mask) if not special]
        out.append(text[starts[0]:] if enc.overflowing and starts else text)
    return out


@router.post("/tei/{encoder}/embed", response_model=list[list[float]], responses=TEI_ERRORS,
             summary="Embed texts (TEI-compatible) with the encoder in the path")
async def tei_embed(body: TeiEmbedRequest, request: Request, encoder: str = _ENCODER,
                    adm: Admission = Depends(search_admission)) -> Response:
    """``encoder`` is a domain alias or an encoder reference. Inputs longer than the model's
    max tokens are refused (422) unless ``truncate`` is true (then cut at the end, or at the start
    with ``truncation_direction: left``). Vectors are unit length whatever ``normalize`` says
    (every qswap encoder normalises)."""
    texts = texts_of(body.inputs)
    state = adm.state
    if body.truncate and body.truncation_direction.lower() == "left":
        base = state.base
        prefix = base.spec.document_prefix if body.documents else base.spec.query_prefix
        limit = _max_tokens(base.tokenizer, base.spec.max_length)
        texts = await state.batcher.low_priority(keep_tail, base.tokenizer, texts, prefix, limit)
    out = await embed_texts(adm, texts, DOCUMENTS_MODEL if body.documents else encoder,
                            dimensions=body.dimensions, on_key=lambda key: setattr(request.state, "encoder", key),
                            refuse_truncated=not body.truncate)
    return Response(json_bytes(out.vectors.tolist()), media_type="application/json")


@router.post("/tei/{encoder}", response_model=list[list[float]], responses=TEI_ERRORS,
             summary="Embed texts (TEI's root route, what huggingface_hub's feature_extraction posts to)")
async def tei_root(body: TeiEmbedRequest, request: Request, encoder: str = _ENCODER,
                   adm: Admission = Depends(search_admission)) -> Response:
    """The same as ``POST /tei/{encoder}/embed`` (TEI answers an embedding model's ``POST /`` so)."""
    return await tei_embed(body, request, encoder, adm)


router.add_api_route("/tei/{encoder}/", tei_root, methods=["POST"], response_model=list[list[float]],
                     responses=TEI_ERRORS, dependencies=[Depends(require_search)], include_in_schema=False)


@router.get("/tei/{encoder}/info", response_model=TeiInfo, responses=TEI_ERRORS, dependencies=[Depends(require_search)],
            summary="What the TEI route of this encoder serves")
async def tei_info(encoder: str = _ENCODER, state: ServerState = Depends(ready_state)) -> TeiInfo:
    reg = state.registry
    key = reg.resolve(**model_ref(reg, encoder))
    s = state.settings
    max_len = _max_tokens(state.base.tokenizer, state.base.spec.max_length)
    return TeiInfo(model_id=key, model_sha=state.base_version, model_type={"embedding": {
                   "pooling": state.base.spec.pooling}}, max_concurrent_requests=s.max_pending,
                   max_input_length=max_len, max_batch_tokens=s.max_batch * max_len, max_batch_requests=s.max_batch,
                   max_client_batch_size=s.max_embedding_inputs, version=__version__)


@router.get("/tei/{encoder}/health", responses=TEI_ERRORS, dependencies=[Depends(require_search)],
            summary="200 when the server is ready and the encoder in the path may serve")
async def tei_health(encoder: str = _ENCODER, state: ServerState = Depends(ready_state)) -> Response:
    """TEI's health check: 200 with an empty body; 503 while the server loads, 404 for an unknown
    encoder, 409 for one the guard has not passed."""
    reg = state.registry
    with reg.lease(**model_ref(reg, encoder)):   # the serving gate's answer, as /embed would get it
        pass
    return Response(status_code=200)


def _tokens(tok: Tokenizer, texts: list[str], special: bool) -> list[list[TeiToken]]:
    encs = tok.encode_batch(texts, add_special_tokens=special)
    return [[TeiToken(id=i, text=t, special=bool(m), start=None if m else a, stop=None if m else b)
             for i, t, m, (a, b) in zip(e.ids, e.tokens, e.special_tokens_mask, e.offsets)] for e in encs]


@router.post("/tei/{encoder}/tokenize", response_model=list[list[TeiToken]], responses=TEI_ERRORS,
             dependencies=[Depends(require_search)], summary="The tokens the model reads (TEI-compatible)")
async def tei_tokenize(body: TeiTokenizeRequest, encoder: str = _ENCODER,
                       state: ServerState = Depends(ready_state)) -> list[list[TeiToken]]:
    """One list of tokens per input, cut at the model's max tokens as ``/embed`` cuts with
    ``truncate``; ``start``/``stop`` are character offsets into the text (with the prompt's
    prefix when ``prompt_name`` is given), ``null`` for special tokens."""
    texts = [body.inputs] if isinstance(body.inputs, str) else list(body.inputs)
    if len(texts) > state.settings.max_embedding_inputs:
        raise LimitExceededError(f"{len(texts)} inputs in one request; the limit is "
                                 f"{state.settings.max_embedding_inputs}", "split the inputs over several requests")
    reg = state.registry
    reg.resolve(**model_ref(reg, encoder))   # 404 / 409 as /embed would answer
    spec = state.base.spec
    prefix = "" if body.prompt_name is None else (
        spec.query_prefix if body.prompt_name == "query" else spec.document_prefix)
    texts = [prefix + t for t in texts]
    tok = state.base.tokenizer
    if len(texts) < TOKENIZE_INLINE:
        return _tokens(tok, texts, body.add_special_tokens)
    return await state.batcher.low_priority(_tokens, tok, texts, body.add_special_tokens)


@router.post("/tei/{encoder}/decode", response_model=list[str], responses=TEI_ERRORS,
             dependencies=[Depends(require_search)], summary="Token ids back to text (TEI-compatible)")
async def tei_decode(body: TeiDecodeRequest, encoder: str = _ENCODER,
                     state: ServerState = Depends(ready_state)) -> list[str]:
    """One text per list of ids (a flat list is one input)."""
    tok = state.base.tokenizer
    batches = body.ids if body.ids and isinstance(body.ids[0], list) else [body.ids]
    size = tok.get_vocab_size()
    if len(batches) > state.settings.max_embedding_inputs:
        raise LimitExceededError(f"{len(batches)} inputs in one request; the limit is "
                                 f"{state.settings.max_embedding_inputs}", "split the inputs over several requests")
    # An id the vocabulary lacks (negative, or past its size) reads as the unknown token (the schema cannot know the vocabulary's size).
    unk = tok.token_to_id(str(tok.model.unk_token)) if getattr(tok.model, "unk_token", None) else 0
    batches = [[i if 0 <= i < size else (unk or 0) for i in ids] for ids in batches]
    return tok.decode_batch(batches, skip_special_tokens=body.skip_special_tokens)
