#!/bin/bash
# The two runs compared here: `runs.sh default` (the cpu recipe as committed) and
# `runs.sh previous` (the settings before: fp32, dropout, per-operation AdamW, queries on torch).
cd /work/wt/tune
export QSWAP_DATA_DIR=/work/wt/data
D=/work/wt/data/deb10k; I=/work/wt/data/idx10k
extra=()
[ "$1" = previous ] && extra=(--precision fp32 --no-fused --dropout --query-runtime torch)
echo "load before: $(cat /proc/loadavg)"
/usr/bin/time -v .venv/bin/python -m qswap.cli tune run --beir $D --lang en --index $I --method partial --recipe cpu \
  --val-size 400 --test-size 1000 --negatives 3 --mine index --device cpu --quiet \
  --out DATA/runs/$1/encoder --cache-dir DATA/runs/$1/cache --eval-langs en,de,fr,it \
  --sentinel de=beir:$D:de --sentinel fr=beir:$D:fr --sentinel it=beir:$D:it "${extra[@]}"
echo "load after: $(cat /proc/loadavg)"
