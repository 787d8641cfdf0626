"""Scratch harness: time graphs side by side (IOBinding, 2 threads, spin), and profile them."""
import sys, json, time, collections, statistics
import numpy as np, torch, onnx, onnxruntime as ort
from qswap.encoders import load_base
from qswap.encoders.runtime.onnx import make_session
from qswap.encoders.runtime.shared_export import find_slots, ort_input
from qswap.encoders.embedding import length_buckets

base = load_base("multilingual-e5-small")
slots = find_slots(base.layout)
table = base.word_embeddings().detach().float().numpy()
Q = "chess engine with a graphical board and network play"
(_, ids, mask), = length_buckets(base.tokenizer, [Q], base.spec.query_prefix, 64)
print("tokens", ids.shape)
emb = np.take(table, ids, axis=0)

def feed_for(path, rank, extra=None):
    """Every adapter input the graph at path takes: random rank-`rank` factors, base biases."""
    names = [i.name for i in onnx.load(path, load_external_data=False).graph.input]
    g = torch.Generator().manual_seed(0)
    src = slots.base_inputs(base, rank=rank)
    out = {}
    for n in names:
        if n in ("inputs_embeds", "attention_mask"):
            continue
        if extra and n in extra:
            out[n] = extra[n]; continue
        t = src[n]
        if ".lora_" in n:
            t = torch.randn(t.shape, generator=g) * 0.01
        out[n] = t.contiguous()
    return out

def runner(path, feed, threads=2, profile=None, parallel=False):
    if parallel:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        so.intra_op_num_threads = 1; so.inter_op_num_threads = 2
        so.add_session_config_entry("session.inter_op.allow_spinning", "1")
        so.add_session_config_entry("session.force_spinning_stop", "1")
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    elif profile:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = threads; so.inter_op_num_threads = 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "1")
        so.add_session_config_entry("session.force_spinning_stop", "1")
        so.enable_profiling = True; so.profile_file_prefix = profile
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    else:
        sess = make_session(path, threads, ["CPUExecutionProvider"], True)
    vals = {n: ort_input(t) for n, t in feed.items()}
    b = sess.io_binding()
    for n, v in vals.items():
        b.bind_ortvalue_input(n, v)
    def run():
        b.bind_ortvalue_input("inputs_embeds", ort.OrtValue.ortvalue_from_numpy(emb))
        b.bind_ortvalue_input("attention_mask", ort.OrtValue.ortvalue_from_numpy(mask))
        b.bind_output("embedding")
        sess.run_with_iobinding(b)
        o = b.copy_outputs_to_cpu()[0]
        b.clear_binding_outputs()
        return o
    run.sess = sess; run.vals = vals
    return run

def compare(arms, rounds=60, settle=0.005, warmup=5):
    t = {k: [] for k in arms}
    names = list(arms)
    for r in range(warmup + rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            time.sleep(settle)
            s = time.perf_counter(); arms[n](); d = time.perf_counter() - s
            if r >= warmup: t[n].append(d * 1000)
    for n in names:
        rs = "  ".join(f"/ {ref}: {statistics.median([a / b for a, b in zip(t[n], t[ref])]):.3f}" for ref in names[:2])
        print(f"{n:40s} median {statistics.median(t[n]):7.3f} ms  p10 {np.percentile(t[n],10):7.3f}  {rs}")
    return t

def profile(arm_path, feed, prefix, n=200):
    r = runner(arm_path, feed, profile=prefix)
    for _ in range(n): r()
    f = r.sess.end_profiling()
    ev = json.load(open(f))
    by = collections.defaultdict(float); cnt = collections.Counter()
    for e in ev:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            op = e["args"]["op_name"]; by[op] += e["dur"]; cnt[op] += 1
    tot = sum(by.values()) / n
    print(f"== {prefix}: kernel time per run {tot/1000:.3f} ms")
    for op, d in sorted(by.items(), key=lambda x: -x[1]):
        print(f"   {op:28s} {d/n/1000:7.3f} ms  nodes {cnt[op]//n}")
    sess_ev = [e for e in ev if e.get("name") == "model_run"]
    print("   model_run median", statistics.median(e["dur"] for e in sess_ev[10:]) / 1000, "ms")
