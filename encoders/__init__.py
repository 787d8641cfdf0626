"""Base models and query encoders.

A query encoder is the frozen base model plus a small adapter (``lora``, ``bias``,
``partial``) or nothing (``identity``). :class:`EncoderPool` keeps many of them over one base
in memory and encodes rows of different encoders together.
"""

from qswap.encoders.artifact import (EncoderArtifact, EncoderManifest, complete_encoder, load_encoder,
                                     read_encoder_manifest, save_encoder)
from qswap.encoders.base import BaseEncoder, load_base
from qswap.encoders.loaded import LoadedEncoder, load_query_encoder
from qswap.encoders.embedding import BaseSpec, embed_batch, tokenize_batch
from qswap.matryoshka import truncate
from qswap.encoders.pool import BASE_KEY, EncoderPool

__all__ = ["BASE_KEY", "BaseEncoder", "BaseSpec", "EncoderArtifact", "EncoderManifest", "EncoderPool",
           "LoadedEncoder", "complete_encoder", "embed_batch", "load_base", "load_encoder", "load_query_encoder",
           "read_encoder_manifest", "save_encoder", "tokenize_batch", "truncate"]
