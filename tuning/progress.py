"""Progress for long steps, on a terminal or not.

On a terminal a tqdm bar; otherwise (a log file, CI, ``nohup``) one line on stderr every
``every_s`` seconds with the count, the rate and an ETA, so a redirected run is never silent
for minutes. Query encoding, the longest silent stretch of mining and evaluation, goes
through :func:`encode_with_progress`.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import numpy as np

_EVERY_S = 15.0


class Progress:
    """``update(n)`` / ``close()``, like a tqdm bar."""

    def __init__(self, total: int, desc: str, unit: str = "it", enabled: bool = True,
                 every_s: float = _EVERY_S) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.done = 0
        self.every_s = every_s
        self._t0 = self._last = time.perf_counter()
        self._bar: Any = None
        self._log = False
        if enabled and total > 0:
            if sys.stderr.isatty():
                from tqdm import tqdm
                self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False)
            else:
                self._log = True

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._log:
            now = time.perf_counter()
            if now - self._last >= self.every_s and self.done < self.total:
                self._last = now
                rate = self.done / max(now - self._t0, 1e-9)
                eta = (self.total - self.done) / rate if rate > 0 else float("inf")
                print(f"qswap: {self.desc}: {self.done}/{self.total} {self.unit} ({rate:.1f} {self.unit}/s, "
                      f"about {eta:.0f} s left)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._log:
            print(f"qswap: {self.desc}: {self.done} {self.unit} in {time.perf_counter() - self._t0:.1f} s",
                  file=sys.stderr, flush=True)


def encode_with_progress(encode: Callable[[list[str]], np.ndarray], texts: list[str], desc: str,
                         enabled: bool = True, chunk: int = 256) -> np.ndarray:
    """``encode(texts)`` in chunks of ``chunk`` with progress (one call when disabled)."""
    if not enabled or len(texts) <= chunk:
        return encode(texts)
    bar = Progress(len(texts), desc, "queries", enabled)
    parts = []
    try:
        for i in range(0, len(texts), chunk):
            parts.append(np.asarray(encode(texts[i:i + chunk])))
            bar.update(len(texts[i:i + chunk]))
    finally:
        bar.close()
    return np.concatenate(parts)
