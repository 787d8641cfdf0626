"""A LlamaIndex retriever over qswap's ``/v1/search`` (extra ``qswap[llamaindex]``).

    from qswap.client.llamaindex import QswapRetriever
    retriever = QswapRetriever(url="http://127.0.0.1:8000", domain="legal", k=5)
    nodes = retriever.retrieve("termination clause")

Each hit becomes a ``NodeWithScore`` over a ``TextNode`` (``id_`` the document id) whose
metadata holds the document's own metadata plus ``encoder`` (the exact ``name@version``).
"""

from __future__ import annotations

from typing import Any

try:
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
except ImportError as e:   # an optional extra
    raise ImportError(f"{e}: install the LlamaIndex extra: pip install 'qswap[llamaindex]'") from None

from qswap.client.aio import AsyncClient
from qswap.answers import SearchResponse
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
