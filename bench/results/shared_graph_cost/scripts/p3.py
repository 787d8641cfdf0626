import sys; sys.path.insert(0, "/tmp/lora11")
from harness import *
M = "/tmp/lora11/merged/model.onnx"; S = "/tmp/lora11/shared/shared.onnx"; G = "/tmp/lora11/gemm/shared.onnx"
fs = feed_for(S, 32)
arms = {"merged": runner(M, {}), "shared r32": runner(S, fs), "shared r32 parallel": runner(S, fs, parallel=True),
        "gemm r32": runner(G, feed_for(G, 32))}
for rep in range(3):
    compare(arms, rounds=60)
