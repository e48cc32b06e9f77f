"""Golden values for difftrain's optimizer kernels: torch.optim.Adam and AdamW run 200 steps with
fused=True, foreach=True and the default for-loop, torch.optim.SGD with foreach=True and the
for-loop, lion-pytorch's Lion, prodigyopt's Prodigy, transformers' Adafactor, came-pytorch's CAME,
bitsandbytes' AdamW8bit (its CPU path) and schedulefree's AdamWScheduleFree, over a sweep of settings, on a small network with two parameter
groups (decay with one LR, no decay with another). The C++ test
(test_optimizers.cpp) rebuilds the same network and data from the saved tensors, computes the same
gradients with the same kernels, and compares its weights after every 50 steps.

Writes optimizers.safetensors: per case `<case>.init.<param>`, `<case>.<variant>.step<k>.<param>`,
and the shared data `x`, `y`; and optimizers.json: the cases' settings and the largest difference
torch itself shows between its variants (the tolerance it accepts between them).
"""
import json

import torch
from safetensors.torch import save_file

STEPS = 200
CHECK_EVERY = 50


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.nn.functional.silu(self.norm(self.fc1(x))))


def groups(net, lr, lr_no_decay, weight_decay):
    decay = [p for n, p in net.named_parameters() if p.dim() >= 2]
    plain = [p for n, p in net.named_parameters() if p.dim() < 2]
    return [{"params": decay, "lr": lr, "weight_decay": weight_decay},
            {"params": plain, "lr": lr_no_decay, "weight_decay": 0.0}]


CASES = []
for kind in ("adamw", "adam"):
    for amsgrad in (False, True):
        for weight_decay in (0.0, 0.05):
            for betas, eps in (((0.9, 0.999), 1e-8), ((0.8, 0.95), 1e-6)):
                CASES.append({"name": f"{kind}_ams{int(amsgrad)}_wd{weight_decay}_b{betas[0]}",
                              "kind": kind, "amsgrad": amsgrad, "weight_decay": weight_decay,
                              "beta1": betas[0], "beta2": betas[1], "eps": eps,
                              "lr": 3e-3, "lr_no_decay": 1e-3})
# SGD: plain, heavy-ball with and without dampening, Nesterov; with and without weight decay.
for momentum, dampening, nesterov in ((0.0, 0.0, False), (0.9, 0.0, False), (0.9, 0.1, False),
                                      (0.9, 0.0, True)):
    for weight_decay in (0.0, 0.05):
        CASES.append({"name": f"sgd_m{momentum}_d{dampening}_n{int(nesterov)}_wd{weight_decay}",
                      "kind": "sgd", "momentum": momentum, "dampening": dampening,
                      "nesterov": nesterov, "weight_decay": weight_decay,
                      "lr": 0.05, "lr_no_decay": 0.02})

# Lion (lion-pytorch, the package the LoRA trainers name): betas, decoupled weight decay.
for betas in ((0.9, 0.99), (0.95, 0.98)):
    for weight_decay, decoupled in ((0.0, False), (0.1, False), (0.1, True)):
        CASES.append({"name": f"lion_b{betas[0]}_wd{weight_decay}_dec{int(decoupled)}",
                      "kind": "lion", "beta1": betas[0], "beta2": betas[1],
                      "weight_decay": weight_decay, "decoupled_weight_decay": decoupled,
                      "lr": 3e-4, "lr_no_decay": 1e-4})

# Prodigy (prodigyopt): the defaults, bias correction, safeguarded warm-up, coupled and decoupled
# weight decay, d_coef, a growth limit, β₁ = 0 and a sliced estimate.
for extra in ({}, {"use_bias_correction": True}, {"safeguard_warmup": True},
              {"weight_decay": 0.05}, {"weight_decay": 0.05, "decouple": False},
              {"d_coef": 0.5, "growth_rate": 1.02}, {"beta1": 0.0}, {"slice_p": 3}):
    case = {"name": "prodigy_" + ("_".join(f"{k}{v}" for k, v in extra.items()) or "defaults"),
            "kind": "prodigy", "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
            "decouple": True, "use_bias_correction": False, "safeguard_warmup": False,
            "d0": 1e-6, "d_coef": 1.0, "growth_rate": None, "slice_p": 1,
            "lr": 1.0, "lr_no_decay": 1.0}
    case.update(extra)
    CASES.append(case)

# Adafactor (transformers): its relative step with and without warm-up init, parameter scaling,
# a given lr, β₁, weight decay, clipping and decay rate.
for extra in ({}, {"warmup_init": True}, {"scale_parameter": False},
              {"relative_step": False, "lr": 1e-2, "lr_no_decay": 3e-3},
              {"beta1": 0.9, "weight_decay": 0.05},
              {"relative_step": False, "scale_parameter": False, "lr": 1e-2, "lr_no_decay": 3e-3,
               "clip_threshold": 0.5, "decay_rate": -0.5}):
    case = {"name": "adafactor_" + ("_".join(f"{k}{v}" for k, v in extra.items()) or "defaults"),
            "kind": "adafactor", "eps1": 1e-30, "eps2": 1e-3, "clip_threshold": 1.0,
            "decay_rate": -0.8, "beta1": None, "weight_decay": 0.0, "scale_parameter": True,
            "relative_step": True, "warmup_init": False, "lr": 1e-3, "lr_no_decay": 1e-3}
    case.update(extra)
    CASES.append(case)

# CAME (came-pytorch): its betas, weight decay, another clipping threshold.
for extra in ({}, {"weight_decay": 0.05}, {"beta1": 0.8, "beta2": 0.99, "beta3": 0.999,
                                           "clip_threshold": 0.5}):
    case = {"name": "came_" + ("_".join(f"{k}{v}" for k, v in extra.items()) or "defaults"),
            "kind": "came", "eps1": 1e-30, "eps2": 1e-16, "clip_threshold": 1.0, "beta1": 0.9,
            "beta2": 0.999, "beta3": 0.9999, "weight_decay": 0.0, "lr": 1e-3, "lr_no_decay": 3e-4}
    case.update(extra)
    CASES.append(case)

# 8-bit AdamW (bitsandbytes' CPU path): quantized moments for tensors of 16+ values (the test
# network's are small), its defaults (every tensor below 4096 values: 32-bit moments), betas/eps.
for extra in ({"min_8bit_size": 16}, {}, {"min_8bit_size": 16, "weight_decay": 0.0,
                                          "beta1": 0.8, "beta2": 0.95, "eps": 1e-6}):
    case = {"name": "adamw8bit_" + "_".join(f"{k}{v}" for k, v in extra.items()),
            "kind": "adamw8bit", "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2,
            "min_8bit_size": 4096, "lr": 3e-3, "lr_no_decay": 1e-3}
    if not extra:
        case["name"] = "adamw8bit_defaults"
    case.update(extra)
    CASES.append(case)

# Schedule-free AdamW (schedulefree): its defaults, warm-up, weight decay, r and the lr power,
# other betas. The evaluation weights (optimizer.eval()) after the last step are kept too.
for extra in ({}, {"warmup_steps": 20}, {"weight_decay": 0.05},
              {"r": 1.0, "weight_lr_power": 0.0}, {"beta1": 0.95, "beta2": 0.99}):
    case = {"name": "adamw_schedulefree_" + ("_".join(f"{k}{v}" for k, v in extra.items())
                                             or "defaults"),
            "kind": "adamw_schedulefree", "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
            "weight_decay": 0.0, "warmup_steps": 0, "r": 0.0, "weight_lr_power": 2.0,
            "lr": 2.5e-3, "lr_no_decay": 1e-3}
    case.update(extra)
    CASES.append(case)

PACKAGE_KINDS = ("lion", "prodigy", "adafactor", "came", "adamw8bit", "adamw_schedulefree")


def variants(case):
    if case["kind"] == "adamw_schedulefree":
        return ("for_loop", "foreach")
    if case["kind"] in PACKAGE_KINDS:
        return ("for_loop",)
    return ("foreach", "for_loop") if case["kind"] == "sgd" else ("fused", "foreach", "for_loop")


def run(case, init, x, y, variant):
    net = Net()
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(init[n])
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True},
             "for_loop": {"foreach": False}}[variant]
    param_groups = groups(net, case["lr"], case["lr_no_decay"], case["weight_decay"])
    if case["kind"] == "adafactor":
        from transformers.optimization import Adafactor
        opt = Adafactor(param_groups, lr=None if case["relative_step"] else case["lr"],
                        eps=(case["eps1"], case["eps2"]), clip_threshold=case["clip_threshold"],
                        decay_rate=case["decay_rate"], beta1=case["beta1"],
                        scale_parameter=case["scale_parameter"],
                        relative_step=case["relative_step"], warmup_init=case["warmup_init"])
    elif case["kind"] == "came":
        from came_pytorch import CAME
        opt = CAME(param_groups, lr=case["lr"], eps=(case["eps1"], case["eps2"]),
                   clip_threshold=case["clip_threshold"],
                   betas=(case["beta1"], case["beta2"], case["beta3"]))
    elif case["kind"] == "adamw8bit":
        import bitsandbytes as bnb
        opt = bnb.optim.AdamW8bit(param_groups, lr=case["lr"], betas=(case["beta1"], case["beta2"]),
                                  eps=case["eps"], min_8bit_size=case["min_8bit_size"])
    elif case["kind"] == "adamw_schedulefree":
        import schedulefree
        opt = schedulefree.AdamWScheduleFree(
            param_groups, lr=case["lr"], betas=(case["beta1"], case["beta2"]), eps=case["eps"],
            warmup_steps=case["warmup_steps"], r=case["r"],
            weight_lr_power=case["weight_lr_power"], foreach=variant == "foreach")
        opt.train()
    elif case["kind"] == "prodigy":
        from prodigyopt import Prodigy
        opt = Prodigy(param_groups, lr=case["lr"], betas=(case["beta1"], case["beta2"]),
                      eps=case["eps"], decouple=case["decouple"],
                      use_bias_correction=case["use_bias_correction"],
                      safeguard_warmup=case["safeguard_warmup"], d0=case["d0"],
                      d_coef=case["d_coef"],
                      growth_rate=case["growth_rate"] or float("inf"),  # None: unbounded
                      slice_p=case["slice_p"])
    elif case["kind"] == "lion":
        from lion_pytorch import Lion
        opt = Lion(param_groups, lr=case["lr"], betas=(case["beta1"], case["beta2"]),
                   decoupled_weight_decay=case["decoupled_weight_decay"])
    elif case["kind"] == "sgd":
        opt = torch.optim.SGD(param_groups, lr=case["lr"], momentum=case["momentum"],
                              dampening=case["dampening"], nesterov=case["nesterov"], **flags)
    else:
        cls = torch.optim.AdamW if case["kind"] == "adamw" else torch.optim.Adam
        opt = cls(param_groups, betas=(case["beta1"], case["beta2"]), eps=case["eps"],
                  amsgrad=case["amsgrad"], **flags)
    out = {}
    for step in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(net(x[step % x.shape[0]]), y[step % y.shape[0]]).backward()
        opt.step()
        if step % CHECK_EVERY == 0:
            for n, p in net.named_parameters():
                out[f"step{step}.{n}"] = p.detach().clone()
    if case["kind"] == "adamw_schedulefree":  # the weights to evaluate and save
        opt.eval()
        for n, p in net.named_parameters():
            out[f"eval{STEPS}.{n}"] = p.detach().clone()
    return out


def quantization_golden(tensors):
    """bitsandbytes' dynamic codes and its CPU block-wise encoding of tensors of several sizes
    (whole and partial blocks, zero blocks, a wide range of magnitudes), for both codes."""
    import bitsandbytes.functional as F
    g = torch.Generator().manual_seed(5)
    for signed in (True, False):
        code = F.create_dynamic_map(signed=signed)
        tag = "signed" if signed else "unsigned"
        tensors[f"q8.{tag}.map"] = code
        for n in (1, 255, 256, 1000, 4096, 70001):
            x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 6 * 10.0
            if not signed:
                x = x.abs()
            if n >= 1000:
                x[256:512] = 0.0
            q, absmax = torch.ops.bitsandbytes.quantize_blockwise(x, code, 256)
            tensors[f"q8.{tag}.{n}.x"] = x
            tensors[f"q8.{tag}.{n}.codes"] = q
            tensors[f"q8.{tag}.{n}.absmax"] = absmax
            tensors[f"q8.{tag}.{n}.decoded"] = torch.ops.bitsandbytes.dequantize_blockwise(
                q, absmax, code, 256, torch.float32)


def generate(out_dir):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(7, 8, 6, generator=g)
    y = torch.randn(7, 8, 4, generator=g)
    tensors = {"x": x, "y": y}
    meta = []
    for case in CASES:
        torch.manual_seed(len(meta))
        init = {n: p.detach().clone() for n, p in Net().named_parameters()}
        for n, t in init.items():
            tensors[f"{case['name']}.init.{n}"] = t
        results = {v: run(case, init, x, y, v) for v in variants(case)}
        for variant, res in results.items():
            for k, t in res.items():
                tensors[f"{case['name']}.{variant}.{k}"] = t
        spread = max((results[a][k] - results[b][k]).abs().max().item()
                     for a in results for b in results for k in results[a])
        meta.append(dict(case, torch_variant_spread=spread))
    quantization_golden(tensors)
    save_file(tensors, str(out_dir / "optimizers.safetensors"))
    (out_dir / "optimizers.json").write_text(
        json.dumps({"steps": STEPS, "check_every": CHECK_EVERY, "cases": meta}, indent=1))


if __name__ == "__main__":
    import pathlib
    import sys
    generate(pathlib.Path(sys.argv[1]))
