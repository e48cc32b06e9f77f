"""The Python side of train_vs_python_eager: the same small model and step as bench_train.cpp's
train_step_small (3 Linear layers of width 256, SiLU, MSE; AdamW with a decay and a no-decay group,
diffusers cosine schedule with warm-up, clip_grad_norm_, 2 micro-batches, diffusers EMAModel),
run eagerly. Usage: python_eager_train.py [STEPS|serve [best]]; `best` turns on Python's fastest
eager settings (AdamW fused=True, EMAModel foreach=True). Prints {"seconds_per_step": ...} for the
C++ benchmark to compare with. With `serve` it stays up after its warm-up: each line it reads is a
step count, and it answers each with {"seconds_per_step": ...} for that block of steps (the paired
benchmarks alternate such blocks with their own, so the machine's load changes both alike)."""
import json
import sys
import time

import torch
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from torch import nn


def main():
    serve = len(sys.argv) > 1 and sys.argv[1] == "serve"
    steps = 200 if serve or len(sys.argv) < 2 else int(sys.argv[1])
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

    def timed(n):
        start = time.perf_counter()
        for _ in range(n):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / n

    for _ in range(20):
        step()
    if not serve:
        print(json.dumps({"seconds_per_step": timed(steps), "device": device}))
        return
    print(json.dumps({"ready": True, "device": device}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        print(json.dumps({"seconds_per_step": timed(int(line))}), flush=True)


if __name__ == "__main__":
    main()
