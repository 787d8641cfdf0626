"""Token-budget batching: batches bounded by padded tokens, not by a count of texts.

A batch of texts padded to its longest row costs ``rows x longest`` tokens of compute and
memory, so a fixed count of texts is either too small for short texts or too large (and
mostly padding) for long ones. As TEI's ``--max-batch-tokens``, texts are sorted by length
(longest first: the largest batch, and its memory peak, comes at once) and cut into
batches whose padded size stays within ``max_tokens``; a single text longer than the
budget gets a batch of its own. The caller restores the input order with the indices.
"""

from __future__ import annotations

from collections.abc import Sequence

from qswap.errors import InvalidInputError

#: Padded tokens per batch by default: e5-small's activations stay in L2/L3 and a batch is
#: large enough that the matrix products run near their peak (``qswap bench embed``).
DEFAULT_MAX_TOKENS = 8192


def token_budget_batches(lengths: Sequence[int], max_tokens: int = DEFAULT_MAX_TOKENS,
                         max_rows: int | None = None) -> list[list[int]]:
    """Group text indices into length-sorted batches of at most ``max_tokens`` padded tokens.

    Args:
        lengths: token count of each text (after truncation).
        max_tokens: bound on ``len(batch) * max(lengths in batch)``; a text longer than
            this is a batch of one.
        max_rows: optional bound on texts per batch.

    Returns:
        Lists of indices into ``lengths``, longest texts first; every index exactly once.
    """
    if max_tokens < 1:
        raise InvalidInputError(f"max_tokens must be >= 1, got {max_tokens}", "e.g. 8192")
    if max_rows is not None and max_rows < 1:
        raise InvalidInputError(f"max_rows must be >= 1, got {max_rows}", "omit it for no bound")
    order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
    batches: list[list[int]] = []
    cur: list[int] = []
    width = 0
    for i in order:
        n = max(int(lengths[i]), 1)
        # Longest first: the batch's width is its first row's, so adding a row costs ``width``.
        w = width if cur else n
        if cur and ((len(cur) + 1) * w > max_tokens or (max_rows is not None and len(cur) >= max_rows)):
            batches.append(cur)
            cur, w = [], n
        cur.append(i)
        width = w
    if cur:
        batches.append(cur)
    return batches
