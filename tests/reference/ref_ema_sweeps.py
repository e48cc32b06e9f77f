"""EMA rules x engines x tracking options in float64, against diffusers' EMAModel, ema-pytorch's EMA
and KarrasEMA, and LitEma.

The model is Linear(3, 4) → BatchNorm1d(4) → Linear(4, 2) in float64 with the second Linear frozen
(tensors of different shapes, trainable and not, and buffers). Its weights follow a trajectory both
sides compute with the same torch calls: at step k every floating-point tensor (parameter or
buffer) gains 0.1·sin(0.37·k + arange(numel)). Each configuration's final shadows (and, for
update_model_with_ema_every, the model's own tensors) are recorded by name. Also: ema-pytorch's
decay at every step 0..20000 for several (inv_gamma, power, update_after_step, min_value, beta).
"""
import copy
import json
import warnings

import torch
from diffusers.training_utils import EMAModel
from ema_pytorch import EMA, KarrasEMA
from torch import nn

STEPS = 120


class LitEma(nn.Module):
    # ldm/modules/ema.py (see ref_ema.py), shadows in the parameters' dtype.
    def __init__(self, model, decay=0.9999):
        super().__init__()
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.register_buffer("decay", torch.tensor(decay, dtype=torch.float32))
        self.register_buffer("num_updates", torch.tensor(0, dtype=torch.int))
        self.shadow = {n: p.clone().detach() for n, p in model.named_parameters() if p.requires_grad}

    def __call__(self, model):
        self.num_updates += 1
        decay = min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
        one_minus_decay = 1.0 - decay
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad:
                    self.shadow[n] = self.shadow[n].type_as(p)
                    self.shadow[n].sub_(one_minus_decay * (self.shadow[n] - p))


def make_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    m[2].weight.requires_grad_(False)
    m[2].bias.requires_grad_(False)
    with torch.no_grad():  # buffers away from their defaults so averaging them shows
        m[1].running_mean.copy_(torch.arange(4, dtype=torch.float64) * 0.1)
        m[1].running_var.copy_(torch.arange(4, dtype=torch.float64) * 0.2 + 1)
    return m


def move(model, k):
    with torch.no_grad():
        for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
            t.add_(0.1 * torch.sin(0.37 * k + torch.arange(t.numel(), dtype=torch.float64)).reshape(t.shape))


def flat(d):
    return {k: v.detach().double().flatten().tolist() for k, v in d.items()}


def floating(model):
    out = dict(model.named_parameters())
    out.update({k: v for k, v in model.named_buffers() if v.is_floating_point()})
    return out


def run(make_ema, update, shadows, model_too=False):
    model = make_model()
    e = make_ema(model)
    for k in range(STEPS):
        move(model, k)
        update(e, model)
    out = {"shadows": flat(shadows(e, model))}
    if model_too:
        out["model"] = flat(floating(model))
    return out


def diffusers_cases():
    def params(m):
        return list(m.parameters())

    def shadows(e, m):
        return {n: s for (n, _), s in zip(m.named_parameters(), e.shadow_params)}

    cases = {
        "default": dict(),
        "warmup": dict(decay=0.999, min_decay=0.1, update_after_step=5, use_ema_warmup=True, inv_gamma=2.0,
                       power=0.75),
        "warmup_small_gamma": dict(decay=0.99, use_ema_warmup=True, inv_gamma=0.5, power=2 / 3),
        "late": dict(decay=0.95, update_after_step=40),
        "foreach": dict(decay=0.99, update_after_step=3, foreach=True),
    }
    return {name: run(lambda m, kw=kw: EMAModel(params(m), **kw), lambda e, m: e.step(params(m)), shadows)
            for name, kw in cases.items()}


def ema_pytorch_cases():
    def shadows(e, m):
        return floating(e.ema_model)

    cases = {
        "default": dict(beta=0.99, update_after_step=10, update_every=3),
        "every_step": dict(beta=0.995, update_after_step=0, update_every=1, power=0.75, inv_gamma=2.0),
        "min_value": dict(beta=0.999, update_after_step=5, update_every=2, min_value=0.5),
        "ignore": dict(beta=0.99, update_after_step=10, update_every=1, ignore_names={"0.bias"},
                       ignore_startswith_names={"1."}),
        "no_ema": dict(beta=0.99, update_after_step=4, update_every=2,
                       param_or_buffer_names_no_ema={"0.weight", "1.running_mean"}),
        "foreach": dict(beta=0.98, update_after_step=6, update_every=2, use_foreach=True,
                        param_or_buffer_names_no_ema={"1.running_var"}),
        "frozen": dict(beta=1.0, update_after_step=3, update_every=1),
        "model_copy": dict(beta=0.9, update_after_step=5, update_every=2, update_model_with_ema_every=7),
        "model_pull": dict(beta=0.9, update_after_step=5, update_every=1, update_model_with_ema_every=5,
                           update_model_with_ema_beta=0.3, ignore_names={"2.bias"},
                           param_or_buffer_names_no_ema={"0.bias"}),
    }
    out = {}
    for name, kw in cases.items():
        out[name] = run(lambda m, kw=kw: EMA(m, include_online_model=False, **kw), lambda e, m: e.update(), shadows,
                        model_too="update_model_with_ema_every" in kw)
    for name, kw in {"sigma": dict(sigma_rel=0.12, update_every=1), "gamma_every": dict(gamma=5.0, update_every=3),
                     "frozen": dict(sigma_rel=0.1, update_every=1, frozen=True)}.items():
        out["karras_" + name] = run(lambda m, kw=kw: KarrasEMA(m, **kw), lambda e, m: e.update(),
                                    lambda e, m: dict(e.ema_model.named_parameters()))
    return out


def lit_cases():
    return {"lit": run(lambda m: LitEma(m, decay=0.97), lambda e, m: e(m), lambda e, m: e.shadow)}


def decay_sweep():
    out = {}
    configs = {"default": dict(update_after_step=100), "fast": dict(update_after_step=0, inv_gamma=1.0, power=0.75),
               "slow": dict(update_after_step=7, inv_gamma=3.0, power=0.7),
               "clamped": dict(update_after_step=2, min_value=0.3, beta=0.999, power=2 / 3)}
    model = nn.Linear(1, 1)
    for name, kw in configs.items():
        e = EMA(model, include_online_model=False, **kw)
        values = []
        for step in range(0, 20001):
            e.step.fill_(step)
            values.append(e.get_current_decay())
        out[name] = values
    return out


def generate(out):
    warnings.filterwarnings("ignore")
    (out / "ema_sweeps.json").write_text(json.dumps({
        "steps": STEPS, "initial": flat(floating(make_model())), "diffusers": diffusers_cases(), "ema_pytorch": ema_pytorch_cases(), "lit_ema": lit_cases(),
        "decays": decay_sweep()}))
