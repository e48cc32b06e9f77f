"""The Python side of dit_step_vs_diffusers: diffusers' DiTTransformer2DModel at the small config
bench_transformers.cpp builds, forward + backward of a mean-square loss, eager, on the same number
of threads (on a GPU, under autocast). Usage:
python_dit_step.py CONFIG_JSON STEPS THREADS BATCH [DEVICE [AUTOCAST_DTYPE]];
prints {"seconds_per_step": ...}."""
import json
import sys
import time

import torch
from diffusers import DiTTransformer2DModel


def main():
    config = json.loads(sys.argv[1])
    steps = int(sys.argv[2])
    torch.set_num_threads(int(sys.argv[3]))
    batch = int(sys.argv[4])
    device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
    dtype = {"none": None, "bf16": torch.bfloat16}[sys.argv[6] if len(sys.argv) > 6 else "none"]
    torch.manual_seed(0)
    # Eval mode for the label embedding (no random label dropout); nothing else differs.
    dit = DiTTransformer2DModel(**config).eval().to(device)
    size = config["sample_size"]
    x = torch.randn(batch, config["in_channels"], size, size, device=device)
    t = torch.arange(batch, device=device) * 997 % 1000
    labels = torch.arange(batch, device=device) % config["num_embeds_ada_norm"]

    def step():
        dit.zero_grad(set_to_none=True)
        with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None):
            loss = dit(x, timestep=t, class_labels=labels).sample.float().square().mean()
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
