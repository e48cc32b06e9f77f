"""The Python side of clip_text_encoder_vs_transformers(_paired): transformers' CLIPTextModel
(eager attention) with SD 1.x's CLIP ViT-L/14 configuration, random weights, a forward and backward
of sum(last_hidden_state) on a (BATCH, 77) batch, with the same threads as the C++ side.
Usage: python_text_encoder_step.py BATCH THREADS [serve]; prints {"seconds_per_step": ...}. With
`serve` it stays up after its warm-up: each line it reads is a step count, answered with
{"seconds_per_step": ...} for that block (the paired benchmark alternates such blocks with its
own)."""
import json
import sys
import time

import torch


def main():
    batch, threads = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(threads)
    from transformers import CLIPTextConfig, CLIPTextModel
    from transformers.utils import logging
    logging.set_verbosity_error()
    config = CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                            num_attention_heads=12, projection_dim=768, hidden_act="quick_gelu",
                            attn_implementation="eager")
    torch.manual_seed(0)
    model = CLIPTextModel(config).train()
    ids = torch.randint(0, 49406, (batch, 77))
    ids[:, -1] = 49407

    def step():
        model.zero_grad(set_to_none=True)
        model(ids).last_hidden_state.sum().backward()

    for _ in range(2):
        step()
    if len(sys.argv) > 3 and sys.argv[3] == "serve":
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if not line.strip():
                break
            start = time.perf_counter()
            for _ in range(int(line)):
                step()
            print(json.dumps({"seconds_per_step": (time.perf_counter() - start) / int(line)}),
                  flush=True)
        return
    steps, start = 0, time.perf_counter()
    while steps < 3 or time.perf_counter() - start < 3.0:
        step()
        steps += 1
    print(json.dumps({"seconds_per_step": (time.perf_counter() - start) / steps}))


if __name__ == "__main__":
    main()
