"""Request and response bodies of the OpenAI- and TEI-compatible routes (pydantic, OpenAPI).

The shapes are the ones the official ``openai`` client, LangChain's ``OpenAIEmbeddings`` and
the TEI clients (LlamaIndex, Haystack) send and read; qswap's own fields ride along where
those clients ignore extra keys (``/v1/models``). Token-id inputs are typed here so that the
route can refuse them with a 400 that names the client option, but the schema documents text
only (token ids are not this model's vocabulary).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema

from qswap.answers import ModelCard
from qswap.server.http.models import REF_PATTERN, Count, _no_default, _no_surrogates, _Strict

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


class EmbeddingRequest(_Strict):
    """OpenAI's ``POST /v1/embeddings`` body."""

    model_config = ConfigDict(extra="forbid", strict=True)

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


class TeiEmbedRequest(_Strict):
    """TEI's ``POST /embed`` body."""

    inputs: Inputs = Field(description="a text or a list of texts")
    normalize: bool = Field(True, description="unit-length vectors (qswap's encoders always give them)")
    truncate: bool = Field(False, description="cut inputs longer than the model's max tokens (else they "
                                              "are refused: 422 limit_exceeded)")
    truncation_direction: Literal["right", "Right"] = Field("right", description="only 'right' is supported")
    dimensions: Count = Field(None, json_schema_extra=_no_default, ge=1, le=MAX_DIMENSIONS,
                            description="keep the first N coordinates (Matryoshka) and renormalise")
    prompt_name: Literal["query", "passage"] = Field(
        "query", description="'query': the encoder in the path; 'passage': the frozen document tower")


__all__ = ["DOCUMENTS_MODEL", "MAX_DIMENSIONS", "MAX_EMBEDDING_INPUTS", "MODEL_PATTERN",
           "EmbeddingRequest", "ModelList", "TeiEmbedRequest", "token_ids_given"]
