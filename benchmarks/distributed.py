"""The 2-rank data-parallel benchmark: difftrain's ranks and PyTorch's DDP on the same MLP, both
under torchrun on this machine (Gloo over 127.0.0.1), in the same run.

    distributed.py BENCH_BINARY [--layers 12 --width 1024 --batch 64 --ranks 2]

Prints both sides' timings (local forward + backward; then one all-reduce after it; bucketed
all-reduce from hooks; a whole step with AdamW and clip_grad_norm_), the share of all-reduce time
hidden behind backward by the buckets, (after - buckets) / (after - local) (goal >= 0.5; 0 by
construction for all-reduce after backward), and the step time ratio difftrain / Python DDP.
Then the sharded steps (ShardedDataParallel stages 1 to 3) against DataParallel's step in the same
run (goals: stage 1 <= 1.1x, stage 3 <= 1.5x), stage 1 against Python's DDP +
ZeroRedundancyOptimizer and stage 3 against FSDP2's fully_shard (each layer a unit).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

PY_RANK = r'''
import json, sys, time
import torch, torch.distributed as dist, torch.nn as nn
layers, width, batch, iterations = map(int, sys.argv[1:5])
dist.init_process_group("gloo")
torch.manual_seed(0)
x, y = torch.randn(batch, width), torch.randn(batch, width)
class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
    def forward(self, x, y):
        h = x
        for l in self.fc:
            h = torch.tanh(l(h))
        return (h - y).pow(2).mean()
net = Mlp()
ddp = nn.parallel.DistributedDataParallel(net)
opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=1e-2)
params = list(net.parameters())
def timed(f):
    t = []
    for i in range(iterations + 2):
        dist.barrier()
        start = time.perf_counter()
        f()
        if i >= 2:
            t.append(time.perf_counter() - start)
    return sorted(t)[len(t) // 2]
def zero():
    for p in params:
        p.grad = None
def local():
    zero()
    net(x, y).backward()
def after():
    local()
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    at = 0
    for p in params:
        p.grad.copy_(flat[at:at + p.numel()].view_as(p))
        at += p.numel()
def buckets():
    zero()
    ddp(x, y).backward()
def step():
    opt.zero_grad(set_to_none=True)
    loss = ddp(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    loss.item()
r = {"local": timed(local), "after": timed(after), "buckets": timed(buckets), "step": timed(step)}
from torch.distributed.optim import ZeroRedundancyOptimizer
opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4,
                              weight_decay=1e-2)
r["zero1"] = timed(step)
from torch.distributed.fsdp import fully_shard
net = Mlp()
for l in net.fc:
    fully_shard(l)
fully_shard(net)
opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=1e-2)
ddp = net
r["zero3"] = timed(step)
r["hidden"] = (r["after"] - r["buckets"]) / (r["after"] - r["local"])
if dist.get_rank() == 0:
    print(json.dumps(r))
dist.destroy_process_group()
'''


def torchrun(ranks, cmd):
    torchrun_bin = pathlib.Path(sys.executable).parent / "torchrun"
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    r = subprocess.run([str(torchrun_bin), "--standalone", f"--nproc-per-node={ranks}", *cmd],
                       env=env, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=10)
    a = ap.parse_args()
    sizes = [str(a.layers), str(a.width), str(a.batch), str(a.iterations)]
    cpp = torchrun(a.ranks, ["--no-python", a.binary, "--layers", sizes[0], "--width", sizes[1],
                             "--batch", sizes[2], "--iterations", sizes[3]])
    script = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / "difftrain_ddp_bench_rank.py"
    script.write_text(PY_RANK)
    py = torchrun(a.ranks, [str(script), *sizes])
    params_mib = a.layers * (a.width * a.width + a.width) * 4 / 2**20
    print(f"{a.ranks} ranks, MLP {a.layers} x {a.width} ({params_mib:.0f} MiB of float32 "
          f"gradients), batch {a.batch} per rank, 1 thread per rank")
    print(f"  {'':8s} {'difftrain':>10s} {'Python DDP':>11s}")
    for k in ("local", "after", "buckets", "step"):
        print(f"  {k:8s} {cpp[k] * 1e3:7.1f} ms {py[k] * 1e3:8.1f} ms")
    print(f"  all-reduce hidden behind backward: {cpp['hidden']:.2f} with buckets "
          f"(Python DDP: {py['hidden']:.2f}; all-reduce after backward: 0 by construction)")
    print(f"  step vs Python DDP: {cpp['step'] * 1e3:.1f} ms / {py['step'] * 1e3:.1f} ms = "
          f"ratio {cpp['step'] / py['step']:.3f}")
    print(f"  sharded steps ({a.ranks} ranks), against DataParallel's step {cpp['step'] * 1e3:.1f} ms:")
    for k, goal in (("zero1", " (goal <= 1.1)"), ("zero2", ""), ("zero3", " (goal <= 1.5)")):
        print(f"    stage {k[-1]}: {cpp[k] * 1e3:7.1f} ms, ratio {cpp[k] / cpp['step']:.3f}{goal}")
    print(f"  stage 1 vs Python DDP + ZeroRedundancyOptimizer: {cpp['zero1'] * 1e3:.1f} ms / "
          f"{py['zero1'] * 1e3:.1f} ms = ratio {cpp['zero1'] / py['zero1']:.3f}")
    print(f"  stage 3 vs Python FSDP2 (fully_shard per layer): {cpp['zero3'] * 1e3:.1f} ms / "
          f"{py['zero3'] * 1e3:.1f} ms = ratio {cpp['zero3'] / py['zero3']:.3f}")
    print(json.dumps({"difftrain": cpp, "python_ddp": py}))


if __name__ == "__main__":
    main()
