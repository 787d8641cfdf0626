"""Every route of the qswap HTTP API as a :class:`Call`: what to send and how to read the answer.

:class:`qswap.client.Client` (sync) and :class:`qswap.client.AsyncClient` send the same calls
through httpx; what they share (the routes, the retry rule, the error table) lives here once.
"""

from __future__ import annotations

import base64
import email.utils
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Mapping, Sequence, TypeVar
from urllib.parse import quote

import httpx

from qswap.client.archive import pack_encoder
from qswap.answers import (Alias, DeleteResult, EmbeddingResponse, EncoderInfo, EncoderList, ModelCard,
                           RegisterResponse, SearchResponse, ServerInfo, UpsertResult)
from qswap.errors import QswapError, error_from_body

T = TypeVar("T")
RETRY_STATUSES = (429, 503)   # overloaded, not ready / draining: the server says when to come back
DOCUMENTS_MODEL = "qswap/documents"


@dataclass(frozen=True)
class Call(Generic[T]):
    """One HTTP request and the reader of its JSON answer."""

    method: str
    path: str
    read: Callable[[Any], T]
    json: Any = None
    files: Mapping[str, Any] | None = None
    data: Mapping[str, str] | None = None
    params: Mapping[str, str] = field(default_factory=dict)


def _seg(s: str) -> str:
    return quote(s, safe="@")


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def search(query: str | Sequence[str], *, encoder: str | None = None, domain: str | None = None, k: int = 10,
           offset: int = 0, score_threshold: float | None = None, filter: Mapping[str, Any] | None = None,
           with_text: bool = True) -> Call[SearchResponse]:
    """``POST /v1/search``: one query (a string) or several (a list)."""
    body = _drop_none({"encoder": encoder, "domain": domain, "k": k, "offset": offset or None,
                       "score_threshold": score_threshold, "filter": dict(filter) if filter else None,
                       "with_text": with_text})
    body["query" if isinstance(query, str) else "queries"] = query if isinstance(query, str) else list(query)
    return Call("POST", "/v1/search", SearchResponse.model_validate, json=body)


def _decoded_embeddings(body: Any) -> EmbeddingResponse:
    for d in body.get("data", []):
        if isinstance(d.get("embedding"), str):   # base64 of little-endian float32
            import numpy as np
            d["embedding"] = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist()
    return EmbeddingResponse.model_validate(body)


def embeddings(input: str | Sequence[str], model: str, *, dimensions: int | None = None,
               encoding_format: str = "base64") -> Call[EmbeddingResponse]:
    """``POST /v1/embeddings``; base64 on the wire (4 bytes a coordinate), floats in the answer."""
    body = _drop_none({"input": input if isinstance(input, str) else list(input), "model": model,
                       "dimensions": dimensions, "encoding_format": encoding_format})
    return Call("POST", "/v1/embeddings", _decoded_embeddings, json=body)


def models() -> Call[list[ModelCard]]:
    """``GET /v1/models``."""
    return Call("GET", "/v1/models", lambda b: [ModelCard.model_validate(m) for m in b["data"]])


def model(model_id: str) -> Call[ModelCard]:
    """``GET /v1/models/{id}``."""
    return Call("GET", f"/v1/models/{quote(model_id, safe='@/')}", ModelCard.model_validate)


def info() -> Call[ServerInfo]:
    """``GET /v1/info``."""
    return Call("GET", "/v1/info", ServerInfo.model_validate)


def ready() -> Call[dict[str, Any]]:
    """``GET /readyz`` (503 -> :class:`~qswap.errors.NotReadyError`, retried like a 429)."""
    return Call("GET", "/readyz", dict)


def encoders(*, limit: int | None = None, after: str | None = None) -> Call[EncoderList]:
    """``GET /v1/encoders``: all, or one page of ``limit`` after the cursor ``after``."""
    params = _drop_none({"limit": None if limit is None else str(limit), "after": after})
    return Call("GET", "/v1/encoders", EncoderList.model_validate, params=params)


def encoder(ref: str) -> Call[EncoderInfo]:
    """``GET /v1/encoders/{ref}`` (``name`` = its highest version)."""
    return Call("GET", f"/v1/encoders/{_seg(ref)}", EncoderInfo.model_validate)


def register_path(path: str, *, force: bool = False, wait: bool = False) -> Call[RegisterResponse]:
    """``POST /v1/encoders`` with a directory under the server's encoders root."""
    return Call("POST", "/v1/encoders", RegisterResponse.model_validate,
                json={"path": path, "force": force, "wait": wait})


def upload_encoder(directory: Path | str, *, force: bool = False, wait: bool = False) -> Call[RegisterResponse]:
    """``POST /v1/encoders`` with the directory packed as a ``.tar.gz`` upload."""
    data = pack_encoder(directory)
    return Call("POST", "/v1/encoders", RegisterResponse.model_validate,
                files={"archive": (f"{Path(directory).name}.tar.gz", data, "application/gzip")},
                data={"force": "true" if force else "false", "wait": "true" if wait else "false"})


def delete_encoder(key: str) -> Call[str]:
    """``DELETE /v1/encoders/{name@version}``."""
    return Call("DELETE", f"/v1/encoders/{_seg(key)}", lambda b: b["deleted"])


def aliases() -> Call[dict[str, str]]:
    """``GET /v1/aliases``: domain -> name@version."""
    return Call("GET", "/v1/aliases", lambda b: dict(b["aliases"]))


def set_alias(domain: str, encoder: str, *, force: bool = False) -> Call[Alias]:
    """``PUT /v1/aliases/{domain}``."""
    return Call("PUT", f"/v1/aliases/{_seg(domain)}", Alias.model_validate, json={"encoder": encoder, "force": force})


def delete_alias(domain: str) -> Call[Alias]:
    """``DELETE /v1/aliases/{domain}``."""
    return Call("DELETE", f"/v1/aliases/{_seg(domain)}", Alias.model_validate)


def upsert_documents(documents: Sequence[Mapping[str, Any]]) -> Call[UpsertResult]:
    """``POST /v1/documents``: each ``{"id", "text", "metadata"?}``."""
    return Call("POST", "/v1/documents", UpsertResult.model_validate, json={"documents": [dict(d) for d in documents]})


def delete_documents(ids: Sequence[str]) -> Call[DeleteResult]:
    """``DELETE /v1/documents``."""
    return Call("DELETE", "/v1/documents", DeleteResult.model_validate, json={"ids": list(ids)})


def verdict_reached(enc: EncoderInfo) -> bool:
    """Whether the server's guard has decided on ``enc`` (anything but ``evaluating``)."""
    return enc.guard_status != "evaluating"


# ----------------------------------------------------------------------------- answers


def retry_after(response: httpx.Response, attempt: int, max_wait: float) -> float:
    """How long to wait before retrying a 429/503: the ``Retry-After`` header (seconds or an
    HTTP date), else an exponential back-off (0.5 s, 1 s, 2 s, ...); at most ``max_wait``."""
    value = response.headers.get("retry-after", "").strip()
    wait: float | None = None
    if value:
        try:
            wait = float(value)
        except ValueError:
            when = email.utils.parsedate_to_datetime(value) if value else None
            wait = when.timestamp() - time.time() if when is not None else None
    if wait is None:
        wait = 0.5 * 2 ** attempt
    return min(max(wait, 0.0), max_wait)


def should_retry(response: httpx.Response, attempt: int, max_retries: int) -> bool:
    """A 429 or 503 with retries left."""
    return response.status_code in RETRY_STATUSES and attempt < max_retries


def answer(call: Call[T], response: httpx.Response) -> T:
    """The call's value, or the server's named error (from the one table in :mod:`qswap.errors`)."""
    if response.status_code >= 400:
        try:
            body = response.json()
        except ValueError:
            body = {"detail": response.text.strip()[:300] or response.reason_phrase}
        if isinstance(body, dict) and response.status_code == 429 and "retry_after" not in body:
            try:
                body["retry_after"] = int(float(response.headers.get("retry-after", "1")))
            except ValueError:
                pass
        raise error_from_body(response.status_code, body)
    return call.read(response.json())


def unreachable(url: str, e: Exception) -> QswapError:
    """The error for a server that does not answer at all."""
    return QswapError(f"cannot reach {url}: {e}", "is the server running and the URL right?")


def headers(token: str | None, request_timeout: float | None) -> dict[str, str]:
    """Default headers: the bearer token and the per-request deadline (``X-Request-Timeout``)."""
    h = {"Authorization": f"Bearer {token}"} if token else {}
    if request_timeout is not None:
        h["X-Request-Timeout"] = str(request_timeout)
    return h
