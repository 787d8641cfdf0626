"""Registration: multipart upload of a .tar.gz, bearer token, server errors as named errors."""

from __future__ import annotations

import io
import json
import tarfile

import httpx
import pytest

from qswap.errors import ConflictError, GuardRefusedError, InvalidInputError, NotFoundError, QswapError
from qswap.tuning.register import register_encoder


@pytest.fixture
def encoder_dir(tmp_path):
    d = tmp_path / "my-enc"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"name": "my-enc"}))
    (d / "adapter.safetensors").write_bytes(b"\x00\x01")
    return d


def _parse_multipart(request: httpx.Request) -> dict[str, bytes]:
    ctype = request.headers["content-type"]
    boundary = ctype.split("boundary=")[1].encode()
    parts = {}
    for chunk in request.content.split(b"--" + boundary):
        if b"Content-Disposition" not in chunk:
            continue
        head, _, body = chunk.partition(b"\r\n\r\n")
        name = head.split(b'name="')[1].split(b'"')[0].decode()
        parts[name] = body.rstrip(b"\r\n")
    return parts


def test_upload_shape(encoder_dir):
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["url"], seen["auth"] = str(request.url), request.headers.get("authorization")
        seen["parts"] = _parse_multipart(request)
        return httpx.Response(201, json={"key": "my-enc@1"})

    reply = register_encoder(encoder_dir, "http://srv:8000/", "sekrit", transport=httpx.MockTransport(handler))
    assert reply == {"key": "my-enc@1"}
    assert seen["url"] == "http://srv:8000/v1/encoders" and seen["auth"] == "Bearer sekrit"
    assert seen["parts"]["force"] == b"false"
    with tarfile.open(fileobj=io.BytesIO(seen["parts"]["archive"]), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == ["my-enc/adapter.safetensors", "my-enc/manifest.json"]


def test_force_is_sent(encoder_dir):
    def handler(request):
        return httpx.Response(200, json={"force": _parse_multipart(request)["force"].decode()})
    assert register_encoder(encoder_dir, "http://x", force=True,
                            transport=httpx.MockTransport(handler)) == {"force": "true"}


@pytest.mark.parametrize("status,code,exc", [
    (409, "guard_refused", GuardRefusedError), (409, "conflict", ConflictError), (404, "not_found", NotFoundError),
    (401, "unauthorized", InvalidInputError), (400, "invalid_input", InvalidInputError), (500, "error", QswapError),
])
def test_server_errors_become_named_errors(encoder_dir, status, code, exc):
    def handler(request):
        return httpx.Response(status, json={"error": code, "detail": "nope", "hint": "do this"})
    with pytest.raises(exc) as e:
        register_encoder(encoder_dir, "http://x", transport=httpx.MockTransport(handler))
    assert "nope" in str(e.value) and e.value.hint == "do this"
    assert type(e.value) is exc


def test_not_an_encoder_directory(tmp_path):
    with pytest.raises(NotFoundError):
        register_encoder(tmp_path, "http://x")


def test_unreachable_server(encoder_dir):
    def handler(request):
        raise httpx.ConnectError("refused")
    with pytest.raises(QswapError, match="cannot reach"):
        register_encoder(encoder_dir, "http://x", transport=httpx.MockTransport(handler))
