"""Index changes (admin): upsert documents embedded by the base document tower, delete by id.

The embedding runs on the batch worker thread, between search batches, so model work stays
on one thread and the event loop never runs it.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from qswap.server.auth import require_admin
from qswap.server.errors import LimitExceededError
from qswap.server.models import DeleteDocuments, DeleteResult, UpsertDocuments, UpsertResult
from qswap.server.responses import ADMIN_ERRORS, request_timeout, state_of

router = APIRouter(tags=["documents"])


@router.post("/v1/documents", response_model=UpsertResult, responses=ADMIN_ERRORS,
             dependencies=[Depends(require_admin)], summary="Add or replace documents")
async def upsert_documents(body: UpsertDocuments, request: Request,
                           timeout_s: float = Depends(request_timeout)) -> UpsertResult:
    """Embed and add documents; an id given twice in one request is written once, with its
    last occurrence (as if the request were applied in order)."""
    from qswap.index import Document

    state = state_of(request)
    state.require_ready()
    s = state.settings
    if len(body.documents) > s.max_documents:
        raise LimitExceededError(f"{len(body.documents)} documents in one request; the limit is {s.max_documents}",
                                 "split the documents over several requests")
    last = {d.id: d for d in body.documents}
    docs = [Document(id=d.id, text=d.text, metadata=d.metadata) for d in last.values()]
    n, count = await state.batcher.call(state.embed_and_upsert, docs, timeout_s=timeout_s)
    return UpsertResult(upserted=n, count=count)


@router.delete("/v1/documents", response_model=DeleteResult, responses=ADMIN_ERRORS,
               dependencies=[Depends(require_admin)], summary="Delete documents by id")
async def delete_documents(body: DeleteDocuments, request: Request,
                           timeout_s: float = Depends(request_timeout)) -> DeleteResult:
    state = state_of(request)
    state.require_ready()
    if len(body.ids) > state.settings.max_documents:
        raise LimitExceededError(f"{len(body.ids)} ids in one request; the limit is {state.settings.max_documents}",
                                 "split the ids over several requests")
    n, count = await state.batcher.call(state.delete_documents, body.ids, timeout_s=timeout_s)
    return DeleteResult(deleted=n, count=count)
