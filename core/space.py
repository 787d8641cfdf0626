"""The embedding-space fingerprint.

Documents and queries are comparable only inside one space: the same base weights and
tokenizer, pooling, prefixes, normalisation and dimension. Whatever stores embeddings
(an index, an embedding cache, an encoder manifest) stamps its space; whatever combines
them calls :meth:`EmbeddingSpace.require_same`, which raises
:class:`~qswap.errors.SpaceMismatchError` naming the field that differs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from qswap.errors import InvalidInputError, SpaceMismatchError

# Fields that define comparability, in the order a mismatch is reported. ``name`` is a
# label for people and deliberately left out: a renamed copy of a model is the same space.
_IDENTITY = ("weights_sha256", "tokenizer_sha256", "pooling", "query_prefix",
             "document_prefix", "normalize", "dim")


@dataclass(frozen=True)
class EmbeddingSpace:
    """Everything that makes two embeddings comparable."""

    name: str
    weights_sha256: str
    tokenizer_sha256: str
    pooling: str
    query_prefix: str
    document_prefix: str
    normalize: bool
    dim: int

    @property
    def fingerprint(self) -> str:
        """Short stable hash of the identity fields (16 hex chars)."""
        ident = {k: getattr(self, k) for k in _IDENTITY}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fingerprint"] = self.fingerprint
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EmbeddingSpace":
        names = {f.name for f in fields(cls)}
        missing = names - d.keys()
        if missing:
            raise InvalidInputError(
                f"embedding space record lacks {sorted(missing)}",
                "the manifest was written by another tool or is damaged; rebuild it with qswap",
            )
        space = cls(**{k: d[k] for k in names})
        if "fingerprint" in d and d["fingerprint"] != space.fingerprint:
            raise InvalidInputError(
                f"embedding space record is inconsistent: stored fingerprint {d['fingerprint']} "
                f"!= recomputed {space.fingerprint}",
                "the manifest was edited by hand; restore it or rebuild",
            )
        return space

    def differences(self, other: "EmbeddingSpace") -> list[tuple[str, Any, Any]]:
        """(field, mine, theirs) for every identity field that differs."""
        return [(k, getattr(self, k), getattr(other, k)) for k in _IDENTITY
                if getattr(self, k) != getattr(other, k)]

    def require_same(self, other: "EmbeddingSpace", what: str = "embeddings") -> None:
        """Raise :class:`SpaceMismatchError` if ``other`` is a different space.

        ``self`` is the expected space (e.g. the index's), ``other`` the candidate.
        """
        diffs = self.differences(other)
        if not diffs:
            return
        field, mine, theirs = diffs[0]
        more = f" (and {', '.join(d[0] for d in diffs[1:])})" if len(diffs) > 1 else ""
        raise SpaceMismatchError(
            f"{what}: embedding space differs in {field}: expected {_short(mine)}, got {_short(theirs)}{more}",
            field=field, expected=mine, got=theirs,
            hint=f"use a query encoder built on the index's base model '{self.name}' "
                 f"(space {self.fingerprint}), or rebuild the index with the other base",
        )


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 24 else s[:21] + "..."
