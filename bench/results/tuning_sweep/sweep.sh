#!/bin/bash
# lr x method sweep on Debian (2,000 documents), English training, de/fr/it as sentinels and
# evaluation languages. Data: qswap bench data debian --out DATA/deb2k --max-docs 2000 --seed 0
# Usage: bench/results/tuning_sweep/sweep.sh DATA OUT   (then: cd OUT && python REPO/bench/results/tuning_sweep/table.py *_lr*/)
set -e
data=${1:?BEIR parent dir}; out=${2:?output dir}
mkdir -p "$out"
for method in partial lora bias; do
 for lr in 5e-8 5e-7 2e-6 1e-5; do
  enc=$out/${method}_lr${lr}
  [ -f "$enc/manifest.json" ] && continue
  echo "=== $method $lr $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
  /usr/bin/time -f "wall %e s maxrss %M KB" qswap tune run --beir "$data/deb2k" --lang en --base multilingual-e5-small \
    --val-size 400 --test-size 500 --negatives 3 --mine corpus --mine-k 30 \
    --method $method --loss triplet --lr $lr --batch-size 14 --epoch-batches 40 --max-epochs 6 --patience 2 \
    --eval-langs en,de,fr,it \
    --sentinel de=beir:$data/deb2k:de --sentinel fr=beir:$data/deb2k:fr --sentinel it=beir:$data/deb2k:it \
    --cache-dir "$out/cache" --device cpu --quiet --out "$enc" > "$enc.log" 2>&1
  tail -3 "$enc.log"
 done
done
