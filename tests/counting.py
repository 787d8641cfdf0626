"""A counting wrapper around a real tokenizer (tests that a text is tokenised once)."""

from __future__ import annotations

import threading
from typing import Any


class CountingTokenizer:
    """The real tokenizer, noting every text it is asked to tokenise (``texts``) and on which
    thread each call ran (``threads``)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.texts: list[str] = []
        self.threads: list[str] = []

    def encode_batch(self, inputs: list[str], *a: Any, **kw: Any) -> Any:
        self.texts.extend(inputs)
        self.threads.append(threading.current_thread().name)
        return self.tok.encode_batch(inputs, *a, **kw)

    def encode(self, text: str, *a: Any, **kw: Any) -> Any:
        self.texts.append(text)
        return self.tok.encode(text, *a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)
