"""Request bodies of the HTTP API and the server-only answers (pydantic; they make the OpenAPI
schema). The answers the client reads too live in :mod:`qswap.answers`.

Request models are strict (``k: "5"``, ``k: true``, ``with_text: "yes"`` are refused, not
coerced) and their schema says everything the server refuses: patterns for names, keys and
ids, bounds for numbers, "exactly one of" for alternatives. Lone UTF-16 surrogates cannot be
stored or encoded, so every text field refuses them. Limits that depend on configuration
(max k, queries and documents per request) are written into the schema the running server
serves (:func:`qswap.server.http.app.create_app`); the committed copy has the defaults.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from annotated_types import Ge, Le
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, WithJsonSchema,
                      model_validator)

from qswap.answers import UpsertResult

# Names, versions and domains (qswap.encoders.artifact.validate_name), and name@version keys.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
REF_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}(@[A-Za-z0-9][A-Za-z0-9._-]{0,63})?$"
IMPRESSION_PATTERN = r"^[A-Za-z0-9_-]{16}\.[A-Za-z0-9_-]{22}$"   # qswap.server.traffic.impressions
KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}@[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
# A path under the encoders root: no NUL and no '..' component (written without look-ahead,
# which the validator's regex engine lacks).
_COMPONENT = r"(\.?|\.\.[^\x00/]+|\.[^\x00/.][^\x00/]*|[^\x00/.][^\x00/]*)"
PATH_PATTERN = rf"^{_COMPONENT}(/{_COMPONENT})*$"
NOT_BLANK = r"\S"
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_FILTER_FIELDS = 32
MAX_METADATA_DEPTH = 64
# Hard ceilings of the schema; the running server writes its configured (lower) limits.
MAX_K, MAX_QUERIES, MAX_DOCUMENTS = 10_000, 4096, 100_000


def _no_surrogates(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text contains a lone UTF-16 surrogate (not valid Unicode)") from None
    return s


def _check_number(v: int | float, where: str) -> None:
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{where}: {v} is not a finite number")
    if not INT64_MIN <= v <= INT64_MAX:
        raise ValueError(f"{where}: {v} is outside the 64-bit integer range")


def _check_filter(flt: dict[str, Any] | None) -> dict[str, Any] | None:
    if flt is None:
        return None
    if len(flt) > MAX_FILTER_FIELDS:
        raise ValueError(f"filter has {len(flt)} fields; at most {MAX_FILTER_FIELDS}")
    for field, value in flt.items():
        _no_surrogates(field)
        if not field or len(field) > 128 or '"' in field or "\\" in field:
            raise ValueError(f"bad filter field {field!r}: 1-128 characters, no quotes or backslashes")
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float)):
            _check_number(value, f"filter {field}")
        elif isinstance(value, str):
            _no_surrogates(value)
        else:
            raise ValueError(f"filter {field}: a filter value is one string, number, boolean or null")
    return flt


def _check_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    def walk(v: Any, depth: int) -> None:
        if depth > MAX_METADATA_DEPTH:
            raise ValueError(f"metadata is nested deeper than {MAX_METADATA_DEPTH} levels")
        if isinstance(v, str):
            _no_surrogates(v)
        elif isinstance(v, bool) or v is None:
            pass
        elif isinstance(v, (int, float)):
            # Every backend must store what one accepts: Milvus' JSON holds 64-bit integers
            # only; numbers are bounded as in filters (and as the schema says, at every depth).
            _check_number(v, "metadata")
        elif isinstance(v, list):
            for x in v:
                walk(x, depth + 1)
        elif isinstance(v, dict):
            for key, x in v.items():
                _no_surrogates(key)
                walk(x, depth + 1)
        else:
            raise ValueError(f"metadata holds a {type(v).__name__}, not JSON")
    walk(meta, 0)
    return meta


_SCALAR_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "number", "minimum": INT64_MIN, "maximum": INT64_MAX},
                            {"type": "boolean"}, {"type": "null"}]}
FILTER_SCHEMA: dict[str, Any] = {
    "type": "object", "maxProperties": MAX_FILTER_FIELDS,
    "propertyNames": {"minLength": 1, "maxLength": 128, "pattern": r'^[^"\\]+$'},
    "additionalProperties": _SCALAR_SCHEMA,
    "description": "metadata filter: equality on top-level fields (all must match)"}

def _integral(v: Any) -> Any:
    # JSON Schema counts 12.0 as an integer, so the schema's "integer" admits it; strings and
    # booleans stay refused (no coercion).
    return int(v) if isinstance(v, float) and v.is_integer() else v


Count = Annotated[int, BeforeValidator(_integral)]
Text = Annotated[str, AfterValidator(_no_surrogates)]
Query = Annotated[str, StringConstraints(min_length=1, pattern=NOT_BLANK), AfterValidator(_no_surrogates)]
Filter = Annotated[dict[str, Any] | None, AfterValidator(_check_filter),
                   WithJsonSchema({"anyOf": [FILTER_SCHEMA, {"type": "null"}]})]
# A metadata value, recursively (the app puts it into the schema's components).
METADATA_VALUE_REF = "#/components/schemas/MetadataValue"
METADATA_VALUE_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "string"}, {"type": "number", "minimum": INT64_MIN, "maximum": INT64_MAX}, {"type": "boolean"},
    {"type": "null"}, {"type": "array", "items": {"$ref": METADATA_VALUE_REF}},
    {"type": "object", "additionalProperties": {"$ref": METADATA_VALUE_REF}}],
    "description": "JSON; numbers within the 64-bit integer range"}
Metadata = Annotated[dict[str, Any], AfterValidator(_check_metadata),
                     WithJsonSchema({"type": "object", "additionalProperties": {"$ref": METADATA_VALUE_REF},
                                     "description": "JSON metadata (nesting at most "
                                     f"{MAX_METADATA_DEPTH} levels; numbers within the 64-bit integer range)"})]
DocId = Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=NOT_BLANK),
                  AfterValidator(_no_surrogates)]


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)   # "absent" is not null: the field's type has no null


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ----------------------------------------------------------------------------- search

class SearchRequest(_Strict):
    """One query (``query``) or several (``queries``), searched with one encoder."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "oneOf": [{"required": ["query"]}, {"required": ["queries"]}],
        "not": {"required": ["encoder", "domain"]}})

    # Absent or a string: no null, so the schema's "exactly one of" is what the server checks.
    query: Query = Field(None, json_schema_extra=_no_default, description="a single query (give exactly one of query / queries)")
    queries: list[Query] = Field(None, json_schema_extra=_no_default, min_length=1, max_length=MAX_QUERIES,
                                 description="several queries (at most the server's max_queries)")
    encoder: str = Field(None, json_schema_extra=_no_default, pattern=REF_PATTERN, description="'name' (highest version) or 'name@version'; "
                                                                "default encoder when absent")
    domain: str = Field(None, json_schema_extra=_no_default, pattern=NAME_PATTERN, description="resolved through the alias table to name@version")
    k: Count = Field(10, ge=1, le=MAX_K, description="hits per query (at most the server's max_k)")
    offset: Count = Field(0, ge=0, le=MAX_K, description="skip this many best hits first (pagination; at most "
                                                          "the server's max_k)")
    score_threshold: float = Field(None, json_schema_extra=_no_default, allow_inf_nan=False,
                                   description="drop hits scoring below this (cosine similarity)")
    filter: Filter = None
    with_text: bool = Field(True, description="return document texts with the hits")
    session: str = Field(None, json_schema_extra=_no_default, pattern=NAME_PATTERN,
                         description="an opaque id of the end user's session, named by an application that "
                                     "searches with a bearer token: experiments count evidence per session "
                                     "(ignored without a token; see docs/security.md)")

    @model_validator(mode="after")
    def _one_of(self) -> "SearchRequest":
        if (self.query is None) == (self.queries is None):
            raise ValueError("give exactly one of 'query' or 'queries'")
        if self.encoder is not None and self.domain is not None:
            raise ValueError("give 'encoder' or 'domain', not both")
        return self

    def texts(self) -> list[str]:
        return [self.query] if self.query is not None else list(self.queries or [])


# ----------------------------------------------------------------------------- encoders

class RegisterByPath(_Strict):
    """Register an encoder directory found under the server's encoders root."""

    path: str = Field(min_length=1, max_length=4096, pattern=PATH_PATTERN,
                      description="directory, relative to the encoders root (or absolute inside it); "
                                  "no '..'")
    force: bool = Field(False, description="register and serve even if the guard refuses")
    wait: bool = Field(False, description="with sentinels: answer once the server's evaluation is done "
                                          "(201, or 409 guard_refused with the table, the encoder then not "
                                          "registered) instead of at once (202, guard_status 'evaluating')")


class Deleted(BaseModel):
    deleted: str


class AliasSet(_Strict):
    encoder: str = Field(pattern=REF_PATTERN, description="'name' (highest version, frozen now) or 'name@version'")
    force: bool = Field(False, description="point the alias at an encoder the guard refused (never at one "
                                           "still being evaluated)")


class AliasList(BaseModel):
    aliases: dict[str, str]


# ----------------------------------------------------------------------------- documents

class DocumentIn(_Strict):
    id: DocId
    text: Text = Field(min_length=1)
    metadata: Metadata = Field(default_factory=dict)


class UpsertDocuments(_Strict):
    documents: list[DocumentIn] = Field(min_length=1, max_length=MAX_DOCUMENTS,
                                        description="an id given twice in one request: the last one wins")


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


class DeleteDocuments(_Strict):
    ids: list[DocId] = Field(min_length=1, max_length=MAX_DOCUMENTS)


# ----------------------------------------------------------------------------- health

class Health(BaseModel):
    status: str


class Ready(BaseModel):
    ready: bool
    default_encoder: str | None = None
    index_documents: int | None = None
    encoders_loaded: int | None = None


class ErrorBody(BaseModel):
    """Every error response (4xx/5xx)."""

    error: str = Field(description="machine-readable code, e.g. not_found, space_mismatch")
    detail: str
    hint: str | None = None
    request_id: str | None = None
    guard: dict[str, Any] | None = Field(None, description="guard_refused: the guard record (per-sentinel table)")


# ----------------------------------------------------------------------------- feedback and experiments

class FeedbackRequest(_Strict):
    """What the user did with one search's results: clicked ids, or graded judgements."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "not": {"required": ["clicks", "grades"]}})

    impression: str = Field(min_length=1, max_length=64, pattern=IMPRESSION_PATTERN,
                            description="the search answer's 'impression' (issued to the client that searched)")
    query_index: Count = Field(0, ge=0, le=MAX_QUERIES, description="which query of the search (0 for one query)")
    clicks: list[DocId] = Field(None, json_schema_extra=_no_default, max_length=1000,
                                description="clicked document ids, among the hits shown (none: seen, not clicked)")
    # The schema is spelled out: pydantic writes the value bounds of a pattern-keyed dict as
    # "ge"/"le", which JSON Schema does not know.
    grades: Annotated[dict[DocId, Annotated[int, BeforeValidator(_integral), Ge(0), Le(100)]], WithJsonSchema({
        "type": "object", "maxProperties": 1000,
        "propertyNames": {"minLength": 1, "maxLength": 512, "pattern": NOT_BLANK},
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 100},
        "description": "graded judgements instead of clicks: id -> grade (0 = not relevant)"})] = Field(
        None, json_schema_extra=_no_default, max_length=1000)

    @model_validator(mode="after")
    def _one_of(self) -> "FeedbackRequest":
        if self.grades is not None and self.clicks is not None:
            raise ValueError("give 'clicks' or 'grades', not both")
        return self


class FeedbackRecorded(BaseModel):
    impression: str
    query_index: int
    outcome: int | None = Field(None, description="interleaved searches: +1 the candidate won, -1 the control "
                                                  "won, 0 a tie")


class ExperimentStart(_Strict):
    """Start an online comparison on a domain alias."""

    domain: str = Field(pattern=NAME_PATTERN, description="the domain alias; its current target is the control")
    candidate: str = Field(pattern=REF_PATTERN, description="'name' (highest servable version) or 'name@version'")
    mode: Literal["shadow", "interleave"] = "interleave"
    fraction: float = Field(0.1, gt=0, le=1, description="share of the domain's searches in the experiment")
    auto_promote_alpha: float | None = Field(None, gt=0, lt=1, description="promote on its own once the "
                                             "candidate is ahead and the sign test is significant at this level "
                                             "(tested at min_decided x 1, 2, 4 ... 512 decided impressions, each "
                                             "look at alpha / 10)")
    min_decided: Count = Field(100, ge=1, le=10_000_000, description="decided impressions (counted wins + losses) "
                                                                  "at the first look of auto-promotion")
    min_clients: Count = Field(20, ge=2, le=1_000_000, description="auto-promotion needs decided feedback from at "
                                                                  "least this many distinct clients (sessions)")
    max_per_client: Count = Field(10, ge=1, le=1_000_000, description="decided feedbacks of one client (session) "
                                                                     "that count towards auto-promotion at most")
