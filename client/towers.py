"""Embedding through a qswap server with the two towers kept apart: documents by the frozen
document tower (``qswap/documents``, the space the index was built in), queries by a domain's
encoder. What the LangChain and LlamaIndex embedding classes share."""

from __future__ import annotations

from typing import Sequence

from qswap.client.aio import AsyncClient
from qswap.client.calls import DOCUMENTS_MODEL
from qswap.client.sync import Client
from qswap.errors import InvalidInputError

#: Texts per request (the server takes up to its ``max_embedding_inputs``, 2,048 by default).
BATCH = 256


def query_model(model: str) -> str:
    """The query side's ``model``, refusing the document tower (that is the documents' side)."""
    if not model or model == DOCUMENTS_MODEL:
        raise InvalidInputError(f"model {model!r} is not a query encoder",
                                "name a domain alias, an encoder ('name' or 'name@version') or 'base': "
                                "documents go to qswap/documents on their own")
    return model


def embed(client: Client, texts: Sequence[str], model: str, dimensions: int | None,
          batch: int = BATCH) -> list[list[float]]:
    """Embed ``texts`` with ``model``, ``batch`` texts per request, in order."""
    out: list[list[float]] = []
    for lo in range(0, len(texts), batch):
        res = client.embeddings(list(texts[lo:lo + batch]), model, dimensions=dimensions)
        out.extend(list(d.embedding) for d in sorted(res.data, key=lambda d: d.index))
    return out


async def aembed(client: AsyncClient, texts: Sequence[str], model: str, dimensions: int | None,
                 batch: int = BATCH) -> list[list[float]]:
    """As :func:`embed`, from asyncio code."""
    out: list[list[float]] = []
    for lo in range(0, len(texts), batch):
        res = await client.embeddings(list(texts[lo:lo + batch]), model, dimensions=dimensions)
        out.extend(list(d.embedding) for d in sorted(res.data, key=lambda d: d.index))
    return out
