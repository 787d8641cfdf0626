#!/bin/bash
# Reference arm: today's settings (fp32, dropout, foreach AdamW, torch query encoding) on the new code.
cd /work/wt/tune
export QSWAP_DATA_DIR=/work/wt/data
D=/work/wt/data/deb10k; I=/work/wt/data/idx10k
echo "load before: $(cat /proc/loadavg)"
/usr/bin/time -v .venv/bin/python -m qswap.cli tune run --beir $D --lang en --index $I --method partial --recipe cpu \
  --val-size 400 --test-size 1000 --negatives 3 --mine index --device cpu --quiet \
  --out DATA/runs/ref/encoder --cache-dir DATA/runs/ref/cache --eval-langs en,de,fr,it \
  --sentinel de=beir:$D:de --sentinel fr=beir:$D:fr --sentinel it=beir:$D:it \
  --precision fp32 --no-fused --dropout --query-runtime torch
echo "load after: $(cat /proc/loadavg)"
