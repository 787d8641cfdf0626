#!/bin/bash
# New default (recipe cpu as committed): quality run, same data and options as the e2e bench's default arm.
cd /work/wt/tune
export QSWAP_DATA_DIR=/work/wt/data
D=/work/wt/data/deb10k; I=/work/wt/data/idx10k
echo "load before: $(cat /proc/loadavg)"
/usr/bin/time -v .venv/bin/python -m qswap.cli tune run --beir $D --lang en --index $I --method partial --recipe cpu \
  --val-size 400 --test-size 1000 --negatives 3 --mine index --device cpu --quiet \
  --out DATA/runs/new/encoder --cache-dir DATA/runs/new/cache --eval-langs en,de,fr,it \
  --sentinel de=beir:$D:de --sentinel fr=beir:$D:fr --sentinel it=beir:$D:it
echo "load after: $(cat /proc/loadavg)"
