"""Base models and query encoders.

A query encoder is the frozen base model plus a small adapter (``lora``, ``bias``,
``partial``) or nothing (``identity``). :class:`EncoderPool` keeps many of them over one base
in memory and encodes rows of different encoders together.

The names below are imported from their modules on first use (PEP 562), so that importing a
submodule that needs no torch (the ONNX runtimes' document and query path, a CLI's option
lists) does not import torch through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_NAMES = {
    "EncoderArtifact": "qswap.encoders.artifact", "EncoderManifest": "qswap.encoders.artifact",
    "complete_encoder": "qswap.encoders.artifact", "load_encoder": "qswap.encoders.artifact",
    "read_encoder_manifest": "qswap.encoders.artifact", "save_encoder": "qswap.encoders.artifact",
    "BaseEncoder": "qswap.encoders.base", "load_base": "qswap.encoders.base",
    "LoadedEncoder": "qswap.encoders.loaded", "load_query_encoder": "qswap.encoders.loaded",
    "BaseSpec": "qswap.encoders.embedding", "embed_batch": "qswap.encoders.embedding",
    "tokenize_batch": "qswap.encoders.embedding",
    "truncate": "qswap.matryoshka",
    "BASE_KEY": "qswap.encoders.pool", "EncoderPool": "qswap.encoders.pool",
}

__all__ = sorted(_NAMES)

if TYPE_CHECKING:
    from qswap.encoders.artifact import (EncoderArtifact, EncoderManifest, complete_encoder, load_encoder,
                                         read_encoder_manifest, save_encoder)
    from qswap.encoders.base import BaseEncoder, load_base
    from qswap.encoders.embedding import BaseSpec, embed_batch, tokenize_batch
    from qswap.encoders.loaded import LoadedEncoder, load_query_encoder
    from qswap.encoders.pool import BASE_KEY, EncoderPool
    from qswap.matryoshka import truncate


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'qswap.encoders' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value   # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
