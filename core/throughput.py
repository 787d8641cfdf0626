"""Throughput of a document-embedding job: documents and tokens per second, and its final line.

One meter for every job that embeds documents (an index build, locally or on Ray, an upsert,
tuning's document step), so that their progress bars and closing lines read the same::

    meter = Throughput()
    meter.add(docs=64, tokens=6_100)
    bar.set_postfix_str(meter.rates())        # "6,100 tok/s, 64.0 docs/s"
    print(meter.summary("embedded"))          # "embedded 64 documents (6,100 tokens) in 1.0 s: ..."
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Throughput:
    """Documents and tokens done since ``start`` (monotonic seconds)."""

    docs: int = 0
    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, docs: int, tokens: int = 0) -> None:
        """Count ``docs`` more documents holding ``tokens`` real (unpadded) tokens."""
        self.docs += int(docs)
        self.tokens += int(tokens)

    def seconds(self) -> float:
        """Wall seconds since the start."""
        return max(time.perf_counter() - self.start, 1e-9)

    def rates(self) -> str:
        """``"<tokens>/s, <docs>/s"`` so far (tokens left out when none were counted)."""
        s = self.seconds()
        docs = f"{self.docs / s:.1f} docs/s"
        return f"{self.tokens / s:,.0f} tok/s, {docs}" if self.tokens else docs

    def summary(self, what: str = "embedded") -> str:
        """Closing line: counts, wall time and effective throughput.

        Args:
            what: the verb the line starts with.

        Returns:
            e.g. ``"embedded 10,000 documents (951,204 tokens) in 118.2 s: 8,047 tok/s, 84.6 docs/s"``.
        """
        toks = f" ({self.tokens:,} tokens)" if self.tokens else ""
        return f"{what} {self.docs:,} documents{toks} in {self.seconds():.1f} s: {self.rates()}"
