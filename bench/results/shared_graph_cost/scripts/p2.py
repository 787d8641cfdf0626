import sys; sys.path.insert(0, "/tmp/lora11")
from harness import *
M = "/tmp/lora11/merged/model.onnx"
arms = {"merged": runner(M, {})}
for name in sys.argv[1:]:
    p = f"/tmp/lora11/{name}/shared.onnx"
    arms[f"{name} r0"] = runner(p, feed_for(p, 0))
    if name != "plain":
        arms[f"{name} r32"] = runner(p, feed_for(p, 32))
for rep in range(2):
    compare(arms, rounds=60)
