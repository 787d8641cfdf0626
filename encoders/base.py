"""The frozen base model: one in memory, shared by the document tower and every query encoder.

torch is imported only when something needs it: a base loaded on the CPU from a cached layout
(:mod:`qswap.encoders.layout`) whose runtimes are ONNX never imports it (``qswap index search``
on a warm data directory starts in about a second instead of seven).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path
import sys
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from tokenizers import Tokenizer

from qswap import DEFAULT_MODEL
from qswap.atomic import sha256_file_cached
from qswap.encoders.bundled import resolve_bundled
from qswap.encoders.embedding import BaseSpec, embed_batch, encode_texts
from qswap.encoders.layout import (BaseLayout, layout_key, layout_of, load_array, load_tensors, read_layout,
                                   write_layout)
from qswap.encoders.pooling import POOLINGS
from qswap.errors import IntegrityError, InvalidInputError, NotFoundError
from qswap.space import EmbeddingSpace

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
SPEC_FILE = "qswap_base.json"
SHA_DIR = "_sha256"   # under a layout cache: the weights' hashes, so a start does not read them again
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_SUPPORTED = ("bert", "xlm-roberta", "roberta", "distilbert", "electra", "mpnet")


def default_device() -> torch.device:
    """CUDA when present, else CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class BaseEncoder:
    """A frozen encoder with its tokenizer, text spec and embedding-space fingerprint.

    The torch module (:attr:`model`) is built on first use when the base was loaded from a cached
    :class:`~qswap.encoders.layout.BaseLayout`: the ONNX runtimes read only :attr:`layout` and
    :meth:`tensor`, so a server whose exports are cached never builds it. Thread-safe.
    """

    def __init__(self, name: str, path: Path, tokenizer: Tokenizer, spec: BaseSpec, space: EmbeddingSpace,
                 device: torch.device | str, layout: BaseLayout, model: torch.nn.Module | None = None,
                 build: Callable[[], torch.nn.Module] | None = None) -> None:
        if model is None and build is None:
            raise ValueError("a BaseEncoder needs its model or a way to build it")
        self.name, self.path, self.tokenizer, self.spec, self.space = name, path, tokenizer, spec, space
        # Kept as given: a device named by a string is made a torch.device only when asked for.
        self._device: Any = device
        self.layout = layout
        self._model = model
        self._build = build
        self._loaded: dict[str, torch.Tensor] = {}   # tensors read from the checkpoint before the model
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        """The torch device the model runs on (imports torch)."""
        if isinstance(self._device, str):
            import torch

            self._device = torch.device(self._device)
        return self._device

    @property
    def device_type(self) -> str:
        """``cpu`` or ``cuda``: :attr:`device`'s type, without importing torch."""
        return self._device.split(":")[0] if isinstance(self._device, str) else self._device.type

    @property
    def built(self) -> bool:
        """Whether the torch module exists (a server serving from cached exports never builds it)."""
        return self._model is not None

    @property
    def model(self) -> torch.nn.Module:
        """The frozen torch module, built on first use (once, whichever thread asks first).

        Tensors :meth:`tensor` handed out before it was built become the module's own (same
        storage), so the runtimes holding them and the module share their memory as before.
        """
        model = self._model
        if model is not None:
            return model
        with self._lock:
            if self._model is None:
                assert self._build is not None
                log.info("building the torch base model", extra={"model": self.name})
                model = self._build()
                import torch

                params = dict(model.named_parameters())
                for name, t in self._loaded.items():
                    p = params.get(name)
                    if p is None or p.shape != t.shape or p.dtype != t.dtype or not torch.equal(p.detach(), t):
                        raise IntegrityError(f"the base model {self.path} changed while served: {name} differs "
                                             "from the copy read at start", "restart the server")
                    p.data = t
                self._model = model
                self._loaded.clear()
            return self._model

    def tensor(self, name: str) -> torch.Tensor:
        """The model's parameter ``name`` (the word embeddings, a bias of :attr:`layout`): the
        module's own once built, else read from the checkpoint without building it (the first
        call reads all of the layout's tensors at once: the runtimes ask for each of them)."""
        if self._model is not None:
            return self._model.get_parameter(name)
        with self._lock:
            if self._model is not None:
                return self._model.get_parameter(name)
            if not self._loaded:
                self._loaded = load_tensors(self.path, self.layout)
            return self._loaded[name]

    def word_embeddings(self) -> torch.Tensor:
        """The input word-embedding matrix (vocabulary x hidden), see :meth:`tensor`."""
        return self.tensor(self.layout.word_embeddings)

    def word_embedding_table(self) -> np.ndarray:
        """The word-embedding matrix as float32 numpy: what the ONNX runtimes gather rows from.

        In a process that has torch loaded it is a view of :meth:`word_embeddings` (one copy,
        shared with the torch module and every runtime); in one that has not, and where the
        checkpoint stores it in a dtype numpy reads, it is read from the checkpoint with numpy,
        without importing torch (:func:`~qswap.encoders.layout.load_array`).
        """
        name = self.layout.word_embeddings
        if "torch" not in sys.modules and self._model is None and name in self.layout.sources:
            array = load_array(self.path, self.layout, name)
            if array is not None:
                return array.astype(np.float32, copy=False)
        return self.word_embeddings().detach().float().cpu().numpy()

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


def _weights_sha(path: Path, store: Path | None = None) -> str:
    """The weights' fingerprint (the embedding space's and the layout record's key); ``store``:
    where each file's hash is kept between processes (:func:`~qswap.atomic.sha256_file_cached`)."""
    files = [path / f for f in _WEIGHT_FILES if (path / f).exists()]
    if not files:
        files = sorted(path.glob("model-*.safetensors"))
    if not files:
        raise NotFoundError(f"no model weights in {path}",
                            "expected model.safetensors or pytorch_model.bin in the model directory")
    h = hashlib.sha256()
    for f in files:
        h.update(sha256_file_cached(f, store).encode())
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


def _pad_id(tok: Tokenizer, pid: int | None) -> int:
    if pid is not None:
        return int(pid)
    for t in ("[PAD]", "<pad>"):
        if (i := tok.token_to_id(t)) is not None:
            return i
    return 0


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    # A missing pooler is expected (we pool ourselves); the load report would only alarm people.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _build_model(path: Path, model_type: str, device: torch.device | str) -> torch.nn.Module:
    """The frozen torch module of the model in ``path``, on ``device``, in eval mode."""
    from transformers import AutoModel

    _quiet_transformers()
    kwargs = {"add_pooling_layer": False} if model_type in ("bert", "xlm-roberta", "roberta", "electra") else {}
    kwargs.pop("add_pooling_layer", None) if model_type == "electra" else None
    model = AutoModel.from_pretrained(str(path), local_files_only=True, **kwargs)
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _cached_layout(cache_dir: Path | None, path: Path, device_type: str) -> tuple[str | None, BaseLayout | None]:
    """``(record key, record)`` of the model in ``path`` under ``cache_dir``; the record only on
    CPU (its tensors are read onto the CPU) and where the model has weights to key it by."""
    if cache_dir is None or device_type != "cpu":
        return None, None
    try:
        key = layout_key(path, _weights_sha(path, Path(cache_dir) / SHA_DIR))
    except NotFoundError:   # no weights: the model's own load says why, as without a cache
        return None, None
    return key, read_layout(cache_dir, key)


def _record(cache_dir: Path, key: str, path: Path, model: torch.nn.Module, layout: BaseLayout) -> None:
    """Write the layout record of a model just built; a failure only means the next start builds it too."""
    try:
        recorded = write_layout(cache_dir, key, path, model, layout)
    except Exception as e:   # a full or read-only disk, an odd extra safetensors file: the record is optional
        log.warning("could not record the base model's layout: the next start builds it again",
                    extra={"model": str(path), "error": str(e)})
        return
    if not recorded:
        log.info("the base model's tensors are not all in safetensors files as loaded: it is built at "
                 "every start", extra={"model": str(path)})


def load_base(source: str | Path = DEFAULT_MODEL, device: str | torch.device | None = None,
              max_length: int | None = None, cache_dir: Path | None = None) -> BaseEncoder:
    """Load a frozen base model from a bundled name or a local Hugging Face model directory.

    Bundled names: ``multilingual-e5-small`` (default), ``all-minilm-l6-v2``. A directory must
    hold a BERT/XLM-R family encoder (config.json + weights) and its tokenizer; an optional
    ``qswap_base.json`` gives pooling, prefixes, normalisation and max length.

    Args:
        source: a bundled name or a local Hugging Face model folder (nothing is fetched from a hub).
        device: torch device (default: CUDA when present, else CPU). A string (``"cpu"``) is made a
            torch device only when the model is built: with a cached layout, ``"cpu"`` loads the
            base without importing torch.
        max_length: cut texts to at most this many tokens (default: the model's own limit).
        cache_dir: where the model's :class:`~qswap.encoders.layout.BaseLayout` is recorded (a
            server's ONNX cache). With a record of these model files there (and the CPU), the
            torch module is built on first use instead of now; without one it is built now and
            the record written. None: built now, nothing recorded.

    Returns:
        The frozen base with its tokenizer, text spec and embedding-space fingerprint.
    """
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
    # A device given by name stays a name until torch is needed: see BaseEncoder.device.
    dev: Any = default_device() if device is None else device
    dev_type = dev.split(":")[0] if isinstance(dev, str) else dev.type
    key, layout = _cached_layout(cache_dir, path, dev_type)
    config: Any = None
    if layout is None:
        from transformers import AutoConfig

        _quiet_transformers()
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        model_type, hidden = config.model_type, config.hidden_size
        mpe, pid = getattr(config, "max_position_embeddings", None), getattr(config, "pad_token_id", None)
    else:
        model_type, hidden, mpe, pid = layout.model_type, layout.hidden_size, layout.max_position_embeddings, \
            layout.pad_token_id
    if model_type not in _SUPPORTED:
        raise InvalidInputError(
            f"{path}: model type {model_type!r} is not a supported text encoder",
            f"use a BERT / XLM-R family encoder ({', '.join(_SUPPORTED)})")
    name, spec = _read_spec(path, max_length, default_name)
    tok = _load_tokenizer(path)
    tok_sha = hashlib.sha256(tok.to_str().encode()).hexdigest()
    limit = min(spec.max_length, spec.max_length if mpe is None else mpe)
    tok.enable_truncation(max_length=limit)
    pad = _pad_id(tok, pid)
    tok.enable_padding(pad_id=pad, pad_token=tok.id_to_token(pad) or "[PAD]")
    model = None
    if layout is None:
        model = _build_model(path, model_type, dev)
        layout = layout_of(model, config)
        if key is not None and cache_dir is not None:
            _record(cache_dir, key, path, model, layout)
    space = EmbeddingSpace(name=name, weights_sha256=_weights_sha(path), tokenizer_sha256=tok_sha,
                           pooling=spec.pooling, query_prefix=spec.query_prefix,
                           document_prefix=spec.document_prefix, normalize=spec.normalize,
                           dim=int(hidden))
    return BaseEncoder(name=name, path=path, tokenizer=tok, spec=spec, space=space, device=dev, layout=layout,
                       model=model, build=lambda: _build_model(path, model_type, dev))
