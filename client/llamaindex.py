"""LlamaIndex over a qswap server (extra ``[llamaindex]``): a retriever over ``/v1/search``
and an embedding model that keeps the two towers apart.

    from qswap.client.llamaindex import QswapEmbedding, QswapRetriever
    retriever = QswapRetriever(url="http://127.0.0.1:8000", domain="legal", k=5)
    nodes = retriever.retrieve("termination clause")
    index = VectorStoreIndex(nodes, embed_model=QswapEmbedding(url="http://127.0.0.1:8000", model_name="legal"))

Each hit becomes a ``NodeWithScore`` over a ``TextNode`` (``id_`` the document id) whose
metadata holds the document's own metadata plus ``encoder`` (the exact ``name@version``).
"""

from __future__ import annotations

from typing import Any

try:
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
except ImportError as e:   # an optional extra
    raise ImportError(f"{e}: install the LlamaIndex extra: pip install 'qswap[llamaindex]'") from None

from pydantic import Field

from qswap.answers import SearchResponse
from qswap.client import towers
from qswap.client.aio import AsyncClient
from qswap.client.calls import DOCUMENTS_MODEL
from qswap.client.sync import Client


def _nodes(res: SearchResponse) -> list[NodeWithScore]:
    return [NodeWithScore(node=TextNode(id_=h.id, text=h.text or "", metadata={**h.metadata, "encoder": r.encoder.key}),
                          score=h.score) for r in res.results for h in r.hits]


class QswapRetriever(BaseRetriever):
    """Retrieve with one query encoder (``encoder``) or domain alias (``domain``); neither: the
    server's default encoder.

    Args:
        url: the server's base URL.
        token: the search bearer token, if the server needs one.
        encoder: ``name`` or ``name@version``.
        domain: a domain alias (instead of ``encoder``).
        k: nodes per query.
        filter: metadata equality filter.
        score_threshold: drop hits scoring below this.
        **kwargs: passed to LlamaIndex's ``BaseRetriever`` (``callback_manager``, ``verbose``).
    """

    def __init__(self, url: str = "http://127.0.0.1:8000", token: str | None = None, *, encoder: str | None = None,
                 domain: str | None = None, k: int = 4, filter: dict[str, Any] | None = None,
                 score_threshold: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.url, self.token = url, token
        self.search_args = {"encoder": encoder, "domain": domain, "k": k, "filter": filter,
                            "score_threshold": score_threshold}

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        with Client(self.url, self.token) as client:
            return _nodes(client.search(query_bundle.query_str, **self.search_args))

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        async with AsyncClient(self.url, self.token) as client:
            return _nodes(await client.search(query_bundle.query_str, **self.search_args))


class QswapEmbedding(BaseEmbedding):
    """A LlamaIndex embedding model for an asymmetric qswap server: texts (nodes, documents) are
    embedded by the frozen document tower (``qswap/documents``, the space the server's index
    holds), queries by the query encoder ``model_name``. An index built through it ranks as
    ``/v1/search`` with the same encoder does.

    Args (fields):
        model_name: the query side: a domain alias, an encoder (``name`` or ``name@version``) or ``base``.
        url: the server's base URL.
        token: the search bearer token, if the server needs one.
        dimensions: a Matryoshka prefix for both sides (renormalised); None: the full size.
        timeout: seconds one request may take.
        embed_batch_size: texts per request (LlamaIndex's own field).
    """

    url: str = Field("http://127.0.0.1:8000", description="the qswap server's base URL")
    token: str | None = Field(None, description="the search bearer token, if the server needs one")
    dimensions: int | None = Field(None, description="a Matryoshka prefix for both sides")
    timeout: float = Field(60.0, description="seconds one request may take")

    def __init__(self, model_name: str, **kwargs: Any) -> None:
        kwargs.setdefault("embed_batch_size", towers.BATCH)
        super().__init__(model_name=model_name, **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "QswapEmbedding"

    def _texts(self, texts: list[str], model: str) -> list[list[float]]:
        with Client(self.url, self.token, timeout=self.timeout) as c:
            return towers.embed(c, texts, model, self.dimensions, self.embed_batch_size)

    async def _atexts(self, texts: list[str], model: str) -> list[list[float]]:
        async with AsyncClient(self.url, self.token, timeout=self.timeout) as c:
            return await towers.aembed(c, texts, model, self.dimensions, self.embed_batch_size)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._texts([query], towers.query_model(self.model_name))[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return (await self._atexts([query], towers.query_model(self.model_name)))[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._texts([text], DOCUMENTS_MODEL)[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._texts(texts, DOCUMENTS_MODEL)

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return (await self._atexts([text], DOCUMENTS_MODEL))[0]

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return await self._atexts(texts, DOCUMENTS_MODEL)
