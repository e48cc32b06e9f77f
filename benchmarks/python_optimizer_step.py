"""The Python side of optimizer_step_vs_python_fused / _foreach: torch.optim.AdamW(fused=True) or
(foreach=True) stepping COUNT tensors of NUMEL parameters with gradients, on the GPU when there is
one. Usage: python_optimizer_step.py COUNT NUMEL [fused|foreach]; prints {"seconds_per_step": ...}."""
import json
import sys
import time

import torch


def main():
    count, numel = int(sys.argv[1]), int(sys.argv[2])
    kind = sys.argv[3] if len(sys.argv) > 3 else "fused"
    if kind not in ("fused", "foreach"):
        raise SystemExit(f"kernel must be fused or foreach, got {kind!r}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = [torch.randn(numel, device=device, requires_grad=True) for _ in range(count)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-2, **{kind: True})

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        opt.step()
    sync()
    steps, start = 0, time.perf_counter()
    while steps < 10 or time.perf_counter() - start < 1.0:
        opt.step()
        sync()
        steps += 1
    print(json.dumps({"seconds_per_step": (time.perf_counter() - start) / steps}))


if __name__ == "__main__":
    main()
