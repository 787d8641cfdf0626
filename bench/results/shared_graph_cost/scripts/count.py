import sys, collections, onnx, onnxruntime as ort
for f in sys.argv[1:]:
    so = ort.SessionOptions(); so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = f + ".opt"; so.log_severity_level = 3
    ort.InferenceSession(f, so, providers=["CPUExecutionProvider"])
    g = onnx.load(f + ".opt", load_external_data=False).graph
    c = collections.Counter(n.op_type for n in g.node)
    print(f, len(g.node), dict(sorted(c.items())))
