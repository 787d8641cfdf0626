"""Atomic writes: the new file whole, or the old one untouched and no temporary left behind."""

from __future__ import annotations

import hashlib
from pathlib import Path

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


def test_stored_hash_serves_a_new_process_until_the_file_changes(tmp_path, monkeypatch):
    import os

    import qswap.atomic

    f, store = tmp_path / "w.bin", tmp_path / "store"
    f.write_bytes(b"one")
    assert sha256_file_cached(f, store) == hashlib.sha256(b"one").hexdigest()
    hashed: list[Path] = []
    monkeypatch.setattr(qswap.atomic, "sha256_file", lambda p, *a: hashed.append(p) or sha256_file(p, *a))
    monkeypatch.setattr(qswap.atomic, "_sha_memo", {})   # as in a new process: the record answers
    assert sha256_file_cached(f, store) == hashlib.sha256(b"one").hexdigest() and hashed == []
    # Same size, mtime put back: the change time still moves, so the file is hashed again.
    st = f.stat()
    f.write_bytes(b"two")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    monkeypatch.setattr(qswap.atomic, "_sha_memo", {})
    assert sha256_file_cached(f, store) == hashlib.sha256(b"two").hexdigest() and len(hashed) == 1
    (next(store.iterdir())).write_text("{torn")   # an unreadable record: hashed again, rewritten
    monkeypatch.setattr(qswap.atomic, "_sha_memo", {})
    assert sha256_file_cached(f, store) == hashlib.sha256(b"two").hexdigest() and len(hashed) == 2
    monkeypatch.setattr(qswap.atomic, "_sha_memo", {})
    assert sha256_file_cached(f, store) == hashlib.sha256(b"two").hexdigest() and len(hashed) == 2
    # Within one process, a file already hashed and recorded is answered from memory: the record
    # is neither read nor written again.
    record = next(store.iterdir())
    record.write_text("{torn")
    assert sha256_file_cached(f, store) == hashlib.sha256(b"two").hexdigest() and len(hashed) == 2
    assert record.read_text() == "{torn"


def test_staged_dir_swaps_in_a_complete_directory_or_nothing(tmp_path):
    from qswap.atomic import staged_dir

    target = tmp_path / "out" / "set"
    with staged_dir(target) as staging:
        assert staging.parent == target.parent and not target.exists()
        (staging / "a.txt").write_text("one")
    assert (target / "a.txt").read_text() == "one" and oct(target.stat().st_mode & 0o777) == "0o755"

    with pytest.raises(RuntimeError):
        with staged_dir(target) as staging:
            (staging / "a.txt").write_text("half")
            raise RuntimeError("killed mid-write")
    assert (target / "a.txt").read_text() == "one"                 # the old directory, untouched
    assert sorted(p.name for p in target.parent.iterdir()) == ["set"]   # no staging left behind

    with staged_dir(target, prefix=".set.staging-") as staging:
        assert staging.name.startswith(".set.staging-")
        (staging / "b.txt").write_text("two")
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]   # replaced whole, not merged
