"""What the HTTP API answers: the response bodies, defined once and read by both sides.

The server declares them as its routes' response models (they make the OpenAPI schema); the
client (:mod:`qswap.client`) parses its answers into them. Request bodies, which the server
validates strictly, stay with the server (:mod:`qswap.server.http.models`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from qswap.feedback.experiment import Experiment, ExperimentList  # noqa: F401  (re-exported: typed once, where the store keeps it)
from qswap.guard import GuardRecord, GuardStatus


class EncoderRef(BaseModel):

    """Exactly which encoder version served a query."""

    key: str = Field(description="name@version, or 'base' for the base model itself")
    name: str
    version: str
    forced: bool = Field(False, description="it serves only because an admin forced it: its guard verdict is "
                                            "not a pass")


class Timings(BaseModel):
    queue_ms: float = Field(description="waiting for a batch slot")
    encode_ms: float = Field(description="the batch's forward pass")
    search_ms: float = Field(description="the batch's index search")


class ExperimentRef(BaseModel):
    """The online experiment a query took part in (interleaved: hits come from both encoders)."""

    id: str
    mode: str = Field(description="shadow | interleave")
    candidate: str = Field(description="name@version of the candidate encoder")


class HitOut(BaseModel):
    """One hit of a search answer."""

    id: str
    score: float
    text: str | None = Field(description="the document text (null with with_text: false), cut at the server's "
                                         "max_hit_text_chars")
    metadata: dict[str, Any] = Field(description="the document metadata; {} when it exceeds the server's "
                                                 "max_hit_metadata_bytes")
    truncated: bool = Field(False, description="text or metadata was cut (see the server's limits)")


class QueryResult(BaseModel):
    hits: list[HitOut]
    encoder: EncoderRef
    truncated: bool = Field(description="the query was cut to the model's max tokens (or max_query_chars)")
    timings: Timings
    experiment: ExperimentRef | None = Field(None, description="set when the query took part in an "
                                             "interleaving experiment on its domain")


class SearchResponse(BaseModel):
    results: list[QueryResult]
    took_ms: float
    impression: str | None = Field(None, description="the id to send feedback with (POST /v1/feedback), issued "
                                                     "to the client that searched; null when capture is off")


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
    guard: GuardRecord | None = Field(None, description="the guard record the encoder's manifest carries "
                                                        "(self-reported: informational)")
    guard_status: GuardStatus | None = Field(
        None, description="the server's own verdict (--sentinels): 'evaluating' until done, then 'passed', "
                          "'refused', 'insufficient_evidence' (a sentinel has too few judged queries left) or "
                          "'failed'; 'unguarded' when the server has no sentinels. Only 'passed' and "
                          "'unguarded' encoders, or forced ones once their verdict is known, serve")
    forced: bool = Field(False, description="force was given (registration or alias): served once the verdict "
                                            "is known, whatever it is; never while evaluating")
    evaluation: GuardRecord | None = Field(
        None, description="the server's guard record: per sentinel and reference encoder (base, aliased "
                          "encoders) n, nDCG@10 before/after, Wilcoxon statistic, p (raw and Holm), "
                          "sign test, reciprocal rank, pooled PND Z, verdict")
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
    next: str | None = Field(None, description="with `limit`: the `after` cursor of the next page "
                                               "(null on the last page, and without `limit`)")


class Alias(BaseModel):
    domain: str
    encoder: str
    previous: str | None = None
    forced: bool = Field(False, description="the encoder serves only because an admin forced it (its guard "
                                            "verdict is not a pass)")


class UpsertResult(BaseModel):
    upserted: int
    count: int = Field(description="documents in the index afterwards")


class DeleteResult(BaseModel):
    deleted: int
    count: int


class ServerInfo(BaseModel):
    version: str
    model: str
    space: dict[str, Any]
    index: dict[str, Any]
    default_encoder: str
    backend: str
    admin: str
    limits: dict[str, int]


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32")


class Usage(BaseModel):
    prompt_tokens: int = Field(description="tokens the model read (prefix and special tokens included, "
                                           "after truncation to its max length)")
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str = Field(description="what embedded: the resolved 'name@version', 'base' or 'qswap/documents'")
    usage: Usage


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``: OpenAI's fields, then qswap's own."""

    id: str = Field(description="what to send as 'model'")
    object: Literal["model"] = "model"
    created: int = Field(description="registration time (Unix seconds; 0 for the base model and the documents)")
    owned_by: str = "qswap"
    kind: str = Field(description="'documents' (the document tower), 'alias' (a domain alias), or the "
                                  "encoder's kind ('identity' for the base model, 'lora', 'bias', 'partial', ...)")
    encoder: str = Field(description="the encoder this id resolves to now (name@version, 'base', "
                                     "'qswap/documents')")
    dimensions: int = Field(description="the embedding size (the most 'dimensions' may ask for)")
    guard_status: str | None = Field(None, description="the server's guard verdict of the encoder")
    runtime: str | None = Field(None, description="what runs its forward passes now")


# ----------------------------------------------------------------------------- documents

class JobError(BaseModel):
    status: int = Field(description="the HTTP status the error would have had as a direct answer")
    error: str
    detail: str
    hint: str | None = None


class DocumentJobInfo(BaseModel):
    """An upsert running in the background (202), or finished."""

    id: str
    status: Literal["queued", "running", "done", "failed"]
    documents: int = Field(description="documents to write (an id given twice counts once)")
    embedded: int = Field(description="documents embedded so far")
    created_at: float
    finished_at: float | None = None
    result: UpsertResult | None = Field(None, description="once done: written, and the index's count; the write "
                                                          "is committed (durable) when the status says done")
    error: JobError | None = Field(None, description="once failed: nothing of the job was written")


# ----------------------------------------------------------------------------- health

class Health(BaseModel):
    status: str


class Ready(BaseModel):
    ready: bool
    default_encoder: str | None = None
    index_documents: int | None = None
    encoders_loaded: int | None = None
    warming: list[str] = Field(default_factory=list, description=(
        "what the query backend still builds in the background, by kind (shared graph, segment graph, "
        "mixed-batch session, merged graph): answers are served meanwhile, on a slower path; empty once "
        "built. Some builds start only with the traffic that needs them (the first batches that mix "
        "encoders): send that traffic, then wait until this is empty before timing the server"))


# ----------------------------------------------------------------------------- feedback and experiments

class FeedbackRecorded(BaseModel):
    impression: str
    query_index: int
    outcome: int | None = Field(None, description="interleaved searches: +1 the candidate won, -1 the control "
                                                  "won, 0 a tie")


# ----------------------------------------------------------------------------- TEI

class TeiInfo(BaseModel):
    """TEI's ``GET /info``, for the encoder in the path."""

    model_id: str
    model_sha: str | None = None
    model_dtype: str = "float32"
    model_type: dict[str, Any]
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int | None = None
    max_client_batch_size: int
    tokenization_workers: int = 1
    version: str


class TeiToken(BaseModel):
    """One token of TEI's ``/tokenize`` answer."""

    id: int
    text: str
    special: bool
    start: int | None = None
    stop: int | None = None
