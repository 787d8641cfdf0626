"""Atomic writes: the new file whole, or the old one untouched and no temporary left behind."""

from __future__ import annotations

import hashlib

import pytest

from qswap.atomic import atomic_stream, atomic_write_bytes, atomic_write_via, sha256_file_cached, sha256_file


def test_stream_and_via_replace_whole_files(tmp_path):
    f = tmp_path / "sub" / "a.bin"
    with atomic_stream(f) as w:
        w.write(b"hello ")
        w.write(b"world")
    assert f.read_bytes() == b"hello world" and w.sha.hexdigest() == hashlib.sha256(b"hello world").hexdigest()
    sha = atomic_write_via(f, lambda tmp: open(tmp, "wb").write(b"via"))
    assert f.read_bytes() == b"via" and sha == sha256_file(f)
    assert [p.name for p in f.parent.iterdir()] == ["a.bin"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    f = tmp_path / "a.bin"
    atomic_write_bytes(f, b"old")
    with pytest.raises(RuntimeError):
        with atomic_stream(f) as w:
            w.write(b"half")
            raise RuntimeError("killed")
    with pytest.raises(OSError):
        atomic_write_via(f, lambda tmp: (_ for _ in ()).throw(OSError("disk full")))
    assert f.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]


def test_cached_hash_follows_content_changes(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"one")
    assert sha256_file_cached(f) == sha256_file(f)
    f.write_bytes(b"three")   # size changes: hashed again
    assert sha256_file_cached(f) == hashlib.sha256(b"three").hexdigest()
