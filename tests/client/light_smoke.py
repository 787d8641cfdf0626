"""Run by the ``qswap-client`` venv's python (tests/client/test_light_client.py), not by pytest:
the light client against a real server, where neither torch nor numpy is installed.

Usage: python light_smoke.py URL ADMIN_TOKEN
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys


def main(url: str, token: str) -> None:
    for heavy in ("torch", "numpy", "faiss", "transformers"):
        assert importlib.util.find_spec(heavy) is None, f"{heavy} is installed in the light venv"
    from qswap.client import AsyncClient, Client, SearchResponse, UpsertResult
    from qswap.errors import NotFoundError, UnreachableError
    with Client(url, token) as c:
        assert c.healthz().status == "ok" and c.ready().ready
        res = c.search("chess puzzle", k=3)
        assert isinstance(res, SearchResponse) and len(res.results[0].hits) == 3
        vec = c.embeddings(["chess puzzle"], "base", dimensions=8).data[0].embedding   # base64 decoded without numpy
        assert len(vec) == 8 and abs(sum(x * x for x in vec) - 1.0) < 1e-5
        assert {"base", "qswap/documents"} <= {m.id for m in c.models()}
        up = c.upsert_documents([{"id": "light-1", "text": "chess puzzle club"}], wait=True)
        assert isinstance(up, UpsertResult) and up.upserted == 1
        assert c.delete_documents(["light-1"]).deleted == 1
        assert "qswap_requests_total" in c.metrics()
        try:
            c.encoder("no-such-encoder")
            raise AssertionError("no NotFoundError")
        except NotFoundError as e:
            assert e.hint
    try:
        Client("http://127.0.0.1:9", timeout=2).healthz()
        raise AssertionError("no UnreachableError")
    except UnreachableError:
        pass

    async def aio() -> None:
        async with AsyncClient(url, token) as ac:
            assert (await ac.search("chess puzzle", k=2)).results[0].hits
    asyncio.run(aio())
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "faiss"))
    assert not loaded, loaded
    print("light client ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
