"""Hot encoders: the few encoders that serve most of a server's rows, run on merged graphs.

The shared graph (:mod:`qswap.encoders.runtime.shared`) serves any number of encoders from one
session, but an encoder's rows cost more there than on its own merged export: the shared graph
takes the adapter as inputs and keeps Q, K and V apart, while a merged graph packs them into one
attention op (``bench/results/forward_mixed/``: a batch of 8 queries of one LoRA r=32 encoder,
1.25x the merged graph's time). When a few encoders carry most of the traffic (a server with one
domain, or a few domains, or a few domains far ahead of the others), each is worth a merged session
of its own.

With ``slots`` merged sessions allowed, an encoder is hot once it serves a fair share of them:
at least :func:`hot_share` (``slots``) of a window's rows, ``HOT_SHARE / slots`` (half with one
slot, an eighth with four: so four equal domains all run merged); the busiest go first.

:class:`HotEncoders` only decides which encoders those are, from the rows a server served; the
backend builds and frees the sessions.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable

from qswap.errors import InvalidInputError

#: With one slot, an encoder with at least this share of a window's served rows becomes hot (runs
#: merged); with N slots, this share over N (:func:`hot_share`). A hot one goes back to the shared
#: graph below half of its line, so that a share near the line does not export and free a session
#: window after window.
HOT_SHARE = 0.5
#: Served rows per decision: a few seconds of a loaded server, long enough that a burst of one
#: encoder's requests does not export a graph it will not keep.
HOT_WINDOW_ROWS = 512
#: Merged sessions kept for hot encoders by default; 0 turns hot encoders off. Each holds the base's
#: transformer weights again (105-115 MB of RSS for multilingual-e5-small, bench/results/peer/:
#: "qswap hot off" rows), and its one-core twin on a server running two forward lanes ~85 MB more
#: (:class:`qswap.encoders.runtime.onnx.OnnxBackend`). One: a one-domain server gains at low concurrency (1.17x QPS at c=1 in
#: that run), while four equal domains all hot gained 1.07x at c=1 and lost at c=8 and c=32
#: (0.93x, 0.99x) for +462 MB, so more slots are an option (``--hot-encoders 4``), not the default.
DEFAULT_HOT = 1
#: Slots a server of a few busy domains would set (``--hot-encoders 4``): the mixed-batch
#: benchmark's ``hot k=K`` arms go up to this many encoders.
FEW_DOMAINS_HOT = 4


def hot_share(slots: int) -> float:
    """The share of a window's served rows that makes an encoder hot with ``slots`` merged sessions
    allowed: ``HOT_SHARE / slots``, so that as many equal busiest encoders as there are slots
    (and no more than twice as many) reach it."""
    return HOT_SHARE / max(slots, 1)


class HotEncoders:
    """Which encoders are hot, from the rows served (thread-safe).

    ``slots``: hot encoders at most (0: none, ever); ``window``: served rows per decision.
    """

    def __init__(self, slots: int = DEFAULT_HOT, window: int = HOT_WINDOW_ROWS) -> None:
        if slots < 0 or window < 1:
            raise InvalidInputError(f"hot slots must be >= 0 and the window >= 1 row, got {slots}, {window}",
                                    "0 slots turn hot encoders off")
        self.slots = slots
        self.window = window
        self._recent: Counter[str] = Counter()
        self._hot: set[str] = set()
        self._lock = threading.Lock()

    def count(self, keys: list[str], eligible: Callable[[str], bool]) -> tuple[list[str], list[str]]:
        """Count served rows (one key per row); at the end of a window, decide.

        ``eligible(key)``: whether ``key`` may run merged (loaded, on the shared graph). Returns
        ``(promoted, demoted)``: keys that just became hot, and keys that no longer are (both
        empty between decisions).
        """
        if self.slots == 0:
            return [], []
        with self._lock:
            self._recent.update(keys)
            rows = sum(self._recent.values())
            if rows < self.window:
                return [], []
            share = {k: n / rows for k, n in self._recent.items()}
            self._recent.clear()
            line = hot_share(self.slots)
            demoted = sorted(k for k in self._hot if share.get(k, 0.0) < line / 2 or not eligible(k))
            self._hot.difference_update(demoted)
            promoted = []
            # Busiest first (ties by key, so that which of equal encoders get the last slots is stable).
            for k, s in sorted(share.items(), key=lambda kv: (-kv[1], kv[0])):
                if s < line or len(self._hot) >= self.slots:
                    break
                if k not in self._hot and eligible(k):
                    self._hot.add(k)
                    promoted.append(k)
            return promoted, demoted

    def discard(self, key: str) -> bool:
        """Forget ``key`` (removed, or its weights changed); whether it was hot."""
        with self._lock:
            self._recent.pop(key, None)
            was = key in self._hot
            self._hot.discard(key)
            return was

    def keys(self) -> set[str]:
        """The hot encoders now (their merged sessions may still be building)."""
        with self._lock:
            return set(self._hot)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._hot
