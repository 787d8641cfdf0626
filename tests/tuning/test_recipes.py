"""Recipes resolved for a device: precision and batch by what the device is (fake device specs,
no CUDA call)."""

from __future__ import annotations

import pytest

from qswap.tuning.recipes import RECIPES, DeviceSpec, default_recipe, describe, device_batch, device_spec, resolve

CPU = DeviceSpec("cpu", "cpu")
AMX = DeviceSpec("cpu", "cpu", fast_bf16=True)
H200 = DeviceSpec("cuda", "NVIDIA H200", fast_bf16=True, memory_gib=139.8)
L4 = DeviceSpec("cuda", "NVIDIA L4", fast_bf16=True, memory_gib=22.0)
T4 = DeviceSpec("cuda", "Tesla T4", fast_bf16=False, memory_gib=14.6)


def test_cpu_recipe_on_cpus_is_unchanged():
    assert resolve("cpu", CPU) == {**RECIPES["cpu"], "precision": "fp32", "lr_rule": "none"}
    assert resolve("cpu", AMX)["precision"] == "bf16"   # native bf16: autocast pays on these CPUs
    assert default_recipe(CPU) == "cpu" and device_batch(AMX) == 14


def test_a_gpu_trains_in_fp32_where_bf16_autocast_loses():
    # Even the cpu recipe resolves to fp32 on a GPU with bf16 tensor cores.
    assert resolve("cpu", H200)["precision"] == "fp32"
    assert resolve("cpu", H200, precision="bf16")["precision"] == "bf16"   # an explicit choice stands


@pytest.mark.parametrize("spec, batch, epoch_batches", [(H200, 56, 25), (L4, 28, 50), (T4, 14, 100)])
def test_gpu_recipe_sizes_the_batch_to_the_device(spec, batch, epoch_batches):
    r = resolve("gpu", spec)
    assert default_recipe(spec) == "gpu"
    assert (r["batch_size"], r["epoch_batches"], r["precision"]) == (batch, epoch_batches, "fp32")
    assert r["lr_rule"] == "sqrt" and r["lr"] == RECIPES["cpu"]["lr"]   # scaled from batch 14 by the caller
    assert r["batch_size"] * r["epoch_batches"] == 1400                   # the cpu recipe's queries per epoch


def test_explicit_batch_keeps_the_recipe_epoch():
    r = resolve("gpu", H200, batch_size=32)
    assert (r["batch_size"], r["epoch_batches"], r["lr_rule"]) == (32, 100, "none")
    assert resolve("gpu", H200, lr_rule="none")["lr_rule"] == "none"
    assert "sized to the GPU" in describe("gpu") and "batches of 14" in describe("cpu")


def test_device_spec_of_this_machine():
    spec = device_spec("cpu")
    assert spec.kind == "cpu" and spec.memory_gib == 0.0
