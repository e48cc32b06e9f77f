"""The Python side of the <model>_step_vs_diffusers benchmarks of bench_transformers.cpp:
diffusers' DiTTransformer2DModel, PixArtTransformer2DModel, SD3Transformer2DModel or
CogVideoXTransformer3DModel (rotary embeddings as its pipeline computes them) at the small
config the benchmark builds, forward + backward of a mean-square loss, eager, on the same number
of threads (on a GPU, under autocast). Usage:
python_transformer_step.py MODEL CONFIG_JSON STEPS THREADS BATCH [DEVICE [AUTOCAST_DTYPE]]
with MODEL dit, pixart, sd3, cogvideox (text: 16 tokens) or cogvideox_vae (a 9-frame 32x32 video
reconstructed); prints {"seconds_per_step": ...}."""
import json
import sys
import time
from types import SimpleNamespace

import torch
from diffusers import (AutoencoderKLCogVideoX, CogVideoXTransformer3DModel, DiTTransformer2DModel, PixArtTransformer2DModel,
                       SD3Transformer2DModel)
from diffusers.pipelines.cogvideo.pipeline_cogvideox import CogVideoXPipeline

TOKENS = 16


def main():
    kind = sys.argv[1]
    config = json.loads(sys.argv[2])
    steps = int(sys.argv[3])
    torch.set_num_threads(int(sys.argv[4]))
    batch = int(sys.argv[5])
    device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
    dtype = {"none": None, "bf16": torch.bfloat16}[sys.argv[7] if len(sys.argv) > 7 else "none"]
    torch.manual_seed(0)
    cls = {"dit": DiTTransformer2DModel, "pixart": PixArtTransformer2DModel,
           "sd3": SD3Transformer2DModel, "cogvideox": CogVideoXTransformer3DModel,
           "cogvideox_vae": AutoencoderKLCogVideoX}[kind]
    # Eval mode for DiT's label embedding (no random label dropout); nothing else differs.
    model = cls(**config).eval().to(device)
    t = torch.arange(batch, device=device) * 997 % 1000
    if kind == "cogvideox_vae":  # a 9-frame video (B, C, F, H, W), reconstructed
        x = torch.randn(batch, config.get("in_channels", 3), 9, 32, 32, device=device)
    elif kind == "cogvideox":  # video latents (B, F, C, H, W) at the configured size
        frames = (config["sample_frames"] - 1) // config.get("temporal_compression_ratio", 4) + 1
        h, w = config["sample_height"], config["sample_width"]
        x = torch.randn(batch, frames, config["in_channels"], h, w, device=device)
        pipe = SimpleNamespace(vae_scale_factor_spatial=8, transformer=model)
        rotary = CogVideoXPipeline._prepare_rotary_positional_embeddings(
            pipe, h * 8, w * 8, frames, torch.device(device))
    else:
        size = config["sample_size"]
        x = torch.randn(batch, config["in_channels"], size, size, device=device)
    if kind == "cogvideox_vae":
        kwargs = {}
    elif kind == "cogvideox":
        kwargs = {"timestep": t, "image_rotary_emb": rotary, "encoder_hidden_states":
                  torch.randn(batch, TOKENS, config["text_embed_dim"], device=device)}
    elif kind == "dit":
        kwargs = {"timestep": t, "class_labels": torch.arange(batch, device=device) % 1000}
    elif kind == "pixart":
        kwargs = {"timestep": t, "encoder_hidden_states":
                  torch.randn(batch, TOKENS, config["caption_channels"], device=device)}
    else:
        kwargs = {"timestep": t.float(), "encoder_hidden_states":
                  torch.randn(batch, TOKENS, config["joint_attention_dim"], device=device),
                  "pooled_projections": torch.randn(batch, config["pooled_projection_dim"],
                                                    device=device)}

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None):
            loss = model(x, **kwargs).sample.float().square().mean()
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
