cd /work/main
exec /usr/bin/time -v .venv/bin/qswap tune run --beir /tmp/deb2k --lang en --base multilingual-e5-small \
  --val-size 400 --test-size 500 --negatives 3 --mine corpus --mine-k 30 \
  --method partial --loss triplet --lr 2e-6 --batch-size 14 --epoch-batches 40 --max-epochs 8 --patience 3 --seed 1 \
  --eval-langs en,de,fr,it \
  --sentinel de=beir:/tmp/deb2k:de --sentinel fr=beir:/tmp/deb2k:fr --sentinel it=beir:/tmp/deb2k:it \
  --device cpu --out /tmp/tune_deb/run3
