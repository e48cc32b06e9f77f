"""Golden values for difftrain's gradient-norm clipping: torch.nn.utils.clip_grad_norm_ as Python
runs it (foreach on CPU tensors) over a sweep of norm types and limits, on gradient sets of one
dtype and of two (float32 and float64, which torch groups and norms kind by kind), with a
parameter that has no gradient.

Writes clipping.safetensors: per layout `<layout>.grad<i>` (the gradients before clipping; a
missing index is a parameter without gradient), per case `<case>.grad<i>` after clipping and
`<case>.total` (the returned norm); and clipping.json: the cases.
"""
import json

import torch
from safetensors.torch import save_file

SHAPES = [(7, 5), (5,), (), (3, 4, 2), (1000,), (2, 3)]
# layout: each parameter's dtype, None for a parameter without a gradient
LAYOUTS = {
    "f32": [torch.float32, torch.float32, torch.float32, None, torch.float32, torch.float32],
    "mixed": [torch.float32, torch.float64, torch.float32, torch.float64, None, torch.float32],
}
NORM_TYPES = {"l2": 2.0, "l1": 1.0, "inf": float("inf"), "l3": 3.0, "l0_5": 0.5}
MAX_NORMS = {"loose": 1e4, "tight": 0.25}


def grads(layout):
    g = torch.Generator().manual_seed(11)
    out = []
    for i, (shape, dtype) in enumerate(zip(SHAPES, LAYOUTS[layout])):
        if dtype is None:
            out.append(None)
            continue
        scale = 10.0 ** (i % 3 - 1)  # gradients of different sizes
        out.append((torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype))
    return out


def generate(out_dir):
    tensors, cases = {}, []
    for layout in LAYOUTS:
        for i, t in enumerate(grads(layout)):
            if t is not None:
                tensors[f"{layout}.grad{i}"] = t.contiguous()
        for norm_name, norm_type in NORM_TYPES.items():
            for limit_name, max_norm in MAX_NORMS.items():
                name = f"{layout}_{norm_name}_{limit_name}"
                params = []
                for t in grads(layout):
                    p = torch.nn.Parameter(torch.zeros(t.shape if t is not None else (2,),
                                                       dtype=t.dtype if t is not None else torch.float32))
                    p.grad = None if t is None else t.clone()
                    params.append(p)
                total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
                tensors[f"{name}.total"] = total.detach().to(torch.float64).reshape(1)
                for i, p in enumerate(params):
                    if p.grad is not None:
                        tensors[f"{name}.grad{i}"] = p.grad.contiguous()
                # JSON has no infinity: "inf" names it
                cases.append({"name": name, "layout": layout,
                              "norm_type": norm_type if norm_type != float("inf") else "inf",
                              "max_norm": max_norm})
    save_file(tensors, str(out_dir / "clipping.safetensors"))
    (out_dir / "clipping.json").write_text(
        json.dumps({"params": len(SHAPES), "shapes": [list(s) for s in SHAPES],
                    "cases": cases}, indent=1))
