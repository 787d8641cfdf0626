"""Server parts without HTTP: archive safety, micro-batching, registry LRU / refcounts, settings."""

from __future__ import annotations

import asyncio
import io
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from qswap.errors import (ConflictError, GuardRefusedError, IndexCorruptError, IntegrityError, InvalidInputError, NotFoundError,
                          SpaceMismatchError)
from qswap.server.intake import extract_encoder_archive
from qswap.server.batching import MicroBatcher
from qswap.server.config import ServerSettings, is_loopback
from qswap.server.errors import DeadlineExceededError, LimitExceededError, OverloadedError, status_for
from qswap.server.registry import version_order

# ----------------------------------------------------------------------------- archives


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


# ----------------------------------------------------------------------------- batching


def _fake(calls: list, fail_key: str | None = None):
    def encode(texts, keys):
        calls.append(("encode", list(texts), list(keys), threading.current_thread().name))
        if fail_key in keys:
            raise InvalidInputError(f"bad key {fail_key}")
        # row i -> a vector that encodes which text it was: search returns it as the hit id
        return np.array([[float(len(t)), float(hash(k) % 7)] for t, k in zip(texts, keys)], dtype=np.float32)

    def search(q, k, flt, with_text):
        calls.append(("search", len(q), k, flt))
        return [[f"{int(row[0])}:{r}" for r in range(k)] for row in q]
    return encode, search


def _run(coro):
    return asyncio.run(coro)


def test_batcher_merges_concurrent_requests_into_one_pass():
    calls: list = []
    enc, srch = _fake(calls)
    b = MicroBatcher(encode=enc, search=srch, window_s=0.2, max_batch=64, adaptive=False)
    b.start()
    try:
        async def main():
            texts = [["a" * (i + 1)] * (1 + i % 2) for i in range(10)]
            outs = await asyncio.gather(*[b.search(t, f"k{i % 3}", k=2 + i % 3) for i, t in enumerate(texts)])
            return texts, outs, threading.current_thread().name
        texts, outs, loop_thread = _run(main())
    finally:
        b.stop()
    encodes = [c for c in calls if c[0] == "encode"]
    searches = [c for c in calls if c[0] == "search"]
    assert len(encodes) == 1 and len(encodes[0][1]) == sum(len(t) for t in texts)
    assert len(searches) == 1 and searches[0][2] == 4            # one call, largest k of the group
    assert encodes[0][3] == "qswap-batcher" != loop_thread       # model code never on the event loop
    for i, (t, out) in enumerate(zip(texts, outs)):
        assert len(out.hits) == len(t)
        assert all(len(h) == 2 + i % 3 for h in out.hits)        # each request gets its own k
        assert all(h[0].startswith(f"{len(t[0])}:") for h in out.hits)  # and its own rows
        assert out.batch_requests == 10


def test_batcher_adaptive_window_skips_the_wait_when_idle():
    """A lone request is not held for the window; under load the window batches again."""
    calls: list = []
    enc, srch = _fake(calls)
    b = MicroBatcher(encode=enc, search=srch, window_s=0.5, max_batch=64)
    b.start()
    try:
        async def lone():
            t0 = time.perf_counter()
            await b.search(["x"], "k", k=1)
            return time.perf_counter() - t0
        assert _run(lone()) < 0.25                    # did not wait the 0.5 s window
        b._last_requests = 2                          # as after a batch of several requests
        async def burst():
            return await asyncio.gather(*[b.search(["y"], "k", k=1) for _ in range(5)])
        outs = _run(burst())
    finally:
        b.stop()
    assert all(o.batch_requests == 5 for o in outs)   # the window collected the whole burst


def test_batcher_isolates_failures():
    calls: list = []
    enc, srch = _fake(calls, fail_key="bad")
    done: list[str] = []
    b = MicroBatcher(encode=enc, search=srch, window_s=0.2, max_batch=64, adaptive=False)
    b.start()
    try:
        async def main():
            return await asyncio.gather(
                b.search(["x"], "good", 1, {"s": "a"}, on_done=lambda: done.append("1")),
                b.search(["yy"], "bad", 1, on_done=lambda: done.append("2")),
                b.search(["zzz"], "good", 1, {"s": "b"}, on_done=lambda: done.append("3")),
                b.search(["w"], "good", 1, {"s": "a"}, on_done=lambda: done.append("4")),
                return_exceptions=True)
        outs = _run(main())
    finally:
        b.stop()
    assert isinstance(outs[1], InvalidInputError)
    assert [o.hits[0][0] for o in (outs[0], outs[2], outs[3])] == ["1:0", "3:0", "1:0"]
    assert sorted(done) == ["1", "2", "3", "4"]                 # every reference released once


def test_batcher_one_search_per_distinct_filter():
    calls: list = []
    enc, srch = _fake(calls)
    b = MicroBatcher(encode=enc, search=srch, window_s=0.2, max_batch=64, adaptive=False)
    b.start()
    try:
        async def main():
            return await asyncio.gather(b.search(["x"], "k", 1, {"s": "a"}), b.search(["yy"], "k", 3, {"s": "b"}),
                                        b.search(["zzz"], "k", 2, {"s": "a"}))
        outs = _run(main())
    finally:
        b.stop()
    assert len([c for c in calls if c[0] == "encode"]) == 1
    assert sorted((str(c[3]), c[1], c[2]) for c in calls if c[0] == "search") == [
        ("{'s': 'a'}", 2, 2), ("{'s': 'b'}", 1, 3)]
    assert [len(o.hits[0]) for o in outs] == [1, 3, 2]


def test_batcher_respects_max_batch_and_runs_calls_on_worker():
    calls: list = []
    enc, srch = _fake(calls)
    b = MicroBatcher(encode=enc, search=srch, window_s=0.2, max_batch=4, adaptive=False)
    b.start()
    try:
        async def main():
            outs = await asyncio.gather(*[b.search(["q"] * 3, "k", 1) for _ in range(4)])
            name = await b.call(lambda: threading.current_thread().name)
            return outs, name
        outs, name = _run(main())
    finally:
        b.stop()
    assert name == "qswap-batcher"
    assert all(len(c[1]) <= 4 for c in calls if c[0] == "encode")
    assert sum(len(c[1]) for c in calls if c[0] == "encode") == 12 and len(outs) == 4


# ----------------------------------------------------------------------------- registry


@pytest.fixture()
def registry(tmp_path, tiny_base):
    from qswap.encoders import EncoderPool
    from qswap.server.backend import TorchBackend, make_backend
    from qswap.server.registry import EncoderRegistry
    def make(budget: int = 1 << 30, default: str = "base", backend: str = "torch") -> EncoderRegistry:
        pool = EncoderPool(tiny_base)   # a new registry is a restart: a new pool
        be = TorchBackend(pool) if backend == "torch" else make_backend(backend, pool, tmp_path / "onnx", 1)
        r = EncoderRegistry(state_dir=tmp_path / "state", pool=pool, space=tiny_base.space,
                            backend=be, default_encoder=default, memory_budget=budget)
        r.load_state()
        made.append(r)
        return r
    made: list = []
    yield make
    for r in made:
        r.close()


def test_registry_lru_budget_pins_and_reloads(registry, encoders_root):
    reg = registry(budget=1)   # smaller than any adapter: only pinned / in-use / newest stay
    reg.register(encoders_root / "ft1")
    reg.set_alias("games", "ft@1")                   # pinned from now on
    for d in ("ft2", "bias1"):
        reg.register(encoders_root / d)
    assert [k for k in reg.keys() if reg.is_loaded(k)] == ["bias@1", "ft@1"]   # ft@2 was evicted
    assert "ft@2" not in reg.pool
    reg.register(encoders_root / "part1")
    assert reg.is_loaded("ft@1") and reg.is_loaded("part@1") and not reg.is_loaded("bias@1")
    key = reg.acquire(encoder="ft")                  # name -> latest version
    assert key == "ft@2" and not reg.is_loaded(key)
    reg.ensure_loaded(key)                           # first use loads it again
    assert reg.is_loaded("ft@2") and reg.pool.encode(["chess"], ["ft@2"]).shape == (1, 32)
    reg.register(encoders_root / "bias1")            # identical again: nothing evicts the in-use ft@2
    assert reg.is_loaded("ft@2")
    reg.release(key)


def test_registry_budget_counts_the_onnx_session(registry, encoders_root):
    reg = registry(backend="onnx")
    reg.register(encoders_root / "ft1")
    pool_bytes = reg.pool.memory_bytes("ft@1")
    session_bytes = reg.backend.memory_bytes("ft@1")
    assert session_bytes > pool_bytes > 0   # a whole transformer copy vs a LoRA adapter
    assert reg.info("ft@1", "v")["memory_bytes"] == pool_bytes + session_bytes
    # A budget that fits the adapters but not their sessions keeps only the newest loaded.
    reg.close()
    reg2 = registry(budget=2 * pool_bytes + session_bytes, backend="onnx")
    for d in ("ft2", "bias1"):
        reg2.register(encoders_root / d)
    assert [k for k in reg2.keys() if reg2.is_loaded(k)] == ["bias@1"]


def test_registry_survives_deleting_the_only_lora(registry, encoders_root):
    reg = registry()
    reg.register(encoders_root / "ft1")
    reg.delete("ft@1")
    assert reg.pool.encode(["chess"], ["base"]).shape == (1, 32)


def test_registry_persists_and_copies(registry, encoders_root, tmp_path):
    import shutil
    src = tmp_path / "src"
    shutil.copytree(encoders_root / "bias1", src)
    reg = registry()
    rec, created = reg.register(src, source="test")
    assert created and reg.register(src)[1] is False          # identical: idempotent
    reg.set_alias("sound", "bias@1")
    (src / "adapter.safetensors").write_bytes(b"changed after registration")
    with pytest.raises(ConflictError, match="another server"):
        registry()                                             # one server per state dir
    reg.close()
    reg2 = registry()                                          # a restart with the same state dir
    assert reg2.keys() == ["bias@1"] and reg2.aliases() == {"sound": "bias@1"}
    reg2.ensure_loaded("bias@1")                               # loads the server's own verified copy
    assert reg2.resolve(domain="sound") == "bias@1"


def test_registry_refusals(registry, encoders_root, tmp_path):
    import shutil

    from qswap.encoders import load_encoder, save_encoder
    reg = registry()
    with pytest.raises(SpaceMismatchError) as e:
        reg.register(encoders_root / "alien")
    assert e.value.field == "weights_sha256"
    bad = tmp_path / "tampered"
    shutil.copytree(encoders_root / "bias1", bad)
    (bad / "adapter.safetensors").write_bytes(b"tampered")
    with pytest.raises(IntegrityError):
        reg.register(bad)
    link = tmp_path / "linked"
    shutil.copytree(encoders_root / "bias1", link)
    (link / "adapter.safetensors").unlink()
    (link / "adapter.safetensors").symlink_to(encoders_root / "bias1" / "adapter.safetensors")
    with pytest.raises(InvalidInputError):
        reg.register(link)
    # the guard: a failed record is refused unless forced
    art = load_encoder(encoders_root / "bias1")
    g = tmp_path / "guarded"
    save_encoder(g, name="guarded", version="1", kind="bias", space=art.manifest.embedding_space(),
                 tensors=art.overrides, guard={"passed": False, "checks": [
                     {"name": "s", "metric": "mrr", "degraded": True, "z": -3.0}]})
    with pytest.raises(GuardRefusedError, match=r"s \(mrr, Z=-3.00\)") as e:
        reg.register(g)
    assert e.value.guard["passed"] is False                   # the refusal carries its evidence
    assert reg.keys() == []
    rec, created = reg.register(g, force=True)
    assert created and rec.forced and rec.guard_status == "unguarded"   # no sentinels on this registry
    assert sorted(reg.keys()) == ["guarded@1"]                # nothing of the refused ones stays
    assert [p.name for p in reg.store.iterdir()] == ["guarded@1"]


def test_registry_delete_waits_for_in_flight(registry, encoders_root):
    reg = registry()
    reg.register(encoders_root / "bias1")
    key = reg.acquire(encoder="bias@1")
    t = threading.Thread(target=reg.delete, args=("bias@1", 10.0))
    t.start()
    with reg._released:                                          # the condition the delete waits on
        assert reg._released.wait_for(lambda: reg.is_deleting(key), 10)
    assert t.is_alive()                                          # still waiting for our reference
    with pytest.raises(NotFoundError):
        reg.acquire(encoder="bias@1")                            # but new requests are refused
    assert reg.pool.encode(["still served"], [key]).shape == (1, 32)
    reg.release(key)
    t.join(5)
    assert not t.is_alive() and reg.keys() == [] and "bias@1" not in reg.pool


def test_registry_delete_refusals(registry, encoders_root):
    reg = registry()
    reg.register(encoders_root / "bias1")
    reg.set_alias("x", "bias@1")
    with pytest.raises(ConflictError):
        reg.delete("bias@1")
    with pytest.raises(InvalidInputError):
        reg.delete("bias")
    reg.delete_alias("x")
    key = reg.acquire(encoder="bias@1")
    with pytest.raises(ConflictError):
        reg.delete("bias@1", timeout_s=0.1)                      # in use past the timeout
    reg.release(key)
    assert reg.resolve(encoder="bias") == "bias@1"               # the refused delete left it usable
    reg.delete("bias@1")


def test_torch_backend_runs_large_batches_in_bf16(tiny_base, encoders_root):
    from qswap.encoders import EncoderPool, load_encoder
    from qswap.server.backend import TorchBackend, make_backend
    pool = EncoderPool(tiny_base)
    pool.add(load_encoder(encoders_root / "ft1", tiny_base.space))
    texts = [f"query number {i} about chess" for i in range(8)]
    keys = ["ft@1"] * 8
    fp32 = TorchBackend(pool).encode(texts, keys)
    bf16 = TorchBackend(pool, "bf16", bf16_min_batch=8)
    assert [bf16.precision_for(n) for n in (1, 7, 8, 64)] == ["fp32", "fp32", "bf16", "bf16"]
    assert bf16.precision_for(64, encoders=2) == "fp32"
    # Below the threshold: exactly the fp32 answer; at it: bf16 rounding, still the same direction.
    assert np.array_equal(bf16.encode(texts[:7], keys[:7]), fp32[:7])
    got = bf16.encode(texts, keys)
    assert not np.array_equal(got, fp32)
    assert np.sum(got * fp32, axis=1).min() > 0.99
    # A batch mixing encoders stays fp32.
    mixed = ["ft@1", "base"] * 4
    assert np.array_equal(bf16.encode(texts, mixed), TorchBackend(pool).encode(texts, mixed))
    with pytest.raises(InvalidInputError, match="torch backend"):
        make_backend("onnx", pool, Path("/nonexistent"), precision="bf16")
    with pytest.raises(InvalidInputError, match="unknown precision"):
        TorchBackend(pool, "fp16")


# ----------------------------------------------------------------------------- settings and errors


def test_settings_refuse_unsafe(tmp_path):
    with pytest.raises(InvalidInputError):
        ServerSettings(insecure=True, host="0.0.0.0").check()
    ServerSettings(insecure=True, host="127.0.0.1").check()
    ServerSettings(insecure=True, host="::1").check()
    with pytest.raises(InvalidInputError):
        ServerSettings(admin_token="short").check()
    assert ServerSettings(admin_token="x" * 20).admin_mode == "token"
    assert ServerSettings().admin_mode == "disabled"
    with pytest.raises(InvalidInputError, match="needs the torch backend"):
        ServerSettings(backend="onnx", query_precision="bf16").check()
    ServerSettings(backend="torch", query_precision="bf16").check()
    assert is_loopback("localhost") and not is_loopback("10.0.0.1")


def test_settings_from_environment(monkeypatch):
    monkeypatch.setenv("QSWAP_ADMIN_TOKEN", "t" * 32)
    monkeypatch.setenv("QSWAP_MAX_K", "7")
    s = ServerSettings()
    assert s.admin_token.get_secret_value() == "t" * 32 and s.max_k == 7


def test_settings_refuse_blank_tokens():
    for tok in (" " * 20, "\t" * 20, "abcdefgh ijklmnopq"):
        with pytest.raises(InvalidInputError, match="whitespace"):
            ServerSettings(admin_token=tok).check()
    with pytest.raises(InvalidInputError):
        ServerSettings(search_token=" " * 32).check()


def test_version_order_is_numeric_where_numeric():
    def highest(*versions: str) -> str:
        return max(versions, key=version_order)
    assert highest("9", "10", "2") == "10"
    assert highest("1.9", "1.10", "1.2") == "1.10"
    assert highest("v2", "v10") == "v10"
    assert highest("a", "b") == "b"
    assert highest("2024-01-31", "2024-02-01") == "2024-02-01"


def test_batcher_admission_limits_and_deadlines():
    release = threading.Event()

    def encode(texts, keys):
        release.wait(5)
        return np.zeros((len(texts), 2), dtype=np.float32)

    def search(q, k, flt, with_text):
        return [[] for _ in q]

    async def main():
        b = MicroBatcher(encode=encode, search=search, window_s=0.0, max_batch=1, max_pending=3,
                         max_pending_per_encoder=2)
        b.start()
        first = asyncio.ensure_future(b.search(["a"], "e1", 1))          # runs (blocked in encode)
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(b.search(["b"], "e1", 1, timeout_s=0.1))   # waits, expires
        await asyncio.sleep(0.01)
        with pytest.raises(OverloadedError):                             # e1 has 2 admitted
            await b.search(["c"], "e1", 1)
        other = asyncio.ensure_future(b.search(["d"], "e2", 1))         # overall 3 of 3
        await asyncio.sleep(0.01)
        with pytest.raises(OverloadedError):
            await b.search(["e"], "e3", 1)
        with pytest.raises(DeadlineExceededError):
            await queued
        release.set()
        await first
        await other
        await asyncio.sleep(0.05)
        assert b.pending == 0                                            # the dropped job left the count
        await b.search(["f"], "e1", 1)
        b.drain()
        with pytest.raises(Exception, match="shutting down"):
            await b.search(["g"], "e1", 1)
        b.stop()
    _run(main())


def test_error_map_is_the_one_table():
    assert status_for(OverloadedError("m")) == (429, "overloaded")
    assert status_for(DeadlineExceededError("m")) == (504, "deadline_exceeded")
    assert status_for(IndexCorruptError("m")) == (500, "index_corrupt")   # a subclass overrides its parent


def test_error_map():
    assert status_for(SpaceMismatchError("m", "dim", 1, 2)) == (409, "space_mismatch")
    assert status_for(GuardRefusedError("m")) == (409, "guard_refused")
    assert status_for(ConflictError("m")) == (409, "conflict")
    assert status_for(NotFoundError("m")) == (404, "not_found")
    assert status_for(IntegrityError("m")) == (422, "integrity_error")
    assert status_for(LimitExceededError("m")) == (422, "limit_exceeded")
    assert status_for(InvalidInputError("m")) == (400, "invalid_input")


def test_registry_name_resolves_to_the_highest_version(registry, tiny_base, tmp_path):
    from ..encoders.adapters import make_overrides
    r = registry()
    # Registered out of order: "10" last-but-one, "9" last; the highest is 10, not the latest.
    for v in ("2", "10", "9"):
        r.register(make_overrides(tiny_base, tmp_path / f"v{v}", "ver", "bias", seed=40 + int(v), version=v))
    assert r.resolve(encoder="ver") == "ver@10"
    r.delete("ver@10")
    assert r.resolve(encoder="ver") == "ver@9"


def test_register_by_path_refuses_hard_links(registry, tiny_base, tmp_path):
    import os

    from qswap.server.intake import open_under_root

    from ..encoders.adapters import make_overrides
    r = registry()
    root = tmp_path / "root"
    enc = make_overrides(tiny_base, tmp_path / "outside", "hl", "bias", seed=50)
    (root / "hl").mkdir(parents=True)
    for p in enc.iterdir():
        os.link(p, root / "hl" / p.name)   # the files live outside the root too
    with pytest.raises(InvalidInputError, match="hard links"):
        with open_under_root(root, "hl") as src:
            r.register(src)
    assert "hl@1" not in r.keys()
    with pytest.raises(NotFoundError):
        open_under_root(root, "x" * 300)


def test_registry_counts_a_shared_lora_encoder_at_its_adapter_bytes(registry, encoders_root):
    # The shared runtime binds a LoRA adapter in place: the budget must count the adapter, not
    # the merged transformer a per-encoder export would hold (else ~10 LoRA encoders of e5-small
    # fill a 1 GiB budget and the LRU evicts the rest).
    reg = registry(backend="shared")
    reg.backend.wait(timeout=120)
    key = reg.register(encoders_root / "ft1")[0].key
    footprint = reg.cache.loaded[key]
    assert reg.backend.runtime(key) == "onnx-shared"
    assert footprint == reg.pool.memory_bytes(key) < reg.backend.merged.memory_bytes(key)


def test_guard_encodes_sentinels_length_sorted_but_keeps_query_order():
    from qswap.guard.evaluator import SentinelGuard, SentinelSet
    texts = [("q" * n) + f" {i}" for i, n in enumerate([3, 40, 1, 17, 25, 2, 33] * 10)]
    calls: list[list[str]] = []

    def encode(chunk: list[str], keys: list[str]) -> np.ndarray:
        calls.append(chunk)
        return np.array([[len(t), float(t.split()[-1])] for t in chunk], dtype=np.float32)

    s = SentinelSet("s", None, [str(i) for i in range(len(texts))], texts, [{"d": 1}] * len(texts))
    guard = SentinelGuard([s], index=None, encode=encode)
    try:
        emb = guard._embeddings("k", "v1", lambda n: None)[0]
    finally:
        guard.close()
    assert emb[:, 1].tolist() == list(range(len(texts)))          # row i is query i
    assert [len(c) for c in calls] == [32, 32, 6]
    lens = [len(t) for c in calls for t in c]
    assert lens == sorted(lens, reverse=True)                      # chunks of similar length
