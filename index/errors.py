"""The index's own named error: stored index data that cannot be trusted.

:class:`IndexCorruptError` is an :class:`~qswap.errors.IntegrityError` raised for damage on
the serving side (a checksum mismatch, a missing or unreadable file, a document store that
cannot be read, a collection whose qswap manifest is gone). It is not the caller's fault, so
the server answers it as a server-side error, unlike an IntegrityError in an uploaded file.
It is defined with the other named errors (``qswap.errors``), where the client reads it too.
"""

from __future__ import annotations

from qswap.errors import IndexCorruptError

__all__ = ["IndexCorruptError"]
