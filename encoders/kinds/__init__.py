"""Adapter kinds as plugins: one module per kind, one contract (:class:`AdapterKind`).

``KINDS`` maps a manifest's ``kind`` to its plugin; everything that depends on the kind
(which files an encoder directory holds, how they load, how the pool binds them, what they cost,
what a fast runtime binds) asks the plugin, so adding a kind is adding a module here.
"""

from __future__ import annotations

from qswap.encoders.kinds.base import AdapterKind, Attached, LowRank
from qswap.encoders.kinds.bias import BiasKind
from qswap.encoders.kinds.identity import IdentityKind
from qswap.encoders.kinds.lora import MAX_RANK, LoraKind
from qswap.encoders.kinds.partial import PartialKind
from qswap.errors import InvalidInputError

KINDS: dict[str, AdapterKind] = {k.name: k for k in (IdentityKind(), LoraKind(), BiasKind(), PartialKind())}


def get_kind(name: str) -> AdapterKind:
    """The plugin for ``name``; :class:`InvalidInputError` for an unknown kind."""
    try:
        return KINDS[name]
    except (KeyError, TypeError):
        raise InvalidInputError(f"unknown encoder kind {name!r}", f"use one of {', '.join(KINDS)}") from None


__all__ = ["AdapterKind", "Attached", "KINDS", "LowRank", "MAX_RANK", "get_kind"]
