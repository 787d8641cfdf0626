"""bf16 vs fp32 documents against the 10,000-document Debian index (torch fp32, float16 storage).

Run: QSWAP_DATA_DIR=/work/wt/data .venv/bin/python bench/results/embed/bf16_quality_check.py 1500
(the index built by `qswap index build <deb10k> --out <data dir>/idx10k` before the document tower
moved to ONNX Runtime). Writes quality_<N>.json: min/mean cosine and recall@10 of the index's
top-10 among the first N documents for 500 queries per language (en/de/fr/it). Result of
2026-11-24 (load average 12-32): quality_1500.json.
"""
import json, os, sys, time, numpy as np
os.environ.setdefault("QSWAP_DATA_DIR", "/work/wt/data")
from qswap.encoders import load_base
from qswap.encoders.runtime.documents import DocumentEncoder
from qswap.index import DocumentIndex
from qswap.bench.embed_arms import read_corpus, read_queries, quality
N = int(sys.argv[1])
beir = "/work/wt/data/deb10k"
from pathlib import Path
ids, texts = read_corpus(Path(beir), N)
with DocumentIndex.open("/work/wt/data/idx10k", read_only=True) as idx:
    all_ids, vecs = idx.export_embeddings()
row = {d: i for i, d in enumerate(all_ids)}
ref = vecs[[row[d] for d in ids]].astype(np.float32)
base = load_base("multilingual-e5-small")
qs = read_queries(Path(beir), 500)
q = base.encode_queries([x for v in qs.values() for x in v], batch_size=64)
out = {"documents": N, "queries": {k: len(v) for k, v in qs.items()}, "reference": "idx10k (torch fp32, float16 storage)"}
for name, enc in (("onnx fp32", DocumentEncoder(base)), ("bf16", DocumentEncoder(base, precision="bf16"))):
    t0 = time.time(); v = enc.encode(texts, progress=True); 
    out[name] = {**quality(ref, v, q), "seconds": time.time() - t0, "loadavg": os.getloadavg()}
    print(name, out[name], flush=True)
json.dump(out, open(Path(__file__).with_name(f"quality_{N}.json"), "w"), indent=1)
