import sys, collections
from pathlib import Path
import torch, onnx
import onnxruntime as ort
from qswap.encoders import load_base
from qswap.encoders.runtime import shared_export as se
torch.set_num_threads(2)
base = load_base("multilingual-e5-small")
out = Path("/tmp/lora11")
which = sys.argv[1]

@torch.library.custom_op("qswap::reshape_to", mutates_args=())
def reshape_to(y: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    return y.reshape([int(s) for s in shape]).clone()
@reshape_to.register_fake
def _(y, shape):
    raise NotImplementedError
def _sym(g, y, shape):
    return g.op("Reshape", y, shape)
SHAPES = {}
def shape_for(inputs, o):
    if o not in SHAPES:
        SHAPES[o] = torch.cat([torch._shape_as_tensor(inputs.mask), torch.tensor([o])])
    return SHAPES[o]
torch.onnx.register_custom_op_symbolic("qswap::reshape_to", _sym, 17)

def gemm_forward(self, x):
    v = self.inputs.values
    if self.plain or self.inputs.segments:
        return orig(self, x)
    a, b = v[f"{self.name}.lora_A"], v[f"{self.name}.lora_B"]
    i, o = self.weight.shape[1], self.weight.shape[0]
    x2 = x.reshape(-1, i)
    y = torch.matmul(x2, self.weight.t())
    y = torch.addmm(y, torch.matmul(x2, a.t()), b.t())
    y = torch.ops.qswap.reshape_to(y, shape_for(self.inputs, o))
    return y if self.bias_in_attention else y + v[f"{self.name}.bias"]

orig = se._AdaptedLinear.forward
if which == "plain":
    print(se.export_shared(base, out / "plain", lora=[]))
elif which == "gemm":
    se._AdaptedLinear.forward = gemm_forward
    print(se.export_shared(base, out / "gemm"))
