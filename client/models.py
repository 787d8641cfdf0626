"""What the qswap server answers, as typed objects (the fields of its OpenAPI schema).

Unknown fields are kept (``extra="allow"``), so a newer server does not break an older client.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class Hit(_Answer):
    id: str
    score: float
    text: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class EncoderRef(_Answer):
    key: str
    name: str
    version: str


class QueryResult(_Answer):
    hits: list[Hit]
    encoder: EncoderRef
    truncated: bool


class SearchResponse(_Answer):
    results: list[QueryResult]
    took_ms: float


class Embedding(_Answer):
    index: int
    embedding: list[float]
    object: str = "embedding"


class Usage(_Answer):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Answer):
    data: list[Embedding]
    model: str
    usage: Usage
    object: str = "list"


class ModelCard(_Answer):
    id: str
    kind: str
    encoder: str
    dimensions: int
    created: int = 0
    owned_by: str = "qswap"
    guard_status: str | None = None
    runtime: str | None = None


class EncoderInfo(_Answer):
    key: str
    name: str
    version: str
    kind: str
    space: str
    loaded: bool
    pinned: bool
    in_flight: int
    aliases: list[str] = Field(default_factory=list)
    guard_status: str | None = None
    evaluation: dict[str, Any] | None = None
    forced: bool = False
    runtime: str | None = None


class EncoderList(_Answer):
    default: str
    encoders: list[EncoderInfo]
    next: str | None = None


class RegisterResponse(_Answer):
    encoder: EncoderInfo
    created: bool


class Alias(_Answer):
    domain: str
    encoder: str
    previous: str | None = None


class UpsertResult(_Answer):
    upserted: int
    count: int


class DeleteResult(_Answer):
    deleted: int
    count: int


class ServerInfo(_Answer):
    version: str
    model: str
    space: dict[str, Any]
    index: dict[str, Any]
    default_encoder: str
    backend: str
    admin: str
    limits: dict[str, int]
