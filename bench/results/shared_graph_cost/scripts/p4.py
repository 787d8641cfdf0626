import sys; sys.path.insert(0, "/tmp/lora11")
from harness import *
M = "/tmp/lora11/merged/model.onnx"; S = "/tmp/lora11/shared/shared.onnx"; Qp = "/tmp/lora11/qkv/shared.onnx"
fs = feed_for(S, 32)
fq = {k: v for k, v in fs.items() if not any(f"self.{p}.lora_A" in k for p in ("query", "key", "value"))}
for k in list(fs):
    if k.endswith("self.query.lora_A"):
        L = k[: -len(".query.lora_A")]
        fq[f"{L}.qkv.lora_A"] = torch.cat([fs[f"{L}.{p}.lora_A"] for p in ("query", "key", "value")]).contiguous()
a, b = runner(S, fs), runner(Qp, fq)
oa, ob = a(), b()
print("cosine", float((oa * ob).sum() / np.linalg.norm(oa) / np.linalg.norm(ob)), "maxdiff", float(abs(oa - ob).max()))
arms = {"merged": runner(M, {}), "shared r32": a, "qkv-A r32": b}
for rep in range(3):
    compare(arms, rounds=60)
