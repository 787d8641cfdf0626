"""LangChain over a qswap server (extra ``[langchain]``): a retriever over ``/v1/search`` and
an ``Embeddings`` class that keeps the two towers apart.

    from qswap.client.langchain import QswapEmbeddings, QswapRetriever
    retriever = QswapRetriever(url="http://127.0.0.1:8000", domain="legal", k=5)
    docs = retriever.invoke("termination clause")
    store = InMemoryVectorStore(QswapEmbeddings(url="http://127.0.0.1:8000", model="legal"))

Each hit becomes a LangChain ``Document`` (``id`` the document id, ``page_content`` its text)
whose metadata holds the document's own metadata plus ``score`` and ``encoder`` (the exact
``name@version`` that served the query).
"""

from __future__ import annotations

from typing import Any

try:
    from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.embeddings import Embeddings
    from langchain_core.retrievers import BaseRetriever
except ImportError as e:   # an optional extra
    raise ImportError(f"{e}: install the LangChain extra: pip install 'qswap[langchain]'") from None

from pydantic import BaseModel

from qswap.answers import SearchResponse
from qswap.client import towers
from qswap.client.aio import AsyncClient
from qswap.client.calls import DOCUMENTS_MODEL
from qswap.client.sync import Client


def _documents(res: SearchResponse) -> list[Document]:
    out = []
    for r in res.results:
        for h in r.hits:
            out.append(Document(id=h.id, page_content=h.text or "",
                                metadata={**h.metadata, "id": h.id, "score": h.score, "encoder": r.encoder.key}))
    return out


class QswapRetriever(BaseRetriever):
    """Retrieve with one query encoder (``encoder``) or domain alias (``domain``); neither: the
    server's default encoder.

    Args (fields):
        url: the server's base URL.
        token: the search bearer token, if the server needs one.
        encoder: ``name`` or ``name@version``.
        domain: a domain alias (instead of ``encoder``).
        k: documents per query.
        filter: metadata equality filter.
        score_threshold: drop hits scoring below this.
    """

    url: str = "http://127.0.0.1:8000"
    token: str | None = None
    encoder: str | None = None
    domain: str | None = None
    k: int = 4
    filter: dict[str, Any] | None = None
    score_threshold: float | None = None

    def _search_args(self) -> dict[str, Any]:
        return {"encoder": self.encoder, "domain": self.domain, "k": self.k, "filter": self.filter,
                "score_threshold": self.score_threshold}

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        with Client(self.url, self.token) as client:
            return _documents(client.search(query, **self._search_args()))

    async def _aget_relevant_documents(self, query: str, *,
                                       run_manager: AsyncCallbackManagerForRetrieverRun) -> list[Document]:
        async with AsyncClient(self.url, self.token) as client:
            return _documents(await client.search(query, **self._search_args()))


class QswapEmbeddings(BaseModel, Embeddings):
    """LangChain ``Embeddings`` for an asymmetric qswap server: ``embed_documents`` uses the
    frozen document tower (``qswap/documents``, the space the server's index holds),
    ``embed_query`` the query encoder ``model``. A vector store filled through it ranks as
    ``/v1/search`` with the same ``model`` does.

    Args (fields):
        url: the server's base URL.
        token: the search bearer token, if the server needs one.
        model: the query side: a domain alias, an encoder (``name`` or ``name@version``) or ``base``.
        dimensions: a Matryoshka prefix for both sides (renormalised); None: the full size.
        batch_size: texts per request.
        timeout: seconds one request may take.
    """

    url: str = "http://127.0.0.1:8000"
    token: str | None = None
    model: str
    dimensions: int | None = None
    batch_size: int = towers.BATCH
    timeout: float = 60.0

    def _client(self) -> Client:
        return Client(self.url, self.token, timeout=self.timeout)

    def _aclient(self) -> AsyncClient:
        return AsyncClient(self.url, self.token, timeout=self.timeout)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """Embed documents with the document tower (``qswap/documents``)."""
        with self._client() as c:
            return towers.embed(c, texts, DOCUMENTS_MODEL, self.dimensions, self.batch_size)

    def embed_query(self, text: str) -> list[float]:
        """Embed a query with the query encoder ``model``."""
        with self._client() as c:
            return towers.embed(c, [text], towers.query_model(self.model), self.dimensions)[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        """As :meth:`embed_documents`, from asyncio code."""
        async with self._aclient() as c:
            return await towers.aembed(c, texts, DOCUMENTS_MODEL, self.dimensions, self.batch_size)

    async def aembed_query(self, text: str) -> list[float]:
        """As :meth:`embed_query`, from asyncio code."""
        async with self._aclient() as c:
            return (await towers.aembed(c, [text], towers.query_model(self.model), self.dimensions))[0]
