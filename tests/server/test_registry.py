"""server/registry/facade.py: LRU and budget, persistence, refusals, deletes, version order, names."""

from __future__ import annotations

import threading

import pytest

from qswap.errors import (ConflictError, GuardRefusedError, IntegrityError, InvalidInputError, NotFoundError,
                          SpaceMismatchError)
from qswap.server.registry.records import version_order

@pytest.fixture()
def registry(tmp_path, tiny_base):
    from qswap.encoders import EncoderPool
    from qswap.encoders.runtime.backend import TorchBackend, make_backend
    from qswap.server.registry.facade import EncoderRegistry
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
    assert reg.info("ft@1", "v").memory_bytes == pool_bytes + session_bytes
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
        reg.acquire(encoder="bias@1")                            # new requests stay refused
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


def test_version_order_is_numeric_where_numeric():
    def highest(*versions: str) -> str:
        return max(versions, key=version_order)
    assert highest("9", "10", "2") == "10"
    assert highest("1.9", "1.10", "1.2") == "1.10"
    assert highest("v2", "v10") == "v10"
    assert highest("a", "b") == "b"
    assert highest("2024-01-31", "2024-02-01") == "2024-02-01"


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

    from qswap.server.registry.intake import open_under_root

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
    # ...and what binds the adapter (its OrtValues, the IOBindings: no tensor data)
    assert footprint == reg.pool.memory_bytes(key) + reg.backend.memory_bytes(key)
    assert footprint < reg.backend.merged.memory_bytes(key), (footprint, reg.backend.merged.memory_bytes(key))
