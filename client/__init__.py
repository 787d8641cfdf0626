"""qswap's Python client: every route of the HTTP API, sync (:class:`Client`) and async
(:class:`AsyncClient`), on httpx, with typed answers (:mod:`qswap.answers`). Errors are the
named errors of :mod:`qswap.errors`, the same table the server answers from; 429 and 503 are
retried after ``Retry-After``.

It needs httpx and pydantic only: the ``qswap-client`` distribution ships it alone (no torch).
Framework integrations (optional extras) live beside it: :mod:`qswap.client.langchain`
(``[langchain]``) and :mod:`qswap.client.llamaindex` (``[llamaindex]``).
"""

from qswap.answers import (Alias, DeleteResult, DocumentJobInfo, Embedding, EmbeddingResponse, EncoderInfo,
                           EncoderList, Experiment, FeedbackRecorded, Health, HitOut as Hit, ModelCard, QueryResult,
                           Ready, RegisterResponse, SearchResponse, ServerInfo, TeiInfo, UpsertResult)
from qswap.client.aio import AsyncClient
from qswap.client.archive import pack_encoder
from qswap.client.calls import DOCUMENTS_MODEL
from qswap.client.sync import Client

__all__ = ["Alias", "AsyncClient", "Client", "DOCUMENTS_MODEL", "DeleteResult", "DocumentJobInfo", "Embedding",
           "EmbeddingResponse", "EncoderInfo", "EncoderList", "Experiment", "FeedbackRecorded", "Health", "Hit",
           "ModelCard", "QueryResult", "Ready", "RegisterResponse", "SearchResponse", "ServerInfo", "TeiInfo",
           "UpsertResult", "pack_encoder"]
