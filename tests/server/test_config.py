"""server/config.py: settings refused when unsafe, read from the environment."""

from __future__ import annotations

import pytest

from qswap.errors import InvalidInputError
from qswap.server.config import ServerSettings, is_loopback


def test_settings_refuse_unsafe(tmp_path):
    with pytest.raises(InvalidInputError):
        ServerSettings(insecure=True, host="0.0.0.0").check()
    ServerSettings(insecure=True, host="127.0.0.1").check()
    ServerSettings(insecure=True, host="::1").check()
    with pytest.raises(InvalidInputError):
        ServerSettings(admin_token="short").check()
    assert ServerSettings(admin_token="x" * 20).admin_mode == "token"
    assert ServerSettings().admin_mode == "disabled"
    with pytest.raises(InvalidInputError, match="needs the torch backend"):
        ServerSettings(backend="onnx", query_precision="bf16").check()
    ServerSettings(backend="torch", query_precision="bf16").check()
    ServerSettings(backend="cuda", query_precision="fp16").check()
    ServerSettings(backend="cuda", query_precision="bf16").check()
    with pytest.raises(InvalidInputError, match="fp16 needs the cuda backend"):
        ServerSettings(backend="torch", query_precision="fp16").check()
    assert is_loopback("localhost") and not is_loopback("10.0.0.1")


def test_settings_from_environment(monkeypatch):
    monkeypatch.setenv("QSWAP_ADMIN_TOKEN", "t" * 32)
    monkeypatch.setenv("QSWAP_MAX_K", "7")
    s = ServerSettings()
    assert s.admin_token.get_secret_value() == "t" * 32 and s.max_k == 7


def test_settings_refuse_blank_tokens():
    for tok in (" " * 20, "\t" * 20, "abcdefgh ijklmnopq"):
        with pytest.raises(InvalidInputError, match="whitespace"):
            ServerSettings(admin_token=tok).check()
    with pytest.raises(InvalidInputError):
        ServerSettings(search_token=" " * 32).check()


def test_backend_follows_the_device(monkeypatch):
    # Named: kept whatever the device. Unnamed: cuda where the model runs on a GPU, else shared.
    assert ServerSettings(device="cuda", backend="torch").backend == "torch"
    assert ServerSettings(device="cuda").backend == "cuda"
    assert ServerSettings(device="cuda:1").backend == "cuda"
    assert ServerSettings(device="cpu").backend == "shared"
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ServerSettings().backend == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ServerSettings().backend == "shared"
    monkeypatch.setenv("QSWAP_BACKEND", "onnx")
    assert ServerSettings(device="cuda").backend == "onnx"
