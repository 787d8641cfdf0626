"""Encoder directories: a query encoder is the frozen base plus one adapter, stored on disk.

Layout of an encoder directory::

    manifest.json                 # written last; lists every other file with its sha256
    adapter_config.json           # kind "lora": peft's own format, so adapters trained with
    adapter_model.safetensors     #   peft or sentence-transformers load unchanged
    adapter.safetensors           # kinds "bias" / "partial": base parameter name -> tensor
    report.*, *.png               # optional tuning report (checksummed like the rest)

Kind ``identity`` has no adapter file: it is the base model itself.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel as PydanticModel, ValidationError

from qswap import __version__
from qswap.atomic import atomic_copy, atomic_write_json, replace_dir, sha256_file
from qswap.errors import IntegrityError, InvalidInputError, NotFoundError
from qswap.space import EmbeddingSpace

KINDS = ("identity", "lora", "bias", "partial")
Kind = Literal["identity", "lora", "bias", "partial"]
MANIFEST = "manifest.json"
LORA_FILES = ("adapter_config.json", "adapter_model.safetensors")
TENSOR_FILE = "adapter.safetensors"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class EncoderManifest(PydanticModel):
    """What an encoder is, which base space it belongs to, and checksums of its files."""

    name: str
    version: str
    kind: Kind
    space: dict[str, Any]
    files: dict[str, str]
    training: dict[str, Any] | None = None
    guard: dict[str, Any] | None = None
    created_at: float
    qswap_version: str

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


def validate_name(name: str, what: str = "encoder name") -> str:
    """Names and versions are path- and URL-safe: letters, digits, ``.``, ``_``, ``-``."""
    if not _NAME.match(name or ""):
        raise InvalidInputError(f"invalid {what} {name!r}",
                                "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return name


def save_encoder(out_dir: Path, *, name: str, version: str, kind: Kind, space: EmbeddingSpace,
                 tensors: dict[str, torch.Tensor] | None = None, lora_dir: Path | None = None,
                 training: dict[str, Any] | None = None, guard: dict[str, Any] | None = None,
                 extra_files: list[Path] | None = None) -> EncoderManifest:
    """Write an encoder directory atomically (staging directory, manifest last, rename)."""
    from safetensors.torch import save_file

    validate_name(name)
    validate_name(version, "encoder version")
    if kind not in KINDS:
        raise InvalidInputError(f"unknown encoder kind {kind!r}", f"use one of {KINDS}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes 0700; an encoder directory is data a server user reads
    try:
        if kind == "lora":
            if lora_dir is None:
                raise InvalidInputError("a lora encoder needs lora_dir (peft save_pretrained output)")
            for f in LORA_FILES:
                if not (Path(lora_dir) / f).exists():
                    raise NotFoundError(f"{lora_dir} lacks {f}", "save the adapter with peft's save_pretrained")
                atomic_copy(Path(lora_dir) / f, staging / f)
        elif kind in ("bias", "partial"):
            if not tensors:
                raise InvalidInputError(f"a {kind} encoder needs tensors")
            save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                      str(staging / TENSOR_FILE), metadata={"kind": kind})
        for f in extra_files or []:
            atomic_copy(Path(f), staging / Path(f).name)
        files = {p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file()}
        manifest = EncoderManifest(name=name, version=version, kind=kind, space=space.to_dict(),
                                   files=files, training=training, guard=guard,
                                   created_at=time.time(), qswap_version=__version__)
        atomic_write_json(staging / MANIFEST, manifest.model_dump())
        replace_dir(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return manifest


def read_manifest(path: Path) -> EncoderManifest:
    """Parse ``manifest.json`` of an encoder directory (no checksum verification)."""
    path = Path(path)
    mf = path / MANIFEST
    if not mf.exists():
        raise NotFoundError(f"{path} is not an encoder directory (no {MANIFEST})",
                            "point to a directory written by `qswap tune run` or save_encoder")
    try:
        return EncoderManifest.model_validate(json.loads(mf.read_text()))
    except (json.JSONDecodeError, ValidationError, UnicodeDecodeError) as e:
        first = str(e).splitlines()[0]
        raise IntegrityError(f"{mf} is not a valid encoder manifest: {first}",
                             "restore the encoder directory from its source") from None


def verify_files(path: Path, manifest: EncoderManifest) -> None:
    """Check that every file the manifest lists exists with its recorded sha256."""
    required = {"lora": LORA_FILES, "bias": (TENSOR_FILE,), "partial": (TENSOR_FILE,)}.get(manifest.kind, ())
    for f in required:
        if f not in manifest.files:
            raise IntegrityError(f"{path}: manifest of a {manifest.kind} encoder does not list {f}",
                                 "the directory was not written by qswap; re-export it")
    for fname, sha in manifest.files.items():
        if "/" in fname or fname.startswith("."):
            raise IntegrityError(f"{path}: manifest lists a bad file name {fname!r}", "re-export the encoder")
        f = path / fname
        if not f.exists():
            raise IntegrityError(f"{path}: {fname} is missing", "copy the whole encoder directory again")
        if sha256_file(f) != sha:
            raise IntegrityError(f"{path}: checksum mismatch for {fname}",
                                 "the file is corrupt or was modified; copy the encoder again")


def load_encoder(path: Path, expected_space: EmbeddingSpace | None = None) -> EncoderArtifact:
    """Load and verify an encoder directory: manifest, checksums, space, adapter tensors."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    manifest = read_manifest(path)
    verify_files(path, manifest)
    if expected_space is not None:
        expected_space.require_same(manifest.embedding_space(), f"encoder {manifest.key}")
    art = EncoderArtifact(manifest=manifest, path=path)
    try:
        if manifest.kind in ("bias", "partial"):
            art.overrides = load_file(str(path / TENSOR_FILE))
        elif manifest.kind == "lora":
            art.lora_config = json.loads((path / "adapter_config.json").read_text())
            art.lora_state = load_file(str(path / "adapter_model.safetensors"))
    except (SafetensorError, json.JSONDecodeError, OSError) as e:
        raise IntegrityError(f"{path}: cannot read adapter of {manifest.key}: {e}",
                             "the adapter file is corrupt; re-export the encoder") from None
    return art
