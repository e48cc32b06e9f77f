"""LoRA layers as PEFT defines them (its LoraLayer forward, restated in plain PyTorch):
y = base(x) + (alpha / r) * lora_B(lora_A(x)), for a Linear and for a Conv2d (A: the layer's kernel,
stride and padding into r channels; B: 1x1). B is random here so the branch matters. Saves the
weights ("w.<name>"), the input, the output, the merged weight W + (alpha/r)·B·A and the gradients of
sum(y * probe) with respect to the LoRA matrices and the input, to lora_<case>.safetensors."""
import torch
from safetensors.torch import save_file
from torch import nn


class LoraLinear(nn.Module):
    def __init__(self, i, o, r, alpha):
        super().__init__()
        self.base = nn.Linear(i, o)
        self.lora_A = nn.Linear(i, r, bias=False)
        self.lora_B = nn.Linear(r, o, bias=False)
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale

    def merged(self):
        return self.base.weight + self.scale * self.lora_B.weight @ self.lora_A.weight


class LoraConv(nn.Module):
    def __init__(self, i, o, k, stride, padding, r, alpha):
        super().__init__()
        self.base = nn.Conv2d(i, o, k, stride=stride, padding=padding)
        self.lora_A = nn.Conv2d(i, r, k, stride=stride, padding=padding, bias=False)
        self.lora_B = nn.Conv2d(r, o, 1, bias=False)
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale

    def merged(self):
        b = self.lora_B.weight.flatten(1)
        return self.base.weight + self.scale * (b @ self.lora_A.weight.flatten(1)).view_as(self.base.weight)


def case(out, name, m, x, g):
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    x = x.clone().requires_grad_(True)
    y = m(x)
    probe = torch.randn(y.shape, generator=g, dtype=torch.float64)
    (y * probe).sum().backward()
    t = {
        "w.weight": m.base.weight, "w.bias": m.base.bias,
        "w.lora_A.weight": m.lora_A.weight, "w.lora_B.weight": m.lora_B.weight,
        "in.x": x, "in.probe": probe, "out.y": y, "out.merged": m.merged(),
        "grad.lora_A.weight": m.lora_A.weight.grad, "grad.lora_B.weight": m.lora_B.weight.grad,
        "grad.x": x.grad,
    }
    save_file({k: v.detach().contiguous() for k, v in t.items()}, str(out / f"lora_{name}.safetensors"),
              metadata={"scale": repr(m.scale)})


def generate(out):
    g = torch.Generator().manual_seed(21)
    case(out, "linear", LoraLinear(12, 10, 4, 16.0).double(), torch.randn(3, 5, 12, generator=g, dtype=torch.float64), g)
    case(out, "conv", LoraConv(6, 8, 3, 2, 1, 3, 6.0).double(), torch.randn(2, 6, 9, 9, generator=g, dtype=torch.float64), g)
