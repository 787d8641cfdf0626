"""The client's methods, one per route, written once for the sync and the async client.

Each method builds a :class:`~qswap.client.calls.Call` and hands it to ``self._send``: in
:class:`~qswap.client.Client` that returns the value, in :class:`~qswap.client.AsyncClient`
an awaitable of it (so ``await client.search(...)`` there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from qswap.client import calls


class Routes:
    """Every route of the qswap API (see each method); subclasses supply ``_send``."""

    def _send(self, call: calls.Call[Any]) -> Any:
        raise NotImplementedError

    def search(self, query: str | Sequence[str], *, encoder: str | None = None, domain: str | None = None,
               k: int = 10, offset: int = 0, score_threshold: float | None = None,
               filter: Mapping[str, Any] | None = None, with_text: bool = True) -> Any:
        """Search with a chosen query encoder.

        Args:
            query: one query, or a list of queries (one result each).
            encoder: ``name`` (highest version) or ``name@version``; the default encoder when absent.
            domain: a domain alias instead of ``encoder``.
            k: hits per query.
            offset: skip this many best hits first (pagination).
            score_threshold: drop hits scoring below this.
            filter: metadata equality filter.
            with_text: return document texts.

        Returns:
            :class:`~qswap.answers.SearchResponse`.
        """
        return self._send(calls.search(query, encoder=encoder, domain=domain, k=k, offset=offset,
                                       score_threshold=score_threshold, filter=filter, with_text=with_text))

    def embeddings(self, input: str | Sequence[str], model: str, *, dimensions: int | None = None) -> Any:
        """Embed texts with a query encoder (alias or reference) or ``qswap/documents``.

        Args:
            input: a text or a list of texts.
            model: a domain alias, an encoder reference, or ``qswap/documents``.
            dimensions: a Matryoshka prefix (renormalised).

        Returns:
            :class:`~qswap.answers.EmbeddingResponse` (floats; base64 on the wire).
        """
        return self._send(calls.embeddings(input, model, dimensions=dimensions))

    def models(self) -> Any:
        """Every id ``model`` may name: list of :class:`~qswap.answers.ModelCard`."""
        return self._send(calls.models())

    def model(self, model_id: str) -> Any:
        """One model id as the server resolves it: :class:`~qswap.answers.ModelCard`."""
        return self._send(calls.model(model_id))

    def info(self) -> Any:
        """What is served (model, space, index, limits): :class:`~qswap.answers.ServerInfo`."""
        return self._send(calls.info())

    def ready(self) -> Any:
        """``/readyz``'s answer once ready (retries while the server loads, within ``max_retries``)."""
        return self._send(calls.ready())

    def encoders(self, *, limit: int | None = None, after: str | None = None) -> Any:
        """Encoders and the default: :class:`~qswap.answers.EncoderList`.

        Args:
            limit: at most this many (None: all); the answer's ``next`` is the next page's cursor.
            after: the cursor: the previous page's ``next``.
        """
        return self._send(calls.encoders(limit=limit, after=after))

    def encoder(self, ref: str) -> Any:
        """One encoder (``name`` = highest version): :class:`~qswap.answers.EncoderInfo`."""
        return self._send(calls.encoder(ref))

    def register_path(self, path: str, *, force: bool = False, wait: bool = False) -> Any:
        """Register a directory under the server's encoders root (admin).

        Args:
            path: relative to the server's ``--encoders-root``.
            force: serve even if the server's guard refuses it.
            wait: with sentinels, answer after the verdict (refusal: GuardRefusedError).

        Returns:
            :class:`~qswap.answers.RegisterResponse`.
        """
        return self._send(calls.register_path(path, force=force, wait=wait))

    def upload_encoder(self, directory: Path | str, *, force: bool = False, wait: bool = False) -> Any:
        """Pack a local encoder directory as ``.tar.gz`` and register it (admin).

        Args:
            directory: what ``qswap tune run`` wrote (holds ``manifest.json``).
            force: serve even if the server's guard refuses it.
            wait: with sentinels, answer after the verdict (refusal: GuardRefusedError).

        Returns:
            :class:`~qswap.answers.RegisterResponse`.
        """
        return self._send(calls.upload_encoder(directory, force=force, wait=wait))

    def delete_encoder(self, key: str) -> Any:
        """Delete ``name@version`` (admin); returns the deleted key."""
        return self._send(calls.delete_encoder(key))

    def aliases(self) -> Any:
        """Domain -> ``name@version``."""
        return self._send(calls.aliases())

    def set_alias(self, domain: str, encoder: str, *, force: bool = False) -> Any:
        """Point ``domain`` at ``encoder`` (admin): :class:`~qswap.answers.Alias`."""
        return self._send(calls.set_alias(domain, encoder, force=force))

    def delete_alias(self, domain: str) -> Any:
        """Remove a domain alias (admin): :class:`~qswap.answers.Alias`."""
        return self._send(calls.delete_alias(domain))

    def upsert_documents(self, documents: Sequence[Mapping[str, Any]]) -> Any:
        """Add or replace documents ``{"id", "text", "metadata"?}`` (admin): :class:`UpsertResult`."""
        return self._send(calls.upsert_documents(documents))

    def delete_documents(self, ids: Sequence[str]) -> Any:
        """Delete documents by id (admin): :class:`~qswap.answers.DeleteResult`."""
        return self._send(calls.delete_documents(ids))
