"""A full disk (ENOSPC) answers 507 ``insufficient_storage`` with a hint on every write route
(register by path and by upload, upsert, alias change), loses nothing acknowledged before, and
the server works again once space is freed.

The state dir and the index live on a real 24 MB tmpfs that the test fills; where mounting is
not allowed (not root), the same test injects ENOSPC at the write layer (qswap.atomic) and in
SQLite's commit instead.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import sqlite3
import subprocess
import tarfile
from pathlib import Path
from typing import Iterator

import pytest

from .conftest import ADMIN, LiveServer, server_settings


def _mount_tmpfs(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    try:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(path)],
                           capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0


class Disk:
    """A disk that can be filled and freed: a real tmpfs, or injected ENOSPC."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.real = _mount_tmpfs(root)
        self.monkeypatch = monkeypatch
        self.filler = root / "filler"

    def fill(self) -> None:
        if self.real:
            with open(self.filler, "wb", buffering=0) as f:
                for size in (1 << 20, 4096, 1):   # down to the last byte that fits
                    try:
                        while True:
                            f.write(b"\0" * size)
                    except OSError as e:
                        assert e.errno == errno.ENOSPC
            return
        import qswap.atomic as atomic
        import qswap.index.backends.faiss.docstore as docstore

        def full(*a, **kw):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.monkeypatch.setattr(atomic, "_tmp_in", full)
        self.monkeypatch.setattr(atomic, "_open_append", full)   # the registry's journal

        def apply_full(self_, *a, **kw):
            err = sqlite3.OperationalError("database or disk is full")
            err.sqlite_errorcode = 13   # type: ignore[attr-defined]
            raise err
        self.monkeypatch.setattr(docstore.DocStore, "apply", apply_full)

    def free(self) -> None:
        if self.real:
            self.filler.unlink()
        else:
            self.monkeypatch.undo()

    def close(self) -> None:
        if self.real:
            subprocess.run(["umount", "-l", str(self.root)], capture_output=True, timeout=30)


@pytest.fixture
def disk(tmp_path, monkeypatch) -> Iterator[Disk]:
    d = Disk(tmp_path / "disk", monkeypatch)
    yield d
    d.close()


def _archive(src: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        t.add(src, arcname=src.name)
    return buf.getvalue()


def _is_507(r) -> None:
    assert r.status_code == 507, r.text
    body = r.json()
    assert body["error"] == "insufficient_storage" and "disk" in body["detail"] and body["hint"], body


def test_full_disk_answers_507_and_loses_nothing_acknowledged(disk, tiny_model_dir, index_dir, encoders_root):
    shutil.copytree(index_dir, disk.root / "index")
    s = server_settings(disk.root, tiny_model_dir, disk.root / "index", encoders_root=encoders_root,
                        admin_token=ADMIN, backend="torch")
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        # Acknowledged before the disk fills: an encoder, an alias, a document.
        assert c.post("/v1/encoders", json={"path": "ft1"}).status_code == 201
        assert c.put("/v1/aliases/games", json={"encoder": "ft@1"}).status_code == 200
        assert c.post("/v1/documents", json={"documents": [{"id": "kept", "text": "chess game"}]}).status_code == 200

        disk.fill()
        _is_507(c.post("/v1/encoders", json={"path": "bias1"}))
        _is_507(c.post("/v1/encoders", files={"archive": ("a.tar.gz", _archive(encoders_root / "part1"),
                                                          "application/gzip")}))
        _is_507(c.post("/v1/documents", json={"documents": [{"id": "lost", "text": "chess puzzle " * 200}]}))
        # An alias change is one journal line: on a real disk it may still fit the journal's last
        # block (then it is committed like any acknowledged change); when it does not, 507.
        sound = c.put("/v1/aliases/sound", json={"encoder": "ft@1"})
        if sound.status_code != 200 or not disk.real:
            _is_507(sound)
        aliases = {"games": "ft@1", **({"sound": "ft@1"} if sound.status_code == 200 else {})}
        metrics = c.get("/metrics").text
        assert 'qswap_errors_total{code="insufficient_storage",status="507"}' in metrics

        # Reads still work on a full disk, and nothing acknowledged is gone.
        r = c.post("/v1/search", json={"query": "chess", "k": 1, "domain": "games"})
        assert r.status_code == 200 and r.json()["results"][0]["encoder"]["key"] == "ft@1"
        assert c.get("/v1/aliases").json()["aliases"] == aliases
        keys = {e["key"] for e in c.get("/v1/encoders").json()["encoders"]}
        assert keys == {"base", "ft@1"}   # the refused registrations left nothing behind

        disk.free()
        assert c.post("/v1/encoders", json={"path": "bias1"}).status_code == 201
        assert c.post("/v1/documents", json={"documents": [{"id": "after", "text": "chess"}]}).status_code == 200
        for doc_id in ("kept", "after"):
            hits = c.post("/v1/search", json={"query": "chess", "k": 60, "with_text": False}).json()
            assert doc_id in {h["id"] for h in hits["results"][0]["hits"]}
        hits = c.post("/v1/search", json={"query": "chess", "k": 60, "with_text": False}).json()
        assert "lost" not in {h["id"] for h in hits["results"][0]["hits"]}
    # a restart on the same dirs finds the acknowledged state
    with LiveServer(s) as srv, srv.client(ADMIN) as c:
        assert {e["key"] for e in c.get("/v1/encoders").json()["encoders"]} == {"base", "ft@1", "bias@1"}
        assert c.get("/v1/aliases").json()["aliases"] == aliases


def test_a_full_disk_says_in_the_log_what_needed_the_space(caplog):
    """The 507 answer stays generic; the log names the file and what it was for (e.g. the
    document tower's ONNX export that the first upsert makes)."""
    import errno
    import logging

    from qswap.server.http.errors import storage_error

    exc = OSError(errno.ENOSPC, "No space left on device", "/srv/qswap/state/onnx/documents-fp32.onnx")
    with caplog.at_level(logging.WARNING, logger="qswap.server"):
        err = storage_error(RuntimeError("export failed"))
        assert err is None                                   # not a full disk: nothing logged
        err = storage_error(exc)
    assert err is not None and err.status == 507
    rec = [r for r in caplog.records if r.getMessage() == "disk full: a write failed"]
    assert len(rec) == 1 and rec[0].path.endswith("documents-fp32.onnx") and "ONNX export" in rec[0].writing
