"""Request and response bodies of the HTTP API (pydantic; they make the OpenAPI schema).

Limits that depend on configuration (max k, queries per request) are checked in the routes,
so the schema stays the same whatever the settings are.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------------------- search

class SearchRequest(_Strict):
    """One query (``query``) or several (``queries``), searched with one encoder."""

    query: str | None = Field(None, min_length=1, description="a single query")
    queries: list[str] | None = Field(None, min_length=1, description="several queries")
    encoder: str | None = Field(None, description="'name' (latest version) or 'name@version'; "
                                                  "default encoder when absent")
    domain: str | None = Field(None, description="resolved through the alias table to name@version")
    k: int = Field(10, ge=1, description="hits per query (at most the server's max_k)")
    filter: dict[str, Any] | None = Field(None, description="metadata filter, as the index accepts it")
    with_text: bool = Field(True, description="return document texts with the hits")

    @model_validator(mode="after")
    def _one_of(self) -> "SearchRequest":
        if (self.query is None) == (self.queries is None):
            raise ValueError("give exactly one of 'query' or 'queries'")
        for q in self.texts():
            if not q.strip():
                raise ValueError("queries must not be empty or blank")
        if self.encoder is not None and self.domain is not None:
            raise ValueError("give 'encoder' or 'domain', not both")
        return self

    def texts(self) -> list[str]:
        return [self.query] if self.query is not None else list(self.queries or [])


class Hit(BaseModel):
    id: str
    score: float
    text: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class EncoderRef(BaseModel):
    """Exactly which encoder version served a query."""

    key: str = Field(description="name@version, or 'base' for the base model itself")
    name: str
    version: str


class Timings(BaseModel):
    queue_ms: float = Field(description="waiting for a batch slot")
    encode_ms: float = Field(description="the batch's forward pass")
    search_ms: float = Field(description="the batch's index search")


class QueryResult(BaseModel):
    hits: list[Hit]
    encoder: EncoderRef
    truncated: bool = Field(description="the query was cut to the model's max tokens (or max_query_chars)")
    timings: Timings


class SearchResponse(BaseModel):
    results: list[QueryResult]
    took_ms: float


# ----------------------------------------------------------------------------- encoders

class RegisterByPath(_Strict):
    """Register an encoder directory found under the server's encoders root."""

    path: str = Field(min_length=1, description="directory, relative to the encoders root (or absolute inside it)")
    force: bool = Field(False, description="register even if the tuning guard refuses")


class EncoderInfo(BaseModel):
    key: str
    name: str
    version: str
    kind: str
    space: str = Field(description="embedding-space fingerprint")
    created_at: float | None = None
    registered_at: float | None = None
    source: str | None = None
    loaded: bool
    pinned: bool
    in_flight: int
    memory_bytes: int | None = None
    aliases: list[str] = Field(default_factory=list)
    training: dict[str, Any] | None = None
    guard: dict[str, Any] | None = None
    runtime: Literal["torch", "onnx", "onnx-shared"] | None = Field(
        None, description="what runs its forward passes now: 'onnx-shared' (the shared base session, adapter "
                          "bound per run) or 'onnx' (its own merged export) once the background export is ready, "
                          "else 'torch'")
    runtime_error: str | None = Field(None, description="why the ONNX export failed (torch keeps serving)")


class RegisterResponse(BaseModel):
    encoder: EncoderInfo
    created: bool = Field(description="false when the identical encoder was already registered")


class EncoderList(BaseModel):
    default: str = Field(description="the encoder that answers requests naming none")
    encoders: list[EncoderInfo]


class Deleted(BaseModel):
    deleted: str


class AliasSet(_Strict):
    encoder: str = Field(min_length=1, description="'name' (latest version, frozen now) or 'name@version'")


class Alias(BaseModel):
    domain: str
    encoder: str
    previous: str | None = None


class AliasList(BaseModel):
    aliases: dict[str, str]


# ----------------------------------------------------------------------------- documents

class DocumentIn(_Strict):
    id: str = Field(min_length=1, max_length=512)
    text: str = Field(min_length=1)
    metadata: dict[str, Any] = Field(default_factory=dict)


class UpsertDocuments(_Strict):
    documents: list[DocumentIn] = Field(min_length=1)


class UpsertResult(BaseModel):
    upserted: int
    count: int = Field(description="documents in the index afterwards")


class DeleteDocuments(_Strict):
    ids: list[str] = Field(min_length=1)


class DeleteResult(BaseModel):
    deleted: int
    count: int


# ----------------------------------------------------------------------------- health

class Health(BaseModel):
    status: str


class Ready(BaseModel):
    ready: bool
    default_encoder: str | None = None
    index_documents: int | None = None
    encoders_loaded: int | None = None


class ServerInfo(BaseModel):
    version: str
    model: str
    space: dict[str, Any]
    index: dict[str, Any]
    default_encoder: str
    backend: str
    admin: str
    limits: dict[str, int]


class ErrorBody(BaseModel):
    """Every error response (4xx/5xx)."""

    error: str = Field(description="machine-readable code, e.g. not_found, space_mismatch")
    detail: str
    hint: str | None = None
    request_id: str | None = None
