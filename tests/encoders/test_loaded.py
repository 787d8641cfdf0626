"""load_query_encoder: one saved encoder over its base, ready to encode queries."""

from __future__ import annotations

import numpy as np
import pytest

from qswap.encoders import BASE_KEY, EncoderPool, load_encoder, load_query_encoder
from qswap.errors import SpaceMismatchError

from .adapters import make_overrides

TEXTS = ["chess puzzle game", "audio player", "a text editor for the terminal"]


def test_encodes_as_a_pool_does_and_differs_from_the_base(tiny_base, tmp_path):
    path = make_overrides(tiny_base, tmp_path / "b", "b", "bias", seed=1)
    loaded = load_query_encoder(path, tiny_base)
    assert loaded.key == "b@1" and loaded.base is tiny_base
    pool = EncoderPool(tiny_base)
    pool.add(load_encoder(path, tiny_base.space))
    np.testing.assert_allclose(loaded.encode(TEXTS), pool.encode(TEXTS, ["b@1"] * 3), atol=1e-6)
    np.testing.assert_allclose(loaded.encode_base(TEXTS), pool.encode(TEXTS, [BASE_KEY] * 3), atol=1e-6)
    assert np.abs(loaded.encode(TEXTS) - loaded.encode_base(TEXTS)).max() > 1e-3


def test_loads_the_base_it_is_given_by_name_and_refuses_another_space(tiny_base, tiny_model_dir,
                                                                       other_tiny_model_dir, tmp_path):
    path = make_overrides(tiny_base, tmp_path / "b", "b", "bias", seed=1)
    by_dir = load_query_encoder(path, tiny_model_dir, device="cpu")
    assert by_dir.base.space == tiny_base.space
    np.testing.assert_allclose(by_dir.encode(TEXTS), load_query_encoder(path, tiny_base).encode(TEXTS), atol=1e-5)
    with pytest.raises(SpaceMismatchError):
        load_query_encoder(path, other_tiny_model_dir, device="cpu")
