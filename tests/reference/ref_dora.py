"""Golden values for DoRA (nn/layers/adaptable.hpp, LoraOptions::use_dora): on a Linear, a 3×3 and a
1×1 convolution, over a sweep of ranks and alphas, with A, B and the magnitude all random (so the
magnitude is not the norm it starts as):

* per output row: PEFT's LoRA layer with `use_dora=True` — the output, the gradients of A, B, the
  magnitude and the input for a random cotangent, and the merged weight; and lycoris-lora's
  `weight_decompose` (wd_on_out=True) on the same tensors — its output;
* per input column: lycoris-lora's `weight_decompose` with wd_on_out=False (the web UI's form) —
  the output and the same gradients.

Writes dora.safetensors: `<case>.<module>.{weight,bias,lora_A,lora_B,magnitude,x,cotangent,y,
grad_A,grad_B,grad_magnitude,grad_x}` (+ `.merged`, `.lycoris_y` per output row); the magnitude is
stored in the shape of the weight ((out, 1, ...) or (1, in, ...)); dora.json: the cases.
"""
import json

import torch
import torch.nn.functional as F
from safetensors.torch import save_file


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(24, 36)
        self.conv = torch.nn.Conv2d(8, 12, 3, padding=1)
        self.point = torch.nn.Conv2d(12, 16, 1)


INPUTS = {"lin": (5, 24), "conv": (2, 8, 6, 6), "point": (2, 12, 5, 5)}
MODULES = ("lin", "conv", "point")

CASES = []
for rank, alpha in ((4, 4.0), (4, 8.0), (2, 1.0), (8, 3.0)):
    CASES.append({"name": f"out_r{rank}_a{alpha}", "axis": "output", "rank": rank,
                  "alpha": alpha})
for rank, alpha in ((4, 4.0), (2, 5.0), (8, 1.0)):
    CASES.append({"name": f"in_r{rank}_a{alpha}", "axis": "input", "rank": rank, "alpha": alpha})


def apply(module, base, x, w):
    if module == "lin":
        return F.linear(x, w, base.bias)
    return F.conv2d(x, w, base.bias, padding=base.padding)


def generate(out_dir):
    from peft import LoraConfig, get_peft_model
    from lycoris.functional.general import weight_decompose
    tensors, meta = {}, []
    for i, case in enumerate(CASES):
        torch.manual_seed(300 + i)
        net = Net()
        base = {n: p.detach().clone() for n, p in net.named_parameters()}
        rank, alpha, name = case["rank"], case["alpha"], case["name"]
        scale = alpha / rank
        if case["axis"] == "output":
            model = get_peft_model(net, LoraConfig(r=rank, lora_alpha=alpha, use_dora=True,
                                                   init_lora_weights=False,
                                                   target_modules=list(MODULES)))
        for module in MODULES:
            key = f"{name}.{module}"
            weight = base[f"{module}.weight"]
            tensors[f"{key}.weight"] = weight
            tensors[f"{key}.bias"] = base[f"{module}.bias"]
            x = torch.randn(*INPUTS[module])
            if case["axis"] == "output":
                layer = getattr(model.base_model.model, module)
                a = layer.lora_A["default"].weight
                b = layer.lora_B["default"].weight
                m = layer.lora_magnitude_vector["default"].weight
                with torch.no_grad():
                    m.mul_(torch.rand_like(m) + 0.5)
                xg = x.clone().requires_grad_()
                y = layer(xg)
                cot = torch.randn_like(y)
                (y * cot).sum().backward()
                mag = m.detach().reshape(weight.shape[0], *[1] * (weight.dim() - 1))
                grad_m = m.grad.reshape(mag.shape)
                # lycoris-lora's maths on the same tensors (per output row)
                with torch.no_grad():
                    merged_lyco = weight + scale * (
                        b.flatten(1) @ a.flatten(1)).reshape(weight.shape)
                    w_eff = weight_decompose(merged_lyco, mag, 1, True)
                    tensors[f"{key}.lycoris_y"] = apply(module, layer.base_layer, x, w_eff)
                    layer.merge(adapter_names=["default"])
                    tensors[f"{key}.merged"] = layer.base_layer.weight.detach().clone()
                    layer.unmerge()
                tensors.update({f"{key}.lora_A": a.detach().clone(),
                                f"{key}.lora_B": b.detach().clone(), f"{key}.magnitude": mag,
                                f"{key}.grad_A": a.grad.clone(), f"{key}.grad_B": b.grad.clone(),
                                f"{key}.grad_magnitude": grad_m})
            else:
                layer = getattr(net, module)
                a = torch.empty(rank, *weight.shape[1:]) if module != "lin" else torch.empty(
                    rank, weight.shape[1])
                torch.nn.init.kaiming_uniform_(a, a=5 ** 0.5)
                b = torch.randn(weight.shape[0], rank, *([1, 1] if module != "lin" else [])) * 0.1
                w_in = weight.transpose(0, 1).reshape(weight.shape[1], -1).norm(dim=1)
                mag = (w_in * (torch.rand_like(w_in) + 0.5)).reshape(
                    1, weight.shape[1], *[1] * (weight.dim() - 2))
                a.requires_grad_(), b.requires_grad_(), mag.requires_grad_()
                xg = x.clone().requires_grad_()
                merged = weight + scale * (b.flatten(1) @ a.flatten(1)).reshape(weight.shape)
                w_eff = weight_decompose(merged, mag, 1, False)
                y = apply(module, layer, xg, w_eff)
                cot = torch.randn_like(y)
                (y * cot).sum().backward()
                tensors.update({f"{key}.lora_A": a.detach().clone(),
                                f"{key}.lora_B": b.detach().clone(),
                                f"{key}.magnitude": mag.detach().clone(),
                                f"{key}.grad_A": a.grad.clone(), f"{key}.grad_B": b.grad.clone(),
                                f"{key}.grad_magnitude": mag.grad.clone()})
            tensors.update({f"{key}.x": x, f"{key}.cotangent": cot, f"{key}.y": y.detach().clone(),
                            f"{key}.grad_x": xg.grad.clone()})
        meta.append(case)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "dora.safetensors"))
    (out_dir / "dora.json").write_text(json.dumps({"cases": meta}, indent=1))


if __name__ == "__main__":
    import pathlib
    import sys
    generate(pathlib.Path(sys.argv[1]))
