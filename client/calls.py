"""Every route of the qswap HTTP API as a :class:`Call`: what to send and how to read the answer.

:class:`qswap.client.Client` (sync) and :class:`qswap.client.AsyncClient` send the same calls
through httpx: ``client.search(...)`` sends ``search(...)`` below, with the same arguments, and
returns (or, async, awaits) the typed answer its :class:`Call` promises. :data:`ROUTES` names the
builder of each route of the committed OpenAPI schema (a test holds the two equal).
"""

from __future__ import annotations

import array
import base64
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Literal, Mapping, Sequence, TypeVar
from urllib.parse import quote

from qswap.answers import (Alias, DeleteResult, DocumentJobInfo, EmbeddingResponse, EncoderInfo, EncoderList,
                           Experiment, ExperimentList, FeedbackRecorded, Health, ModelCard, Ready, RegisterResponse,
                           SearchResponse, ServerInfo, TeiInfo, TeiToken, UpsertResult)
from qswap.client.archive import pack_encoder

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
DOCUMENTS_MODEL = "qswap/documents"

#: (method, path template of the OpenAPI schema) -> the names of the builders that send it.
ROUTES: dict[tuple[str, str], list[str]] = {}


def route(method: str, path: str) -> Callable[[F], F]:
    """Record that the decorated builder sends ``method path`` (a template of the OpenAPI schema)."""
    def mark(build: F) -> F:
        ROUTES.setdefault((method, path), []).append(build.__name__)
        return build
    return mark


@dataclass(frozen=True)
class Call(Generic[T]):
    """One HTTP request and the readers of its answer.

    ``read`` turns the JSON answer (``text``: the text answer) of a 2xx into ``T``; a 202
    answer goes to ``accepted`` instead when given (a background job to poll).
    """

    method: str
    path: str
    read: Callable[[Any], T]
    json: Any = None
    files: Mapping[str, Any] | None = None
    data: Mapping[str, str] | None = None
    params: Mapping[str, str] = field(default_factory=dict)
    accepted: Callable[[Any], T] | None = None
    text: bool = False


def _seg(s: str) -> str:
    return quote(s, safe="@")


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _texts(texts: str | Sequence[str]) -> str | list[str]:
    return texts if isinstance(texts, str) else list(texts)


def _floats(b64: str) -> list[float]:
    """Base64 of little-endian float32 -> floats (numpy not needed: the light client has none)."""
    a = array.array("f", base64.b64decode(b64))
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


# ----------------------------------------------------------------------------- search and embeddings

@route("POST", "/v1/search")
def search(query: str | Sequence[str], *, encoder: str | None = None, domain: str | None = None, k: int = 10,
           offset: int = 0, score_threshold: float | None = None, filter: Mapping[str, Any] | None = None,
           with_text: bool = True, session: str | None = None) -> Call[SearchResponse]:
    """``POST /v1/search``: search with a chosen query encoder.

    Args:
        query: one query, or a list of queries (one result each).
        encoder: ``name`` (highest version) or ``name@version``; the default encoder when absent.
        domain: a domain alias instead of ``encoder``.
        k: hits per query.
        offset: skip this many best hits first (pagination).
        score_threshold: drop hits scoring below this.
        filter: metadata equality filter.
        with_text: return document texts.
        session: an opaque id of your end user's session (an application searching with a bearer
            token): experiments count feedback evidence per session.

    Returns:
        :class:`~qswap.answers.SearchResponse`: one result per query; its ``impression`` is
        the id to send feedback with (when the server captures).
    """
    body = _drop_none({"encoder": encoder, "domain": domain, "k": k, "offset": offset or None,
                       "score_threshold": score_threshold, "filter": dict(filter) if filter else None,
                       "with_text": with_text, "session": session})
    body["query" if isinstance(query, str) else "queries"] = _texts(query)
    return Call("POST", "/v1/search", SearchResponse.model_validate, json=body)


def _decoded_embeddings(body: Any) -> EmbeddingResponse:
    for d in body.get("data", []):
        if isinstance(d.get("embedding"), str):
            d["embedding"] = _floats(d["embedding"])
    return EmbeddingResponse.model_validate(body)


@route("POST", "/v1/embeddings")
def embeddings(input: str | Sequence[str], model: str, *, dimensions: int | None = None) -> Call[EmbeddingResponse]:
    """``POST /v1/embeddings``: embed texts with a query encoder or the document tower.

    Args:
        input: a text or a list of texts.
        model: a domain alias, an encoder reference, ``base``, or ``qswap/documents`` (the frozen
            document tower: the space the index was built in).
        dimensions: a Matryoshka prefix (renormalised).

    Returns:
        :class:`~qswap.answers.EmbeddingResponse` with float vectors (base64 on the wire).
    """
    body = _drop_none({"input": _texts(input), "model": model, "dimensions": dimensions, "encoding_format": "base64"})
    return Call("POST", "/v1/embeddings", _decoded_embeddings, json=body)


@route("GET", "/v1/models")
def models() -> Call[list[ModelCard]]:
    """``GET /v1/models``: every id ``model`` may name (aliases, encoders, ``qswap/documents``)."""
    return Call("GET", "/v1/models", lambda b: [ModelCard.model_validate(m) for m in b["data"]])


@route("GET", "/v1/models/{model_id}")
def model(model_id: str) -> Call[ModelCard]:
    """``GET /v1/models/{id}``: one model id as the server resolves it now."""
    return Call("GET", f"/v1/models/{quote(model_id, safe='@/')}", ModelCard.model_validate)


@route("POST", "/tei/{encoder}/embed")
def tei_embed(encoder: str, inputs: str | Sequence[str], *, truncate: bool = False,
              truncation_direction: Literal["right", "left"] = "right", dimensions: int | None = None,
              prompt_name: str = "query") -> Call[list[list[float]]]:
    """``POST /tei/{encoder}/embed``: Text Embeddings Inference's route, the encoder in the path.

    Args:
        encoder: a domain alias or an encoder reference.
        inputs: a text or a list of texts.
        truncate: cut inputs longer than the model's max tokens (else 422 ``limit_exceeded``).
        truncation_direction: which end of a too-long input is cut.
        dimensions: a Matryoshka prefix (renormalised).
        prompt_name: ``query`` (the encoder in the path) or ``passage`` / ``document`` (the
            document tower); the server's schema lists every accepted name.

    Returns:
        One unit vector per input.
    """
    body = _drop_none({"inputs": _texts(inputs), "truncate": truncate, "truncation_direction": truncation_direction,
                       "dimensions": dimensions, "prompt_name": prompt_name})
    return Call("POST", f"/tei/{_seg(encoder)}/embed", lambda b: [list(map(float, v)) for v in b], json=body)


@route("POST", "/tei/{encoder}/tokenize")
def tei_tokenize(encoder: str, inputs: str | Sequence[str], *, add_special_tokens: bool = True,
                 prompt_name: str | None = None) -> Call[list[list[TeiToken]]]:
    """``POST /tei/{encoder}/tokenize``: the tokens the model reads, one list per input.

    Args:
        encoder: a domain alias or an encoder reference (must be servable, as for ``/embed``).
        inputs: a text or a list of texts.
        add_special_tokens: include the model's special tokens.
        prompt_name: prepend that prompt's prefix, as ``/embed`` does (None: the text as sent).
    """
    body = _drop_none({"inputs": _texts(inputs), "add_special_tokens": add_special_tokens,
                       "prompt_name": prompt_name})
    return Call("POST", f"/tei/{_seg(encoder)}/tokenize",
                lambda b: [[TeiToken.model_validate(t) for t in toks] for toks in b], json=body)


@route("POST", "/tei/{encoder}/decode")
def tei_decode(encoder: str, ids: Sequence[int] | Sequence[Sequence[int]], *,
               skip_special_tokens: bool = True) -> Call[list[str]]:
    """``POST /tei/{encoder}/decode``: token ids back to text (a flat list is one input)."""
    flat = not ids or not isinstance(ids[0], Sequence)
    body = {"ids": list(ids) if flat else [list(x) for x in ids],  # type: ignore[arg-type]
            "skip_special_tokens": skip_special_tokens}
    return Call("POST", f"/tei/{_seg(encoder)}/decode", lambda b: [str(t) for t in b], json=body)


@route("GET", "/tei/{encoder}/health")
def tei_health(encoder: str) -> Call[bool]:
    """``GET /tei/{encoder}/health``: True when the server is ready and the encoder may serve
    (else the named error: NotReadyError, NotFoundError, GuardPendingError, ...)."""
    return Call("GET", f"/tei/{_seg(encoder)}/health", lambda _: True, text=True)


@route("GET", "/tei/{encoder}/info")
def tei_info(encoder: str) -> Call[TeiInfo]:
    """``GET /tei/{encoder}/info``: what TEI clients read about the encoder in the path."""
    return Call("GET", f"/tei/{_seg(encoder)}/info", TeiInfo.model_validate)


# ----------------------------------------------------------------------------- health

@route("GET", "/healthz")
def healthz() -> Call[Health]:
    """``GET /healthz``: liveness (the process answers)."""
    return Call("GET", "/healthz", Health.model_validate)


@route("GET", "/readyz")
def ready() -> Call[Ready]:
    """``GET /readyz``: readiness (503 -> :class:`~qswap.errors.NotReadyError`, retried like a 429)."""
    return Call("GET", "/readyz", Ready.model_validate)


@route("GET", "/metrics")
def metrics() -> Call[str]:
    """``GET /metrics``: the Prometheus text exposition."""
    return Call("GET", "/metrics", str, text=True)


@route("GET", "/v1/info")
def info() -> Call[ServerInfo]:
    """``GET /v1/info``: what is served (model, space, index, limits)."""
    return Call("GET", "/v1/info", ServerInfo.model_validate)


# ----------------------------------------------------------------------------- encoders and aliases

@route("GET", "/v1/encoders")
def encoders(*, limit: int | None = None, after: str | None = None) -> Call[EncoderList]:
    """``GET /v1/encoders``: encoders and the default.

    Args:
        limit: at most this many (None: all); the answer's ``next`` is the next page's cursor.
        after: the cursor: the previous page's ``next``.
    """
    params = _drop_none({"limit": None if limit is None else str(limit), "after": after})
    return Call("GET", "/v1/encoders", EncoderList.model_validate, params=params)


@route("GET", "/v1/encoders/{ref}")
def encoder(ref: str) -> Call[EncoderInfo]:
    """``GET /v1/encoders/{ref}``: one encoder (``name`` = its highest version)."""
    return Call("GET", f"/v1/encoders/{_seg(ref)}", EncoderInfo.model_validate)


@route("POST", "/v1/encoders")
def register_path(path: str, *, force: bool = False, wait: bool = False) -> Call[RegisterResponse]:
    """``POST /v1/encoders`` (admin): register a directory under the server's encoders root.

    Args:
        path: relative to the server's ``--encoders-root``.
        force: serve even if the server's guard refuses it.
        wait: with sentinels, answer after the verdict (refusal: GuardRefusedError).
    """
    return Call("POST", "/v1/encoders", RegisterResponse.model_validate,
                json={"path": path, "force": force, "wait": wait}, accepted=RegisterResponse.model_validate)


@route("POST", "/v1/encoders")
def upload_encoder(directory: Path | str, *, force: bool = False, wait: bool = False) -> Call[RegisterResponse]:
    """``POST /v1/encoders`` (admin): pack a local encoder directory as ``.tar.gz`` and register it.

    Args:
        directory: what ``qswap tune run`` wrote (holds ``manifest.json``).
        force: serve even if the server's guard refuses it.
        wait: with sentinels, answer after the verdict (refusal: GuardRefusedError).
    """
    data = pack_encoder(directory)
    return Call("POST", "/v1/encoders", RegisterResponse.model_validate,
                files={"archive": (f"{Path(directory).name}.tar.gz", data, "application/gzip")},
                data={"force": "true" if force else "false", "wait": "true" if wait else "false"},
                accepted=RegisterResponse.model_validate)


@route("DELETE", "/v1/encoders/{ref}")
def delete_encoder(key: str) -> Call[str]:
    """``DELETE /v1/encoders/{name@version}`` (admin); the answer is the deleted key."""
    return Call("DELETE", f"/v1/encoders/{_seg(key)}", lambda b: str(b["deleted"]))


@route("GET", "/v1/aliases")
def aliases() -> Call[dict[str, str]]:
    """``GET /v1/aliases``: domain -> ``name@version``."""
    return Call("GET", "/v1/aliases", lambda b: dict(b["aliases"]))


@route("PUT", "/v1/aliases/{domain}")
def set_alias(domain: str, encoder: str, *, force: bool = False) -> Call[Alias]:
    """``PUT /v1/aliases/{domain}`` (admin): point ``domain`` at ``encoder``."""
    return Call("PUT", f"/v1/aliases/{_seg(domain)}", Alias.model_validate, json={"encoder": encoder, "force": force})


@route("DELETE", "/v1/aliases/{domain}")
def delete_alias(domain: str) -> Call[Alias]:
    """``DELETE /v1/aliases/{domain}`` (admin)."""
    return Call("DELETE", f"/v1/aliases/{_seg(domain)}", Alias.model_validate)


def verdict_reached(enc: EncoderInfo) -> bool:
    """Whether the server's guard has decided on ``enc`` (anything but ``evaluating``)."""
    return enc.guard_status != "evaluating"


# ----------------------------------------------------------------------------- documents

@route("POST", "/v1/documents")
def upsert_documents(documents: Sequence[Mapping[str, Any]]) -> Call[UpsertResult | DocumentJobInfo]:
    """``POST /v1/documents`` (admin): add or replace documents ``{"id", "text", "metadata"?}``.

    One request: the result (200), or the job a large upsert became (202);
    ``Client.upsert_documents(..., wait=True)`` polls the job until it is done."""
    return Call("POST", "/v1/documents", UpsertResult.model_validate, json={"documents": [dict(d) for d in documents]},
                accepted=DocumentJobInfo.model_validate)


@route("GET", "/v1/documents/jobs/{job_id}")
def document_job(job_id: str) -> Call[DocumentJobInfo]:
    """``GET /v1/documents/jobs/{id}`` (admin): progress, then the result or the error, of an upsert job."""
    return Call("GET", f"/v1/documents/jobs/{_seg(job_id)}", DocumentJobInfo.model_validate)


@route("DELETE", "/v1/documents")
def delete_documents(ids: Sequence[str]) -> Call[DeleteResult]:
    """``DELETE /v1/documents`` (admin): delete documents by id."""
    return Call("DELETE", "/v1/documents", DeleteResult.model_validate, json={"ids": list(ids)})


# ----------------------------------------------------------------------------- experiments

@route("GET", "/v1/experiments")
def experiments() -> Call[list[Experiment]]:
    """``GET /v1/experiments``: every experiment with its live statistics."""
    return Call("GET", "/v1/experiments", lambda b: ExperimentList.model_validate(b).experiments)


@route("GET", "/v1/experiments/{domain}")
def experiment(domain: str) -> Call[Experiment]:
    """``GET /v1/experiments/{domain}``: the domain's experiment (wins, losses, p-value, overlap)."""
    return Call("GET", f"/v1/experiments/{_seg(domain)}", Experiment.model_validate)


@route("POST", "/v1/experiments")
def start_experiment(domain: str, candidate: str, *, mode: Literal["shadow", "interleave"] = "interleave",
                     fraction: float = 0.1, auto_promote_alpha: float | None = None, min_decided: int = 100,
                     min_clients: int = 20, max_per_client: int = 10) -> Call[Experiment]:
    """``POST /v1/experiments`` (admin): compare ``candidate`` online with what ``domain`` serves.

    Args:
        domain: the domain alias; its current target is the control.
        candidate: ``name`` (highest servable version) or ``name@version``.
        mode: ``interleave`` (team-draft interleaving, credited by feedback) or ``shadow``.
        fraction: share of the domain's searches in the experiment.
        auto_promote_alpha: promote on its own once significantly ahead at this level.
        min_decided: decided impressions at the first look of auto-promotion.
        min_clients: auto-promotion needs decided feedback from at least this many distinct
            clients (sessions).
        max_per_client: decided feedbacks of one client (session) that count towards auto-promotion at most.
    """
    body = _drop_none({"domain": domain, "candidate": candidate, "mode": mode, "fraction": fraction,
                       "auto_promote_alpha": auto_promote_alpha, "min_decided": min_decided,
                       "min_clients": min_clients, "max_per_client": max_per_client})
    return Call("POST", "/v1/experiments", Experiment.model_validate, json=body)


def _action(domain: str, action: str) -> Call[Experiment]:
    return Call("POST", f"/v1/experiments/{_seg(domain)}/{action}", Experiment.model_validate)


@route("POST", "/v1/experiments/{domain}/{action}")
def stop_experiment(domain: str) -> Call[Experiment]:
    """``POST /v1/experiments/{domain}/stop`` (admin): no more traffic takes part (the record stays)."""
    return _action(domain, "stop")


@route("POST", "/v1/experiments/{domain}/{action}")
def promote_experiment(domain: str) -> Call[Experiment]:
    """``POST /v1/experiments/{domain}/promote`` (admin): point the domain at the candidate."""
    return _action(domain, "promote")


@route("POST", "/v1/experiments/{domain}/{action}")
def rollback_experiment(domain: str) -> Call[Experiment]:
    """``POST /v1/experiments/{domain}/rollback`` (admin): point the domain back at what it served before."""
    return _action(domain, "rollback")


@route("POST", "/v1/feedback")
def feedback(impression: str, *, query_index: int = 0, clicks: Sequence[str] | None = None,
             grades: Mapping[str, int] | None = None) -> Call[FeedbackRecorded]:
    """``POST /v1/feedback``: what the user did with one search's results.

    Send it with the same credentials (and ``session``) as the search: the impression id is
    bound to the client that searched, and another client's feedback on it is 404.

    Args:
        impression: the search answer's ``impression`` (``SearchResponse.impression``).
        query_index: which query of the search (0 for one query).
        clicks: clicked document ids, among the hits shown (an empty list: seen, nothing clicked).
        grades: graded judgements instead of clicks: id -> grade (0 = not relevant).
    """
    body = _drop_none({"impression": impression, "query_index": query_index,
                       "clicks": None if clicks is None else list(clicks),
                       "grades": None if grades is None else dict(grades)})
    return Call("POST", "/v1/feedback", FeedbackRecorded.model_validate, json=body)
