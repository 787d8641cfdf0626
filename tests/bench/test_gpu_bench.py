"""``qswap bench gpu``: on a machine without a GPU it says so, runs the cuda backend's CPU twin
(the gathered forward against the torch pool, 1/4/20 encoders) and exits 0."""

from __future__ import annotations

import json

import torch

from qswap.cli import main as qswap_main


def test_bench_gpu_records_the_device_and_the_cpu_twin(tmp_path):
    out = tmp_path / "out"
    rc = qswap_main(["bench", "gpu", "--quick", "--out", str(out), "--work", str(tmp_path / "work"),
                     "--phases", "env,twin,query,docs"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())["results"]
    has_gpu = torch.cuda.is_available()
    assert res["gpu"] is has_gpu
    phases = res["phases"]
    assert set(phases) == {"env", "twin", "query", "docs"}
    assert phases["env"]["status"] == "ok" and phases["env"]["machine"]["cuda_available"] is has_gpu
    assert phases["env"]["recipe"]["default"] == ("gpu" if has_gpu else "cpu")
    twin = phases["twin"]["cuda backend fp32 vs torch fp32 (CPU)"]
    for n in (1, 4, 20):
        assert twin[f"{n} encoders"]["min_cosine"] >= 0.99999
    if not has_gpu:
        assert res["device"].startswith("no GPU found")
        assert phases["query"]["status"].startswith("no GPU") and phases["docs"]["status"].startswith("no GPU")
        assert "No GPU on this machine" in (out / "README.md").read_text()


def test_unknown_phase_is_refused(tmp_path, capsys):
    assert qswap_main(["bench", "gpu", "--quick", "--out", str(tmp_path / "o"), "--phases", "env,nope"]) != 0
    assert "unknown phase 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()   # refused before anything was written
