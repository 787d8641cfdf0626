"""Hostile encoder uploads through HTTP: each is refused with a 4xx, quickly, and changes
nothing: the encoder list and a reference query's scores (base and a LoRA) are the same bit for
bit afterwards, and no extraction folder is left in the state dir."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from .conftest import ADMIN, LiveServer, server_settings

QUERIES = ["chess puzzle game", "network server linux"]


def _gz_tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for info, data in members:
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _member(name: str, data: bytes = b"x", kind: bytes = tarfile.REGTYPE, link: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, (data if kind == tarfile.REGTYPE else None)


def _encoder_members(src: Path, prefix: str = "enc") -> list[tuple]:
    return [_member(f"{prefix}/{p.name}", p.read_bytes()) for p in sorted(src.iterdir()) if p.is_file()]


def _pax_bomb(declared: int) -> bytes:
    """A gzip whose first tar header is a PAX header declaring ``declared`` bytes of zeros."""
    hdr = tarfile.TarInfo("././@PaxHeader")
    hdr.type = tarfile.XHDTYPE
    hdr.size = declared
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1) as gz:
        gz.write(hdr.tobuf(format=tarfile.USTAR_FORMAT))
        zeros = b"0" * (8 << 20)
        for _ in range(declared >> 23):
            gz.write(zeros)
    return raw.getvalue()


def _zero_bomb(n_bytes: int) -> bytes:
    """A valid gzip tar whose one member is ``n_bytes`` of zeros (tiny compressed)."""
    info = tarfile.TarInfo("enc/adapter.safetensors")
    info.size = n_bytes
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9) as gz:
        gz.write(info.tobuf(format=tarfile.GNU_FORMAT))
        zeros = b"\0" * (1 << 20)
        for _ in range(n_bytes >> 20):
            gz.write(zeros)
        gz.write(b"\0" * 1024)
    return raw.getvalue()


def _tampered(encoders_root: Path) -> bytes:
    members = _encoder_members(encoders_root / "part1")
    return _gz_tar([(i, b"\0" * len(d)) if i.name.endswith(".safetensors") else (i, d) for i, d in members])


# name -> (archive builder, expected status)
CASES: dict[str, tuple[Callable[[Path], bytes], int]] = {
    "pax_header_400MB": (lambda root: _pax_bomb(400 << 20), 400),
    "zeros_beyond_extracted_limit": (lambda root: _zero_bomb(8 << 20), 400),
    "not_gzip": (lambda root: b"PK\x03\x04 a zip, not a tar.gz" * 10, 400),
    "gzip_not_tar": (lambda root: gzip.compress(b"hello" * 1000), 400),
    "truncated_gzip": (lambda root: _gz_tar(_encoder_members(root / "ft1"))[:300], 400),
    "symlink": (lambda root: _gz_tar(_encoder_members(root / "ft1") + [
        _member("enc/evil", kind=tarfile.SYMTYPE, link="/etc/passwd")]), 400),
    "hardlink": (lambda root: _gz_tar(_encoder_members(root / "ft1") + [
        _member("enc/evil", kind=tarfile.LNKTYPE, link="enc/manifest.json")]), 400),
    "dotdot": (lambda root: _gz_tar(_encoder_members(root / "ft1") + [_member("enc/../../evil")]), 400),
    "absolute": (lambda root: _gz_tar(_encoder_members(root / "ft1") + [_member("/tmp/qswap-evil")]), 400),
    "device": (lambda root: _gz_tar(_encoder_members(root / "ft1") + [
        _member("enc/dev", kind=tarfile.CHRTYPE)]), 400),
    "too_many_members": (lambda root: _gz_tar(_encoder_members(root / "ft1") + [
        _member(f"enc/f{i}") for i in range(80)]), 400),
    "duplicate_member": (lambda root: _gz_tar(_encoder_members(root / "ft1") + [
        _member("enc/manifest.json", b"{}")]), 400),
    "no_manifest": (lambda root: _gz_tar([_member("enc/adapter.safetensors", b"0" * 64)]), 400),
    "manifest_not_json": (lambda root: _gz_tar([_member("enc/manifest.json", b"\xff\xfe not json")]), 422),
    "checksum_mismatch": (_tampered, 422),
    "other_embedding_space": (lambda root: _gz_tar(_encoder_members(root / "alien")), 409),
}


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory, tiny_model_dir, index_dir, encoders_root) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("hostile")
    # torch: reference scores must not move when a background ONNX export finishes between snapshots
    s = server_settings(tmp, tiny_model_dir, index_dir, encoders_root=encoders_root, admin_token=ADMIN,
                        max_extracted_bytes=4 << 20, upload_timeout_s=20, backend="torch")
    with LiveServer(s) as srv:
        with srv.client(ADMIN) as c:
            assert c.post("/v1/encoders", json={"path": "ft1"}).status_code == 201
        yield srv


def _snapshot(c) -> tuple:
    encoders = sorted((e["key"], e["loaded"]) for e in c.get("/v1/encoders").json()["encoders"])
    scores = [c.post("/v1/search", json={"queries": QUERIES, "k": 10, "encoder": enc, "with_text": False}).json()
              ["results"] for enc in ("base", "ft@1")]
    return encoders, json.dumps([[r["hits"] for r in res] for res in scores])


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_upload_refused_and_changes_nothing(hostile_server, encoders_root, case):
    build, status = CASES[case]
    archive = build(encoders_root)
    store = hostile_server.app.state.qs.registry.store   # uploads are extracted into .incoming-* here
    with hostile_server.client(ADMIN) as c:
        before = _snapshot(c)
        t0 = time.perf_counter()
        r = c.post("/v1/encoders", files={"archive": ("enc.tar.gz", archive, "application/gzip")})
        took = time.perf_counter() - t0
        assert r.status_code == status, (case, r.status_code, r.text)
        body = r.json()
        assert body["detail"] and body["hint"] and body["error"]
        assert took < 10, f"{case}: refusing took {took:.1f}s"
        assert _snapshot(c) == before, case
    assert store.is_dir() and not list(store.glob(".incoming-*")), case
    assert not Path("/tmp/qswap-evil").exists()


def test_a_good_upload_still_works_after_the_hostile_ones(hostile_server, encoders_root):
    members = _encoder_members(encoders_root / "bias1")
    with hostile_server.client(ADMIN) as c:
        r = c.post("/v1/encoders", files={"archive": ("enc.tar.gz", _gz_tar(members), "application/gzip")})
        assert r.status_code in (200, 201), r.text
        assert c.post("/v1/search", json={"query": "x", "encoder": "bias@1"}).status_code == 200
