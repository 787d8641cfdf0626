"""The frozen base model: one in memory, shared by the document tower and every query encoder."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from qswap import DEFAULT_MODEL
from qswap.atomic import sha256_file_cached
from qswap.encoders.bundled import resolve_bundled
from qswap.encoders.embedding import BaseSpec, embed_batch, encode_texts
from qswap.encoders.pooling import POOLINGS
from qswap.errors import InvalidInputError, NotFoundError
from qswap.space import EmbeddingSpace

log = logging.getLogger(__name__)
SPEC_FILE = "qswap_base.json"
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_SUPPORTED = ("bert", "xlm-roberta", "roberta", "distilbert", "electra", "mpnet")


def default_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class BaseEncoder:
    """A frozen encoder with its tokenizer, text spec and embedding-space fingerprint."""

    name: str
    path: Path
    model: torch.nn.Module
    tokenizer: Tokenizer
    spec: BaseSpec
    space: EmbeddingSpace
    device: torch.device

    @property
    def dim(self) -> int:
        return self.space.dim

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return embed_batch(self.model, ids, mask, self.spec)

    def encode_documents(self, texts: list[str], batch_size: int = 32,
                         progress: bool = False, precision: str = "fp32") -> np.ndarray:
        """Embed documents with the document prefix (the frozen text tower).

        ``precision="bf16"`` runs under autocast (fast on AMX / AVX-512-BF16 CPUs and tensor-core
        GPUs); off by default: see the measured quality change in README ("Fast query path").
        """
        from qswap.encoders.precision import autocast_context
        with autocast_context(self.device, precision):
            return encode_texts(self._forward, self.tokenizer, texts, self.spec.document_prefix,
                                batch_size, self.device, self.dim, progress, "embedding documents")

    def encode_queries(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        """Embed queries with the query prefix, using the base weights (the identity encoder)."""
        return encode_texts(self._forward, self.tokenizer, texts, self.spec.query_prefix,
                            batch_size, self.device, self.dim)


def _weights_sha(path: Path) -> str:
    files = [path / f for f in _WEIGHT_FILES if (path / f).exists()]
    if not files:
        files = sorted(path.glob("model-*.safetensors"))
    if not files:
        raise NotFoundError(f"no model weights in {path}",
                            "expected model.safetensors or pytorch_model.bin in the model directory")
    h = hashlib.sha256()
    for f in files:
        h.update(sha256_file_cached(f).encode())
    return h.hexdigest()


def _read_spec(path: Path, max_length: int | None, default_name: str) -> tuple[str, BaseSpec]:
    """The text spec: ``qswap_base.json`` if present, else inferred from sentence-transformers files."""
    f = path / SPEC_FILE
    if f.exists():
        d = json.loads(f.read_text())
        name = d.get("name", path.name)
        spec = BaseSpec(pooling=d.get("pooling", "mean"), query_prefix=d.get("query_prefix", ""),
                        document_prefix=d.get("document_prefix", ""),
                        normalize=bool(d.get("normalize", True)),
                        max_length=int(d.get("max_length", 512)))
    else:
        name = default_name
        pooling = "mean"
        pcfg = path / "1_Pooling" / "config.json"
        if pcfg.exists():
            p = json.loads(pcfg.read_text())
            pooling = "cls" if p.get("pooling_mode_cls_token") else "mean"
        ml = 512
        sbc = path / "sentence_bert_config.json"
        if sbc.exists():
            ml = int(json.loads(sbc.read_text()).get("max_seq_length", ml))
        spec = BaseSpec(pooling=pooling, max_length=ml)
    if max_length is not None:
        spec = BaseSpec(spec.pooling, spec.query_prefix, spec.document_prefix, spec.normalize, max_length)
    if spec.pooling not in POOLINGS:
        raise InvalidInputError(f"{f}: unknown pooling {spec.pooling!r}", f"use one of {POOLINGS}")
    return name, spec


def _load_tokenizer(path: Path) -> Tokenizer:
    tj = path / "tokenizer.json"
    if tj.exists():
        return Tokenizer.from_file(str(tj))
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return tok.backend_tokenizer
    except Exception as e:  # transformers raises many types for a missing/odd tokenizer
        raise NotFoundError(f"no usable tokenizer in {path}: {e}",
                            "the directory needs tokenizer.json (or a fast-tokenizer vocab)") from e


def _pad_id(tok: Tokenizer, config: object) -> int:
    pid = getattr(config, "pad_token_id", None)
    if pid is not None:
        return int(pid)
    for t in ("[PAD]", "<pad>"):
        if (i := tok.token_to_id(t)) is not None:
            return i
    return 0


def load_base(source: str | Path = DEFAULT_MODEL, device: str | torch.device | None = None,
              max_length: int | None = None) -> BaseEncoder:
    """Load a frozen base model from a bundled name or a local Hugging Face model directory.

    Bundled names: ``multilingual-e5-small`` (default), ``all-minilm-l6-v2``. A directory must
    hold a BERT/XLM-R family encoder (config.json + weights) and its tokenizer; an optional
    ``qswap_base.json`` gives pooling, prefixes, normalisation and max length.

    Args:
        source: a bundled name or a local Hugging Face model folder (nothing is fetched from a hub).
        device: torch device (default: CUDA when present, else CPU).
        max_length: cut texts to at most this many tokens (default: the model's own limit).

    Returns:
        The frozen base with its tokenizer, text spec and embedding-space fingerprint.
    """
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    # A missing pooler is expected (we pool ourselves); the load report would only alarm people.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    src = str(source)
    path = Path(src).expanduser()
    default_name = path.name
    if path.is_dir():
        path = path.resolve()
        default_name = path.name
    elif "/" in src or src.startswith("."):
        raise NotFoundError(f"model directory {src} does not exist",
                            "give an existing local model directory or a bundled name")
    else:
        path = resolve_bundled(src)
        default_name = src
    if not (path / "config.json").exists():
        raise NotFoundError(f"{path} has no config.json", "point to a Hugging Face model directory")
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    if config.model_type not in _SUPPORTED:
        raise InvalidInputError(
            f"{path}: model type {config.model_type!r} is not a supported text encoder",
            f"use a BERT / XLM-R family encoder ({', '.join(_SUPPORTED)})")
    name, spec = _read_spec(path, max_length, default_name)
    tok = _load_tokenizer(path)
    tok_sha = hashlib.sha256(tok.to_str().encode()).hexdigest()
    limit = min(spec.max_length, getattr(config, "max_position_embeddings", spec.max_length))
    tok.enable_truncation(max_length=limit)
    pad = _pad_id(tok, config)
    tok.enable_padding(pad_id=pad, pad_token=tok.id_to_token(pad) or "[PAD]")
    kwargs = {"add_pooling_layer": False} if config.model_type in ("bert", "xlm-roberta", "roberta", "electra") else {}
    kwargs.pop("add_pooling_layer", None) if config.model_type == "electra" else None
    model = AutoModel.from_pretrained(str(path), local_files_only=True, **kwargs)
    dev = torch.device(device) if device is not None else default_device()
    model.to(dev).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    space = EmbeddingSpace(name=name, weights_sha256=_weights_sha(path), tokenizer_sha256=tok_sha,
                           pooling=spec.pooling, query_prefix=spec.query_prefix,
                           document_prefix=spec.document_prefix, normalize=spec.normalize,
                           dim=int(config.hidden_size))
    return BaseEncoder(name=name, path=path, model=model, tokenizer=tok, spec=spec, space=space, device=dev)
