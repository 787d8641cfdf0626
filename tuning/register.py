"""Upload an encoder directory to a running qswap server (``qswap tune register``).

The directory goes up as a ``.tar.gz`` through :class:`qswap.client.Client` (multipart
``POST /v1/encoders``), so refusals arrive as the named errors of the one error table
(``guard_refused`` -> GuardRefusedError with the per-sentinel table, ``space_mismatch`` ->
SpaceMismatchError, ...). ``wait`` (the default here) makes a server with sentinels answer
once its own evaluation is done: 201, or 409 ``guard_refused``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qswap.client import Client


def register_encoder(encoder_dir: Path, url: str, token: str | None = None, force: bool = False,
                     timeout: float = 300.0, transport: Any = None, wait: bool = True) -> dict[str, Any]:
    """Register ``encoder_dir`` on the server at ``url``.

    Args:
        encoder_dir: what ``qswap tune run`` wrote.
        url: the server's base URL.
        token: the admin bearer token.
        force: serve even if the server's guard refuses it.
        timeout: seconds the upload (and, with ``wait``, the evaluation) may take.
        transport: an httpx transport (proxies, tests).
        wait: answer after the server's sentinel evaluation.

    Returns:
        The server's JSON reply (``{"encoder": {...}, "created": bool}``).
    """
    with Client(url, token, timeout=timeout, transport=transport) as client:
        return client.upload_encoder(encoder_dir, force=force, wait=wait).model_dump(mode="json")
