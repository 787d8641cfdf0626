"""A LangChain retriever over qswap's ``/v1/search`` (extra ``qswap[langchain]``).

    from qswap.client.langchain import QswapRetriever
    retriever = QswapRetriever(url="http://127.0.0.1:8000", domain="legal", k=5)
    docs = retriever.invoke("termination clause")

Each hit becomes a LangChain ``Document`` (``id`` the document id, ``page_content`` its text)
whose metadata holds the document's own metadata plus ``score`` and ``encoder`` (the exact
``name@version`` that served the query).
"""

from __future__ import annotations

from typing import Any

try:
    from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever
except ImportError as e:   # an optional extra
    raise ImportError(f"{e}: install the LangChain extra: pip install 'qswap[langchain]'") from None

from qswap.client.aio import AsyncClient
from qswap.answers import SearchResponse
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
