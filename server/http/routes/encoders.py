"""Encoder and alias routes: register (by path or upload), list, show, delete, alias.

Mutations are admin routes; listing and showing follow the search access rule. Registration
and deletion do disk and model work, so they run in threads, never on the event loop.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from qswap.guard import GuardStatus
from qswap.server.http.auth import require_admin, require_search
from qswap.encoders.runtime.backend import runtime_of
from qswap.errors import ForbiddenError, UnsupportedMediaTypeError
from qswap.names import KEY_PATTERN, NAME_PATTERN, REF_PATTERN
from qswap.server.http.models import AliasList, AliasSet, Deleted, RegisterByPath
from qswap.answers import Alias, EncoderInfo, EncoderList, RegisterResponse
from qswap.server.registry.intake import open_under_root
from qswap.server.registry.records import EncoderRecord
from qswap.server.http.responses import ERRORS, ready_state
from qswap.server.state import ServerState

router = APIRouter(tags=["encoders"])

MAX_PAGE = 1000   # encoders per page of GET /v1/encoders with a limit
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}

_REGISTER_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": RegisterByPath.model_json_schema()},
            "multipart/form-data": {"encoding": {"archive": {"contentType": "application/gzip"}}, "schema": {
                "type": "object", "required": ["archive"], "additionalProperties": False,
                "properties": {
                    "archive": {"type": "string", "format": "binary", "contentMediaType": "application/gzip",
                                "description": "gzip-compressed tar of one encoder directory (anything "
                                               "else is refused with 400)"},
                    "force": {"type": "boolean", "default": False,
                              "description": "register and serve even if the guard refuses"},
                    "wait": {"type": "boolean", "default": False,
                             "description": "answer once the server's sentinel evaluation is done"}}}},
        },
    }
}


def _info(state: ServerState, key: str) -> EncoderInfo:
    info = state.registry.info(key, state.base_version)
    if state.backend is None:
        return info
    return info.model_copy(update=runtime_of(state.backend, key))


def _form_bool(value: object, field: str) -> bool:
    if value is None:
        return False
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise RequestValidationError([{"loc": ("body", field), "msg": "must be true or false", "type": "bool_parsing"}])


@router.post("/v1/encoders", response_model=RegisterResponse, status_code=201,
             responses={**ERRORS, 200: {"model": RegisterResponse,
                                              "description": "the identical encoder was already registered"},
                        202: {"model": RegisterResponse,
                              "description": "stored; the server's sentinel evaluation is running"}},
             dependencies=[Depends(require_admin)], openapi_extra=_REGISTER_BODY,
             summary="Register an encoder (directory under the encoders root, or uploaded .tar.gz)")
async def register_encoder(request: Request, response: Response,
                           state: ServerState = Depends(ready_state)) -> RegisterResponse:
    """JSON ``{"path", "force"}`` registers a directory under the configured encoders root;
    multipart (``archive`` file + ``force`` field) registers an uploaded ``.tar.gz``.

    The encoder is copied into the server's store, checksums and embedding space are verified
    (409 ``space_mismatch`` names the differing field), and the adapter is attached. With
    sentinels (``--sentinels``) the server then evaluates it on its own index in the background:
    202 with ``guard_status: "evaluating"`` and a ``Location`` to poll; it serves (by name or
    alias) once ``passed``. ``wait=true`` answers after the verdict instead: 201, or 409
    ``guard_refused`` with the per-sentinel table in ``guard`` (and the encoder is not kept).
    Without sentinels: 201 when created, 200 when the identical encoder was already registered.
    """
    ctype = request.headers.get("content-type", "").lower()
    if ctype.startswith("multipart/form-data"):
        form = await request.form(max_files=1, max_fields=5)
        try:
            archive = form.get("archive")
            if not isinstance(archive, UploadFile):
                raise RequestValidationError([{"loc": ("body", "archive"), "type": "missing",
                                               "msg": "a file field 'archive' (.tar.gz) is required"}])
            force = _form_bool(form.get("force"), "force")
            wait = _form_bool(form.get("wait"), "wait")
            rec, created = await asyncio.to_thread(state.register_archive, archive.file, force, archive.filename,
                                                   wait)
        finally:
            await form.close()
    elif ctype.startswith("application/json") or not ctype:
        try:
            payload = RegisterByPath.model_validate_json(await request.body())
        except ValidationError as e:
            raise RequestValidationError([{**err, "loc": ("body", *err.get("loc", ()))} for err in e.errors()]) from None
        root = state.settings.encoders_root
        if root is None:
            raise ForbiddenError("register-by-path is disabled: the server has no encoders root",
                                 "restart with --encoders-root DIR, or upload a .tar.gz archive")

        def register_path() -> tuple[EncoderRecord, bool]:
            with open_under_root(root, payload.path) as src:   # copied from what was checked
                return state.registry.register(src, force=payload.force, source=f"path:{payload.path}",
                                               wait=payload.wait)

        rec, created = await asyncio.to_thread(register_path)
    else:
        raise UnsupportedMediaTypeError(f"cannot read a {ctype.split(';')[0]} body here",
                                        "send application/json (path) or multipart/form-data (archive)")
    # 202: stored, but the server's own evaluation is still running (it is not served yet).
    response.status_code = 202 if rec.guard_status == GuardStatus.EVALUATING else 201 if created else 200
    if response.status_code == 202:
        response.headers["Location"] = f"/v1/encoders/{rec.key}"
    return RegisterResponse(encoder=_info(state, rec.key), created=created)


@router.get("/v1/encoders", response_model=EncoderList, responses=ERRORS,
            dependencies=[Depends(require_search)], summary="List encoders")
async def list_encoders(
        state: ServerState = Depends(ready_state),
        limit: int | None = Query(None, ge=1, le=MAX_PAGE,
                                  description=f"at most this many encoders (1..{MAX_PAGE}); the answer's "
                                              "`next` is the cursor of the next page (default: all)"),
        after: str | None = Query(None, pattern=REF_PATTERN,
                                  description="the cursor: list the keys after this one (the previous "
                                              "answer's `next`)")) -> EncoderList:
    """The base first, then every registered version by key. With ``limit``, one page at a time:
    pass the answer's ``next`` as ``after`` until it is null. A page is read in one step under
    the registry's lock; keys registered meanwhile appear on a later page if they sort after the
    cursor."""
    reg = state.registry
    keys, cursor = reg.page(after, limit)
    return EncoderList(default=reg.default_key(), encoders=[_info(state, k) for k in keys], next=cursor)


@router.get("/v1/encoders/{ref}", response_model=EncoderInfo, responses=ERRORS,
            dependencies=[Depends(require_search)], summary="Show an encoder ('name' = highest version)")
async def get_encoder(ref: str = Path(pattern=REF_PATTERN), state: ServerState = Depends(ready_state)) -> EncoderInfo:
    return _info(state, state.registry.resolve(encoder=ref))


# One resource, one path template: GET reads any reference, DELETE needs the exact version.
@router.delete("/v1/encoders/{ref}", response_model=Deleted, responses=ERRORS,
               dependencies=[Depends(require_admin)], summary="Delete an encoder version")
async def delete_encoder(ref: str = Path(pattern=KEY_PATTERN, description="the exact name@version"),
                         state: ServerState = Depends(ready_state)) -> Deleted:
    """Refused (409) while an alias or the default points at it; waits for in-flight requests."""
    await asyncio.to_thread(state.registry.delete, ref, state.settings.delete_timeout_s)
    return Deleted(deleted=ref)


@router.get("/v1/aliases", response_model=AliasList, responses=ERRORS,
            dependencies=[Depends(require_search)], tags=["aliases"], summary="List domain aliases")
async def list_aliases(state: ServerState = Depends(ready_state)) -> AliasList:
    return AliasList(aliases=state.registry.aliases())


@router.put("/v1/aliases/{domain}", response_model=Alias, responses=ERRORS,
            dependencies=[Depends(require_admin)], tags=["aliases"], summary="Point a domain at an encoder")
async def set_alias(body: AliasSet, domain: str = Path(pattern=NAME_PATTERN),
                    state: ServerState = Depends(ready_state)) -> Alias:
    """Atomic switch: requests admitted before it finish on the previous version. The alias
    ``default`` replaces the configured default encoder. With sentinels, only an encoder whose
    evaluation passed can be aliased (409 ``guard_pending`` / ``guard_refused`` otherwise;
    ``force`` accepts a refused one)."""
    key, previous = await asyncio.to_thread(state.registry.set_alias, domain, body.encoder, body.force)
    return Alias(domain=domain, encoder=key, previous=previous, forced=state.registry.forced(key))


@router.delete("/v1/aliases/{domain}", response_model=Alias, responses=ERRORS,
               dependencies=[Depends(require_admin)], tags=["aliases"], summary="Remove a domain alias")
async def delete_alias(domain: str = Path(pattern=NAME_PATTERN), state: ServerState = Depends(ready_state)) -> Alias:
    key = await asyncio.to_thread(state.registry.delete_alias, domain)
    return Alias(domain=domain, encoder=key, forced=state.registry.forced(key))
