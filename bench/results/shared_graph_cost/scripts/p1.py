import sys; sys.path.insert(0, "/tmp/lora11")
from harness import *
M, S = "/tmp/lora11/merged/model.onnx", "/tmp/lora11/shared/shared.onnx"
fb, fl = feed_for(S, 0), feed_for(S, 32)
profile(M, {}, "/tmp/lora11/prof_merged")
profile(S, fb, "/tmp/lora11/prof_sbase")
profile(S, fl, "/tmp/lora11/prof_slora")
compare({"merged": runner(M, {}), "shared base": runner(S, fb), "shared lora32": runner(S, fl)})
