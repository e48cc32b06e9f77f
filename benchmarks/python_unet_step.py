"""The Python side of unet_step_vs_diffusers: diffusers' UNet2DConditionModel at the small SD-like
configuration bench_models.cpp builds, forward + backward of a mean-square loss, eager, on the same
number of threads; on a GPU, under autocast. Usage:
python_unet_step.py CONFIG_JSON STEPS THREADS [DEVICE [AUTOCAST_DTYPE [BATCH [TOKENS]]]]; prints
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
    device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[
        sys.argv[5] if len(sys.argv) > 5 else "none"]
    batch = int(sys.argv[6]) if len(sys.argv) > 6 else 2
    tokens = int(sys.argv[7]) if len(sys.argv) > 7 else 16
    unet = UNet2DConditionModel(**config).train().to(device)
    size = config["sample_size"]
    x = torch.randn(batch, config["in_channels"], size, size, device=device)
    t = torch.arange(batch, device=device) * 997 % 1000
    ctx = torch.randn(batch, tokens, config["cross_attention_dim"], device=device)

    def step():
        unet.zero_grad(set_to_none=True)
        with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None):
            loss = unet(x, t, ctx).sample.float().square().mean()
        loss.backward()

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(3):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    print(json.dumps({"seconds_per_step": (time.perf_counter() - start) / steps}))


if __name__ == "__main__":
    main()
