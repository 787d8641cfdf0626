"""The serving gate: the one answer to "may this encoder answer users, chosen this way?".

Every path that decides what answers a user asks :func:`serving_error` with the :class:`Use`
it makes of the encoder; nothing else reads a record's verdict to decide. The table:

=============  ===================  ======================  ===================  ==========
use            verdict passed /     refused, insufficient,  force given in this  evaluating
               unguarded            failed, forced before   request
=============  ===================  ======================  ===================  ==========
``name``       serves               serves (marked forced)  -                    no
``default``    serves               serves (marked forced)  -                    no
``domain``     serves               serves (marked forced)  -                    serves [1]
``alias``      serves               no                      serves, recorded     no
``candidate``  serves               no                      -                    no
``promote``    serves               no                      -                    no
``rollback``   serves               serves (marked forced)  -                    no
=============  ===================  ======================  ===================  ==========

[1] A domain alias was gated when it was set; when its encoder is re-evaluated at start it keeps
serving (a restart must not take a domain down; the registry logs an error if the verdict
refuses it).

Why: ``force`` is an admin's decision about one use, so it is asked for again at every alias
switch and never carried into an experiment. An experiment shows the candidate's lists to the
domain's users and ends in a promotion, and a promotion (manual or automatic) is a claim that
the candidate proved itself: a forced encoder may do neither. Wherever a forced encoder answers,
the answer says so (``forced`` on the search answer's encoder, on the encoder and the alias).
"""

from __future__ import annotations

from enum import Enum

from qswap.errors import GuardPendingError, GuardRefusedError, QswapError
from qswap.guard import GuardStatus
from qswap.guard.checks import guard_table, insufficient_table
from qswap.server.registry.records import EncoderRecord


class Use(str, Enum):
    """How a path chooses the encoder that will answer users."""

    NAME = "name"              # a request names it: 'name' (highest version allowed) or 'name@version'
    DEFAULT = "default"        # a request names nothing: the configured default encoder
    DOMAIN = "domain"          # a request names a domain alias (gated when the alias was set)
    ALIAS = "alias"            # an admin points an alias at it (PUT /v1/aliases, also 'default')
    CANDIDATE = "candidate"    # an experiment's candidate: its start, and every search it takes part in
    PROMOTE = "promote"        # an experiment's promotion, by an admin or automatic
    ROLLBACK = "rollback"      # an experiment's rollback to the encoder the domain served before


#: Uses that accept an encoder an admin forced before (the record's ``forced``).
_RECORDED_FORCE = {Use.NAME, Use.DEFAULT, Use.DOMAIN, Use.ROLLBACK}
#: Uses that accept ``force`` given in the request itself.
_GIVEN_FORCE = {Use.ALIAS}


def serving_error(rec: EncoderRecord | None, use: Use, force: bool = False) -> QswapError | None:
    """Why ``rec`` may not serve for ``use``, or None when it may (the module's table).

    Args:
        rec: the encoder's record (None: the base model, which always serves).
        use: how the caller chooses it.
        force: ``force`` given in this request (only :attr:`Use.ALIAS` reads it).

    Returns:
        None, or the 409 to answer: :class:`GuardPendingError` while it is evaluated,
        :class:`GuardRefusedError` (with the guard record) when its verdict does not allow ``use``.
    """
    if rec is None:
        return None
    status = rec.guard_status
    if use == Use.DOMAIN:
        return None
    key = rec.key
    if status == GuardStatus.EVALUATING:
        return GuardPendingError(f"encoder {key} is still being evaluated on the server's sentinels",
                                 f"retry when GET /v1/encoders/{key} shows guard_status 'passed'")
    if status.servable:
        return None
    if use in _GIVEN_FORCE and force:
        return None
    if use in _RECORDED_FORCE and rec.forced:
        return None
    return _refusal(rec, use)


def is_forced(rec: EncoderRecord | None) -> bool:
    """Whether ``rec`` answers only because an admin forced it (its verdict is not a pass)."""
    return rec is not None and not rec.guard_status.servable and rec.guard_status != GuardStatus.EVALUATING


def _refusal(rec: EncoderRecord, use: Use) -> GuardRefusedError:
    key, ev = rec.key, rec.evaluation or {}
    if use in (Use.CANDIDATE, Use.PROMOTE):
        what = "an experiment's candidate" if use == Use.CANDIDATE else "promoted"
        return GuardRefusedError(f"encoder {key} did not pass the guard (guard_status {rec.guard_status.value}"
                                 f"{', forced' if rec.forced else ''}): it cannot be {what}",
                                 "an experiment compares encoders whose guard passed; to serve this one anyway, "
                                 "point the alias at it with PUT /v1/aliases/{domain} and force=true", guard=ev)
    hint = "use force=true to accept it anyway" if use in _GIVEN_FORCE else \
        "register it with force=true, or point an alias at it with force=true"
    if rec.guard_status == GuardStatus.FAILED:
        return GuardRefusedError(f"encoder {key} could not be evaluated on the server's sentinels: "
                                 f"{ev.get('error', 'unknown error')}",
                                 f"register it again to retry the evaluation, or {hint}", guard=ev)
    if rec.guard_status == GuardStatus.INSUFFICIENT:
        return GuardRefusedError(f"encoder {key} could not be judged: {insufficient_table(ev)}",
                                 "rebuild the sentinels over the current index (`qswap sentinels make "
                                 f"--index`) and restart, or {hint}", guard=ev)
    return GuardRefusedError(f"encoder {key} significantly degrades sentinel(s): "
                             f"{guard_table(ev, only_bad=True) or 'see its evaluation'}",
                             f"re-tune it, or {hint}", guard=ev)


__all__ = ["Use", "is_forced", "serving_error"]
