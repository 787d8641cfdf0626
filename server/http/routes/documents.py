"""Index changes (admin): upsert documents embedded by the base document tower, delete by id.

An upsert passes the cost gate (:mod:`qswap.server.serving.gate`) and is a job
(:mod:`qswap.server.serving.jobs`): its embedding runs on the batch worker in token-bounded
slices between search batches, then one index commit writes it. A small upsert
answers when written (200); a large one (more than ``sync_upsert_documents``), or one still
running at its deadline, answers 202 with the job to poll.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Path, Request, Response
from fastapi.responses import JSONResponse

from qswap.server.http.auth import require_admin
from qswap.errors import LimitExceededError
from qswap.server.http.models import DeleteDocuments, UpsertDocuments
from qswap.answers import DeleteResult, DocumentJobInfo, UpsertResult
from qswap.server.http.responses import ERRORS, ready_state, request_timeout, state_of
from qswap.server.serving.gate import Admission, admission
from qswap.server.state import ServerState

router = APIRouter(tags=["documents"])


@router.post("/v1/documents", response_model=UpsertResult, responses={
                 **ERRORS, 202: {"model": DocumentJobInfo, "description": "large upsert (or past its deadline): "
                                       "written in the background; poll the Location"}},
             dependencies=[Depends(require_admin)], summary="Add or replace documents")
async def upsert_documents(body: UpsertDocuments, request: Request,
                           adm: Admission = Depends(admission)) -> Response:
    """Embed and add documents; an id given twice in one request is written once, with its
    last occurrence (as if the request were applied in order).

    Up to ``sync_upsert_documents`` documents: 200 once they are written. More, or when the
    write is still running at the request's deadline: 202 with the job (``Location:
    /v1/documents/jobs/ID``); it is acknowledged (durable) when the job's status is ``done``.
    """
    from qswap.index import Document

    state = adm.state
    s = state.settings
    if len(body.documents) > s.max_documents:
        raise LimitExceededError(f"{len(body.documents)} documents in one request; the limit is {s.max_documents}",
                                 "split the documents over several requests")
    last = {d.id: d for d in body.documents}
    docs = [Document(id=d.id, text=d.text, metadata=d.metadata) for d in last.values()]
    job = state.jobs.submit(docs)
    assert job.task is not None
    if len(docs) <= s.sync_upsert_documents:
        done, _ = await asyncio.wait({job.task}, timeout=max(adm.remaining(), 0.0))
        if done:
            if job.exception is not None:
                raise job.exception
            return JSONResponse(UpsertResult(**(job.result or {})).model_dump())
    return JSONResponse(DocumentJobInfo.model_validate(job.info()).model_dump(), status_code=202,
                        headers={"Location": f"/v1/documents/jobs/{job.id}"})


@router.get("/v1/documents/jobs/{job_id}", response_model=DocumentJobInfo, responses=ERRORS,
            dependencies=[Depends(require_admin)], summary="Progress and result of an upsert job")
async def document_job(request: Request, job_id: str = Path(pattern=r"^[0-9a-f]{32}$")) -> DocumentJobInfo:
    """``queued``/``running`` (with ``embedded`` so far), then ``done`` (``result``) or ``failed``
    (``error``, with the status the error would have had; nothing of a failed job is written)."""
    return DocumentJobInfo.model_validate(state_of(request).jobs.get(job_id).info())


@router.delete("/v1/documents", response_model=DeleteResult, responses=ERRORS,
               dependencies=[Depends(require_admin)], summary="Delete documents by id")
async def delete_documents(body: DeleteDocuments, request: Request,
                           timeout_s: float = Depends(request_timeout),
                           state: ServerState = Depends(ready_state)) -> DeleteResult:
    if len(body.ids) > state.settings.max_documents:
        raise LimitExceededError(f"{len(body.ids)} ids in one request; the limit is {state.settings.max_documents}",
                                 "split the ids over several requests")
    n, count = await state.batcher.call(state.delete_documents, body.ids, timeout_s=timeout_s)
    return DeleteResult(deleted=n, count=count)
