"""A process killed (SIGKILL) at any moment of a save leaves the previous index loadable.

A child process opens the index and changes it in a loop (add, delete, upsert, FAISS
snapshots, HNSW rebuilds, re-indexing), printing each committed generation. The parent
kills it after a random delay, then opens the index and checks it: checksums and digest
(done by open), every live document's stored vector matches its text, FAISS holds exactly
the live rows, search finds documents, and nothing committed was lost.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from qswap.index import Document, DocumentIndex, IndexConfig, build_index, create_index
from qswap.index.backends.faiss import faiss_index
from qswap.index.build import staging_dir

CHILD = textwrap.dedent('''
    import hashlib, sys
    import numpy as np
    from qswap.index import Document, DocumentIndex, IndexConfig

    def vec(text):
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        v = np.random.default_rng(seed).standard_normal(32)
        return (v / np.linalg.norm(v)).astype(np.float32)

    # Small thresholds so that snapshots, tombstone rebuilds and chunk merges all happen.
    DocumentIndex.SNAPSHOT_MIN_CHANGES = 4
    DocumentIndex.SNAPSHOT_FRACTION = 0.0
    DocumentIndex.TOMBSTONE_MIN = 6
    DocumentIndex.TOMBSTONE_FRACTION = 0.0
    path, seed = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3 and sys.argv[3] == "pause-after-manifest":
        # Hold the process right after a commit's manifest rename, before it reports the
        # commit: the parent kills it there (the window random kills rarely hit).
        import threading
        from qswap.index import manifest
        from qswap.index.backends.faiss import commit
        def write_then_pause(root, m):
            manifest.write_manifest(root, m)
            print("manifest-written", m["generation"], flush=True)
            threading.Event().wait()
        commit.write_manifest = write_then_pause
    rng = np.random.default_rng(seed)
    idx = DocumentIndex.open(path)
    print("ready", idx.generation, flush=True)
    n = 0
    while True:
        ids = [d.id for d in idx.get([f"d{i}" for i in range(60)]) if d is not None]
        op = rng.integers(0, 10)
        if op < 3 or len(ids) < 10:
            docs = [Document(f"s{seed}-{n + j}", f"s{seed}-{n + j} v0", {"k": int(j)}) for j in range(3)]
            n += 3
            idx.add(docs, np.stack([vec(d.text) for d in docs]))
        elif op < 5:
            idx.delete(list(rng.choice(ids, 2, replace=False)))
        elif op < 8:
            pick = list(rng.choice(ids, 2, replace=False))
            docs = [Document(i, f"{i} v{seed}.{n}", {"up": True}) for i in pick]
            n += 1
            idx.upsert(docs, np.stack([vec(d.text) for d in docs]))
        elif op == 8:
            idx.save()
        else:
            kind = ["flat", "hnsw", "ivf"][int(rng.integers(0, 3))]
            idx.reindex(IndexConfig(kind=kind, quant="sq8", nprobe=64))
        print("committed", idx.generation, flush=True)
''')


def _vec(text: str) -> np.ndarray:
    import hashlib
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
    v = np.random.default_rng(seed).standard_normal(32)
    return (v / np.linalg.norm(v)).astype(np.float32)


def check_consistent(idx: DocumentIndex) -> None:
    ids, vecs = idx.export_embeddings()
    assert len(ids) == len(set(ids)) == idx.count
    docs = idx.get(ids)
    want = np.stack([_vec(d.text) for d in docs])
    # every document's stored vector is the one written with its text (rows line up)
    np.testing.assert_allclose(vecs.astype(np.float32), want, atol=2e-3)
    info = idx.info()
    stored = faiss_index.ids_of(idx._faiss)
    assert len(stored) - info["tombstones"] == idx.count == info["faiss_vectors"] - info["tombstones"]
    hits = idx.search(want[:20], 1)
    assert sum(h[0].id == i for h, i in zip(hits, ids[:20])) >= 19


def test_sigkill_during_saves_leaves_a_loadable_consistent_index(tmp_path, space, embed):
    path = tmp_path / "idx"
    docs = [Document(f"d{i}", f"d{i} v0", {}) for i in range(60)]
    create_index(path, docs, np.stack([_vec(d.text) for d in docs]), space,
                 IndexConfig(kind="hnsw", quant="sq8")).close()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    rng = np.random.default_rng(1)
    deadline = time.monotonic() + 90  # 12 kills take ~12 s on an idle machine
    kills, commits_seen, in_flight = 0, 0, 0
    while kills < 12 and time.monotonic() < deadline:
        p = subprocess.Popen([sys.executable, str(script), str(path), str(kills)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        first = p.stdout.readline()
        if not first.startswith("ready"):
            p.kill()
            pytest.fail(f"child failed: {first}{p.stderr.read()}")
        time.sleep(float(rng.uniform(0.02, 0.4)))
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        lines = [ln.split() for ln in p.stdout.read().splitlines() if ln.startswith("committed")]
        err = p.stderr.read()
        assert "Traceback" not in err, err
        kills += 1
        commits_seen += len(lines)
        last = int(lines[-1][1]) if lines else int(first.split()[1])
        with DocumentIndex.open(path) as idx:
            # durable: every reported commit survived; at most the one in flight also did
            assert last <= idx.generation <= last + 1
            in_flight += idx.generation == last + 1
            check_consistent(idx)
    print(f"{kills} kills, {commits_seen} commits, {in_flight} kills landed after a manifest was written")
    assert kills == 12 and commits_seen >= 20, (kills, commits_seen)

    # The case random kills rarely hit: killed after the manifest rename, before the commit was
    # reported. The new generation is the one that loads, whole and consistent.
    p = subprocess.Popen([sys.executable, str(script), str(path), "99", "pause-after-manifest"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    bound = threading.Timer(60, p.kill)   # a bound, not an ordering: ends a child that never pauses
    bound.start()
    for line in p.stdout:              # a handshake: the child says where it is
        lines.append(line)
        if line.startswith("manifest-written"):
            break
    bound.cancel()
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert lines and lines[-1].startswith("manifest-written"), "".join(lines) + p.stderr.read()
    reported = [int(ln.split()[1]) for ln in lines if ln.startswith(("ready", "committed"))]
    written = int(lines[-1].split()[1])
    assert written == reported[-1] + 1
    with DocumentIndex.open(path) as idx:
        assert idx.generation == written      # killed after the manifest rename: the new state loads
        check_consistent(idx)


BUILD_CHILD = textwrap.dedent('''
    import hashlib, sys, time
    from pathlib import Path
    import numpy as np
    from qswap.index import IndexConfig, build_index
    from qswap.space import EmbeddingSpace

    def embed(texts):
        time.sleep(0.05)
        out = []
        for t in texts:
            seed = int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "little")
            v = np.random.default_rng(seed).standard_normal(32)
            out.append(v / np.linalg.norm(v))
        print("embedded", len(texts), flush=True)
        return np.array(out, dtype=np.float32)

    space = EmbeddingSpace(**{k: v for k, v in __import__("json").loads(sys.argv[3]).items() if k != "fingerprint"})
    build_index(Path(sys.argv[1]), Path(sys.argv[2]), embed, space, IndexConfig(batch_size=8, chunk_rows=24),
                progress=False)
    print("done", flush=True)
''')


@pytest.mark.parametrize("chunk_rows", [24, 4096])
def test_sigkill_during_build_then_resume(tmp_path, corpus, space, embed, chunk_rows):
    """Killed mid-chunk, a build resumes at the last whole batch (also inside one big chunk)."""
    import json
    script = tmp_path / "build_child.py"
    script.write_text(BUILD_CHILD.replace("chunk_rows=24", f"chunk_rows={chunk_rows}"))
    out = tmp_path / "idx"
    p = subprocess.Popen([sys.executable, str(script), str(corpus), str(out), json.dumps(space.to_dict())],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    embedded = 0
    while embedded < 80:  # kill mid-way: 10 batches of 8 are embedded, the 11th may be in flight
        line = p.stdout.readline()
        assert line, p.stderr.read()
        embedded += int(line.split()[1])
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not out.exists() and staging_dir(out).exists()
    again: list[str] = []
    with build_index(corpus, out, lambda t: (again.extend(t), embed(t))[1], space,
                     IndexConfig(batch_size=8, chunk_rows=chunk_rows), progress=False) as idx:
        # at most the batch in flight is embedded twice (before: the whole chunk of 4096)
        assert 150 - 88 <= len(again) <= 150 - 72
        assert idx.count == 150
        ids, vecs = idx.export_embeddings()
        texts = {d.id: d.text for d in idx.get(ids)}
        np.testing.assert_allclose(vecs.astype(np.float32), embed([texts[i] for i in ids]), atol=2e-3)


STEP_CHILD = textwrap.dedent('''
    import hashlib, os, sys
    import numpy as np
    from qswap.index import Document, DocumentIndex
    from qswap.index.backends.faiss import faiss_index
    from qswap.index.backends.faiss import commit
    from qswap.index.backends.faiss.docstore import DocStore
    from qswap.index.backends.faiss.embeddings import EmbeddingStore

    def vec(text):
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        v = np.random.default_rng(seed).standard_normal(32)
        return (v / np.linalg.norm(v)).astype(np.float32)

    def die_after(owner, name):
        real = getattr(owner, name)
        def wrapper(*a, **k):
            out = real(*a, **k)
            os._exit(9)  # as abrupt as SIGKILL: no cleanup, no flush
        setattr(owner, name, staticmethod(wrapper) if isinstance(owner, type) and name == "write_chunk" else wrapper)

    step = sys.argv[2]
    DocumentIndex.SNAPSHOT_MIN_CHANGES = 1
    DocumentIndex.SNAPSHOT_FRACTION = 0.0
    idx = DocumentIndex.open(sys.argv[1])
    target = {"write_chunk": (EmbeddingStore, "write_chunk"), "apply": (DocStore, "apply"),
              "faiss_write": (faiss_index, "write"), "merge": (EmbeddingStore, "merge"),
              "write_manifest": (commit, "write_manifest")}[step]
    die_after(*target)
    docs = [Document("d5", "d5 new", {}), Document("fresh", "fresh v0", {})]
    idx.upsert(docs, np.stack([vec(d.text) for d in docs]))
    print("no crash", flush=True)
''')


@pytest.mark.parametrize("step", ["write_chunk", "apply", "faiss_write", "merge", "write_manifest"])
def test_kill_right_after_each_step_of_a_commit(tmp_path, space, step):
    path = tmp_path / "idx"
    docs = [Document(f"d{i}", f"d{i} v0", {}) for i in range(60)]
    with create_index(path, docs, np.stack([_vec(d.text) for d in docs]), space,
                      IndexConfig(kind="hnsw", quant="sq8")) as idx:
        idx.add([Document("extra", "extra v0", {})], _vec("extra v0")[None])  # so the next add merges chunks
        g0 = idx.generation
    script = tmp_path / "step_child.py"
    script.write_text(STEP_CHILD)
    r = subprocess.run([sys.executable, str(script), str(path), step], capture_output=True, text=True)
    assert r.returncode == 9 and "no crash" not in r.stdout, r.stderr
    with DocumentIndex.open(path) as idx:
        committed = step == "write_manifest"
        assert idx.generation == g0 + committed
        assert idx.count == 61 + committed
        assert idx.get(["d5"])[0].text == ("d5 new" if committed else "d5 v0")
        assert (idx.get(["fresh"])[0] is not None) == committed
        check_consistent(idx)
        listed = set(idx.manifest["files"])
        on_disk = {f"{d}/{p.name}" for d in ("emb", "faiss") for p in (path / d).iterdir()}
        assert on_disk == listed  # leftovers of the killed commit are gone
