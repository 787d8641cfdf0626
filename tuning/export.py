"""Exporting a tuning run's encoder: saved once as a draft (evaluated as the server will load
it), then published with the run's report, training summary and guard verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qswap.encoders import complete_encoder, save_encoder
from qswap.space import EmbeddingSpace
from qswap.tuning.methods import QueryTower

DRAFT = "draft"


def save_draft(tower: QueryTower, workdir: Path, name: str, version: str, space: EmbeddingSpace) -> tuple[str, Path]:
    """Export the tuned tower and save it as an encoder directory in ``workdir``.

    Args:
        tower: the trained query tower.
        workdir: the run's scratch directory, beside the output (the draft is moved from there).
        name: the encoder's name.
        version: the encoder's version.
        space: the base's embedding space.

    Returns:
        The kind it was saved as and the draft directory.
    """
    exported = tower.export(workdir)
    draft = workdir / DRAFT
    save_encoder(draft, name=name, version=version, kind=exported.kind, space=space,
                 tensors=exported.tensors, lora_dir=exported.lora_dir)
    return exported.kind, draft


def publish(out: Path, draft: Path | None, *, name: str, version: str, space: EmbeddingSpace,
            training: dict[str, Any], guard: dict[str, Any], files: list[Path]) -> None:
    """Write the run's encoder directory ``out``: the draft with the report, or the identity.

    Args:
        out: the encoder directory to write (atomically).
        draft: the evaluated draft; ``None`` when nothing beat the base (the identity encoder).
        name: the encoder's name.
        version: the encoder's version.
        space: the base's embedding space.
        training: the training summary for the manifest.
        guard: the guard record for the manifest.
        files: report files to add.
    """
    if draft is None:
        save_encoder(out, name=name, version=version, kind="identity", space=space, training=training,
                     guard=guard, extra_files=files)
    else:
        complete_encoder(draft, out, training=training, guard=guard, extra_files=files)
