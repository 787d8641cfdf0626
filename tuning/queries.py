"""Query texts of one tuning run: tokenised once, encoded on the serving path's fast runtime.

A run encodes the same queries many times: mining (base), every validation pass (the tower
in training), the language matrix and the guard (base and tuned). :class:`QueryTokens`
tokenises each text once and hands out token ids (for the training tower's torch forward,
:meth:`QueryTokens.batch`, and for ONNX Runtime). :class:`FastQueries` runs the base and the
tuned encoder on ONNX Runtime through the serving path's own backend
(:class:`qswap.encoders.runtime.onnx.OnnxBackend`: merged export, fused graph, checked against torch
to cosine >= 0.99999 on probe texts when exported), and memoises the base's vectors by text,
so queries mining encoded are never encoded again by the evaluation. Exports are cached by
content digest (``<data dir>/onnx-cache`` by default): the base is exported once per machine,
a tuned encoder once per run. Without ONNX Runtime, or if an export fails, it falls back to
the torch pool with the same vectors (and says why in :attr:`FastQueries.runtime`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tokenizers import Tokenizer

from qswap.encoders import BASE_KEY, BaseEncoder, EncoderPool
from qswap.paths import data_dir

log = logging.getLogger(__name__)

Encode = Callable[[list[str]], np.ndarray]


def default_export_dir() -> Path:
    """``<data dir>/onnx-cache``: ONNX exports of base and tuned query encoders, by digest."""
    return data_dir() / "onnx-cache"


class QueryTokens:
    """Token ids of query texts (prefix included, unpadded), each text tokenised once."""

    def __init__(self, tokenizer: Tokenizer, prefix: str) -> None:
        self.tokenizer, self.prefix = tokenizer, prefix
        self.pad_id = int((tokenizer.padding or {}).get("pad_id", 0))
        self._ids: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def ids(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's token ids; texts not seen before are tokenised in one batch."""
        missing = list(dict.fromkeys(t for t in texts if t not in self._ids))
        if missing:
            for t, e in zip(missing, self.tokenizer.encode_batch([self.prefix + t for t in missing])):
                # The tokenizer pads to the call's longest row: keep the real tokens only.
                self._ids[t] = np.asarray(e.ids[:sum(e.attention_mask)], dtype=np.int64)
        return [self._ids[t] for t in texts]

    def batch(self, texts: list[str], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)`` of ``texts`` padded to their longest row, as
        :func:`qswap.encoders.tokenize_batch` returns them (right padding)."""
        rows = self.ids(texts)
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
            mask[i, :len(r)] = 1
        return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)


class FastQueries:
    """Base and tuned query encoders of one run on ONNX Runtime (torch where it cannot run).

    Args:
        base: the frozen base.
        tokens: the run's token memo (shared with training).
        export_dir: ONNX export cache (default :func:`default_export_dir`).
        enabled: ``False`` keeps every encoder on torch (the reference path).
    """

    def __init__(self, base: BaseEncoder, tokens: QueryTokens, export_dir: Path | None = None,
                 enabled: bool = True) -> None:
        self.base, self.tokens = base, tokens
        self.pool = EncoderPool(base)
        self.backend = None
        self.runtime: dict[str, str] = {}
        self._base_memo: dict[str, np.ndarray] = {}
        if enabled:
            try:
                from qswap.encoders.runtime.onnx import OnnxBackend
                self.backend = OnnxBackend(self.pool, export_dir or default_export_dir())
            except ImportError as e:   # onnxruntime is a core dependency; a broken install falls back
                self.runtime[BASE_KEY] = f"torch (no ONNX Runtime: {e})"

    def _ready(self, key: str) -> bool:
        if self.backend is None:
            self.runtime.setdefault(key, "torch")
            return False
        self.backend.prepare(key)
        ok = self.backend.wait(key)
        self.runtime[key] = "onnx" if ok else f"torch (export failed: {self.backend.error(key)})"
        return ok

    def _encoder(self, key: str) -> Encode:
        fast = self._ready(key)

        def encode(texts: list[str]) -> np.ndarray:
            if not texts:
                return np.empty((0, self.base.dim), dtype=np.float32)
            if fast:
                return self.backend.encode_ids(key, self.tokens.ids(texts))
            return self.pool.encode(texts, [key] * len(texts))
        return encode

    def base_encoder(self) -> Encode:
        """The base's query encoder, memoised by text for the whole run."""
        inner = self._encoder(BASE_KEY)

        def encode(texts: list[str]) -> np.ndarray:
            missing = list(dict.fromkeys(t for t in texts if t not in self._base_memo))
            if missing:
                for t, v in zip(missing, inner(missing)):
                    self._base_memo[t] = v
            if not texts:
                return np.empty((0, self.base.dim), dtype=np.float32)
            return np.stack([self._base_memo[t] for t in texts])
        return encode

    def tuned_encoder(self, encoder_dir: Path) -> tuple[str, Encode]:
        """(pool key, query encoder) of the saved encoder at ``encoder_dir``, loaded as the
        server loads it and exported once."""
        from qswap.encoders import load_encoder
        art = load_encoder(encoder_dir, expected_space=self.base.space)
        self.pool.add(art)   # a second encoder of the same name@version is refused (ConflictError)
        return art.key, self._encoder(art.key)

    def close(self) -> None:
        """Stop the export thread."""
        if self.backend is not None:
            self.backend.close()
