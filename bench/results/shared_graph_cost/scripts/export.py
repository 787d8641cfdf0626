import sys, json
from pathlib import Path
import torch
from qswap.encoders import load_base
from qswap.encoders.runtime.onnx_export import export_onnx
from qswap.encoders.runtime.shared_export import export_shared
torch.set_num_threads(2)
base = load_base("multilingual-e5-small")
out = Path("/tmp/lora11")
print(export_onnx(base, {}, out/"merged"))
print(export_shared(base, out/"shared"))
