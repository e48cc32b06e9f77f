"""Golden values for activation and init policies, from torch.nn itself.

Activations: every class the web UI's hypernetworks accept by lowercase name (its own seven, then
every class of torch.nn.modules.activation), forward and the gradient of sum(out * w), in float64.
Inits: the web UI's init rules on seeded tensors, so a seeded C++ run must match draw for draw.
"""
import inspect
import json
import math

import warnings

import torch
import torch.nn.functional as F
from torch.nn.init import kaiming_normal_, kaiming_uniform_, normal_, xavier_normal_, xavier_uniform_, zeros_


def activation_dict():
    # As the web UI builds it (modules/hypernetworks/hypernetwork.py).
    d = {
        "linear": torch.nn.Identity,
        "relu": torch.nn.ReLU,
        "leakyrelu": torch.nn.LeakyReLU,
        "elu": torch.nn.ELU,
        "swish": torch.nn.Hardswish,
        "tanh": torch.nn.Tanh,
        "sigmoid": torch.nn.Sigmoid,
    }
    d.update({n.lower(): c for n, c in inspect.getmembers(torch.nn.modules.activation)
              if inspect.isclass(c) and c.__module__ == "torch.nn.modules.activation"})
    return d


# Classes that need constructor arguments, and the arguments the C++ test uses too.
CTOR_ARGS = {"threshold": (0.5, -1.0)}
NOT_ACTIVATIONS = {"multiheadattention"}  # in the reference's dict, but not constructible bare


def generate(out):
    warnings.filterwarnings("ignore", message="Implicit dimension choice")
    x = torch.linspace(-5.0, 5.0, 2 * 3 * 8, dtype=torch.float64).reshape(2, 3, 8)
    w = torch.cos(torch.arange(x.numel(), dtype=torch.float64)).reshape(x.shape)
    acts = {}
    for name, cls in sorted(activation_dict().items()):
        if name in NOT_ACTIVATIONS:
            continue
        module = cls(*CTOR_ARGS.get(name, ())).double().eval()
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        (y * w[..., : y.shape[-1]] if name == "glu" else y * w).sum().backward()
        acts[name] = {"out": y.detach().flatten().tolist(), "out_shape": list(y.shape),
                      "grad": xi.grad.flatten().tolist()}
    # Extra names difftrain adds: GELU's tanh form and GEGLU's gate.
    xi = x.clone().requires_grad_(True)
    y = F.gelu(xi, approximate="tanh"); (y * w).sum().backward()
    acts["gelu_tanh"] = {"out": y.detach().flatten().tolist(), "out_shape": list(y.shape),
                         "grad": xi.grad.flatten().tolist()}
    xi = x.clone().requires_grad_(True)
    a, gate = xi.chunk(2, dim=-1); y = a * F.gelu(gate)
    (y * w[..., :4]).sum().backward()
    acts["geglu"] = {"out": y.detach().flatten().tolist(), "out_shape": list(y.shape),
                     "grad": xi.grad.flatten().tolist()}

    inits = {}
    for name in ["Normal", "XavierUniform", "XavierNormal", "KaimingUniform", "KaimingNormal"]:
        for activation in ["relu", "leakyrelu"]:
            torch.manual_seed(1234)
            wt = torch.empty(16, 8)
            b = torch.empty(16)
            if name == "Normal":
                normal_(wt, mean=0.0, std=0.01); normal_(b, mean=0.0, std=0)
            elif name == "XavierUniform":
                xavier_uniform_(wt); zeros_(b)
            elif name == "XavierNormal":
                xavier_normal_(wt); zeros_(b)
            elif name == "KaimingUniform":
                kaiming_uniform_(wt, nonlinearity="leaky_relu" if activation == "leakyrelu" else "relu"); zeros_(b)
            else:
                kaiming_normal_(wt, nonlinearity="leaky_relu" if activation == "leakyrelu" else "relu"); zeros_(b)
            inits[f"{name}/{activation}"] = {"weight": wt.flatten().tolist(), "bias": b.tolist()}
    torch.manual_seed(1234)
    lin = torch.nn.Linear(8, 16)
    inits["Default/relu"] = {"weight": lin.weight.detach().flatten().tolist(), "bias": lin.bias.detach().tolist()}

    # A whole module initialised by the web UI's loop.
    torch.manual_seed(7)
    seq = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    for layer in seq:
        if type(layer) == torch.nn.Linear or type(layer) == torch.nn.LayerNorm:
            wt, b = layer.weight.data, layer.bias.data
            if type(layer) == torch.nn.LayerNorm:
                normal_(wt, mean=0.0, std=0.01); normal_(b, mean=0.0, std=0)
            else:
                xavier_normal_(wt); zeros_(b)
    module = {k: v.flatten().tolist() for k, v in seq.state_dict().items()}

    (out / "nn.json").write_text(json.dumps({
        "x": x.flatten().tolist(), "x_shape": list(x.shape), "w": w.flatten().tolist(),
        "activations": acts, "inits": inits, "module_xavier_normal": module,
    }))
