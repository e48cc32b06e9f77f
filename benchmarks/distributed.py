"""The 2-rank data-parallel benchmark: difftrain's ranks and PyTorch's DDP on the same MLP, both
under torchrun on this machine (Gloo over 127.0.0.1), in the same run.

    distributed.py BENCH_BINARY [--layers 12 --width 1024 --batch 64 --ranks 2]

Prints difftrain's timings, the share of all-reduce time hidden behind backward (goal >= 0.5 with
buckets; 0 by construction for all-reduce after backward), and the step time against Python's DDP
(AdamW, clip_grad_norm_, same sizes): ratio = difftrain / Python.
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
t = []
for i in range(iterations + 2):
    dist.barrier()
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = ddp(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    loss.item()
    if i >= 2:
        t.append(time.perf_counter() - start)
if dist.get_rank() == 0:
    print(json.dumps({"step": sorted(t)[len(t) // 2]}))
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
    for k in ("local", "after", "buckets", "step"):
        print(f"  {k:8s} {cpp[k] * 1e3:8.1f} ms")
    print(f"  all-reduce hidden behind backward: {cpp['hidden']:.2f} with buckets "
          f"(all-reduce after backward: 0 by construction)")
    print(f"  step vs Python DDP: {cpp['step'] * 1e3:.1f} ms / {py['step'] * 1e3:.1f} ms = "
          f"ratio {cpp['step'] / py['step']:.3f}")
    print(json.dumps({"difftrain": cpp, "python_ddp": py}))


if __name__ == "__main__":
    main()
