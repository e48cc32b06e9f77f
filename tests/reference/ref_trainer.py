"""A small model trained 200 steps the way a diffusers training script does it: torch AdamW with a
decay and a no-decay group, diffusers get_scheduler("cosine") with warm-up, diffusers EMAModel with
warm-up, clip_grad_norm_, 2 micro-batches of accumulation. Initial weights, every batch, the final
weights and the EMA weights go to trainer_parity.safetensors for the C++ trainer to reproduce.
Also: torch.amp.GradScaler's scale history on a run that overflows (gradscaler.json)."""
import json

import torch
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from safetensors.torch import save_file
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.nn.functional.silu(self.norm(self.fc1(x))))


def generate(out):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(21)
    net = Net()
    init = {f"init.{k}": v.detach().clone() for k, v in net.state_dict().items()}
    steps, accum = 200, 2
    xs = torch.randn(steps, accum, 8, 6, generator=g)
    ys = torch.randn(steps, accum, 8, 4, generator=g)
    decay = [p for n, p in net.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in net.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3, weight_decay=1e-2)
    sched = get_scheduler("cosine", opt, num_warmup_steps=20, num_training_steps=steps)
    ema = EMAModel(net.parameters(), decay=0.99, use_ema_warmup=True, power=2 / 3)
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        for m in range(accum):
            loss = torch.nn.functional.mse_loss(net(xs[s, m]), ys[s, m])
            (loss / accum).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        sched.step()
        ema.step(net.parameters())
    tensors = dict(init)
    tensors.update({f"final.{k}": v.detach().clone() for k, v in net.state_dict().items()})
    names = [n for n, _ in net.named_parameters()]
    tensors.update({f"ema.{n}": p.detach().clone() for n, p in zip(names, ema.shadow_params)})
    tensors["xs"], tensors["ys"] = xs, ys
    save_file(tensors, str(out / "trainer_parity.safetensors"))

    # GradScaler on the CPU, starting so high that the first steps overflow, growing every 3 steps.
    torch.manual_seed(1)
    lin = nn.Linear(4, 4)
    w0 = lin.weight.detach().clone()
    b0 = lin.bias.detach().clone()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 126, growth_interval=3)
    x = torch.ones(2, 4)
    history, stepped = [], []
    for _ in range(12):
        opt.zero_grad()
        loss = (lin(x) ** 2).mean() * 100
        scaler.scale(loss).backward()
        before = lin.weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        stepped.append(not torch.equal(before, lin.weight.detach()))
        history.append(scaler.get_scale())
    (out / "gradscaler.json").write_text(json.dumps({
        "w0": w0.flatten().tolist(), "b0": b0.tolist(), "history": history, "stepped": stepped,
        "w": lin.weight.detach().flatten().tolist()}))
