"""PyTorch's own DistributedDataParallel on the model, data and settings of worker.cpp.

Run under torchrun (one process per rank); writes <out>.rank<r>.json with the weights it ends
with. With --zero the optimizer is torch's ZeroRedundancyOptimizer (ZeRO stage 1: each rank
steps its own parameters, then they are broadcast), the reference of ShardedDataParallel's
stages 1 and 2. With --fsdp the model is FSDP2's fully_shard instead (each --wide hidden layer a
unit, then the root), the reference of stage 3; --param-dtype and --reduce-dtype give every
fully_shard a MixedPrecisionPolicy (the reference of stage 3's mixed precision). Gradient accumulation uses DDP's no_sync (FSDP's
set_requires_gradient_sync(False)) for every micro-batch but the last, as the difftrain trainer
does; clipping by the global norm after the reduction.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn

GLOBAL_BATCH, IN, OUT = 16, 8, 4


def global_batch(step, micro):
    f64 = torch.float64
    x = torch.sin(torch.arange(GLOBAL_BATCH * IN, dtype=f64) * 0.1 + 0.7 * step + 1.3 * micro)
    y = torch.cos(torch.arange(GLOBAL_BATCH * OUT, dtype=f64) * 0.05 + 0.3 * step - 0.9 * micro)
    return x.reshape(GLOBAL_BATCH, IN), y.reshape(GLOBAL_BATCH, OUT)


class Net(nn.Module):
    def __init__(self, dtype, wide=0):
        super().__init__()
        width = 32 if wide > 0 else 16
        self.fc1 = nn.Linear(IN, width)
        self.hidden = []
        for i in range(wide):  # registered between fc1 and fc2, as worker.cpp's
            self.add_module(f"hidden{i}", nn.Linear(width, width))
            self.hidden.append(getattr(self, f"hidden{i}"))
        self.fc2 = nn.Linear(width, OUT)
        self.register_buffer("scale", torch.ones(OUT, dtype=torch.float64))
        self.to(dtype)
        with torch.no_grad():
            for k, (_, p) in enumerate(self.named_parameters()):
                v = torch.sin(torch.arange(p.numel(), dtype=torch.float64) * 0.37 + k) * 0.3
                p.copy_(v.reshape(p.shape))

    def forward(self, x, y):
        h = torch.tanh(self.fc1(x))
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        pred = self.fc2(h) * self.scale
        return (pred - y).pow(2).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", required=True)
    ap.add_argument("--zero", action="store_true")
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--wide", type=int, default=0)
    ap.add_argument("--param-dtype")
    ap.add_argument("--reduce-dtype")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.float32 if a.dtype == "float32" else torch.float64
    net = Net(dtype, a.wide)
    if rank != 0:  # as worker.cpp: other ranks start elsewhere; DDP makes them rank 0's
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.5)
            net.scale.fill_(2.0)
    if a.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        with torch.no_grad():  # fully_shard keeps each rank's values: rank 0's first
            for t in [*net.parameters(), *net.buffers()]:
                dist.broadcast(t, 0)
        named = lambda n: getattr(torch, n) if n else None  # noqa: E731
        mp = MixedPrecisionPolicy(param_dtype=named(a.param_dtype),
                                  reduce_dtype=named(a.reduce_dtype))
        for layer in net.hidden:
            fully_shard(layer, mp_policy=mp)
        ddp = fully_shard(net, mp_policy=mp)
    else:
        ddp = nn.parallel.DistributedDataParallel(net)
    settings = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    if a.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW,
                                      **settings)
    else:
        opt = torch.optim.AdamW(net.parameters(), **settings)
    rows = GLOBAL_BATCH // world
    losses = []
    for step in range(a.steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(a.accumulation):
            x, y = global_batch(step, m)
            x = x[rank * rows:(rank + 1) * rows].to(dtype)
            y = y[rank * rows:(rank + 1) * rows].to(dtype)
            if a.fsdp:
                ddp.set_requires_gradient_sync(m + 1 == a.accumulation)
                loss = ddp(x, y)
                (loss / a.accumulation).backward()
            elif m + 1 < a.accumulation:
                with ddp.no_sync():
                    loss = ddp(x, y)
                    (loss / a.accumulation).backward()
            else:
                loss = ddp(x, y)
                (loss / a.accumulation).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        losses.append(total / a.accumulation)
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in net.parameters()]
    weights = torch.cat([p.detach().double().reshape(-1) for p in whole]).tolist()
    with open(f"{a.out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "world_size": world, "step": a.steps, "weights": weights,
                   "losses": losses, "error": None}, f)
    dist.barrier()  # no rank leaves while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
