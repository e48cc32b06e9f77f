"""The Python side of train_vs_python_eager: the same small model and step as bench_train.cpp's
train_step_small (3 Linear layers of width 256, SiLU, MSE; AdamW with a decay and a no-decay group,
diffusers cosine schedule with warm-up, clip_grad_norm_, 2 micro-batches, diffusers EMAModel),
run eagerly. Usage: python_eager_train.py [STEPS [best]]; `best` turns on Python's fastest eager
settings (AdamW fused=True, EMAModel foreach=True). Prints {"seconds_per_step": ...} for the C++
benchmark to compare with."""
import json
import sys
import time

import torch
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from torch import nn


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    best = len(sys.argv) > 2 and sys.argv[2] == "best"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(torch.get_num_threads())
    net = nn.Sequential(nn.Linear(256, 256), nn.SiLU(), nn.Linear(256, 256), nn.SiLU(),
                        nn.Linear(256, 256)).to(device)
    decay = [p for p in net.parameters() if p.ndim >= 2]
    no_decay = [p for p in net.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, weight_decay=1e-2, **({"fused": True} if best else {}))
    sched = get_scheduler("cosine", opt, num_warmup_steps=100, num_training_steps=100000)
    ema = EMAModel(net.parameters(), decay=0.9999, use_ema_warmup=True, foreach=best)
    data = [(torch.randn(64, 256, device=device), torch.randn(64, 256, device=device)) for _ in range(2)]

    def step():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in data:
            loss = torch.nn.functional.mse_loss(net(x), y)
            total += loss.item()
            (loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        ema.step(net.parameters())
        return total

    for _ in range(20):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    print(json.dumps({"seconds_per_step": (time.perf_counter() - start) / steps, "device": device}))


if __name__ == "__main__":
    main()
