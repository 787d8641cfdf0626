"""Surgery: Q/K/V LoRA A-factors as ONE (3r, in) input per layer, one MatMul + Split."""
import onnx, re
from onnx import helper, TensorProto
m = onnx.load("/tmp/lora11/shared/shared.onnx")
g = m.graph
prod = {o: n for n in g.node for o in n.output}
cons = {}
for n in g.node:
    for i in n.input: cons.setdefault(i, []).append(n)
drop, new_inputs = [], []
layers = sorted({re.match(r"(.*attention\.self)\.query\.lora_A", i.name).group(1) for i in g.input if re.match(r".*attention\.self\.query\.lora_A", i.name)})
for L in layers:
    outs, x = [], None
    for p in ("query", "key", "value"):
        a = f"{L}.{p}.lora_A"
        tr = cons[a][0]; assert tr.op_type == "Transpose"
        mm = cons[tr.output[0]][0]; assert mm.op_type == "MatMul"
        x = mm.input[0] if mm.input[1] == tr.output[0] else mm.input[1]
        outs.append(mm.output[0]); drop += [tr, mm]
    name = f"{L}.qkv.lora_A"
    new_inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [f"{L}.r3", 384]))
    g.node.extend([helper.make_node("Transpose", [name], [name + ".T"], perm=[1, 0]),
                   helper.make_node("MatMul", [x, name + ".T"], [name + ".h"]),
                   helper.make_node("Split", [name + ".h"], outs, axis=-1)])
for n in drop: g.node.remove(n)
keep = [i for i in g.input if not re.match(r".*attention\.self\.(query|key|value)\.lora_A", i.name)]
del g.input[:]; g.input.extend(keep + new_inputs)
# topological order
import collections
avail = {i.name for i in g.input} | {i.name for i in g.initializer} | {""}
nodes, order = list(g.node), []
while nodes:
    rest = []
    for n in nodes:
        if all(i in avail for i in n.input): order.append(n); avail.update(n.output)
        else: rest.append(n)
    assert len(rest) < len(nodes); nodes = rest
del g.node[:]; g.node.extend(order)
onnx.save(m, "/tmp/lora11/qkv/shared.onnx") if __import__("os").makedirs("/tmp/lora11/qkv", exist_ok=True) is None else None
print(len(layers), "layers rewritten")
