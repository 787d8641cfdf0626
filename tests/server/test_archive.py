"""server/registry/intake.py (uploads): archive layouts, refusals, bounded headers, the extraction deadline."""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path

import pytest

from qswap.errors import InvalidInputError
from qswap.server.registry.intake import extract_encoder_archive

def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]], mode: str = "w:gz") -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as t:
        for info, data in members:
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _extract(buf: io.BytesIO, dest: Path, max_bytes: int = 1 << 20, max_members: int = 16) -> Path:
    dest.mkdir()
    return extract_encoder_archive(buf, dest, max_bytes=max_bytes, max_members=max_members)


def test_archive_good_layouts(tmp_path):
    top = _extract(_tar([_file("manifest.json", b"{}"), _file("adapter.safetensors", b"abc")]), tmp_path / "a")
    assert top == tmp_path / "a" and (top / "adapter.safetensors").read_bytes() == b"abc"
    sub = _extract(_tar([_file("enc/manifest.json", b"{}"), _file("./enc/x.bin", b"1")]), tmp_path / "b")
    assert sub == tmp_path / "b" / "enc" and (sub / "x.bin").read_bytes() == b"1"


@pytest.mark.parametrize("case", ["absolute", "dotdot", "symlink", "hardlink", "fifo", "deep", "too_big",
                                  "too_many", "duplicate", "no_manifest", "not_gzip", "garbage"])
def test_archive_refusals(tmp_path, case):
    members = [_file("enc/manifest.json", b"{}")]
    if case == "absolute":
        members.append(_file("/etc/evil", b"x"))
    elif case == "dotdot":
        members.append(_file("enc/../../evil", b"x"))
    elif case in ("symlink", "hardlink"):
        info = tarfile.TarInfo("enc/link")
        info.type = tarfile.SYMTYPE if case == "symlink" else tarfile.LNKTYPE
        info.linkname = "/etc/passwd"
        members.append((info, None))
    elif case == "fifo":
        info = tarfile.TarInfo("enc/pipe")
        info.type = tarfile.FIFOTYPE
        members.append((info, None))
    elif case == "deep":
        members.append(_file("enc/a/b/c", b"x"))
    elif case == "too_big":
        members.append(_file("enc/big", b"0" * 5000))
    elif case == "too_many":
        members += [_file(f"enc/f{i}", b"x") for i in range(20)]
    elif case == "duplicate":
        members += [_file("enc/dup", b"1"), _file("enc/dup", b"2")]
    elif case == "no_manifest":
        members = [_file("enc/other.json", b"{}")]
    if case == "not_gzip":
        buf = _tar(members, mode="w")
    elif case == "garbage":
        buf = io.BytesIO(b"\x1f\x8b" + b"not really gzip" * 10)
    else:
        buf = _tar(members)
    with pytest.raises(InvalidInputError):
        _extract(buf, tmp_path / "out", max_bytes=4096)
    assert not (tmp_path / "evil").exists() and not Path("/etc/evil").exists()


def _pax_bomb(declared: int) -> io.BytesIO:
    """A small gzip whose first member is a PAX header declaring ``declared`` bytes (zeros)."""
    import gzip
    hdr = tarfile.TarInfo("././@PaxHeader")
    hdr.type = tarfile.XHDTYPE
    hdr.size = declared
    block = hdr.tobuf(format=tarfile.USTAR_FORMAT)
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb") as gz:
        gz.write(block)
        zeros = b"0" * (1 << 20)
        for _ in range(declared // len(zeros)):
            gz.write(zeros)
    raw.seek(0)
    return raw


@pytest.mark.serial
def test_archive_huge_extended_header_refused_before_parsing(tmp_path):
    # 64 MB of PAX header compresses to ~64 KB; tarfile alone reads and parses all of it.
    buf = _pax_bomb(64 << 20)
    assert len(buf.getvalue()) < 200_000
    t0 = time.perf_counter()
    with pytest.raises(InvalidInputError, match="extended header declares"):
        _extract(buf, tmp_path / "out")
    assert time.perf_counter() - t0 < 2.0   # refused from the header block, not after reading 64 MB


def test_archive_sparse_and_deadline_and_cancel(tmp_path):
    info = tarfile.TarInfo("enc/s")
    info.type = tarfile.GNUTYPE_SPARSE
    with pytest.raises(InvalidInputError):
        _extract(_tar([_file("enc/manifest.json", b"{}"), (info, None)], mode="w:gz"), tmp_path / "a")
    members = [_file("enc/manifest.json", b"{}"), _file("enc/x", b"1")]
    (tmp_path / "b").mkdir()
    with pytest.raises(InvalidInputError, match="longer than the server allows"):
        extract_encoder_archive(_tar(members), tmp_path / "b", max_bytes=1 << 20, max_members=8,
                                deadline=time.monotonic() - 1)
    (tmp_path / "c").mkdir()
    with pytest.raises(InvalidInputError, match="shutting down"):
        extract_encoder_archive(_tar(members), tmp_path / "c", max_bytes=1 << 20, max_members=8,
                                cancelled=lambda: True)
