#!/usr/bin/env bash
# On the GPU machine (no network; python3 with torch + CUDA), from the repository root with .gpu/
# carried: install the carried wheels it lacks into a private site folder, unpack the data, run
# `qswap bench gpu` within ten minutes. Results: $OUT/bench-gpu (results.json, README.md).
#   OUT=/some/dir bash bench/gpu_device/run.sh          (docs/gpu.md)
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
P="$ROOT/.gpu"
OUT="${OUT:-$ROOT/.gpu-out}"
WORK="${GPU_WORK:-${TMPDIR:-/tmp}/qswap-gpu}"
SITE="$WORK/site"
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK" "$SITE"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export QSWAP_DATA_DIR="$WORK/qswap-data" QSWAP_COMMIT="$(cat "$P/COMMIT" 2>/dev/null)"
WHEELS=$(python3 "$ROOT/bench/gpu_device/select_wheels.py" "$P/wheels")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" $WHEELS 2>&1 | tail -3
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
tar -xzf "$P/data/beir.tar.gz" -C "$WORK"
cd "$WORK"   # not the checkout: `import qswap` must find the installed wheel
nvidia-smi -L 2>&1 | head -2
timeout -k 10 "${GPU_TIMEOUT_S:-580}" python3 -m qswap.cli bench gpu --e5-bin "$P/data/e5-small-q4-trimmed.bin" \
  --beir "$WORK/beir" --out "$OUT/bench-gpu" --work "$WORK/bench" --budget-s "${GPU_BUDGET_S:-540}"
echo "exit $?; results in $OUT/bench-gpu"
