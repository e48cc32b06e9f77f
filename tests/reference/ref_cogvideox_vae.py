"""Golden values for difftrain's AutoencoderKLCogVideoX: diffusers' own CogVideoX 3-D VAE.

Tiny random configurations: one to four levels, one to three temporal compressions, frame counts
odd and even (1 + 4k as CogVideoX uses them, 6 and a single frame, which diffusers accepts), odd
heights and widths, frame batches smaller than the video (so the causal convolutions carry frames
from one batch to the next, as diffusers' default 8/2 batches do for 49-frame videos), widths that
change inside a level (1×1×1 shortcuts), the quant convolutions, and another activation. Each case
saves the model with save_pretrained, runs reconstruction (encode, the posterior's mode, decode) on
a seeded video in training mode and writes the video, the posterior's moments, the output and the
gradient of sum(out · w) for every parameter. A tiled case writes the tiled encode and decode of a
video larger than its tiles. The published VAE (CogVideoX-2b's and -5b's config: diffusers'
defaults, scaling_factor 1.15258426 and 0.7) is instantiated on the meta device for its names,
shapes and count.
"""
import json
import pathlib

import torch
from diffusers import AutoencoderKLCogVideoX
from diffusers.utils import logging as diffusers_logging
from safetensors.torch import save_file

diffusers_logging.set_verbosity_error()

DOWN, UP = "CogVideoXDownBlock3D", "CogVideoXUpBlock3D"


def tiny(levels, **kw):
    cfg = dict(down_block_types=[DOWN] * levels, up_block_types=[UP] * levels)
    cfg.update(kw)
    return cfg


# name, config, (frames, height, width), frame batches (sample, latent) or None for diffusers'
CASES = [
    ("two_levels_odd_frames", tiny(2, block_out_channels=[8, 16], layers_per_block=1,
                                   latent_channels=4, norm_num_groups=4,
                                   temporal_compression_ratio=2, sample_height=16,
                                   sample_width=16), (5, 10, 14), None),
    ("three_levels_frame_batched", tiny(3, block_out_channels=[8, 8, 16], layers_per_block=2,
                                        latent_channels=3, norm_num_groups=2,
                                        temporal_compression_ratio=4, sample_height=16,
                                        sample_width=16), (17, 8, 12), (8, 2)),
    ("small_batches_even_frames", tiny(2, block_out_channels=[4, 8], layers_per_block=1,
                                       latent_channels=2, norm_num_groups=2, norm_eps=1e-5,
                                       temporal_compression_ratio=2, scaling_factor=0.7,
                                       sample_height=8, sample_width=8), (6, 9, 7), (2, 1)),
    ("quant_convs_mish", tiny(2, in_channels=2, out_channels=3, latent_channels=3,
                              block_out_channels=[6, 6], layers_per_block=1, norm_num_groups=3,
                              act_fn="mish", temporal_compression_ratio=1, use_quant_conv=True,
                              use_post_quant_conv=True, sample_height=8, sample_width=8),
     (3, 6, 6), (2, 1)),
    ("one_frame_image", tiny(3, block_out_channels=[4, 8, 8], layers_per_block=1,
                             latent_channels=2, norm_num_groups=4, temporal_compression_ratio=4,
                             sample_height=8, sample_width=8), (1, 8, 8), None),
]

# diffusers' defaults are CogVideoX-2b's vae/config.json; -5b's sets scaling_factor 0.7.
COGVIDEOX_VAE = {"_class_name": "AutoencoderKLCogVideoX", "act_fn": "silu",
                 "block_out_channels": [128, 256, 256, 512], "down_block_types": [DOWN] * 4,
                 "force_upcast": True, "in_channels": 3, "latent_channels": 16,
                 "latents_mean": None, "latents_std": None, "layers_per_block": 3,
                 "norm_eps": 1e-06, "norm_num_groups": 32, "out_channels": 3,
                 "sample_height": 480, "sample_width": 720, "scaling_factor": 1.15258426,
                 "shift_factor": None, "temporal_compression_ratio": 4,
                 "up_block_types": [UP] * 4, "use_post_quant_conv": False,
                 "use_quant_conv": False}


def randomise(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def generate(out):
    root = out / "cogvideox_vae"
    root.mkdir(parents=True, exist_ok=True)
    index = {"cases": []}
    for name, config, (f, h, w), batches in CASES:
        torch.manual_seed(0)
        model = AutoencoderKLCogVideoX(**config)
        randomise(model)
        model.save_pretrained(root / name)
        model = AutoencoderKLCogVideoX.from_pretrained(root / name).train()
        if batches:
            model.num_sample_frames_batch_size, model.num_latent_frames_batch_size = batches
        g = torch.Generator().manual_seed(5)
        x = torch.randn(2, model.config.in_channels, f, h, w, generator=g)
        posterior = model.encode(x).latent_dist
        y = model.decode(posterior.mode()).sample
        wgt = torch.randn(y.shape, generator=g)
        (y * wgt).sum().backward()
        tensors = {"input.sample": x, "moments": posterior.parameters.detach(),
                   "output": y.detach(), "weight": wgt}
        tensors.update({f"grad.{n}": p.grad.clone() for n, p in model.named_parameters()})
        save_file({k: v.contiguous() for k, v in tensors.items()}, root / f"{name}.io.safetensors")
        index["cases"].append({"name": name, "frame_batches": batches,
                               "parameters": sum(p.numel() for p in model.parameters())})

    # Tiling: a 2-level model, tiles of 8×10 pixels (4×5 latents), diffusers' overlaps.
    name = "tiled"
    torch.manual_seed(0)
    model = AutoencoderKLCogVideoX(**tiny(2, block_out_channels=[4, 8], layers_per_block=1,
                                          latent_channels=2, norm_num_groups=2,
                                          temporal_compression_ratio=2, sample_height=16,
                                          sample_width=20))
    randomise(model)
    model.save_pretrained(root / name)
    model = AutoencoderKLCogVideoX.from_pretrained(root / name).eval()
    model.num_sample_frames_batch_size, model.num_latent_frames_batch_size = 4, 2
    model.enable_tiling()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 3, 5, 21, 26, generator=g)
    z = torch.randn(1, 2, 3, 11, 13, generator=g)
    with torch.no_grad():
        moments = model.encode(x).latent_dist.parameters
        video = model.decode(z).sample
    save_file({"input.sample": x, "input.latents": z, "moments": moments.contiguous(),
               "decoded": video.contiguous()}, root / f"{name}.io.safetensors")
    index["tiled"] = {"name": name, "tile_sample_min_height": model.tile_sample_min_height,
                      "tile_sample_min_width": model.tile_sample_min_width,
                      "frame_batches": [4, 2]}

    with torch.device("meta"):
        args = {k: v for k, v in COGVIDEOX_VAE.items() if not k.startswith("_")}
        full = AutoencoderKLCogVideoX(**args)
        index["published"] = {"config": COGVIDEOX_VAE,
                              "shapes": {n: list(p.shape) for n, p in full.state_dict().items()},
                              "parameters": sum(p.numel() for p in full.parameters())}
    (out / "cogvideox_vae.json").write_text(json.dumps(index))


if __name__ == "__main__":
    import sys
    generate(pathlib.Path(sys.argv[1]))
