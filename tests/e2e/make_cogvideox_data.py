"""Test data for finetune_transformer's CogVideoX mode, made here, never downloaded: two tiny
CogVideoX pipelines with random weights (diffusers' CogVideoXPipeline.save_pretrained: a T5 encoder
of the trained T5 tokenizer, an AutoencoderKLCogVideoX compressing time 4x, a
CogVideoXTransformer3DModel with 3-D rotary embeddings and CogVideoXDDIMScheduler in CogVideoX-5b's
setting; the other with the fixed sine-cosine table and CogVideoXDPMScheduler in CogVideoX-2b's),
and a video folder in diffusers' local layout: prompts.txt and videos.txt, one line per video, each
video a folder of PNG frames of a Fashion-MNIST item sliding across the frame (10 to 13 frames, so
the programs cut them to 9).

    make_cogvideox_data.py OUT GOLDEN_DIR FASHION_MNIST_DIR
"""
import pathlib
import sys

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import make_text_to_image_data as t2i  # noqa: E402


def tiny_text_and_vae(golden: pathlib.Path, scaling_factor: float, invert_scale_latents=False):
    """The T5 tokenizer of the tests, a 2-layer T5 of width 32 and a 3-level CogVideoX VAE with 4
    latent channels compressing time 4x (random weights from torch's current seed)."""
    from diffusers import AutoencoderKLCogVideoX
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast
    tokenizer = T5TokenizerFast.from_pretrained(str(golden / "t5_tokenizer" / "t5_both"))
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=48,
                                           num_layers=2, num_heads=2,
                                           feed_forward_proj="gated-gelu",
                                           dropout_rate=0.0)).eval()
    vae = AutoencoderKLCogVideoX(
        block_out_channels=[8, 8, 16], down_block_types=["CogVideoXDownBlock3D"] * 3,
        up_block_types=["CogVideoXUpBlock3D"] * 3, latent_channels=4, layers_per_block=1,
        norm_num_groups=4, temporal_compression_ratio=4, sample_height=32, sample_width=32,
        scaling_factor=scaling_factor, invert_scale_latents=invert_scale_latents)
    return tokenizer, text_encoder, vae


def write_pipeline(root: pathlib.Path, golden: pathlib.Path, rotary: bool):
    from diffusers import (CogVideoXDDIMScheduler, CogVideoXDPMScheduler, CogVideoXPipeline,
                           CogVideoXTransformer3DModel)
    torch.manual_seed(1 if rotary else 2)
    tokenizer, text_encoder, vae = tiny_text_and_vae(golden, 0.7 if rotary else 1.15258426)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        time_embed_dim=16, text_embed_dim=32, num_layers=2, sample_width=8, sample_height=8,
        sample_frames=9, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=16,
        use_rotary_positional_embeddings=rotary)
    common = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                  clip_sample=False, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                  set_alpha_to_one=True, steps_offset=0, timestep_spacing="trailing")
    scheduler = (CogVideoXDDIMScheduler(snr_shift_scale=1.0, **common) if rotary
                 else CogVideoXDPMScheduler(snr_shift_scale=3.0, **common))
    CogVideoXPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                      transformer=transformer, scheduler=scheduler).save_pretrained(root)


def write_videos(root: pathlib.Path, fmnist: pathlib.Path):
    root.mkdir(parents=True, exist_ok=True)
    items = t2i.fashion_mnist(fmnist, 2)
    prompts, videos = [], []
    for k, (image, label) in enumerate(items):
        frames = 10 + k % 4
        folder = root / f"clip{k}"
        folder.mkdir()
        for f in range(frames):
            canvas = np.zeros((40, 40), np.uint8)
            x = min(max(f if k % 2 == 0 else 12 - f, 0), 12)
            canvas[6:34, x:x + 28] = image
            rgb = np.stack([canvas, canvas // 2, 255 - canvas], -1)
            Image.fromarray(rgb).save(folder / f"{f:04d}.png")
        direction = "right" if k % 2 == 0 else "left"
        prompts.append(f"a {t2i.CLASSES[label]} sliding to the {direction}")
        videos.append(f"clip{k}")
    (root / "prompts.txt").write_text("\n".join(prompts) + "\n")
    (root / "videos.txt").write_text("\n".join(videos) + "\n")


def main():
    out, golden, fmnist = map(pathlib.Path, sys.argv[1:4])
    from diffusers.utils import logging as dlogging
    from transformers.utils import logging
    logging.set_verbosity_error()
    dlogging.set_verbosity_error()
    write_pipeline(out / "cogvideox", golden, True)
    write_pipeline(out / "cogvideox_2b", golden, False)
    write_videos(out / "videos", fmnist)


if __name__ == "__main__":
    main()
