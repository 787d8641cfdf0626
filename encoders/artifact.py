"""Encoder directories: a query encoder is the frozen base plus one adapter, stored on disk.

Layout of an encoder directory::

    manifest.json                 # written last; lists every other file with its sha256
    adapter_config.json           # kind "lora": peft's own format, so adapters trained with
    adapter_model.safetensors     #   peft or sentence-transformers load unchanged
    adapter.safetensors           # kinds "bias" / "partial": base parameter name -> tensor
    report.*, *.png               # optional tuning report (checksummed like the rest)

Kind ``identity`` has no adapter file: it is the base model itself. Which files a kind needs and
how they are read is the kind's plugin's business (:mod:`qswap.encoders.kinds`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel as PydanticModel, ValidationError, field_validator

from qswap import __version__
from qswap.atomic import atomic_copy, atomic_write_json, sha256_file, staged_dir
from qswap.encoders.kinds import KINDS, get_kind
from qswap.errors import IntegrityError, NotFoundError
from qswap.names import validate_name
from qswap.space import EmbeddingSpace

ENCODER_MANIFEST = "manifest.json"
_MAX_FILE_NAME = 255   # bytes, as most file systems allow


def bad_file_name(name: str) -> str | None:
    """Why ``name`` cannot be a file of an encoder directory (``None`` if it can)."""
    if not isinstance(name, str) or not name:
        return "an empty name"
    if name == ENCODER_MANIFEST:
        return "the manifest itself"
    if "\x00" in name:
        return "a NUL byte"
    if "/" in name or "\\" in name or name.startswith("."):
        return "a path or hidden name"
    try:
        if len(name.encode("utf-8")) > _MAX_FILE_NAME:
            return f"over {_MAX_FILE_NAME} bytes"
    except UnicodeEncodeError:
        return "characters that are not valid Unicode"
    if any(ord(c) < 32 for c in name):
        return "a control character"
    return None


class EncoderManifest(PydanticModel):
    """What an encoder is, which base space it belongs to, and checksums of its files."""

    name: str
    version: str
    kind: str   # a key of qswap.encoders.kinds.KINDS
    space: dict[str, Any]
    files: dict[str, str]
    training: dict[str, Any] | None = None
    guard: dict[str, Any] | None = None
    created_at: float
    qswap_version: str

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        if v not in KINDS:
            raise ValueError(f"unknown encoder kind {v!r} (known: {', '.join(KINDS)})")
        return v

    @field_validator("files")
    @classmethod
    def _plain_file_names(cls, v: dict[str, str]) -> dict[str, str]:
        # Refused here, so every reader (copying, verifying, serving) sees only plain names.
        for name in v:
            why = bad_file_name(name)
            if why is not None:
                raise ValueError(f"file name {name!r} is {why}")
        return v

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"

    def embedding_space(self) -> EmbeddingSpace:
        return EmbeddingSpace.from_dict(self.space)


@dataclass
class EncoderArtifact:
    """A verified encoder directory, loaded into memory (not yet attached to a base)."""

    manifest: EncoderManifest
    path: Path
    overrides: dict[str, torch.Tensor] = field(default_factory=dict)
    lora_config: dict[str, Any] | None = None
    lora_state: dict[str, torch.Tensor] | None = None

    @property
    def key(self) -> str:
        return self.manifest.key


def save_encoder(out_dir: Path, *, name: str, version: str, kind: str, space: EmbeddingSpace,
                 tensors: dict[str, torch.Tensor] | None = None, lora_dir: Path | None = None,
                 training: dict[str, Any] | None = None, guard: dict[str, Any] | None = None,
                 extra_files: list[Path] | None = None) -> EncoderManifest:
    """Write an encoder directory atomically (staging directory, manifest last, rename)."""
    validate_name(name)
    validate_name(version, "encoder version")
    plugin = get_kind(kind)
    with staged_dir(Path(out_dir)) as staging:
        plugin.save(staging, tensors=tensors, lora_dir=lora_dir)
        for f in extra_files or []:
            atomic_copy(Path(f), staging / Path(f).name)
        files = {p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file()}
        manifest = EncoderManifest(name=name, version=version, kind=kind, space=space.to_dict(),
                                   files=files, training=training, guard=guard,
                                   created_at=time.time(), qswap_version=__version__)
        atomic_write_json(staging / ENCODER_MANIFEST, manifest.model_dump())
    return manifest


def complete_encoder(draft: Path, out_dir: Path, *, training: dict[str, Any] | None = None,
                     guard: dict[str, Any] | None = None, extra_files: list[Path] | None = None) -> EncoderManifest:
    """Publish a draft encoder directory as ``out_dir``, atomically, without writing its tensors again.

    A tuning run saves its encoder once as a draft, evaluates it as saved, then publishes it
    with what the evaluation found: the draft's files are moved into the new directory,
    ``extra_files`` (the report) are added and the manifest is rewritten with ``training`` and
    ``guard``. The draft directory is consumed.

    Args:
        draft: a directory :func:`save_encoder` wrote.
        out_dir: the encoder directory to create or replace.
        training: the training summary for the manifest.
        guard: the guard record for the manifest.
        extra_files: files to add beside the adapter (report, plots).

    Returns:
        The published manifest.
    """
    import shutil

    draft = Path(draft)
    first = read_encoder_manifest(draft)
    with staged_dir(Path(out_dir)) as staging:
        for name in first.files:
            shutil.move(str(draft / name), str(staging / name))   # a rename beside out_dir
        for f in extra_files or []:
            atomic_copy(Path(f), staging / Path(f).name)
        files = {**first.files, **{Path(f).name: sha256_file(staging / Path(f).name) for f in extra_files or []}}
        manifest = first.model_copy(update={"files": dict(sorted(files.items())), "training": training,
                                            "guard": guard, "created_at": time.time()})
        atomic_write_json(staging / ENCODER_MANIFEST, manifest.model_dump())
    shutil.rmtree(draft, ignore_errors=True)   # only its old manifest is left
    return manifest


def _no_constant(name: str) -> Any:
    # Infinity / NaN are not JSON: kept, they would make every file that copies them invalid JSON.
    raise ValueError(f"the number {name} is not valid JSON")


def read_encoder_manifest(path: Path) -> EncoderManifest:
    """Parse ``manifest.json`` of an encoder directory (no checksum verification)."""
    path = Path(path)
    mf = path / ENCODER_MANIFEST
    if not mf.exists():
        raise NotFoundError(f"{path} is not an encoder directory (no {ENCODER_MANIFEST})",
                            "point to a directory written by `qswap tune run` or save_encoder")
    try:
        return EncoderManifest.model_validate(json.loads(mf.read_text(), parse_constant=_no_constant))
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "manifest"
        raise IntegrityError(f"{mf} is not a valid encoder manifest: {where}: {err.get('msg', '')}",
                             "restore the encoder directory from its source") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:   # JSONDecodeError is a ValueError
        first = str(e).splitlines()[0]
        raise IntegrityError(f"{mf} is not a valid encoder manifest: {first}",
                             "restore the encoder directory from its source") from None


def verify_files(path: Path, manifest: EncoderManifest) -> None:
    """Check that every file the manifest lists exists with its recorded sha256."""
    for f in get_kind(manifest.kind).files:
        if f not in manifest.files:
            raise IntegrityError(f"{path}: manifest of a {manifest.kind} encoder does not list {f}",
                                 "the directory was not written by qswap; re-export it")
    for fname, sha in manifest.files.items():
        why = bad_file_name(fname)
        if why is not None:
            raise IntegrityError(f"{path}: manifest lists a bad file name {fname!r} ({why})", "re-export the encoder")
        f = path / fname
        if not f.exists():
            raise IntegrityError(f"{path}: {fname} is missing", "copy the whole encoder directory again")
        if sha256_file(f) != sha:
            raise IntegrityError(f"{path}: checksum mismatch for {fname}",
                                 "the file is corrupt or was modified; copy the encoder again")


def load_encoder(path: Path, expected_space: EmbeddingSpace | None = None) -> EncoderArtifact:
    """Load and verify an encoder directory: manifest, checksums, space, adapter tensors.

    The kind's plugin checks what needs no base (config, declared shapes and ranks, finite
    values) before reading tensors; :meth:`EncoderPool.add` checks the rest against the base.
    """
    path = Path(path)
    manifest = read_encoder_manifest(path)
    verify_files(path, manifest)
    if expected_space is not None:
        expected_space.require_same(manifest.embedding_space(), f"encoder {manifest.key}")
    art = EncoderArtifact(manifest=manifest, path=path)
    get_kind(manifest.kind).load(art)
    return art
