"""Request and response bodies of the OpenAI- and TEI-compatible routes (pydantic, OpenAPI).

The shapes are the ones the official ``openai`` client, LangChain's ``OpenAIEmbeddings`` and
the TEI clients (LlamaIndex, Haystack) send and read; qswap's own fields ride along where
those clients ignore extra keys (``/v1/models``). Token-id inputs are typed here so that the
route can refuse them with a 400 that names the client option, but the schema documents text
only (token ids are not this model's vocabulary).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema, model_validator

from qswap.answers import ModelCard
from qswap.server.http.models import REF_PATTERN, Count, _no_default, _no_surrogates

# The reserved model id of the frozen document tower (the index's own embeddings).
DOCUMENTS_MODEL = "qswap/documents"
MODEL_PATTERN = rf"^(qswap/documents|{REF_PATTERN[1:-1]})$"
# Hard ceilings of the schema; the running server writes its configured (lower) limits.
MAX_EMBEDDING_INPUTS, MAX_DIMENSIONS = 4096, 8192

EmbedText = Annotated[str, StringConstraints(min_length=1), AfterValidator(_no_surrogates)]
_TEXTS_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS}],
    "description": "a text or a list of texts (token-id arrays are refused with 400: send text)"}
_NonEmpty = Field(min_length=1)
Inputs = Annotated[EmbedText | Annotated[list[EmbedText], _NonEmpty] | Annotated[list[int], _NonEmpty]
                   | Annotated[list[list[int]], _NonEmpty], WithJsonSchema(_TEXTS_SCHEMA)]


def token_ids_given(value: Any) -> bool:
    """Whether an ``input`` holds token ids (what tiktoken-based clients send) instead of text."""
    return isinstance(value, list) and bool(value) and not isinstance(value[0], str)


class _Lenient(BaseModel):
    """A compatibility route's body: read as its anchor (OpenAI, TEI) reads it. Unknown fields are
    ignored (clients send their own, e.g. ``input_type``) and ``null`` for an optional field means
    its default; the fields qswap reads are still strictly typed."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in cls.model_fields
                                                           and not cls.model_fields[k].is_required())}
        return data


class EmbeddingRequest(_Lenient):
    """OpenAI's ``POST /v1/embeddings`` body."""

    input: Inputs = Field(description="a text or a list of texts (at most the server's max_embedding_inputs)")
    model: str = Field(pattern=MODEL_PATTERN, max_length=129,
                       description="a domain alias, an encoder ('name' = highest version, 'name@version', "
                                   "'base'), or 'qswap/documents' for the frozen document tower")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="'base64': each embedding is the base64 of its little-endian float32 bytes")
    dimensions: Count = Field(None, json_schema_extra=_no_default, ge=1, le=MAX_DIMENSIONS,
                            description="keep the first N coordinates (Matryoshka) and renormalise")
    user: str = Field(None, json_schema_extra=_no_default, max_length=256, description="ignored")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# TEI's prompt names as qswap reads them: the encoder in the path, or the frozen document tower.
QUERY_PROMPTS, DOCUMENT_PROMPTS = ("query",), ("passage", "document", "documents", "doc", "corpus")
PROMPT_NAMES = QUERY_PROMPTS + DOCUMENT_PROMPTS
_PROMPT_DOC = ("'query' (the default): the encoder in the path; 'passage' (or 'document', 'documents', 'doc', "
               "'corpus'): the frozen document tower, as the index embeds its documents")


class TeiEmbedRequest(_Lenient):
    """TEI's ``POST /embed`` (and ``POST /``) body."""

    inputs: Inputs = Field(description="a text or a list of texts")
    normalize: bool = Field(True, description="unit-length vectors (qswap's encoders always give them)")
    truncate: bool = Field(False, description="cut inputs longer than the model's max tokens (else they "
                                              "are refused: 422 limit_exceeded)")
    truncation_direction: Literal["right", "Right", "left", "Left"] = Field(
        "right", description="which end of a too-long input is cut when truncate is true")
    dimensions: Count = Field(None, json_schema_extra=_no_default, ge=1, le=MAX_DIMENSIONS,
                            description="keep the first N coordinates (Matryoshka) and renormalise")
    prompt_name: Literal[PROMPT_NAMES] = Field("query", description=_PROMPT_DOC)  # type: ignore[valid-type]

    @property
    def documents(self) -> bool:
        """Whether the request asks for the document tower."""
        return self.prompt_name in DOCUMENT_PROMPTS


class TeiTokenizeRequest(_Lenient):
    """TEI's ``POST /tokenize`` body."""

    inputs: Annotated[EmbedText | Annotated[list[EmbedText], _NonEmpty], WithJsonSchema(_TEXTS_SCHEMA)] = Field(
        description="a text or a list of texts")
    add_special_tokens: bool = Field(True, description="include the model's special tokens ([CLS], [SEP], ...)")
    prompt_name: Literal[PROMPT_NAMES] | None = Field(  # type: ignore[valid-type]
        None, description="prepend that prompt's prefix, as /embed does (default: the text as sent)")


_TokenId = Count   # 289.0 reads as 289, as JSON Schema's integer allows; unknown ids decode as [UNK]


class TeiDecodeRequest(_Lenient):
    """TEI's ``POST /decode`` body."""

    ids: Annotated[list[_TokenId], _NonEmpty] | Annotated[list[Annotated[list[_TokenId], _NonEmpty]], _NonEmpty] = Field(
        description="token ids, or a list of lists of token ids")
    skip_special_tokens: bool = Field(True, description="leave out the model's special tokens")



class OpenAIErrorDetail(BaseModel):
    """OpenAI's error object: what the ``openai`` package's exceptions carry."""

    message: str = Field(description="what is wrong, then qswap's hint")
    type: str = Field(description="invalid_request_error, authentication_error, rate_limit_error, server_error, ...")
    param: str | None = Field(None, description="the request field the error is about, when known")
    code: str = Field(description="qswap's error code, e.g. not_found, limit_exceeded, guard_refused")


class OpenAIErrorBody(BaseModel):
    """Error answers of the OpenAI-compatible routes (qswap's fields beside OpenAI's ``error``)."""

    model_config = ConfigDict(extra="allow")

    error: OpenAIErrorDetail
    hint: str | None = None
    request_id: str | None = None


class TeiErrorBody(BaseModel):
    """Error answers of the TEI-compatible routes (qswap's fields beside TEI's)."""

    model_config = ConfigDict(extra="allow")

    error: str = Field(description="what is wrong, then qswap's hint")
    error_type: str = Field(description="TEI's kind: Validation, Overloaded, Unhealthy, Backend")
    code: str = Field(description="qswap's error code")
    hint: str | None = None
    request_id: str | None = None


__all__ = ["DOCUMENTS_MODEL", "DOCUMENT_PROMPTS", "MAX_DIMENSIONS", "MAX_EMBEDDING_INPUTS", "MODEL_PATTERN",
           "PROMPT_NAMES", "QUERY_PROMPTS", "EmbeddingRequest", "ModelList", "TeiDecodeRequest", "TeiEmbedRequest",
           "TeiTokenizeRequest", "token_ids_given"]
