"""A saved query encoder loaded as the server loads it (verified, over its base, in a pool),
ready to encode queries: what evaluations and benchmarks of one encoder start from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qswap import DEFAULT_MODEL
from qswap.encoders.artifact import load_encoder, read_encoder_manifest
from qswap.encoders.base import BaseEncoder, load_base
from qswap.encoders.pool import BASE_KEY, EncoderPool


@dataclass
class LoadedEncoder:
    """One encoder in a pool over its base."""

    base: BaseEncoder
    pool: EncoderPool
    key: str

    def encode(self, texts: list[str]) -> np.ndarray:
        """Query embeddings of ``texts`` with the encoder.

        Args:
            texts: the queries (the base's query prefix is added).

        Returns:
            ``(len(texts), dim)`` float32, as the server computes them on torch.
        """
        return self.pool.encode(texts, [self.key] * len(texts))

    def encode_base(self, texts: list[str]) -> np.ndarray:
        """Query embeddings of ``texts`` with the base alone (the reference an encoder is compared to).

        Args:
            texts: the queries.

        Returns:
            ``(len(texts), dim)`` float32.
        """
        return self.pool.encode(texts, [BASE_KEY] * len(texts))


def load_query_encoder(path: str | Path, base: BaseEncoder | str | Path | None = None,
                       device: str | torch.device | None = None) -> LoadedEncoder:
    """Load and verify the encoder directory ``path`` over its base.

    Args:
        path: an encoder directory (``qswap tune run``'s output, or ``save_encoder``'s).
        base: the base, loaded or by name/directory; default: the one the encoder's manifest names.
        device: where a base loaded here runs (default: ``load_base``'s choice).

    Returns:
        The encoder in a pool of its own.

    Raises:
        SpaceMismatchError: the encoder was tuned on another embedding space than ``base``.
    """
    if not isinstance(base, BaseEncoder):
        name = base or read_encoder_manifest(Path(path)).space.get("name", DEFAULT_MODEL)
        base = load_base(name, device=device)
    art = load_encoder(Path(path), expected_space=base.space)
    pool = EncoderPool(base)
    pool.add(art)
    return LoadedEncoder(base, pool, art.key)
