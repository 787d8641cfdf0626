"""bf16 helpers: precision checking, hardware detection, autocast around real encoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qswap.encoders import precision
from qswap.encoders.precision import autocast_context, check_precision, cpu_bf16_flags, has_fast_bf16
from qswap.errors import InvalidInputError

TEXTS = ["chess puzzle game", "audio and music", "physics data", "the linux search server",
         "a tool for python", "math and science library with many games and music tools"]


def test_unknown_precision_is_refused():
    assert check_precision("bf16") == "bf16"
    for bad in ("fp16", "BF16", ""):
        with pytest.raises(InvalidInputError):
            check_precision(bad)
        with pytest.raises(InvalidInputError):
            autocast_context("cpu", bad)
    with pytest.raises(InvalidInputError):
        autocast_context("meta", "bf16")


def test_fp32_context_changes_nothing(tiny_base):
    ref = tiny_base.encode_documents(TEXTS)
    with autocast_context(tiny_base.device, "fp32"):
        assert not torch.is_autocast_enabled("cpu")
        got = tiny_base.encode_documents(TEXTS)
    np.testing.assert_array_equal(got, ref)


def test_bf16_context_runs_bf16_and_stays_close(tiny_base):
    ref = tiny_base.encode_documents(TEXTS)
    a = torch.randn(4, 8)
    with autocast_context(tiny_base.device, "bf16"):
        assert torch.is_autocast_enabled("cpu")
        assert (a @ a.T).dtype == torch.bfloat16
        got = tiny_base.encode_documents(TEXTS)
    assert not torch.is_autocast_enabled("cpu")   # the context is left cleanly
    assert got.dtype == np.float32
    assert not np.array_equal(got, ref)           # it really ran in bf16 ...
    cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() > 0.99                       # ... and stays the same embedding


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile\n\nprocessor\t: 1\n")
    zen = tmp_path / "zen"
    zen.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16\n")
    plain = tmp_path / "plain"
    plain.write_text("flags\t\t: fpu sse avx2 avx512f\n")
    assert cpu_bf16_flags(amx) == ("amx_bf16",)
    assert cpu_bf16_flags(zen) == ("avx512_bf16",)
    assert cpu_bf16_flags(plain) == ()
    assert cpu_bf16_flags(tmp_path / "missing") == ()


def test_has_fast_bf16_follows_the_flags(monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ("amx_bf16",))
    assert has_fast_bf16("cpu") is True
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ())
    assert has_fast_bf16("cpu") is False
    assert has_fast_bf16("meta") is False


def test_has_fast_bf16_on_cuda_follows_the_capability(monkeypatch):
    """CUDA: no GPU -> False; otherwise compute capability >= 8.0 (asserted on any host)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert has_fast_bf16("cuda") is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for major, fast in ((7, False), (8, True), (9, True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i, m=major: (m, 0))
        assert has_fast_bf16("cuda") is fast
        assert has_fast_bf16("cuda:0") is fast


def test_encode_documents_bf16_close_to_fp32(tiny_base):
    texts = ["chess game", "audio and music library", "physics data tool"]
    fp32 = tiny_base.encode_documents(texts)
    bf16 = tiny_base.encode_documents(texts, precision="bf16")
    cos = (fp32 * bf16).sum(axis=1)
    assert cos.min() > 0.99 and abs(fp32 - bf16).max() > 0  # really ran in lower precision


def test_bf16_without_native_support_warns_once(monkeypatch, caplog):
    precision.warn_emulated.cache_clear()
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ())
    with caplog.at_level("WARNING", logger="qswap.encoders"):
        with autocast_context("cpu", "bf16"):
            pass
        with autocast_context("cpu", "bf16"):
            pass
    assert len(caplog.records) == 1
    assert "emulated" in caplog.records[0].message
    precision.warn_emulated.cache_clear()
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: ("avx512_bf16",))
    caplog.clear()
    with caplog.at_level("WARNING", logger="qswap.encoders"):
        with autocast_context("cpu", "bf16"):
            pass
    assert not caplog.records
