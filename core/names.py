"""Names the server and the tools accept (encoders, versions, domains, sentinels)."""

from __future__ import annotations

import re

from qswap.errors import InvalidInputError

_NAME_RE = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_NAME = re.compile(rf"^{_NAME_RE}$")
# The same rule as JSON-schema patterns (the HTTP models): a name, a name or key, a key (name@version).
NAME_PATTERN = rf"^{_NAME_RE}$"
REF_PATTERN = rf"^{_NAME_RE}(@{_NAME_RE})?$"
KEY_PATTERN = rf"^{_NAME_RE}@{_NAME_RE}$"
#: The key of the identity encoder every encoder pool has (the base model itself), and of the
#: base's ONNX export directory, which the query and document runtimes share.
BASE_KEY = "base"


def validate_name(name: str, what: str = "encoder name") -> str:
    """Names and versions are path- and URL-safe: letters, digits, ``.``, ``_``, ``-``.

    Args:
        name: the name to check.
        what: what it names, for the error message.

    Returns:
        ``name`` unchanged (raises :class:`InvalidInputError` otherwise).
    """
    if not _NAME.match(name or ""):
        raise InvalidInputError(f"invalid {what} {name!r}",
                                "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return name
