"""What the ONNX runtimes read of a base model without building its torch module, cached on disk.

Building the torch base (importing ``transformers``' modelling code and loading every weight) is
most of a server's start. The ONNX runtimes need only a little of it: the config facts the
tokenizer and the embedding space use, the model's Linear / LayerNorm layout (the shared graph's
adapter slots), its parameter count, and a few tensors (the word-embedding matrix, the Linear and
LayerNorm biases). :class:`BaseLayout` holds these. It is read from a built model once
(:func:`layout_of`), with where each of those tensors sits in the model's own safetensors files,
each one checked to be bitwise the model's, and kept as one JSON record per model under a cache
directory (:func:`write_layout`). A later load of the same model files (config and weights by
content, same ``transformers`` and ``torch``) reads the record (:func:`read_layout`) and the
tensors straight from the checkpoint (:func:`load_tensors`), and builds the torch module only
when something needs it (:class:`qswap.encoders.base.BaseEncoder`). Reading a record, and the
word embeddings as numpy (:func:`load_array`), does not import torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from qswap.atomic import atomic_write_json

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Bump when the record's content changes, so older records are ignored.
LAYOUT_FORMAT = 1
LAYOUT_DIR = "_base"


@dataclass(frozen=True)
class BaseLayout:
    """A base model's facts as its built torch module has them.

    ``linear``: every ``nn.Linear`` as (name, in_features, out_features, has bias), in module
    order; ``norm``: every affine ``nn.LayerNorm`` with a bias as (name, normalized size);
    ``sources``: tensor name -> (checkpoint file name, key, dtype) of the tensors
    :func:`load_tensors` reads (the word embeddings and every bias above); empty when they
    could not all be found in safetensors files (then the record is not written).
    """

    model_type: str
    hidden_size: int
    max_position_embeddings: int | None
    pad_token_id: int | None
    word_embeddings: str
    parameters: int
    linear: tuple[tuple[str, int, int, bool], ...]
    norm: tuple[tuple[str, int], ...]
    sources: dict[str, tuple[str, str, str]]

    def bias_names(self) -> list[str]:
        """The Linear and LayerNorm biases the model has, by parameter name."""
        return [f"{m}.bias" for m, _, _, has in self.linear if has] + [f"{m}.bias" for m, _ in self.norm]


def layout_of(model: torch.nn.Module, config: Any = None) -> BaseLayout:
    """The layout of a built model (``config``: its ``transformers`` config; default ``model.config``)."""
    import torch

    config = config if config is not None else model.config
    weight = model.get_input_embeddings().weight
    wname = next((n for n, p in model.named_parameters() if p is weight), "")
    lin, norm = [], []
    for name, m in model.named_modules():
        if not name:
            continue
        if isinstance(m, torch.nn.Linear):
            lin.append((name, m.in_features, m.out_features, m.bias is not None))
        elif isinstance(m, torch.nn.LayerNorm) and m.elementwise_affine and m.bias is not None:
            norm.append((name, int(torch.Size(m.normalized_shape).numel())))
    pad = getattr(config, "pad_token_id", None)
    mpe = getattr(config, "max_position_embeddings", None)
    return BaseLayout(model_type=str(config.model_type), hidden_size=int(config.hidden_size),
                      max_position_embeddings=None if mpe is None else int(mpe),
                      pad_token_id=None if pad is None else int(pad), word_embeddings=wname,
                      parameters=sum(p.numel() for p in model.parameters()),
                      linear=tuple(lin), norm=tuple(norm), sources={})


def layout_key(model_dir: Path, weights_sha256: str) -> str:
    """Content key of a model's record: its config file and weights, the libraries that build it
    (by their installed versions: a key is computed without importing them)."""
    cfg = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
    return hashlib.sha256(f"{LAYOUT_FORMAT}|{cfg}|{weights_sha256}|{_version('transformers')}|{_version('torch')}"
                          .encode()).hexdigest()


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def _record_path(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / LAYOUT_DIR / f"{key}.json"


def read_layout(cache_dir: Path, key: str) -> BaseLayout | None:
    """The record of ``key`` under ``cache_dir``; None when there is none (or it is unreadable)."""
    try:
        d = json.loads(_record_path(cache_dir, key).read_text())
        if d.get("format") != LAYOUT_FORMAT or not d.get("sources"):
            return None
        return BaseLayout(model_type=d["model_type"], hidden_size=int(d["hidden_size"]),
                          max_position_embeddings=d["max_position_embeddings"], pad_token_id=d["pad_token_id"],
                          word_embeddings=d["word_embeddings"], parameters=int(d["parameters"]),
                          linear=tuple((str(n), int(i), int(o), bool(b)) for n, i, o, b in d["linear"]),
                          norm=tuple((str(n), int(s)) for n, s in d["norm"]),
                          sources={k: (str(f), str(c), str(t)) for k, (f, c, t) in d["sources"].items()})
    except (OSError, ValueError, KeyError, TypeError):   # missing or torn record: build the model
        return None


def write_layout(cache_dir: Path, key: str, model_dir: Path, model: torch.nn.Module, layout: BaseLayout) -> bool:
    """Record ``layout`` with where its tensors sit in ``model_dir``'s safetensors files, each
    checked bitwise against the built ``model``; returns False (nothing written) when one is not
    found there as it is in the model (another checkpoint format, a renamed or converted tensor)."""
    import torch

    params = dict(model.named_parameters())
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return False
    from safetensors import safe_open

    prefix = getattr(model, "base_model_prefix", "")
    sources: dict[str, tuple[str, str, str]] = {}
    handles = [safe_open(str(f), framework="pt") for f in files]
    keys = [set(h.keys()) for h in handles]
    for name in [layout.word_embeddings, *layout.bias_names()]:
        p = params.get(name)
        if p is None or p.device.type != "cpu":
            return False
        for f, h, ks in zip(files, handles, keys):
            stored = next((k for k in (name, f"{prefix}.{name}") if k in ks), None)
            if stored is not None:
                t = h.get_tensor(stored)
                if t.shape == p.shape and torch.equal(t.to(p.dtype), p.detach()):
                    sources[name] = (f.name, stored, str(p.dtype).removeprefix("torch."))
                break
        if name not in sources:
            return False
    record = {"format": LAYOUT_FORMAT, **asdict(layout), "sources": sources}
    atomic_write_json(_record_path(cache_dir, key), record)
    return True


def load_tensors(model_dir: Path, layout: BaseLayout) -> dict[str, torch.Tensor]:
    """Every tensor of ``layout.sources`` (the word embeddings and the biases) from the model's
    checkpoint files, as the model has them: views of the files' private (copy-on-write) mappings,
    as ``transformers`` loads a model's own. Each file is opened once: a start reads them all
    together (one open per name cost a hundred opens of a large file)."""
    import torch
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for n, (fname, _, _) in layout.sources.items():
        by_file.setdefault(fname, []).append(n)
    out: dict[str, torch.Tensor] = {}
    for fname, ns in by_file.items():
        with safe_open(str(model_dir / fname), framework="pt") as f:
            for n in ns:
                _, key, dtype = layout.sources[n]
                out[n] = f.get_tensor(key).to(getattr(torch, dtype))
    return out


# safetensors dtype names -> numpy's (bfloat16 has none)
_NUMPY_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16"}


def load_array(model_dir: Path, layout: BaseLayout, name: str) -> np.ndarray | None:
    """Tensor ``name`` of ``layout.sources`` as a read-only numpy view of its checkpoint file,
    without torch: mapped, not read, so only the rows used are paged in (a few queries touch a few
    rows of a 250k-row word-embedding matrix). None when numpy has no type for its dtype (bfloat16).

    The safetensors format is an 8-byte little-endian header size, a JSON header giving each
    tensor's dtype, shape and byte range after it, then the data.
    """
    fname, key, _ = layout.sources[name]
    path = model_dir / fname
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(size))[key]
    dtype = _NUMPY_DTYPES.get(entry["dtype"])
    if dtype is None:
        return None
    start, _end = entry["data_offsets"]
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", offset=8 + size + start,
                     shape=tuple(entry["shape"]))
