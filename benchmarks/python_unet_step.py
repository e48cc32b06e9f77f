"""The Python side of unet_step_vs_diffusers: diffusers' UNet2DConditionModel at the small SD-like
configuration bench_models.cpp builds, forward + backward of a mean-square loss, eager, on the same
number of threads. Usage: python_unet_step.py CONFIG_JSON STEPS THREADS; prints
{"seconds_per_step": ...}."""
import json
import sys
import time

import torch
from diffusers import UNet2DConditionModel


def main():
    config = json.loads(sys.argv[1])
    steps = int(sys.argv[2])
    torch.set_num_threads(int(sys.argv[3]))
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**config).train()
    size = config["sample_size"]
    x = torch.randn(2, config["in_channels"], size, size)
    t = torch.tensor([10, 500])
    ctx = torch.randn(2, 16, config["cross_attention_dim"])

    def step():
        unet.zero_grad(set_to_none=True)
        unet(x, t, ctx).sample.square().mean().backward()

    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    print(json.dumps({"seconds_per_step": (time.perf_counter() - start) / steps}))


if __name__ == "__main__":
    main()
