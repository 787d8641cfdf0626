"""One document index for every Ray Serve replica: one writer actor, generation-following readers.

An index folder has one writer at a time (its writer lock) and any number of read-only
readers. Under Ray:

- :class:`IndexWriter` is a detached, named Ray actor that holds the index open for writing
  (restarted by Ray if it dies; the index's own commit protocol makes every change atomic, so a
  restart loses nothing that was acknowledged). It never embeds: replicas embed upserted
  documents with their own base document tower and send the vectors.
- every replica searches a :class:`SharedIndex`: the index opened read-only, reopened when the
  manifest's generation moves (polled every ``poll_s``; each commit is a new generation). A
  replica that forwarded a change reopens at once at the generation the writer returned, so a
  client reads its own write from the replica it wrote through, and from every other replica
  within ``poll_s``.

The index folder must be reachable by every replica and by the writer (one machine, or a
shared volume). A ``milvus://`` collection needs none of this: Milvus is one index for every
replica and its own writer, so each replica opens it as a single process does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from qswap.errors import InvalidInputError, NotReadyError, QswapError
from qswap.index import Document, DocumentIndex

log = logging.getLogger("qswap.server")

NAMESPACE = "qswap"
POLL_S = 0.2
WRITER_RETRIES = 3


def writer_name(index_path: Path) -> str:
    """The Ray actor name of the writer of ``index_path`` (one writer per index folder)."""
    digest = hashlib.sha256(str(Path(index_path).resolve()).encode()).hexdigest()[:16]
    return f"qswap-index-writer-{digest}"


def _manifest_generation(path: Path) -> int | None:
    try:
        return int(json.loads((path / "manifest.json").read_text())["generation"])
    except Exception:  # noqa: BLE001 - mid-rename or unreadable: "unknown", ask again next poll
        return None


class IndexWriterImpl:
    """The body of the writer actor (a plain class, so it can also be tested in-process)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.index = DocumentIndex.open(self.path)   # takes the writer lock; recovers a torn commit

    def upsert(self, docs: list[Document], embeddings: np.ndarray) -> tuple[int, int, int]:
        n = self.index.upsert(docs, embeddings)
        return n, self.index.count, self.index.generation

    def delete(self, ids: list[str]) -> tuple[int, int, int]:
        n = self.index.delete(ids)
        return n, self.index.count, self.index.generation

    def generation(self) -> int:
        return self.index.generation

    def close(self) -> None:
        self.index.close()


def get_or_create_writer(index_path: Path) -> Any:
    """The writer actor of ``index_path``: the existing one, or a new detached one."""
    import ray
    # A call the dying writer did not answer, or one sent while it restarts, is sent again to
    # the restarted writer (max_task_retries): upserting the same documents again gives the
    # same index, and deleting ids already deleted is a no-op (its count then says 0 for them).
    actor = ray.remote(IndexWriterImpl).options(
        name=writer_name(index_path), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1, max_task_retries=WRITER_RETRIES, num_cpus=0, max_concurrency=1)
    return actor.remote(str(Path(index_path).resolve()))


def qswap_error_of(e: BaseException) -> BaseException:
    """What a failed Ray call means to a client: a qswap error raised in the actor or replica
    as itself (the HTTP layer maps it to the same 4xx as in one process), a lost or restarting
    actor as :class:`NotReadyError` (503: retry), anything else unchanged.

    Args:
        e: the exception the Ray call raised.

    Returns:
        the exception to raise instead.
    """
    import ray
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, QswapError):
        return e.cause
    if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        return NotReadyError("the Ray actor serving this request went away (it is being restarted)",
                             "retry the request")
    return e


def _call(method: Any, *args: Any) -> Any:
    """Call an actor method and wait; failures as :func:`qswap_error_of` says."""
    import ray
    try:
        return ray.get(method.remote(*args))
    except Exception as e:  # noqa: BLE001 - mapped, or raised unchanged
        raise qswap_error_of(e) from None


class SharedIndex:
    """What a replica searches: a read-only view that follows the index's generations.

    Changes go to the writer actor; everything else is the current read-only
    :class:`DocumentIndex` (attributes not defined here are looked up on it)."""

    def __init__(self, path: Path, *, writable: bool = True, poll_s: float = POLL_S) -> None:
        self.path = Path(path)
        self.writable = writable
        self._idx = DocumentIndex.open(self.path, read_only=True, verify=False)
        self._retired: DocumentIndex | None = None
        self._swap_lock = threading.Lock()
        self._stop = threading.Event()
        self._writer: Any = None
        self.reopens = 0
        self._poller = threading.Thread(target=self._poll, args=(poll_s,), name="qswap-index-poll", daemon=True)
        self._poller.start()

    # -- reading ------------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        return getattr(self._idx, name)

    @property
    def count(self) -> int:
        return self._idx.count

    @property
    def generation(self) -> int:
        return self._idx.generation

    @property
    def space(self) -> Any:
        return self._idx.space

    def search(self, queries: np.ndarray, k: int, filter: dict[str, Any] | None = None,
               with_text: bool = True) -> list[list[Any]]:
        return self._idx.search(queries, k, filter, with_text)

    def refresh(self, at_least: int | None = None) -> bool:
        """Reopen if the index on disk is at another generation (or this view is below ``at_least``)."""
        with self._swap_lock:
            gen = _manifest_generation(self.path)
            cur = self._idx.generation
            if (gen is None or gen == cur) and (at_least is None or cur >= at_least):
                return False
            new = DocumentIndex.open(self.path, read_only=True, verify=False)
            old, self._idx = self._idx, new
            # Searches that picked up ``old`` may still run: close it one swap later.
            if self._retired is not None:
                self._retired.close()
            self._retired = old
            self.reopens += 1
        log.info("index reopened", extra={"generation": new.generation, "documents": new.count})
        return True

    def _poll(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            try:
                self.refresh()
            except Exception:   # a writer mid-commit, say: the next poll tries again
                log.exception("index refresh failed")

    # -- changes go to the writer -------------------------------------------------------------

    def _check_writable(self) -> None:
        if not self.writable:
            raise InvalidInputError(f"index {self.path} was opened read-only", "serve it without --read-only-index")

    def _writer_actor(self) -> Any:
        if self._writer is None:
            import ray
            self._writer = ray.get_actor(writer_name(self.path), namespace=NAMESPACE)
        return self._writer

    def upsert(self, docs: list[Document], embeddings: np.ndarray) -> int:
        self._check_writable()
        n, _count, gen = _call(self._writer_actor().upsert, list(docs), np.asarray(embeddings))
        self.refresh(at_least=gen)
        return n

    def delete(self, ids: list[str]) -> int:
        self._check_writable()
        n, _count, gen = _call(self._writer_actor().delete, list(ids))
        self.refresh(at_least=gen)
        return n

    def close(self) -> None:
        self._stop.set()
        with self._swap_lock:
            for idx in (self._retired, self._idx):
                if idx is not None:
                    idx.close()
