"""Document upserts as jobs: embedding in token-bounded slices between search batches.

An upsert embeds its documents with the base document tower on the batch worker, one slice
(at most ``slice_tokens``) per turn: each slice queues behind
the searches that arrived meanwhile, so a large upsert slows search by at most one slice per
batch instead of blocking it. When every slice is embedded, the documents are written in one
commit of the index (all of them or none): the job is ``done`` only once that commit is
durable, and only then is the write acknowledged.

Jobs live in memory (the last :data:`KEEP_JOBS`); a job that was running when the server
stopped was not acknowledged and is unknown after a restart (upserts are idempotent: resend).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qswap.errors import NotFoundError, OverloadedError, QswapError
from qswap.server.http.compat_models import DOCUMENTS_MODEL
from qswap.server.serving.admission import Ticket, token_slices
from qswap.server.http.errors import status_for, storage_error

log = logging.getLogger("qswap.server")

KEEP_JOBS = 256
_ADMISSION_RETRY_S = 0.05   # a slice refused by a full admission queue waits this long and retries


@dataclass
class DocumentJob:
    """One upsert: its progress, and its result or error once finished."""

    id: str
    documents: int
    status: str = "queued"            # queued -> running -> done | failed
    embedded: int = 0
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    result: dict[str, int] | None = None
    error: dict[str, Any] | None = None
    exception: BaseException | None = field(default=None, repr=False)
    task: asyncio.Task | None = field(default=None, repr=False)

    def info(self) -> dict[str, Any]:
        """The job as the API shows it (``DocumentJobInfo``)."""
        return {"id": self.id, "status": self.status, "documents": self.documents, "embedded": self.embedded,
                "created_at": self.created_at, "finished_at": self.finished_at, "result": self.result,
                "error": self.error}


class DocumentJobs:
    """The server's upsert jobs (event loop side)."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self._jobs: dict[str, DocumentJob] = {}

    def submit(self, docs: list[Any]) -> DocumentJob:
        """Start embedding and writing ``docs`` (``qswap.index.Document``) in the background.

        Args:
            docs: the documents, ids unique.

        Returns:
            The job (its ``task`` finishes when the write is committed or failed).
        """
        job = DocumentJob(uuid.uuid4().hex, len(docs))
        self._jobs[job.id] = job
        while len(self._jobs) > KEEP_JOBS:
            oldest = next((j for j in self._jobs.values() if j.finished_at is not None), None)
            if oldest is None:
                break
            del self._jobs[oldest.id]
        job.task = asyncio.get_running_loop().create_task(self._run(job, docs))
        return job

    def get(self, job_id: str) -> DocumentJob:
        """The job ``job_id`` (NotFoundError when unknown or forgotten)."""
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"no document job {job_id}",
                                f"jobs are kept in memory (the last {KEEP_JOBS}); a restart forgets them")
        return job

    async def _retry(self, submit: Any) -> Any:
        while True:
            try:
                return await submit()
            except OverloadedError:   # searches fill the queue: a background job waits its turn
                await asyncio.sleep(_ADMISSION_RETRY_S)

    async def _embed(self, texts: list[str], tokens: list[int]) -> np.ndarray:
        """One slice of the job's documents through the batch worker's document path (a job has
        no client to lose and no deadline: it runs until done or the server stops)."""
        out = await self._retry(lambda: self.state.batcher.embed(texts, DOCUMENTS_MODEL, ticket=Ticket(),
                                                                 tokens=tokens, documents=True))
        return out.vectors

    async def _run(self, job: DocumentJob, docs: list[Any]) -> None:
        state = self.state
        try:
            counts = await state.batcher.low_priority(state.token_counts, [d.text for d in docs], True)
            job.status = "running"
            parts = []
            for lo, hi in token_slices(counts, state.settings.slice_tokens):
                parts.append(await self._embed([d.text for d in docs[lo:hi]], counts[lo:hi]))
                job.embedded = hi
            emb = np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)
            n, count = await self._retry(lambda: state.batcher.call(state.upsert_embedded, docs, emb))
        except Exception as e:   # the job's answer: the error as the API would have said it
            job.exception = e
            err = storage_error(e) or e
            if isinstance(err, QswapError):
                status, code = status_for(err)
                log.warning("document job failed", extra={"job": job.id, "status": status, "error": code,
                                                          "detail": err.message})
                job.error = {"status": status, "error": code, "detail": err.message, "hint": err.hint}
            else:
                log.exception("document job failed", extra={"job": job.id})
                job.error = {"status": 500, "error": "internal_error", "detail": "internal server error",
                             "hint": "the server logs have the details (search for the job id)"}
            job.status = "failed"
        else:
            job.result = {"upserted": n, "count": count}
            job.status = "done"
        finally:
            job.finished_at = time.time()

