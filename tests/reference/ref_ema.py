"""Golden EMA shadows from the real libraries: diffusers' EMAModel (per-tensor and foreach),
ema-pytorch's EMA, KarrasEMA and PostHocEMA, and LitEma (latent diffusion / CogVideoX, copied here
as it does not install). One toy model (with a frozen parameter and batch-norm buffers) is trained
200 steps with AdamW; the weights after every step are recorded so the C++ side replays exactly the
same sequence, and each EMA's final shadows are recorded by parameter name.
"""
import json
import tempfile
import warnings

import torch
from diffusers.training_utils import EMAModel
from ema_pytorch import EMA, KarrasEMA, PostHocEMA
from torch import nn

STEPS = 200


class LitEma(nn.Module):
    # ldm/modules/ema.py, as CogVideoX's sgm uses it.
    def __init__(self, model, decay=0.9999, use_num_upates=True):
        super().__init__()
        self.m_name2s_name = {}
        self.register_buffer("decay", torch.tensor(decay, dtype=torch.float32))
        self.register_buffer("num_updates", torch.tensor(0, dtype=torch.int) if use_num_upates
                             else torch.tensor(-1, dtype=torch.int))
        for name, p in model.named_parameters():
            if p.requires_grad:
                s_name = name.replace(".", "")
                self.m_name2s_name.update({name: s_name})
                self.register_buffer(s_name, p.clone().detach().data)

    def forward(self, model):
        decay = self.decay
        if self.num_updates >= 0:
            self.num_updates += 1
            decay = min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
        one_minus_decay = 1.0 - decay
        with torch.no_grad():
            m_param = dict(model.named_parameters())
            shadow_params = dict(self.named_buffers())
            for key in m_param:
                if m_param[key].requires_grad:
                    sname = self.m_name2s_name[key]
                    shadow_params[sname] = shadow_params[sname].type_as(m_param[key])
                    shadow_params[sname].sub_(one_minus_decay * (shadow_params[sname] - m_param[key]))


def make_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 3))
    model[3].bias.requires_grad_(False)  # a frozen parameter: copied, not averaged
    return model


def tensors(model):
    out = {k: v for k, v in model.named_parameters()}
    out.update({k: v for k, v in model.named_buffers() if v.is_floating_point()})
    return out


def flat(d):
    return {k: v.detach().double().flatten().tolist() for k, v in d.items()}


def generate(out):
    warnings.filterwarnings("ignore")
    model = make_model()
    initial = flat(tensors(model))
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())

    diffusers_default = EMAModel(params)
    diffusers_warmup = EMAModel(params, decay=0.999, min_decay=0.1, update_after_step=5, use_ema_warmup=True,
                                inv_gamma=1.0, power=3 / 4)
    diffusers_foreach = EMAModel(params, decay=0.99, update_after_step=3, foreach=True)
    lit = LitEma(model, decay=0.995)
    ema_pt = EMA(model, beta=0.99, update_after_step=20, update_every=3, power=3 / 4, include_online_model=False)
    karras = KarrasEMA(model, sigma_rel=0.15, update_every=2)
    ckpt_dir = tempfile.mkdtemp()
    post_hoc = PostHocEMA(model, sigma_rels=(0.05, 0.28), update_every=1, checkpoint_every_num_steps=20,
                          checkpoint_folder=ckpt_dir, checkpoint_dtype=torch.float32)

    opt = torch.optim.AdamW([p for p in params if p.requires_grad], lr=3e-2)
    g = torch.Generator().manual_seed(1)
    trajectory = []
    for _ in range(STEPS):
        x = torch.randn(16, 6, generator=g)
        y = torch.randn(16, 3, generator=g)
        model.train()
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():  # the frozen bias drifts too, so copying it is visible
            model[3].bias.add_(0.01)
        trajectory.append(flat(tensors(model)))
        for e in (diffusers_default, diffusers_warmup, diffusers_foreach):
            e.step(params)
        lit(model)
        ema_pt.update()
        karras.update()
        post_hoc.update()

    def diffusers_shadows(e):
        return {n: s.double().flatten().tolist() for n, s in zip(names, e.shadow_params)}

    lit_buffers = dict(lit.named_buffers())
    results = {
        "diffusers_default": diffusers_shadows(diffusers_default),
        "diffusers_warmup": diffusers_shadows(diffusers_warmup),
        "diffusers_foreach": diffusers_shadows(diffusers_foreach),
        "lit_ema": {n: lit_buffers[s].double().flatten().tolist() for n, s in lit.m_name2s_name.items()},
        "ema_pytorch": flat(tensors(ema_pt.ema_model)),
        "karras": flat({k: v for k, v in karras.ema_model.named_parameters()}),
        "post_hoc_sigma_0.15": flat(dict(post_hoc.synthesize_ema_model(sigma_rel=0.15).ema_model.named_parameters())),
        "post_hoc_sigma_0.1_step_100": flat(dict(
            post_hoc.synthesize_ema_model(sigma_rel=0.1, step=100).ema_model.named_parameters())),
    }
    # A diffusers EMA state written in difftrain's file layout (shadows by name), for the reverse check.
    torch.save({"format": "difftrain.ema", "version": 1,
                "state": {k: v for k, v in diffusers_warmup.state_dict().items() if k != "shadow_params"},
                "shadow_params": {n: s.clone() for n, s in zip(names, diffusers_warmup.shadow_params)}},
               out / "ema_diffusers_state.pt")
    (out / "ema.json").write_text(json.dumps({
        "initial": initial, "trajectory": trajectory, "results": results,
        "karras_gamma": karras.gamma,
        "diffusers_warmup_state": {k: v for k, v in diffusers_warmup.state_dict().items() if k != "shadow_params"},
    }))
