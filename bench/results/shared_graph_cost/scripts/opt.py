import sys, collections
import onnx, onnxruntime as ort
for name, f in [("merged","/tmp/lora11/merged/model.onnx"),("shared","/tmp/lora11/shared/shared.onnx")]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = f"/tmp/lora11/{name}_opt.onnx"
    so.intra_op_num_threads = 1
    ort.InferenceSession(f, so, providers=["CPUExecutionProvider"])
    for label, p in [("raw", f), ("opt", so.optimized_model_filepath)]:
        g = onnx.load(p, load_external_data=False).graph
        c = collections.Counter(n.op_type for n in g.node)
        print(name, label, len(g.node), dict(sorted(c.items())))
