"""qswap's Python client: every route of the HTTP API, sync (:class:`Client`) and async
(:class:`AsyncClient`), on httpx. Errors are the named errors of :mod:`qswap.errors`, the
same table the server answers from; 429 and 503 are retried after ``Retry-After``.

Framework integrations (optional extras) live beside it: :mod:`qswap.client.langchain`
(``qswap[langchain]``) and :mod:`qswap.client.llamaindex` (``qswap[llamaindex]``).
"""

from qswap.client.aio import AsyncClient
from qswap.client.archive import pack_encoder
from qswap.client.calls import DOCUMENTS_MODEL
from qswap.answers import (Alias, DeleteResult, Embedding, EmbeddingResponse, EncoderInfo, EncoderList, HitOut as Hit,
                           ModelCard, QueryResult, RegisterResponse, SearchResponse, ServerInfo, UpsertResult)
from qswap.client.sync import Client

__all__ = ["Alias", "AsyncClient", "Client", "DOCUMENTS_MODEL", "DeleteResult", "Embedding", "EmbeddingResponse",
           "EncoderInfo", "EncoderList", "Hit", "ModelCard", "QueryResult", "RegisterResponse", "SearchResponse",
           "ServerInfo", "UpsertResult", "pack_encoder"]
