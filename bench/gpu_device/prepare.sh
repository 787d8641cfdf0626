#!/usr/bin/env bash
# Build what `qswap bench gpu` needs on a GPU machine without network into .gpu/ (git-ignored),
# at most 64 MiB: the qswap wheel of HEAD, cp312 manylinux wheels of what that machine lacks,
# a vocabulary-trimmed bundled model, and the Debian BEIR folder as a tarball. Run from the
# repository root with its venv: bash bench/gpu_device/prepare.sh   (docs/gpu.md)
set -euo pipefail
ROOT="$(git rev-parse --show-toplevel)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
P="$ROOT/.gpu"
rm -rf "$P"
mkdir -p "$P/wheels" "$P/data"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# 1. qswap itself: a wheel of the committed tree (what the figures will be recorded against).
git rev-parse HEAD > "$P/COMMIT"
git archive HEAD | tar -x -C "$TMP" --one-top-level=src
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$P/wheels" "$TMP/src"

# 2. What the GPU machine's python 3.12 lacks (it has torch, transformers, onnxruntime,
#    sentence-transformers, numpy, scipy, httpx): the server stack, faiss, peft, prometheus, orjson.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
  -d "$P/wheels" \
  faiss-cpu==1.15.1 pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
  annotated-types==0.8.0 typing-inspection==0.4.5 fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 \
  opentelemetry-api==1.45.2 uvicorn==0.54.0 python-multipart==0.0.34 h11==0.16.0 click==8.5.1 \
  httptools==0.9.0 anyio==4.16.0 typing_extensions==4.16.0 \
  "orjson==$("$PY" -c 'import importlib.metadata as m; print(m.version("orjson"))')" \
  "peft==$("$PY" -c 'import importlib.metadata as m; print(m.version("peft"))')" \
  "prometheus-client==$("$PY" -c 'import importlib.metadata as m; print(m.version("prometheus-client"))')"

# 3. The Debian benchmark (10,000 descriptions; queries en/de/fr/it) and the model trimmed to its pieces.
export QSWAP_DATA_DIR="$TMP/qswap-data"
"$PY" -m qswap.cli bench data debian --out "$TMP/beir" --max-docs 10000 --no-progress
tar -czf "$P/data/beir.tar.gz" -C "$TMP" beir
"$PY" bench/gpu_device/trim_e5.py --beir "$TMP/beir" --out "$P/data/e5-small-q4-trimmed.bin" --check-vectors 16

SIZE=$(du -sb "$P" | cut -f1)
echo "payload: $P, $((SIZE / 1048576)) MiB ($SIZE bytes), commit $(cat "$P/COMMIT")"
if [ "$SIZE" -gt $((64 * 1048576)) ]; then echo "payload over 64 MiB: it will not travel" >&2; exit 1; fi
