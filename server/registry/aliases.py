"""Aliases: pointing a domain at an encoder (``PUT`` / ``DELETE /v1/aliases/{domain}``,
an experiment's promotion and rollback).

:class:`AliasSide` is part of :class:`~qswap.server.registry.facade.EncoderRegistry` (a base
class, kept in its own file). An alias is written in one way only, :meth:`AliasSide.set_alias`:
the serving gate decides for the caller's use, the encoder is loaded before the switch, and the
switch is one journal line and one swap of the alias table, so a request sees the old alias or
the new one, and keeps the encoder it was admitted with.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from qswap.errors import ConflictError, InvalidInputError, NotFoundError
from qswap.names import validate_name
from qswap.server.registry.records import RecordTable
from qswap.server.registry.registration import DEFAULT_ALIAS
from qswap.server.registry.serving import Use, is_forced

log = logging.getLogger("qswap.server")


class AliasSide:
    """Alias-writing methods of the registry (its tables, locks and reference counts)."""

    table: RecordTable
    _lock: threading.RLock
    admin_lock: threading.Lock
    _refs: dict[str, int]
    resolve: Callable[..., str]
    _require_servable: Callable[..., None]
    ensure_loaded: Callable[[str], None]
    release: Callable[[str], None]

    def set_alias(self, domain: str, ref: str, force: bool = False, use: Use = Use.ALIAS,
                  expect: str | None = None) -> tuple[str, str | None]:
        """Point ``domain`` at ``ref`` (loaded first, so the switch costs traffic nothing): the one
        way an alias is written.

        The serving gate decides for ``use``: :attr:`Use.ALIAS` (an admin) refuses an encoder under
        evaluation even with ``force`` and a refused (insufficient evidence, failed) one unless
        ``force``, which records the encoder as forced (it then serves by name too); promotion
        and rollback ask for their own use (a forced candidate is never promoted).

        Args:
            domain: the alias.
            ref: a name or ``name@version``.
            force: given by the admin in this request.
            use: who switches it (:attr:`Use.ALIAS`, :attr:`Use.PROMOTE`, :attr:`Use.ROLLBACK`).
            expect: switch only if the alias points at this key now (409 otherwise), checked
                under the admin lock: a promotion or rollback never overwrites an admin's change.

        Returns:
            The key now served and the previous one.
        """
        validate_name(domain, "domain")
        if domain.lower() == DEFAULT_ALIAS and domain != DEFAULT_ALIAS:
            raise InvalidInputError(f"domain {domain!r} is a case variant of the reserved alias "
                                    f"{DEFAULT_ALIAS!r}", f"use {DEFAULT_ALIAS!r} or another name")
        with self.admin_lock:
            with self._lock:
                if expect is not None and self.table.aliases.get(domain) != expect:
                    raise ConflictError(f"domain {domain!r} no longer points at {expect}",
                                        "the alias changed meanwhile: look at GET /v1/aliases and decide again")
                key = self.resolve(encoder=ref, use=use)
                self._require_servable(key, use, force)
                rec = self.table.records.get(key)
                self._refs[key] = self._refs.get(key, 0) + 1   # held so it cannot be evicted before it is pinned
            try:
                if rec is not None and is_forced(rec) and not rec.forced:   # accepted by force: on record
                    self.table.update(key, forced=True)
                self.ensure_loaded(key)
                with self._lock:
                    previous = self.table.aliases.get(domain)
                    aliases = {**self.table.aliases, domain: key}
                self.table.commit(aliases=aliases)   # one reference swap: requests see old or new
            finally:
                self.release(key)
        log.info("alias set", extra={"domain": domain, "encoder": key, "previous": previous})
        return key, previous

    def delete_alias(self, domain: str) -> str:
        """Remove the alias ``domain``; returns the key it pointed at."""
        with self.admin_lock:
            with self._lock:
                if domain not in self.table.aliases:
                    raise NotFoundError(f"no alias for domain {domain!r}", "list aliases with GET /v1/aliases")
                key = self.table.aliases[domain]
                aliases = {d: k for d, k in self.table.aliases.items() if d != domain}
            self.table.commit(aliases=aliases)
        log.info("alias deleted", extra={"domain": domain, "encoder": key})
        return key
