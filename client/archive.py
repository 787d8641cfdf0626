"""Pack an encoder directory for upload (``POST /v1/encoders``, multipart field ``archive``)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from qswap.errors import NotFoundError


def pack_encoder(encoder_dir: Path | str) -> bytes:
    """A gzip tarball of the encoder directory's files under ``<dir name>/``.

    Args:
        encoder_dir: a directory holding ``manifest.json`` (what ``qswap tune run`` writes).

    Returns:
        The ``.tar.gz`` bytes.
    """
    encoder_dir = Path(encoder_dir)
    if not (encoder_dir / "manifest.json").exists():
        raise NotFoundError(f"{encoder_dir} is not an encoder directory (no manifest.json)",
                            "point to the directory `qswap tune run` wrote")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in sorted(encoder_dir.iterdir()):
            if f.is_file():
                tar.add(f, arcname=f"{encoder_dir.name}/{f.name}")
    return buf.getvalue()
