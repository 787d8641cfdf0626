"""A tiny random-weight BERT (2 layers, 32 wide) with a WordPiece tokenizer and a qswap spec, written
to a folder: for tests of mechanics and for benchmarks whose figure does not depend on the model
(the peak RSS of a build in the document count), never for quality."""

from __future__ import annotations

import json
import string
from pathlib import Path


def make_tiny_model(path: Path, seed: int = 0, hidden: int = 32, layers: int = 2,
                    name: str = "tiny-bert") -> Path:
    """Write a random 2-layer BERT with a WordPiece tokenizer and qswap spec to ``path``."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel

    words = ("the a of and to in is for on with game games play music sound science math "
             "data network server client library tool python linux debian search index "
             "query document encoder chess puzzle physics chemistry audio video text").split()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ":"] + list(string.ascii_lowercase) \
        + list(string.digits) + ["##" + c for c in string.ascii_lowercase] + words
    vocab = list(dict.fromkeys(vocab))
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=4, intermediate_size=hidden * 2,
                     max_position_embeddings=64, pad_token_id=0)
    BertModel(cfg, add_pooling_layer=False).save_pretrained(str(path))
    (path / "qswap_base.json").write_text(json.dumps({
        "name": name, "pooling": "mean", "query_prefix": "query: ",
        "document_prefix": "passage: ", "normalize": True, "max_length": 64}))
    return path
