"""Captured feedback as tuning data: ``qswap feedback export`` and ``qswap tune run --feedback``.

The capture store (:mod:`qswap.feedback.store`, written by ``qswap serve --feedback-dir``) is
turned into a BEIR directory by :func:`qswap.feedback.export.export_beir`; the texts of the
judged documents come from the served index, so the tuned encoder learns against exactly the
document vectors the server searches.
"""

from __future__ import annotations

from pathlib import Path

from qswap.errors import NotFoundError
from qswap.feedback.export import ExportSummary, export_beir
from qswap.feedback.store import DB_FILE, FeedbackStore
from qswap.index import open_index


def export_feedback(feedback_dir: Path, index: str | Path, out: Path, domain: str | None = None) -> ExportSummary:
    """Write one domain's captured feedback as a BEIR directory.

    Args:
        feedback_dir: the server's ``--feedback-dir``.
        index: the served index (document texts by id).
        out: the BEIR directory to write (replaced atomically).
        domain: only searches of this domain alias (all searches when ``None``).

    Returns:
        Counts of what was written.
    """
    if not (Path(feedback_dir) / DB_FILE).is_file():
        raise NotFoundError(f"no capture store in {feedback_dir}",
                            "give the directory the server was started with (--feedback-dir)")
    store = FeedbackStore(Path(feedback_dir))
    idx = open_index(index, read_only=True)
    try:
        def texts_of(ids: list[str]) -> dict[str, str]:
            return {i: d.text for i, d in zip(ids, idx.get(ids)) if d is not None}
        return export_beir(store.labelled(domain), Path(out), texts_of)
    finally:
        idx.close()
        store.close()
