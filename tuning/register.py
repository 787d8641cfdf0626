"""Upload an encoder directory to a running qswap server.

``POST {url}/v1/encoders`` with a multipart body: field ``archive`` holds a ``.tar.gz`` of
the encoder directory (its files under one top-level folder named after the directory)
and form fields ``force`` and ``wait`` are ``"true"``/``"false"``; the bearer token authenticates.
``wait`` (the default here) makes a server with sentinels answer once its own evaluation is
done: 201, or 409 ``guard_refused`` with the per-sentinel table.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

from qswap.errors import (ConflictError, GuardRefusedError, IntegrityError, InvalidInputError,
                          NotFoundError, QswapError, SpaceMismatchError)


def pack_encoder(encoder_dir: Path) -> bytes:
    """A gzip tarball of the encoder directory's files under ``<dir name>/``."""
    encoder_dir = Path(encoder_dir)
    if not (encoder_dir / "manifest.json").exists():
        raise NotFoundError(f"{encoder_dir} is not an encoder directory (no manifest.json)",
                            "point to the directory `qswap tune run` wrote")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in sorted(encoder_dir.iterdir()):
            if f.is_file():
                tar.add(f, arcname=f"{encoder_dir.name}/{f.name}")
    return buf.getvalue()


def _server_error(resp: Any) -> tuple[str, str, str]:
    """(code, message, hint) of an error reply ``{"error": code, "detail": msg, "hint": ...}``."""
    try:
        body = resp.json()
    except ValueError:
        return "", resp.text.strip()[:300] or resp.reason_phrase, ""
    if not isinstance(body, dict):
        return "", str(body)[:300], ""
    code = body.get("error")
    return (str(code) if isinstance(code, str) else "", str(body.get("detail") or body.get("message") or body),
            str(body.get("hint") or ""))


def register_encoder(encoder_dir: Path, url: str, token: str | None = None, force: bool = False,
                     timeout: float = 300.0, transport: Any = None, wait: bool = True) -> dict[str, Any]:
    """Register ``encoder_dir`` on the server at ``url``; returns the server's JSON reply.

    Refusals become the named error the server raised (by its error code): guard_refused ->
    GuardRefusedError, space_mismatch -> SpaceMismatchError, other 409 -> ConflictError,
    404 -> NotFoundError, integrity_error -> IntegrityError, other 4xx -> InvalidInputError.
    ``transport`` is for tests (an ``httpx.MockTransport``).
    """
    import httpx

    data = pack_encoder(encoder_dir)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    endpoint = url.rstrip("/") + "/v1/encoders"
    try:
        with httpx.Client(timeout=timeout, transport=transport) as client:
            resp = client.post(endpoint, headers=headers,
                               files={"archive": (f"{Path(encoder_dir).name}.tar.gz", data, "application/gzip")},
                               data={"force": "true" if force else "false", "wait": "true" if wait else "false"})
    except httpx.HTTPError as e:
        raise QswapError(f"cannot reach {endpoint}: {e}", "is the server running and the URL right?") from None
    if resp.status_code < 300:
        try:
            return resp.json()
        except ValueError:
            return {"status": resp.status_code}
    code, msg, hint = _server_error(resp)
    text = f"server refused the encoder ({resp.status_code} {code}): {msg}".replace(" )", ")")
    if code == "guard_refused":
        body = resp.json() if "json" in resp.headers.get("content-type", "") else {}
        raise GuardRefusedError(text, hint or "inspect the tuning report, or register with --force",
                                guard=body.get("guard") if isinstance(body, dict) else None)
    if code == "space_mismatch":
        raise SpaceMismatchError(text, field="space", expected=None, got=None,
                                 hint=hint or "tune on the base model of the server's index")
    if resp.status_code == 409:
        raise ConflictError(text, hint or "choose another version, or remove the registered one")
    if resp.status_code == 404:
        raise NotFoundError(text, hint or "check the server URL")
    if code == "integrity_error":
        raise IntegrityError(text, hint or "re-run the tuning to rewrite the encoder directory")
    if resp.status_code in (401, 403):
        raise InvalidInputError(text, hint or "pass a valid --token")
    if resp.status_code < 500:
        raise InvalidInputError(text, hint)
    raise QswapError(text, hint or "see the server log")
