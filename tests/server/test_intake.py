"""Register-by-path copies what it checked: the directory is held open (no link followed on the
way) and every file is read relative to it, so swapping the directory or a file for a link
between the check and the copy registers nothing from outside ``--encoders-root``.

The swap is done deterministically between the two steps (inside the copy call), not raced.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qswap.errors import InvalidInputError, NotFoundError
from qswap.server.registry import intake
from qswap.server.registry.intake import copy_encoder, open_under_root

from ..encoders.adapters import make_overrides
from .conftest import ADMIN, LiveServer, server_settings


@pytest.fixture
def root_and_outside(tmp_path, tiny_base) -> tuple[Path, Path]:
    root = tmp_path / "root"
    make_overrides(tiny_base, root / "race", "inside", "bias", seed=61)
    make_overrides(tiny_base, tmp_path / "outside" / "enc", "outside", "bias", seed=62)
    return root, tmp_path / "outside" / "enc"


def _swap_for_link(root: Path, outside: Path) -> None:
    """The attacker's move: the checked directory is renamed away and a link takes its place."""
    os.rename(root / "race", root / "race-moved")
    os.symlink(outside, root / "race", target_is_directory=True)


def test_a_directory_swapped_after_the_check_copies_the_checked_files(root_and_outside, tmp_path):
    root, outside = root_and_outside
    dst = tmp_path / "dst"
    dst.mkdir()
    with open_under_root(root, "race") as src:
        _swap_for_link(root, outside)
        manifest = copy_encoder(src, dst)
    assert manifest.name == "inside"
    for name in manifest.files:
        assert (dst / name).read_bytes() == (root / "race-moved" / name).read_bytes()
    # Checked again now, the path goes through a link: refused.
    with pytest.raises(NotFoundError, match="link"):
        open_under_root(root, "race")


def test_a_file_swapped_for_a_link_after_the_check_is_refused(root_and_outside, tmp_path):
    root, outside = root_and_outside
    dst = tmp_path / "dst"
    dst.mkdir()
    with open_under_root(root, "race") as src:
        (root / "race" / "adapter.safetensors").unlink()
        (root / "race" / "adapter.safetensors").symlink_to(outside / "adapter.safetensors")
        with pytest.raises(InvalidInputError, match="race/adapter.safetensors in the encoder directory is a link"):
            copy_encoder(src, dst)


def test_a_fifo_in_the_encoder_directory_is_refused_without_hanging(root_and_outside, tmp_path):
    root, _ = root_and_outside
    (root / "race" / "adapter.safetensors").unlink()
    os.mkfifo(root / "race" / "adapter.safetensors")
    dst = tmp_path / "dst"
    dst.mkdir()
    with open_under_root(root, "race") as src, pytest.raises(InvalidInputError, match="not a regular file"):
        copy_encoder(src, dst)


def test_live_registration_raced_by_a_link_swap_never_registers_the_outside_encoder(
        root_and_outside, tiny_model_dir, index_dir, tmp_path, monkeypatch):
    root, outside = root_and_outside
    swapped = []
    real_copy = intake.copy_encoder

    def copy_after_swap(src, dst):   # between the check (open) and the copy
        _swap_for_link(root, outside)
        swapped.append(True)
        return real_copy(src, dst)

    monkeypatch.setattr(intake, "copy_encoder", copy_after_swap)
    s = server_settings(tmp_path, tiny_model_dir, index_dir, encoders_root=root, admin_token=ADMIN,
                        read_only_index=True)
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        r = c.post("/v1/encoders", json={"path": "race"})
        assert swapped and r.status_code == 201, r.text
        assert r.json()["encoder"]["key"] == "inside@1"
        assert c.get("/v1/encoders/outside@1").status_code == 404
        # The link is now in place: registering through it is refused, and the message holds
        # no server path.
        monkeypatch.setattr(intake, "copy_encoder", real_copy)
        r = c.post("/v1/encoders", json={"path": "race"})
        assert r.status_code == 404 and "link" in r.json()["detail"], r.text
        assert str(tmp_path) not in r.text


def test_an_upload_is_extracted_once_into_the_store_and_keeps_only_listed_files(
        root_and_outside, tiny_model_dir, index_dir, tmp_path, monkeypatch):
    import io
    import tarfile

    root, _ = root_and_outside
    (root / "race" / "notes.txt").write_text("not listed in the manifest")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(root / "race", arcname="race")
    made: list[Path] = []
    real_extract = intake.extract_encoder_archive

    def extract(fileobj, dest, **kw):
        made.append(Path(dest))
        return real_extract(fileobj, dest, **kw)

    monkeypatch.setattr("qswap.server.state.extract_encoder_archive", extract)
    s = server_settings(tmp_path, tiny_model_dir, index_dir, admin_token=ADMIN, read_only_index=True)
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        r = c.post("/v1/encoders", files={"archive": ("race.tar.gz", buf.getvalue(), "application/gzip")})
        assert r.status_code == 201, r.text
    store = tmp_path / "state" / "encoders"
    assert [p.parent for p in made] == [store]                  # extracted into the store's staging folder
    assert sorted(p.name for p in (store / "inside@1").iterdir()) == sorted(
        p.name for p in (root / "race").iterdir() if p.name != "notes.txt")
    assert sorted(p.name for p in store.iterdir()) == ["inside@1"]   # no staging folder left
